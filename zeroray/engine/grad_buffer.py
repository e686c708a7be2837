"""GradBuffer: one flat buffer that a group's local gradients are written into before they are reduced.

It owns what "the first gradient of a slot is copied, later ones added" means, the zeroing of slots
no gradient reached (``seal``), and what a buffer that was already reduced must become before more
gradients arrive (``reopen``): stages 0-1 keep one persistent buffer across micro-steps, so a
second backward before the optimizer step (accumulation 1) must add to the reduced result, not
reduce it twice. Stages 2-3 write into temporaries that are reduced every micro-step.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

import torch

from zeroray.engine.layout import TensorSlot


class GradState(Enum):
    EMPTY = 0  # stale contents: a slot's first gradient is copied, untouched slots are zeroed by seal()
    LOCAL = 1  # holds this rank's (accumulated) gradients
    REDUCED = 2  # holds the averaged gradients in this rank's shard [lo, hi); the rest is stale


class GradBuffer:
    """A flat gradient buffer over ``slots`` (``data`` has the group's padded size)."""

    def __init__(self, data: torch.Tensor, slots: Sequence[TensorSlot], numel: int):
        self.data = data
        self.slots = slots
        self.numel = numel
        self.state = GradState.EMPTY
        self._written = [False] * len(slots)

    def write(self, i: int, grad: torch.Tensor) -> None:
        """Add (or, in an empty buffer, copy) the gradient of slot ``i``."""
        if self.state is GradState.REDUCED:
            raise RuntimeError("GradBuffer.reopen() must run before new gradients are written")
        slot = self.slots[i]
        dst = self.data[slot.offset : slot.end]
        if self.state is GradState.EMPTY and not self._written[i]:
            dst.copy_(grad.reshape(-1))
            self._written[i] = True
        else:
            dst.add_(grad.reshape(-1))

    def seal(self) -> None:
        """Make an empty buffer's contents valid: zero the slots no gradient was copied into."""
        if self.state is not GradState.EMPTY:
            return
        for slot, w in zip(self.slots, self._written):
            if not w:
                self.data[slot.offset : slot.end].zero_()
        self.data[self.numel :].zero_()
        self.state = GradState.LOCAL

    def mark_reduced(self) -> None:
        self.state = GradState.REDUCED

    def reopen(self, lo: int, hi: int, world_size: int, sharded: bool) -> None:
        """Turn a reduced buffer back into local gradients whose sum over ranks is ``world_size`` times
        the reduced result, so that the next reduction (sum, then divide by the world size) adds the
        new gradients' average to it. Unsharded (stage 0): every rank holds the same average already.
        Sharded: only ``[lo, hi)`` is reduced here; the rest is zeroed and this part scaled."""
        if self.state is not GradState.REDUCED:
            return
        if sharded:
            self.data[:lo].zero_()
            self.data[hi:].zero_()
            self.data[lo:hi].mul_(world_size)
        self.state = GradState.LOCAL

    def clear(self) -> None:
        """After the optimizer used the gradients: the next backward overwrites (no zeroing pass)."""
        self.state = GradState.EMPTY
        self._written = [False] * len(self.slots)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()
