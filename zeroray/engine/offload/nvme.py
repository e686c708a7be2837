"""Masters and states in swap files (``offload_optimizer.device="nvme"``), one per sub-group. Host
memory holds a fixed pool of ``buffer_count`` aligned buffers, each one sub-group's master and states:
while sub-group i is stepped, i+1 is read into the next buffer and i-1 is written back from the one
before (with ``buffer_count`` >= 3 all three overlap). The last writes of a step finish behind the next
forward and backward; anything that reads the states waits for them."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future

import torch

from zeroray.engine.flat_group import FlatGroup
from zeroray.engine.offload.files import (
    ALIGN,
    AlignedBuffer,
    SwapDir,
    aligned,
    read_exact,
    settle_all,
    wait_all,
)
from zeroray.engine.offload.home import Fill, PieceScalars, StateHome, elementwise_states, scalar_state
from zeroray.engine.sub_groups import ParamSlice, SubGroup

_F32 = 4
_COPY_HEADROOM = 64 << 20  # bytes a copy of the swap files leaves free on their disk


class NvmeHome(StateHome):
    """Masters and states in one swap file per sub-group: ``[master | state_1 | ... | state_K]``,
    each segment ``aligned(numel * 4)`` bytes, pieces in order inside a segment.

    Between steps the pool's buffers are idle, and checkpoints move the state through them:
    :meth:`stream` reads a flat group's segment out of the files piece by piece (a save),
    :meth:`load_stream` fills one sub-group's buffer and writes its file once (a load; :meth:`load`
    fills it from whole tensors), and
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
        self.lazy_grads = any(g.reduce_dtype != torch.float32 or g.device != self.host_device for g in groups)

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

    def load(self, subs: Sequence[SubGroup], tensors: Mapping[FlatGroup, Mapping[str, torch.Tensor]],
             scalars: PieceScalars, optimizer: torch.optim.Optimizer) -> None:
        """As :meth:`load_stream`, copying from the tensors: each file is still written once."""
        def take(parts: list[tuple[FlatGroup, str, int, int, torch.Tensor]]) -> None:
            for g, k, lo, hi, dest in parts:
                dest.copy_(tensors[g][k].reshape(-1)[lo:hi])

        self.load_stream(subs, {g: list(t) for g, t in tensors.items()}, take, scalars, optimizer)

    def load_stream(self, subs: Sequence[SubGroup], keys: Mapping[FlatGroup, Sequence[str]], fill: Fill,
                    scalars: PieceScalars, optimizer: torch.optim.Optimizer) -> None:
        """Each sub-group's file written once: its pieces' values filled into a pool buffer, the
        masters copied into the compute shards, the buffer written while the next one fills (one
        ``fill`` per sub-group: host memory stays bounded by the pool)."""
        wanted = {id(p.param): sorted(k for k in keys[p.group] if k != "weight") if scalars(p) is not None else []
                  for sub in subs for p in sub.pieces}
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
                    parts.append((piece.group, k, piece.lo, piece.hi, dest))
            fill(parts)
            for piece in sub.pieces:
                _, off = self._offsets[id(piece.param)]
                piece.group.write_shard(piece.lo, piece.hi, self._segment(buf, i, 0)[off : off + piece.numel])
                if wanted[id(piece.param)]:
                    optimizer.state[piece.param] = scalar_state(scalars(piece) or {})
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
