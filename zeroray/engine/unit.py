"""Unit: one stage-3 unit's lifecycle, the way FSDP2's ``FSDPParamGroup`` owns one ``fully_shard``.

A unit (a transformer block by default, see :mod:`zeroray.engine.plan`) owns its flat groups and
gathers them all together: right before its forward, again right before its backward, and frees
them right after each. It counts the reductions still pending in a backward and frees itself as
soon as the last one is launched, unless it holds frozen parameters (an op may still need those
after the last trainable gradient arrived; it is then freed at the end of backward). The root unit
(parameters in no unit, or in several, such as tied weights) is gathered from the start of forward
until nothing left in backward reads it: the scheduler frees it early (:meth:`free_unused`) once
the tensors saved for backward that view it were read, else at the end of backward.

Which unit runs when, and what to prefetch, is the :class:`~zeroray.engine.schedule.UnitScheduler`'s
business; a unit only knows its own state.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum, auto

from torch import nn

from zeroray.engine.flat_group import FlatGroup, ParamState
from zeroray.engine.quantized_comm import Phase


class TrainingState(Enum):
    IDLE = auto()  # freed, or gathered outside forward/backward (gathered_parameters)
    FORWARD = auto()  # gathered for its forward
    PRE_BACKWARD = auto()  # forward done; its backward may come (it is freed meanwhile)
    BACKWARD = auto()  # gathered again for its backward
    POST_BACKWARD = auto()  # every gradient of it was reduced


class Unit:
    def __init__(self, name: str, module: nn.Module, groups: Sequence[FlatGroup], *, root: bool = False):
        self.name = name
        self.module = module
        self.groups = list(groups)
        self.numel = sum(g.padded for g in self.groups)
        # The root stays gathered from the start of forward to the end of backward.
        self.reshard_after_forward = not root
        self.free_early = not root and all(g.trainable for g in self.groups)
        self.state = TrainingState.IDLE
        self._pending = 0  # reductions not launched yet in this backward
        self._held = 0  # gathered_parameters() nesting: no free while held

    # ------------------------------------------------------------------ gather / free
    @property
    def gathered(self) -> bool:
        return all(g.state is ParamState.GATHERED for g in self.groups)

    def prefetch(self, phase: Phase | None = None) -> None:
        """Issue the all-gathers of every group (async); ``phase``: the step's gather for its "forward" or
        "backward" (int8 under qwZ), or None for the exact values."""
        for g in self.groups:
            g.start_gather(phase)

    def gather(self, phase: Phase | None = None) -> None:
        self.prefetch(phase)
        for g in self.groups:
            g.wait_gather()

    def free(self, to_pool: bool = True, keep_secondary: bool = False) -> None:
        """Free every group (not while held); ``to_pool=False``: the memory goes to the allocator;
        ``keep_secondary``: hpZ keeps each group's secondary copy for the backward."""
        if self._held:
            return
        for g in self.groups:
            if keep_secondary:
                g.keep_secondary()
            g.free(to_pool)

    def hold(self) -> None:
        """Gather and keep gathered until :meth:`release` (engine.gathered_parameters)."""
        self.gather()
        self._held += 1

    def release(self) -> None:
        self._held -= 1
        if self._held == 0 and self.state in (TrainingState.IDLE, TrainingState.PRE_BACKWARD):
            self.free()

    # ------------------------------------------------------------------ forward / backward
    def pre_forward(self) -> None:
        self.state = TrainingState.FORWARD
        self.gather("forward")

    def post_forward(self, backward_follows: bool) -> None:
        if not backward_follows:
            self.state = TrainingState.IDLE
            self.free()
        elif self.reshard_after_forward:
            self.state = TrainingState.PRE_BACKWARD
            self.free(keep_secondary=True)
        else:
            self.state = TrainingState.BACKWARD

    def expect_backward(self) -> None:
        """The model's forward ended: every trainable group will be reduced once in its backward."""
        self._pending = sum(g.trainable for g in self.groups)

    def pre_backward(self) -> None:
        self.state = TrainingState.BACKWARD
        self.gather("backward")

    def reduced(self, group: FlatGroup) -> bool:
        """The reducer launched ``group``'s reduction; True if it was the unit's last."""
        self._pending -= 1
        if self._pending != 0:
            return False
        self.state = TrainingState.POST_BACKWARD
        if self.free_early:
            self.free()
        return True

    def free_unused(self) -> None:
        """Free in the middle of backward, the memory back to the allocator (it is not gathered
        again before the next forward): nothing left in this backward reads the parameters."""
        if self._held:
            return
        self.state = TrainingState.POST_BACKWARD
        self.free(to_pool=False)

    def post_backward(self) -> None:
        self.state = TrainingState.IDLE
        self.free()
        for g in self.groups:
            g.drop_secondary()
