"""Sub-groups: how this rank's master shards are cut into torch optimizer parameters and stepped.

A :class:`ParamSlice` is a contiguous slice of one flat group's master shard inside one model
parameter: one torch parameter, so a model parameter without a gradient is skipped by the torch
optimizer, as under DDP. A :class:`SubGroup` is slices stepped together, at most ``sub_group_size``
elements (DeepSpeed's key): where offload moves the masters and states in and out. A leaf module:
the optimizer (:mod:`zeroray.engine.sharded_optim`) and the state homes (:mod:`zeroray.engine.offload.home`)
both use it, and neither imports the other's concrete classes for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from zeroray.engine.flat_group import FlatGroup


@dataclass(frozen=True)
class ParamSlice:
    """A contiguous slice ``[lo, hi)`` of one flat group's master shard inside one model parameter
    (``index`` into the group's parameters; None: the shard's padding): one torch parameter, so a
    model parameter without a gradient is skipped by the torch optimizer as it would be in DDP."""

    group: FlatGroup
    lo: int
    hi: int
    param: nn.Parameter
    index: int | None

    @property
    def numel(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class SubGroup:
    """Pieces stepped together; at most ``sub_group_size`` elements."""

    index: int
    pieces: tuple[ParamSlice, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.pieces)


def _param_spans(g: FlatGroup) -> list[tuple[int, int, int | None]]:
    """``(lo, hi, index)``: this rank's shard of ``g`` cut at its parameters' bounds (shard offsets;
    index None for the padding past the last parameter)."""
    spans = []
    for i, slot in enumerate(g.slots):
        lo, hi = max(slot.offset, g.lo), min(slot.end, g.hi)
        if lo < hi:
            spans.append((lo - g.lo, hi - g.lo, i))
    end = spans[-1][1] if spans else 0
    if end < g.shard_numel:
        spans.append((end, g.shard_numel, None))
    return spans


def plan_sub_groups(groups: Sequence[FlatGroup], sub_group_size: int) -> list[list[tuple[FlatGroup, int, int, int | None]]]:
    """Consecutive ``(group, lo, hi, index)`` slices of the trainable groups' shards, each inside one
    parameter (see :func:`_param_spans`), packed in order into sub-groups of at most
    ``sub_group_size`` elements (a parameter larger than the room left is split)."""
    subs: list[list[tuple[FlatGroup, int, int, int | None]]] = []
    cur: list[tuple[FlatGroup, int, int, int | None]] = []
    room = sub_group_size
    for g in groups:
        if not g.trainable:
            continue
        for lo, end, index in _param_spans(g):
            while lo < end:
                hi = min(end, lo + room)
                cur.append((g, lo, hi, index))
                room -= hi - lo
                lo = hi
                if room == 0:
                    subs.append(cur)
                    cur, room = [], sub_group_size
    if cur:
        subs.append(cur)
    return subs
