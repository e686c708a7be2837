"""Masters and states in memory: on the compute device (no offload) or in host memory
(``offload_optimizer.device="cpu"``). The torch optimizer's parameters are views of each flat group's
master; its states are its own tensors. On a CPU-only machine host memory *is* the device, so CPU
offload is this same path with no copy at all. Checkpoints read and load the live tensors themselves:
no copy out, and a load's state tensors are taken over where they fit."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence

import torch

from zeroray.engine.flat_group import FlatGroup
from zeroray.engine.offload.home import (
    Fill,
    PieceScalars,
    StateHome,
    elementwise_states,
    scalar_state,
    zeros_like_state,
)
from zeroray.engine.sub_groups import ParamSlice, SubGroup


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
        self.lazy_grads = not self.offloaded and any(g.reduce_dtype != g.master.dtype for g in groups)

    def _host_grad(self, g: FlatGroup) -> torch.Tensor:
        """``g``'s reusable host buffer for its fp32 gradient shard (pinned on CUDA)."""
        buf = self._host_grads.get(g)
        if buf is None:
            buf = torch.empty(g.shard_numel, dtype=g.master.dtype, device=self.master_device, pin_memory=self.pin)
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

    def stream(self, pieces: Sequence[ParamSlice], key: str, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
        """The live tensors, no copy: "weight", the master (whole where ``pieces`` cover the shard); a
        state, piece by piece."""
        if key == "weight":
            yield self.param_data(pieces[0].group, pieces[0].lo, pieces[-1].hi)
            return
        per_piece = [self.states(p, optimizer) for p in pieces]
        for piece, st in zip(pieces, per_piece):
            yield st[key] if key in st else zeros_like_state(per_piece, key, piece.numel)

    def load(self, subs: Sequence[SubGroup], tensors: Mapping[FlatGroup, Mapping[str, torch.Tensor]],
             scalars: PieceScalars, optimizer: torch.optim.Optimizer) -> None:
        """The masters are copied into; the state tensors are taken over (views, no copy, where device
        and dtype fit): the engine's publish casts the masters into the compute shards."""
        self.settle()
        flat = {g: {k: v.reshape(-1) for k, v in t.items()} for g, t in tensors.items()}
        for sub in subs:
            for piece in sub.pieces:
                values, found = flat[piece.group], scalars(piece)
                piece.param.data.copy_(values["weight"][piece.lo : piece.hi])
                states = {k: v[piece.lo : piece.hi] for k, v in values.items() if k != "weight"}
                if found is not None and states:
                    state: dict = {k: v.to(device=self.master_device, dtype=piece.param.dtype) for k, v in states.items()}
                    state.update(scalar_state(found))
                    optimizer.state[piece.param] = state
                else:
                    optimizer.state.pop(piece.param, None)

    def load_stream(self, subs: Sequence[SubGroup], keys: Mapping[FlatGroup, Sequence[str]], fill: Fill,
                    scalars: PieceScalars, optimizer: torch.optim.Optimizer) -> None:
        """One ``fill`` for everything, into fresh whole-shard tensors, before anything changes (a
        failed read leaves the state as it was); then :meth:`load` takes them over."""
        tensors = {g: {k: torch.empty(g.shard_numel, dtype=torch.float32) for k in ks} for g, ks in keys.items()}
        fill([(g, k, 0, g.shard_numel, t) for g, ts in tensors.items() for k, t in ts.items()])
        self.load(subs, tensors, scalars, optimizer)

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
