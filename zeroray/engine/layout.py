"""Partition arithmetic: which flat range of which logical tensor each rank owns.

This is the single source of truth for sharding. The engine, the checkpoint code and the memory
estimator all use it, so a checkpoint written at one world size maps exactly onto another. It imports
only the standard library, so the estimator (``zeroray estimate``) runs without torch.

A *logical flat group* is the concatenation of some tensors (in a fixed order, unpadded). For a
world size N the group is padded at its end to a multiple of N and cut into N equal, contiguous
shards; rank r owns ``[r * S, (r + 1) * S)`` of the padded group. Padding never belongs to a
tensor, so the logical layout (names, shapes, offsets) does not depend on N.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TensorSlot:
    """One logical tensor inside a flat group."""

    name: str
    shape: tuple[int, ...]
    offset: int  # element offset in the logical (unpadded) flat group

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class Piece:
    """The overlap of a flat range with one tensor: ``tensor[t_lo:t_hi]`` == ``flat[f_lo:f_hi]``."""

    name: str
    t_lo: int
    t_hi: int
    f_lo: int
    f_hi: int

    @property
    def numel(self) -> int:
        return self.t_hi - self.t_lo


SWAP_ALIGN = 4096  # NVMe swap files: offsets, lengths and memory aligned to the page (O_DIRECT)
MIN_PARAM_BUFFERS = 2  # parameter swap: a staged write and a demand read may overlap


def swap_aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to whole SWAP_ALIGN pages: the size of a swap-file segment."""
    return -(-nbytes // SWAP_ALIGN) * SWAP_ALIGN


def param_pool_size(buffer_count: int) -> int:
    """Buffers the parameter-swap pool holds for ``offload_param.buffer_count``."""
    return max(MIN_PARAM_BUFFERS, buffer_count)


def padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``world_size`` (at least ``world_size``)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return max(1, math.ceil(numel / world_size)) * world_size


def shard_numel(numel: int, world_size: int) -> int:
    """Elements in each rank's shard of a group of ``numel`` elements."""
    return padded_numel(numel, world_size) // world_size


def shard_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[lo, hi)`` of the padded group that ``rank`` owns (may run past ``numel`` into padding)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    s = shard_numel(numel, world_size)
    return rank * s, (rank + 1) * s


def build_slots(names: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[TensorSlot]:
    """Lay tensors out back to back, in the order given."""
    slots, offset = [], 0
    for name, shape in zip(names, shapes, strict=True):
        slot = TensorSlot(name, tuple(int(d) for d in shape), offset)
        slots.append(slot)
        offset = slot.end
    return slots


def group_numel(slots: Sequence[TensorSlot]) -> int:
    return slots[-1].end if slots else 0


def pieces(slots: Sequence[TensorSlot], lo: int, hi: int) -> Iterator[Piece]:
    """The tensors (and their element ranges) that the flat range ``[lo, hi)`` covers."""
    for slot in slots:
        a, b = max(lo, slot.offset), min(hi, slot.end)
        if a < b:
            yield Piece(slot.name, a - slot.offset, b - slot.offset, a, b)


def owners(numel: int, world_size: int, lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
    """For a flat range ``[lo, hi)``: ``(rank, local_lo, local_hi)`` for each shard it touches.

    ``local_*`` are element offsets inside that rank's shard. Used to turn "I need these elements"
    into range reads of the files other ranks wrote.
    """
    s = shard_numel(numel, world_size)
    for rank in range(lo // s, min(world_size, math.ceil(hi / s)) if hi > lo else 0):
        a, b = max(lo, rank * s), min(hi, (rank + 1) * s)
        if a < b:
            yield rank, a - rank * s, b - rank * s


def precision_bytes(precision: str, optimizer_bytes: int | None = None) -> tuple[int, int, int]:
    """``(param, grad, optimizer)`` bytes per parameter for a precision (optimizer: Adam unless given)."""
    if precision == "fp32":
        p, k = 4, 8
    elif precision in ("bf16", "fp16"):
        p, k = 2, 12
    else:
        raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp16', got {precision!r}")
    if optimizer_bytes is not None:
        if optimizer_bytes < 0:
            raise ValueError(f"optimizer_bytes must be >= 0, got {optimizer_bytes}")
        k = optimizer_bytes
    return p, p, k


def swap_bytes(numel: int, segments: int, sub_group_size: int, buffer_count: int) -> tuple[int, int]:
    """``(host, nvme)`` bytes of NVMe offload for a partition of ``numel`` elements stepped in
    sub-groups of at most ``sub_group_size``: the buffer pool and the swap files."""
    full, rest = divmod(numel, sub_group_size)
    subs = full + (rest > 0)
    files = segments * (full * swap_aligned(sub_group_size * 4) + (swap_aligned(rest * 4) if rest else 0))
    largest = swap_aligned(min(numel, sub_group_size) * 4)
    return min(buffer_count, subs) * segments * largest, files
