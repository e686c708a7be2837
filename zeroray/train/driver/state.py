"""The controller's states, one class each, as in Ray Train V2.

INITIALIZING -> SCHEDULING -> RUNNING -> FINISHED
                    ^            |-> RESTARTING -> SCHEDULING   (failure policy says restart)
                    |            |-> ERRORED                    (failure policy says raise)
                    '-- RESIZING <-'                            (scaling policy asks; the fixed one never does)
                    '-- PREEMPTING <-'                          (a drain notice or a rank's SIGTERM)
SCHEDULING -> RESTARTING / ERRORED when the group cannot start (failure policy)
any non-terminal state -> ABORTED (Ctrl-C in the driver), ERRORED (an error in the driver itself)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from zeroray.train.errors import Failure
from zeroray.train.preemption import PreemptionInfo
from zeroray.train.sizing import ScalingDecision


class StateType(enum.Enum):
    INITIALIZING = "INITIALIZING"
    SCHEDULING = "SCHEDULING"
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"
    RESIZING = "RESIZING"
    PREEMPTING = "PREEMPTING"
    FINISHED = "FINISHED"
    ERRORED = "ERRORED"
    ABORTED = "ABORTED"

    @property
    def is_terminal(self) -> bool:
        return self in (StateType.FINISHED, StateType.ERRORED, StateType.ABORTED)


@dataclass(frozen=True)
class ControllerState:
    type: StateType = field(init=False)

    @property
    def is_terminal(self) -> bool:
        return self.type.is_terminal


@dataclass(frozen=True)
class Initializing(ControllerState):
    type: StateType = field(default=StateType.INITIALIZING, init=False)


@dataclass(frozen=True)
class Scheduling(ControllerState):
    decision: ScalingDecision
    type: StateType = field(default=StateType.SCHEDULING, init=False)


@dataclass(frozen=True)
class Running(ControllerState):
    type: StateType = field(default=StateType.RUNNING, init=False)


@dataclass(frozen=True)
class Restarting(ControllerState):
    failures: list[Failure]
    type: StateType = field(default=StateType.RESTARTING, init=False)


@dataclass(frozen=True)
class Resizing(ControllerState):
    decision: ScalingDecision
    type: StateType = field(default=StateType.RESIZING, init=False)


@dataclass(frozen=True)
class Preempting(ControllerState):
    """Ranks of the group leave soon (``info``): a recovery point, then a group without them."""

    info: PreemptionInfo
    type: StateType = field(default=StateType.PREEMPTING, init=False)


@dataclass(frozen=True)
class Finished(ControllerState):
    type: StateType = field(default=StateType.FINISHED, init=False)


@dataclass(frozen=True)
class Errored(ControllerState):
    """``error``: the TrainingFailedError ``fit()`` raises, or the driver's own unexpected error."""

    error: BaseException
    type: StateType = field(default=StateType.ERRORED, init=False)


@dataclass(frozen=True)
class Aborted(ControllerState):
    type: StateType = field(default=StateType.ABORTED, init=False)
