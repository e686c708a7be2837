"""Where the sharded optimizer's fp32 masters and states live between steps: one decision.

- :class:`ResidentHome`: in memory, on the compute device (no offload) or in host memory
  (``offload_optimizer.device="cpu"``). The torch optimizer's parameters are views of each flat
  group's master; its states are its own tensors. On a CPU-only machine host memory *is* the
  device, so CPU offload is this same path with no copy at all.
- :class:`NvmeHome`: in swap files (``offload_optimizer.device="nvme"``), one per sub-group. Host
  memory holds a fixed pool of ``buffer_count`` aligned buffers, each one sub-group's master and
  states: while sub-group i is stepped, i+1 is read into the next buffer and i-1 is written back
  from the one before (with ``buffer_count`` >= 3 all three overlap). The last writes of a step
  finish behind the next forward and backward; anything that reads the states waits for them.

:class:`~zeroray.engine.sharded_optim.ShardedOptimizer` drives a home through :meth:`StateHome.cycle`
and never knows which one it has.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future

import torch

from zeroray.engine.flat_group import FlatGroup
from zeroray.engine.sub_groups import ParamSlice, SubGroup
from zeroray.engine.swap import ALIGN, AlignedBuffer, SwapDir, aligned, read_exact, settle_all, wait_all

_F32 = 4
_COPY_HEADROOM = 64 << 20  # bytes a copy of the swap files leaves free on their disk

# ``fill(parts)``: write into each ``dest`` the values ``[lo, hi)`` of ``piece``'s ``key``, where lo/hi
# count elements of the piece's group shard (the piece covers ``[piece.lo, piece.hi)`` of it).
Fill = Callable[[list[tuple[ParamSlice, str, int, int, torch.Tensor]]], None]


def elementwise_states(state: dict, numel: int) -> dict[str, torch.Tensor]:
    """The states shaped like their parameter (Adam's moments); scalars (``step``) are left out."""
    return {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0 and v.numel() == numel}


class StateHome:
    """Interface; see the module docstring."""

    def attach(self, groups: Sequence[FlatGroup]) -> None:
        """Called once, before the optimizer's parameters are made."""

    def param_data(self, g: FlatGroup, lo: int, hi: int) -> torch.Tensor:
        raise NotImplementedError

    def prepare(self, subs: Sequence[SubGroup], optimizer: torch.optim.Optimizer) -> None:
        """Called once the optimizer exists."""

    lazy_grads = False  # see GradShards: fp32 gradients made per sub-group, as it is stepped
    early_grads = False  # grad_ready() wants each group's final gradient shard as soon as it is reduced
    publishes_shards = False  # publish() writes the compute shards itself (the engine need not copy the masters)

    def grad_ready(self, g: FlatGroup) -> None:
        """``g``'s gradient shard holds its final value for this step (called during backward when
        :attr:`early_grads`)."""

    def settle(self) -> None:
        """Wait for copies in flight that read the masters, before anyone writes them."""

    def grad(self, g: FlatGroup, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """``g``'s gradient shard (or its ``[lo, hi)``) in fp32 where the optimizer runs; eager
        homes may return the shard itself (scaled in place) or a reused buffer."""
        raise NotImplementedError

    def cycle(self, subs: Sequence[SubGroup], optimizer: torch.optim.Optimizer) -> Iterator[tuple[SubGroup, None]]:
        """Yield each sub-group with its master and states in place for ``optimizer.step()``."""
        raise NotImplementedError

    def publish(self, sub: SubGroup) -> None:
        """The sub-group was stepped: its new masters may go into the compute shards now."""

    def master(self, g: FlatGroup) -> torch.Tensor:
        raise NotImplementedError

    def states(self, piece: ParamSlice, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def load(self, piece: ParamSlice, weight: torch.Tensor, states: dict[str, torch.Tensor], scalars: dict[str, float],
             optimizer: torch.optim.Optimizer) -> None:
        raise NotImplementedError

    # Homes that keep masters and states out of memory (``in_memory`` False) move them through their
    # own bounded buffers instead of whole tensors: ``state_keys``/``stream`` to read, ``load_stream`` to write.
    in_memory = True

    def state_keys(self, piece: ParamSlice, optimizer: torch.optim.Optimizer) -> list[str]:
        """Names of ``piece``'s elementwise optimizer states (none before its first step), sorted."""
        return sorted(self.states(piece, optimizer))

    def stream(self, pieces: Sequence[ParamSlice], key: str, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
        """``pieces``' values of ``key`` ("weight": the master) in order, as consecutive 1-D fp32
        tensors; each is valid until the next one is asked for."""
        raise NotImplementedError

    def load_stream(self, subs: Sequence[SubGroup], keys: Callable[[ParamSlice], Sequence[str]], fill: Fill,
                    scalars: Callable[[ParamSlice], dict[str, float]], optimizer: torch.optim.Optimizer) -> None:
        """Install every piece's ``keys(piece)`` ("weight" and the states it was saved with, or
        "weight" alone: fresh states) from values ``fill`` writes into the home's buffers."""
        raise NotImplementedError

    def copy(self) -> SwapCopy | None:
        """A copy of the masters and states on disk that training may run past (None: they are not
        in files, or the disk has no room for a copy)."""
        return None

    def set_master(self, piece: ParamSlice, values: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        raise NotImplementedError

    def memory(self, subs: Sequence[SubGroup], optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """``{"master": , "states": , "host": , "nvme": }`` bytes: masters and states held on the compute
        device; host memory held for offload (masters, states, grad copies, swap buffers); swap files."""
        raise NotImplementedError

    def io_report(self) -> dict[str, float]:
        """Swap traffic and the time the step spent blocked on it (NVMe only)."""
        return {}

    def close(self) -> None:
        """Release what the home holds (swap files included)."""


def _scalar_state(scalars: dict[str, float]) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(v, dtype=torch.float32) for k, v in scalars.items()}


class ResidentHome(StateHome):
    """Masters and states in memory: each flat group's ``master`` (made by ``FlatGroup.install`` on
    ``master_device``) and the torch optimizer's own state tensors."""

    def __init__(self, compute_device: torch.device, master_device: torch.device, pin_memory: bool):
        self.compute_device = compute_device
        self.master_device = master_device
        self.offloaded = master_device != compute_device
        self.pin = pin_memory and self.offloaded and compute_device.type == "cuda"
        # CPU offload on CUDA with pinned buffers: gradient shards go to the host on a side stream as
        # each group's reduction completes (overlapping backward), and each stepped sub-group's masters
        # go back to the device at once, cast there (overlapping the next sub-group's CPU step).
        self.early_grads = self.pin
        self.publishes_shards = self.offloaded
        self._host_grads: dict[FlatGroup, torch.Tensor] = {}
        self._copies: dict[FlatGroup, torch.cuda.Event] = {}  # device -> host copies in flight
        self._copy_stream: torch.cuda.Stream | None = None
        self._published: torch.cuda.Event | None = None  # the last host -> device copy of masters
        self._io = {"bytes_to_host": 0, "bytes_to_device": 0, "grad_copies_in_backward": 0, "grad_copies_in_step": 0,
                    "grad_wait_s": 0.0}

    def param_data(self, g: FlatGroup, lo: int, hi: int) -> torch.Tensor:
        return g.master if (lo, hi) == (0, g.shard_numel) else g.master[lo:hi]

    def attach(self, groups: Sequence[FlatGroup]) -> None:
        # 16-bit gradients on the device are cast to fp32 per sub-group as it is stepped (GradShards,
        # lazy): the step then holds one sub-group's fp32 copy, not the whole shard's (20 -> 16 bytes a
        # parameter at the step's peak, bf16 at world 1). fp32 gradient shards are used in place.
        self.lazy_grads = not self.offloaded and any(g.grad_shard.dtype != g.master.dtype for g in groups)

    def _host_grad(self, g: FlatGroup) -> torch.Tensor:
        """``g``'s reusable host buffer for its fp32 gradient shard (pinned on CUDA)."""
        buf = self._host_grads.get(g)
        if buf is None:
            buf = torch.empty(g.grad_shard.shape, dtype=g.master.dtype, device=self.master_device, pin_memory=self.pin)
            self._host_grads[g] = buf
        return buf

    def grad_ready(self, g: FlatGroup) -> None:
        stream = self._copy_stream
        if stream is None:
            stream = self._copy_stream = torch.cuda.Stream(self.compute_device)
        buf = self._host_grad(g)
        stream.wait_stream(torch.cuda.current_stream(self.compute_device))  # behind the reduction's result
        with torch.cuda.stream(stream):
            buf.copy_(g.grad_shard, non_blocking=True)  # cast to fp32 on the device, then one DMA
            done = torch.cuda.Event()
            done.record(stream)
        self._copies[g] = done
        self._io["bytes_to_host"] += buf.nbytes
        self._io["grad_copies_in_backward"] += 1

    def grad(self, g: FlatGroup, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        gs = g.grad_shard
        if not self.offloaded:
            if hi is not None or lo:
                gs = gs[lo:hi]
            return gs if gs.dtype == g.master.dtype else gs.to(g.master.dtype)
        buf = self._host_grad(g)
        t0 = time.perf_counter()
        done = self._copies.pop(g, None)
        if done is not None:  # started during backward
            done.synchronize()
        else:
            buf.copy_(gs, non_blocking=self.pin)  # device -> host into the reusable buffer, cast on the way
            if self.pin:
                torch.cuda.current_stream(self.compute_device).synchronize()
            self._io["bytes_to_host"] += buf.nbytes
            self._io["grad_copies_in_step"] += 1
        self._io["grad_wait_s"] += time.perf_counter() - t0
        return buf

    def settle(self) -> None:
        if self._published is not None:
            self._published.synchronize()
            self._published = None

    def cycle(self, subs: Sequence[SubGroup], optimizer: torch.optim.Optimizer) -> Iterator[tuple[SubGroup, None]]:
        self.settle()
        for sub in subs:
            yield sub, None

    def publish(self, sub: SubGroup) -> None:
        if not self.publishes_shards:
            return
        for piece in sub.pieces:  # pinned: cast on the device, and the host goes on stepping the next sub-group
            g = piece.group
            g.write_shard(piece.lo, piece.hi, piece.param.data, non_blocking=self.pin)
            self._io["bytes_to_device"] += piece.numel * g.shard.element_size()
        if self.pin:
            self._published = torch.cuda.Event()
            self._published.record(torch.cuda.current_stream(self.compute_device))

    def io_report(self) -> dict[str, float]:
        """CPU offload on an accelerator: bytes copied each way, gradient copies started during backward
        or in the step, and seconds the step waited for them (cumulative; empty without offload)."""
        return dict(self._io) if self.offloaded else {}

    def master(self, g: FlatGroup) -> torch.Tensor:
        return g.master

    def states(self, piece: ParamSlice, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        return {k: v.reshape(-1) for k, v in elementwise_states(optimizer.state.get(piece.param, {}), piece.numel).items()}

    def load(self, piece: ParamSlice, weight: torch.Tensor, states: dict[str, torch.Tensor], scalars: dict[str, float],
             optimizer: torch.optim.Optimizer) -> None:
        self.settle()
        piece.param.data.copy_(weight.reshape(-1))
        if states:
            state: dict = {k: v.reshape(-1).to(device=self.master_device, dtype=piece.param.dtype) for k, v in states.items()}
            state.update(_scalar_state(scalars))
            optimizer.state[piece.param] = state
        else:
            optimizer.state.pop(piece.param, None)

    def set_master(self, piece: ParamSlice, values: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        self.settle()
        piece.param.data.copy_(values)

    def memory(self, subs: Sequence[SubGroup], optimizer: torch.optim.Optimizer) -> dict[str, int]:
        masters = {id(p.group): p.group.master_bytes() for s in subs for p in s.pieces}
        master = sum(masters.values())
        states = sum(
            v.numel() * v.element_size()
            for s in subs
            for p in s.pieces
            for v in optimizer.state.get(p.param, {}).values()
            if torch.is_tensor(v)
        )
        if not self.offloaded:
            return {"master": master, "states": states, "host": 0, "nvme": 0}
        grads = sum(t.numel() * t.element_size() for t in self._host_grads.values())
        # fp32 compute at stage 3 keeps no separate master on the device; any master here is on the host
        return {"master": 0, "states": 0, "host": master + states + grads, "nvme": 0}

    def close(self) -> None:
        for done in self._copies.values():  # no copy may still write a buffer that is given back
            done.synchronize()
        self._copies.clear()
        self.settle()


class NvmeHome(StateHome):
    """Masters and states in one swap file per sub-group: ``[master | state_1 | ... | state_K]``,
    each segment ``aligned(numel * 4)`` bytes, pieces in order inside a segment.

    Between steps the pool's buffers are idle, and checkpoints move the state through them:
    :meth:`stream` reads a flat group's segment out of the files piece by piece (a save),
    :meth:`load_stream` fills one sub-group's buffer and writes its file once (a load), and
    :meth:`copy` copies the files on their disk for a save that training runs past."""

    in_memory = False

    def __init__(self, swap: SwapDir, buffer_count: int, host_device: torch.device, expected_states: int):
        self.swap = swap
        self.buffer_count = buffer_count
        self.host_device = host_device
        self.expected_states = expected_states
        self.keys: list[str] | None = None  # the elementwise state names, known after the first step or a load
        self._bufs: list[AlignedBuffer] = []
        self._writes: dict[int, list[Future]] = {}  # buffer index -> its write in flight
        self._reads: dict[int, list[Future]] = {}  # buffer index -> its read in flight
        self._segs: list[int] = []  # segments each file holds now
        self._seg_bytes: list[int] = []
        self._offsets: dict[int, tuple[int, int]] = {}  # id(piece.param) -> (sub-group index, offset in segment)
        self._subs: Sequence[SubGroup] = ()
        self._placeholder = torch.empty(0, dtype=torch.float32, device=host_device)
        self.lazy_grads = True  # set per engine: see NvmeHome.attach
        self.publishes_shards = True  # publish() copies each stepped sub-group into the compute shards
        self._read_wait = self._write_wait = 0.0  # seconds the step waited for the disk

    # ------------------------------------------------------------------ set-up
    def attach(self, groups: Sequence[FlatGroup]) -> None:
        # fp32 gradient shards in host memory are used in place; anything else is cast per sub-group.
        self.lazy_grads = any(g.grad_shard.dtype != torch.float32 or g.grad_shard.device != self.host_device for g in groups)

    def param_data(self, g: FlatGroup, lo: int, hi: int) -> torch.Tensor:
        return self._placeholder

    def _name(self, i: int) -> str:
        return f"subgroup{i:05d}.swap"

    def prepare(self, subs: Sequence[SubGroup], optimizer: torch.optim.Optimizer) -> None:
        """Write every sub-group's initial master (the values the model was built with) to its file."""
        self._subs = subs
        for sub in subs:
            off = 0
            for piece in sub.pieces:
                self._offsets[id(piece.param)] = (sub.index, off)
                off += piece.numel
            self._seg_bytes.append(aligned(sub.numel * _F32))
            self._segs.append(1)
        n = min(self.buffer_count, len(subs))
        self._bufs = [AlignedBuffer(self.buffer_bytes(1 + self.expected_states)) for _ in range(n)]
        groups = dict.fromkeys(piece.group for sub in subs for piece in sub.pieces)
        initial = {g: g.take_initial_master() for g in groups}
        for sub in subs:
            b = sub.index % n
            self._wait_buffer(b)
            buf = self._bufs[b]
            for piece in sub.pieces:
                _, off = self._offsets[id(piece.param)]
                buf.tensor[off : off + piece.numel].copy_(initial[piece.group][piece.lo : piece.hi])
            self._writes[b] = self.swap.write(self._name(sub.index), buf, self._seg_bytes[sub.index])
        self._drain()

    def buffer_bytes(self, segments: int) -> int:
        """Host bytes of one buffer: the largest sub-group's master and states."""
        return segments * max(self._seg_bytes, default=ALIGN)

    # ------------------------------------------------------------------ buffers
    def _wait_buffer(self, b: int) -> None:
        w = self._writes.pop(b, None)
        if w is not None:
            t0 = time.perf_counter()
            wait_all(w)
            self._write_wait += time.perf_counter() - t0

    def io_report(self) -> dict[str, float]:
        return {
            "bytes_read": self.swap.bytes_read,
            "bytes_written": self.swap.bytes_written,
            "read_wait_s": self._read_wait,
            "write_wait_s": self._write_wait,
            "direct_io": float(self.swap.direct),
        }

    def _drain(self) -> None:
        for b in list(self._writes):
            self._wait_buffer(b)

    def _ensure_capacity(self) -> None:
        """Grow the buffers once the optimizer's state count is known, if the guess was short;
        what they hold (a read-ahead, the sub-group being stepped) is kept."""
        need = self.buffer_bytes(1 + len(self.keys or ()))
        for b, buf in enumerate(self._bufs):
            if buf.nbytes < need:
                self._wait_buffer(b)
                wait_all(self._reads.get(b, ()))
                grown = AlignedBuffer(need)
                grown.tensor[: buf.tensor.numel()].copy_(buf.tensor)
                self._bufs[b] = grown

    def _segment(self, buf: AlignedBuffer, i: int, s: int) -> torch.Tensor:
        start = s * self._seg_bytes[i] // _F32
        return buf.tensor[start : start + self._subs[i].numel]

    def _read_into(self, i: int, buf: AlignedBuffer) -> list[Future]:
        return self.swap.read(self._name(i), buf, self._segs[i] * self._seg_bytes[i])

    def _write_from(self, i: int, buf: AlignedBuffer) -> list[Future]:
        self._segs[i] = 1 + len(self.keys or ())
        return self.swap.write(self._name(i), buf, self._segs[i] * self._seg_bytes[i])

    # ------------------------------------------------------------------ the step
    def grad(self, g: FlatGroup, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        gs = g.grad_shard[lo:hi]
        if gs.device == self.host_device and gs.dtype == torch.float32:
            return gs  # eager: scaled in place, as without offload
        return gs.to(device=self.host_device, dtype=torch.float32, copy=True)

    def cycle(self, subs: Sequence[SubGroup], optimizer: torch.optim.Optimizer) -> Iterator[tuple[SubGroup, None]]:
        n = len(self._bufs)
        self._drain()  # the previous step's last writes

        def start_read(i: int) -> list[Future]:
            b = i % n
            self._wait_buffer(b)
            self._reads[b] = self._read_into(i, self._bufs[b])
            return self._reads[b]

        reads = {0: start_read(0)} if subs else {}
        for i, sub in enumerate(subs):
            if i + 1 < len(subs) and n > 1:
                reads[i + 1] = start_read(i + 1)
            t0 = time.perf_counter()
            wait_all(reads.pop(i))
            self._read_wait += time.perf_counter() - t0
            self._reads.pop(i % n, None)
            buf = self._bufs[i % n]
            self._bind(sub, buf, optimizer)
            yield sub, None
            self._unbind(sub, optimizer)
            buf = self._bufs[i % n]  # _unbind may have grown the pool's buffers
            self._writes[i % n] = self._write_from(i, buf)
            if n == 1 and i + 1 < len(subs):
                reads[i + 1] = start_read(i + 1)

    def _bind(self, sub: SubGroup, buf: AlignedBuffer, optimizer: torch.optim.Optimizer) -> None:
        i = sub.index
        full = self._segs[i] == 1 + len(self.keys or ())
        for piece in sub.pieces:
            _, off = self._offsets[id(piece.param)]
            piece.param.data = self._segment(buf, i, 0)[off : off + piece.numel]
            state = optimizer.state.get(piece.param)
            if state and self.keys:  # a piece with history: its moments come from the file
                if not full:
                    raise RuntimeError(f"zeroray swap: sub-group {i} has optimizer state but its file holds none")
                for s, k in enumerate(self.keys, start=1):
                    state[k] = self._segment(buf, i, s)[off : off + piece.numel]

    def _unbind(self, sub: SubGroup, optimizer: torch.optim.Optimizer) -> None:
        i = sub.index
        for piece in sub.pieces:
            state = optimizer.state.get(piece.param, {})
            found = elementwise_states(state, piece.numel)
            if found and self.keys is None:
                self.keys = sorted(found)
                self._ensure_capacity()
            buf = self._bufs[i % len(self._bufs)]
            if found and sorted(found) != self.keys:
                raise RuntimeError(f"zeroray swap: optimizer states {sorted(found)} differ from {self.keys}")
            _, off = self._offsets[id(piece.param)]
            master = self._segment(buf, i, 0)[off : off + piece.numel]
            if piece.param.data.data_ptr() != master.data_ptr():  # a grown buffer: keep the values
                master.copy_(piece.param.data)
            for s, k in enumerate(self.keys or (), start=1):
                dst = self._segment(buf, i, s)[off : off + piece.numel]
                if k in found:
                    if found[k].data_ptr() != dst.data_ptr():  # fresh tensors made by the first step
                        dst.copy_(found[k])
                    del state[k]
                elif not found:  # never stepped (no gradient yet): zeros in the file, as states() reads it
                    dst.zero_()
            piece.param.data = self._placeholder

    def publish(self, sub: SubGroup) -> None:
        for piece in sub.pieces:
            piece.group.write_shard(piece.lo, piece.hi, piece.param.data)

    # ------------------------------------------------------------------ state outside the step
    def _read_whole(self, i: int) -> AlignedBuffer:
        self._drain()
        buf = AlignedBuffer(self._segs[i] * self._seg_bytes[i])
        wait_all(self._read_into(i, buf))
        return buf

    def master(self, g: FlatGroup) -> torch.Tensor:
        out = torch.empty(g.shard_numel, dtype=torch.float32, device=self.host_device)
        for sub in self._subs:
            pieces = [p for p in sub.pieces if p.group is g]
            if not pieces:
                continue
            buf = self._read_whole(sub.index)
            try:
                for piece in pieces:
                    _, off = self._offsets[id(piece.param)]
                    out[piece.lo : piece.hi].copy_(self._segment(buf, sub.index, 0)[off : off + piece.numel])
            finally:
                buf.close()
        return out

    def state_keys(self, piece: ParamSlice, optimizer: torch.optim.Optimizer) -> list[str]:
        return list(self.keys or ()) if optimizer.state.get(piece.param) else []

    def states(self, piece: ParamSlice, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        if not optimizer.state.get(piece.param) or not self.keys:
            return {}
        i, off = self._offsets[id(piece.param)]
        buf = self._read_whole(i)
        try:
            return {k: self._segment(buf, i, s)[off : off + piece.numel].clone() for s, k in enumerate(self.keys, start=1)}
        finally:
            buf.close()

    def _segment_index(self, key: str) -> int:
        return 0 if key == "weight" else 1 + (self.keys or []).index(key)

    def stream(self, pieces: Sequence[ParamSlice], key: str, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
        """Read the pieces' segment ``key`` from their files through the pool's buffers (idle between
        steps), in aligned requests of at most a buffer each; the read of the next request runs
        while the caller uses the current one."""
        self._drain()
        cap = min(b.nbytes for b in self._bufs)
        parts = _requests(pieces, self._segment_index(key), self._offsets, self._seg_bytes, cap)
        n = len(self._bufs)
        inflight: dict[int, list[Future]] = {}

        def start(j: int) -> None:
            i, a0, nbytes, _, _ = parts[j]
            inflight[j] = self.swap.read(self._name(i), self._bufs[j % n], nbytes, a0)

        try:
            if parts:
                start(0)
            for j, (_, _, _, first, count) in enumerate(parts):
                if n > 1 and j + 1 < len(parts):
                    start(j + 1)
                wait_all(inflight.pop(j))
                yield self._bufs[j % n].tensor[first : first + count]
                if n == 1 and j + 1 < len(parts):
                    start(j + 1)
        finally:  # abandoned half-way: no read may land in a buffer the next step uses
            for futures in inflight.values():
                settle_all(futures)

    def load_stream(self, subs: Sequence[SubGroup], keys: Callable[[ParamSlice], Sequence[str]], fill: Fill,
                    scalars: Callable[[ParamSlice], dict[str, float]], optimizer: torch.optim.Optimizer) -> None:
        """Each sub-group's file written once: its pieces' values filled into a pool buffer, the
        masters copied into the compute shards, the buffer written while the next one fills."""
        wanted = {id(p.param): sorted(k for k in keys(p) if k != "weight") for sub in subs for p in sub.pieces}
        found = next((w for w in wanted.values() if w), None)
        for w in wanted.values():  # checked before anything is written
            if w and w != (self.keys or found):
                raise ValueError(f"optimizer states {w} do not match this optimizer's {self.keys or found}")
        if found and self.keys is None:
            self.keys = found
            self._ensure_capacity()
        self._drain()
        n = len(self._bufs)
        for sub in subs:
            i, b = sub.index, sub.index % n
            self._wait_buffer(b)
            buf = self._bufs[b]
            parts = []
            for piece in sub.pieces:
                _, off = self._offsets[id(piece.param)]
                for k in ["weight", *wanted[id(piece.param)]]:
                    dest = self._segment(buf, i, self._segment_index(k))[off : off + piece.numel]
                    parts.append((piece, k, piece.lo, piece.hi, dest))
            fill(parts)
            for piece in sub.pieces:
                _, off = self._offsets[id(piece.param)]
                piece.group.write_shard(piece.lo, piece.hi, self._segment(buf, i, 0)[off : off + piece.numel])
                if wanted[id(piece.param)]:
                    optimizer.state[piece.param] = _scalar_state(scalars(piece))
                else:
                    optimizer.state.pop(piece.param, None)
                    for s in range(1, 1 + len(self.keys or ())):  # fresh: zeros, as states() reads them
                        self._segment(buf, i, s)[off : off + piece.numel].zero_()
            self._writes[b] = self._write_from(i, buf)
        self._drain()

    def copy(self) -> SwapCopy | None:
        """Copy the swap files, through the pool's buffers (reads of the next file while the last
        one is written), into a directory beside them, read back ``offload_io.block_size`` bytes at
        a time; None when the disk has no room for it."""
        self._drain()
        need = sum(s * b for s, b in zip(self._segs, self._seg_bytes))
        st = os.statvfs(self.swap.path)
        if st.f_bavail * st.f_frsize < need + _COPY_HEADROOM:
            return None
        sub = f"copy-{uuid.uuid4().hex[:8]}"
        os.makedirs(os.path.join(self.swap.path, sub))
        names = [f"{sub}/{self._name(i)}" for i in range(len(self._subs))]
        copy = SwapCopy(os.path.join(self.swap.path, sub), [self._name(i) for i in range(len(self._subs))],
                        self.keys or (), self._offsets, self._seg_bytes, self.swap.direct, self.swap.block_size)
        n = len(self._bufs)
        try:
            reads: dict[int, list[Future]] = {}

            def start_read(i: int) -> None:
                self._wait_buffer(i % n)
                reads[i] = self._read_into(i, self._bufs[i % n])

            if names:
                start_read(0)
            for i in range(len(names)):
                if n > 1 and i + 1 < len(names):
                    start_read(i + 1)
                wait_all(reads.pop(i))
                nbytes = self._segs[i] * self._seg_bytes[i]
                self._writes[i % n] = self.swap.write(names[i], self._bufs[i % n], nbytes)
                if n == 1 and i + 1 < len(names):
                    start_read(i + 1)
            self._drain()
        except BaseException:
            for futures in reads.values():
                settle_all(futures)
            self._drain_quietly()
            self.swap.forget(sub + "/")
            copy.close()
            raise
        self.swap.forget(sub + "/")
        return copy

    def _drain_quietly(self) -> None:
        for b in list(self._writes):
            settle_all(self._writes.pop(b))

    def _rewrite(self, piece: ParamSlice, edit: Callable[[AlignedBuffer, int, int], None]) -> None:
        """Read ``piece``'s file, ``edit(buffer, sub-group index, offset)``, write it back."""
        i, off = self._offsets[id(piece.param)]
        segs = 1 + len(self.keys or ())
        buf = AlignedBuffer(segs * self._seg_bytes[i])
        try:
            self._drain()
            wait_all(self._read_into(i, buf))
            edit(buf, i, off)
            wait_all(self._write_from(i, buf))
        finally:
            buf.close()

    def set_master(self, piece: ParamSlice, values: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        def edit(buf: AlignedBuffer, i: int, off: int) -> None:
            self._segment(buf, i, 0)[off : off + piece.numel].copy_(values)

        self._rewrite(piece, edit)

    def memory(self, subs: Sequence[SubGroup], optimizer: torch.optim.Optimizer) -> dict[str, int]:
        self._drain()  # the files' sizes once the writes behind the last step are done
        host = sum(b.nbytes for b in self._bufs)
        nvme = sum(s * b for s, b in zip(self._segs, self._seg_bytes))
        return {"master": 0, "states": 0, "host": host, "nvme": nvme}

    def close(self) -> None:
        try:
            self._drain()
        finally:
            for b in self._bufs:
                b.close()
            self._bufs = []
            self.swap.close()


def _requests(pieces: Sequence[ParamSlice], s: int, offsets: dict[int, tuple[int, int]], seg_bytes: Sequence[int],
              cap: int) -> list[tuple[int, int, int, int, int]]:
    """The aligned reads that give ``pieces``' segment ``s`` in order, each at most ``cap`` (aligned)
    bytes: (file index, file offset, bytes, first element wanted in the buffer, elements wanted)."""
    parts = []
    for piece in pieces:
        i, off = offsets[id(piece.param)]
        pos, end = s * seg_bytes[i] + off * _F32, s * seg_bytes[i] + (off + piece.numel) * _F32
        while pos < end:
            a0 = pos // ALIGN * ALIGN
            stop = min(end, a0 + cap)
            parts.append((i, a0, aligned(stop) - a0, (pos - a0) // _F32, (stop - pos) // _F32))
            pos = stop
    return parts


class SwapCopy:
    """A copy of a home's swap files, taken between steps on the same disk, that training may run
    past: a background checkpoint save reads it (from any one thread, one buffer of ``cap`` bytes
    at a time) while the next steps rewrite the originals. :meth:`close` removes it."""

    def __init__(self, path: str, names: Sequence[str], keys: Sequence[str], offsets: dict[int, tuple[int, int]],
                 seg_bytes: Sequence[int], direct: bool, cap: int):
        self.path = path
        self._names = list(names)
        self._keys = list(keys)
        self._offsets = dict(offsets)
        self._seg_bytes = list(seg_bytes)
        self._direct = direct
        self._cap = cap
        self._buf: AlignedBuffer | None = None

    def stream(self, pieces: Sequence[ParamSlice], key: str) -> Iterator[torch.Tensor]:
        """As :meth:`NvmeHome.stream`, from the copy, with a buffer of its own."""
        s = 0 if key == "weight" else 1 + self._keys.index(key)
        if self._buf is None:
            self._buf = AlignedBuffer(self._cap)
        for i, a0, nbytes, first, count in _requests(pieces, s, self._offsets, self._seg_bytes, self._buf.nbytes):
            read_exact(os.path.join(self.path, self._names[i]), self._buf, nbytes, a0, self._direct)
            yield self._buf.tensor[first : first + count]

    def close(self) -> None:
        if self._buf is not None:
            self._buf.close()
            self._buf = None
        shutil.rmtree(self.path, ignore_errors=True)


def expected_state_count(optimizer: torch.optim.Optimizer) -> int:
    """Elementwise states per parameter the optimizer will make (for the free-space check and the
    first buffers; a wrong guess only costs a resize at the first step)."""
    name = type(optimizer).__name__
    d = optimizer.defaults
    if name in ("Adam", "AdamW", "NAdam", "RAdam", "Adamax"):
        return 3 if d.get("amsgrad") else 2
    if name == "SGD":
        return 1 if d.get("momentum", 0) else 0
    if name in ("Adagrad", "Adadelta"):
        return 1 if name == "Adagrad" else 2
    if name == "RMSprop":
        return 1 + bool(d.get("momentum", 0)) + bool(d.get("centered"))
    return 2

