"""What the engine hands a checkpoint and takes back from one: this rank's parts of the logical flat
groups (:mod:`zeroray.engine.layout`), held, read on demand, or copied, and the ranges a load asks
for. Their own module so the checkpoint package depends on these types, not on the engine."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from zeroray.engine.layout import TensorSlot


@dataclass(frozen=True)
class GroupShard:
    """One rank's part of one logical flat group (see :mod:`zeroray.engine.layout`)."""

    name: str
    slots: list[TensorSlot]
    numel: int  # logical (unpadded) elements of the group
    shard_world: int  # ranks the group is split over (1 at stage 0)
    shard_rank: int
    lo: int  # this rank's range of the padded group
    hi: int
    param_group: int | None  # optimizer param group, None = frozen
    tensors: dict[str, torch.Tensor]


@dataclass(frozen=True)
class GroupSource:
    """One rank's part of one logical flat group, read on demand (:meth:`ZeroEngine.stream_shard_state`):
    a :class:`GroupShard` whose tensors are produced piece by piece instead of held."""

    name: str
    slots: list[TensorSlot]
    numel: int
    shard_world: int
    shard_rank: int
    lo: int
    hi: int
    param_group: int | None
    keys: tuple[str, ...]  # "weight" and the elementwise optimizer states the group has now
    in_memory: bool  # read() yields live tensors; False: swap buffers, each valid until the next is asked for
    # read(key): the shard of ``key`` as consecutive 1-D fp32 tensors, ``hi - lo`` elements in all
    read: Callable[[str], Iterator[torch.Tensor]] = field(repr=False)
    # Which of the identical copies of this shard this rank holds, of how many: the ranks of other shard
    # groups under hybrid sharding, every rank at stage 0. A checkpoint writes each shard from one copy.
    copy: int = 0
    copies: int = 1


@dataclass(frozen=True)
class ShardStateCopy:
    """A copy of this rank's shard state that training may run past (:meth:`ZeroEngine.copy_shard_state`)."""

    groups: list[GroupSource]
    close: Callable[[], None]  # removes the copy


@dataclass(frozen=True)
class ShardRange:
    """Elements ``[lo, hi)`` of this rank's shard of group ``group``'s ``key`` (counted from the
    shard's start, the padded group's element ``GroupShard.lo``), to be written into ``dest``
    (``hi - lo`` fp32 elements in host memory) by :meth:`ZeroEngine.load_shard_stream`'s ``fill``."""

    group: str
    key: str
    lo: int
    hi: int
    dest: torch.Tensor
