"""FlatGroup: a set of parameters laid out in one flat, padded buffer, sharded across ranks.

Each ``nn.Parameter`` in the group becomes a view into ``full`` (the compute-precision flat
buffer), so the user's module runs unchanged. This rank persistently keeps:

- stage 0-2: ``full`` (every parameter), stage 3: only ``shard`` (its slice); ``full``'s storage is
  resized to zero between uses and gathered again on demand (the views stay valid);
- stage 0-1: a full flat gradient buffer, stage 2-3: only the gradient shard;
- the fp32 master shard (a view of the compute shard in fp32 runs, its own tensor otherwise) that
  the optimizer updates; the optimizer's states are shaped like it.

Which slice a rank owns comes from :mod:`zeroray.engine.layout`.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

import torch
from torch import nn

from zeroray.engine import layout
from zeroray.engine.comm import Comm, Handle


class ParamState(Enum):
    FREED = 0
    GATHERING = 1
    GATHERED = 2


class FlatGroup:
    """One flat buffer of parameters sharing a unit, an optimizer param group and a dtype."""

    def __init__(
        self,
        name: str,
        params: Sequence[tuple[str, nn.Parameter]],
        comm: Comm,
        *,
        stage: int,
        compute_dtype: torch.dtype,
        trainable: bool,
        param_group: int | None,
    ):
        self.name = name
        self.comm = comm
        self.stage = stage
        self.trainable = trainable
        self.param_group = param_group
        self.params = [p for _, p in params]
        self.param_names = [n for n, _ in params]
        self.slots = layout.build_slots(self.param_names, [tuple(p.shape) for p in self.params])
        self.numel = layout.group_numel(self.slots)
        # Stage 0 shards nothing: one "shard" that is the whole group.
        self.shard_world = 1 if stage == 0 else comm.world_size
        self.shard_rank = 0 if stage == 0 else comm.rank
        self.padded = layout.padded_numel(self.numel, self.shard_world)
        self.lo, self.hi = layout.shard_range(self.numel, self.shard_world, self.shard_rank)
        self.shard_numel = self.hi - self.lo
        device = self.params[0].device
        self.device = device
        self.compute_dtype = compute_dtype

        full = torch.zeros(self.padded, dtype=compute_dtype, device=device)
        with torch.no_grad():
            for slot, p in zip(self.slots, self.params):
                full[slot.offset : slot.end].copy_(p.detach().reshape(-1))
        self.full = full
        self.state = ParamState.GATHERED
        self._gather: Handle | None = None

    # ------------------------------------------------------------------ set-up (collective)
    def sync_from_rank0(self) -> None:
        """All ranks start from rank 0's values, as DDP does at construction."""
        self.comm.broadcast(self.full, src=0)

    def install(self, master_dtype: torch.dtype) -> None:
        """Point the parameters at ``full``, cut this rank's shard, make master and grad buffers."""
        for slot, p in zip(self.slots, self.params):
            p.data = self.full[slot.offset : slot.end].view(slot.shape)
        if self.stage == 3:
            self.shard = self.full[self.lo : self.hi].clone()
        else:
            self.shard = self.full[self.lo : self.hi]
        if not self.trainable:
            self.master = None
            self.grad_full = self.grad_shard = None
        else:
            # Stage 0 in fp32 updates the parameters in place; other cases keep an fp32 copy.
            self.master = self.shard if master_dtype == self.compute_dtype else self.shard.to(master_dtype)
            if self.stage <= 1:
                self.grad_full = torch.zeros(self.padded, dtype=self.compute_dtype, device=self.device)
                self.grad_fresh = True
                self.grad_shard = self.grad_full[self.lo : self.hi]
            else:
                self.grad_full = None
                self.grad_shard = torch.zeros(self.shard_numel, dtype=self.compute_dtype, device=self.device)
        if self.stage == 3:
            self._free_storage()

    # ------------------------------------------------------------------ stage 3: gather / free
    def _free_storage(self) -> None:
        self.full.untyped_storage().resize_(0)
        self.state = ParamState.FREED

    def start_gather(self) -> None:
        """Issue the all-gather of this group's shards (async); no-op unless freed."""
        if self.state is not ParamState.FREED:
            return
        self.full.untyped_storage().resize_(self.padded * self.full.element_size())
        self._gather = self.comm.all_gather(self.full, self.shard, async_op=True)
        self.state = ParamState.GATHERING

    def wait_gather(self) -> None:
        if self.state is ParamState.FREED:
            self.start_gather()
        if self.state is ParamState.GATHERING:
            self._gather.wait()
            self._gather = None
            self.state = ParamState.GATHERED

    def free(self) -> None:
        """Drop the full parameters (stage 3 only); waits for an in-flight gather first."""
        if self.stage != 3 or self.state is ParamState.FREED:
            return
        if self.state is ParamState.GATHERING:
            self.wait_gather()
        self._free_storage()

    # ------------------------------------------------------------------ gradients
    def grad_buffer(self) -> tuple[torch.Tensor | None, bool]:
        """The persistent flat gradient buffer (stages 0-1; None at 2-3, which reduce from a
        temporary) and whether its contents are stale (``fresh``: the first gradient of each slot
        is copied, not added, and untouched slots are zeroed by :meth:`seal`)."""
        return self.grad_full, self.grad_fresh if self.grad_full is not None else True

    def seal(self, buf: torch.Tensor, written: Sequence[bool]) -> None:
        """Zero the parts of a fresh buffer that no gradient was copied into."""
        for slot, w in zip(self.slots, written):
            if not w:
                buf[slot.offset : slot.end].zero_()
        buf[self.numel :].zero_()
        if buf is self.grad_full:
            self.grad_fresh = False

    def reduce(self, buf: torch.Tensor, async_op: bool) -> Handle:
        """Average ``buf`` across ranks into this rank's gradient shard (accumulating)."""
        comm = self.comm
        inv = 1.0 / comm.world_size
        if self.shard_world == 1 or not comm.use_reduce_scatter:
            h = comm.all_reduce(buf, async_op=async_op)
            if buf is self.grad_full:  # grad_shard is a view of it: average just that part
                return h.then(lambda: self.grad_shard.mul_(inv)) if inv != 1.0 else h
            lo, hi = self.lo, self.hi
            return h.then(lambda: self.grad_shard.add_(buf[lo:hi], alpha=inv))
        out = torch.empty(self.shard_numel, dtype=buf.dtype, device=buf.device)
        h = comm.reduce_scatter(out, buf, async_op=async_op)
        if buf is self.grad_full:
            return h.then(lambda: torch.mul(out, inv, out=self.grad_shard))
        return h.then(lambda: self.grad_shard.add_(out, alpha=inv))

    def zero_grad(self) -> None:
        if self.grad_full is not None:
            self.grad_fresh = True  # overwritten, not added to, by the next backward
        elif self.grad_shard is not None:
            self.grad_shard.zero_()

    # ------------------------------------------------------------------ after the optimizer step
    def publish_master(self) -> Handle:
        """Cast the updated master shard into the compute shard and share it with the other ranks."""
        if self.master is not None and self.master is not self.shard:
            self.shard.copy_(self.master)
        if self.stage in (1, 2):
            return self.comm.all_gather(self.full, self.shard, async_op=True)
        return Handle()

    def master_or_shard_fp32(self) -> torch.Tensor:
        """This rank's fp32 slice of the group's weights (frozen groups: cast of the shard)."""
        src = self.master if self.master is not None else self.shard
        return src if src.dtype == torch.float32 else src.float()

    # ------------------------------------------------------------------ accounting
    def param_bytes(self) -> int:
        t = self.full if self.stage < 3 else self.shard
        return t.numel() * t.element_size()

    def grad_bytes(self) -> int:
        t = self.grad_full if self.grad_full is not None else self.grad_shard
        return 0 if t is None else t.numel() * t.element_size()

    def master_bytes(self) -> int:
        if self.master is None or self.master is self.shard:
            return 0
        return self.master.numel() * self.master.element_size()
