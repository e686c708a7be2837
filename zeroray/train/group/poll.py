"""The poll between the driver and the ranks: what one rank answers, and what one poll of the group found.

The worker group calls ``RankActor.poll`` on every rank about ten times a second (at most one call in
flight per rank); each answers a :class:`PollAnswer`. ``WorkerGroup.poll`` folds the answers, dead
actors and silent ranks into one :class:`PollStatus` for the controller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from zeroray.train.errors import WorkerFailure
from zeroray.train.preemption import PreemptionInfo, RecoveryChoice
from zeroray.train.report import Report


@dataclass(frozen=True)
class PollAnswer:
    """One rank's answer to a poll (``RankActor.poll``).

    ``reports``: the group's reports queued since the last poll (rank 0 only: every rank queues them, and
    the others keep theirs for ``RankActor.held_reports``); ``done``: the loop has ended, by returning,
    failing or stopping (every report it made is in this answer or an earlier one); ``failure``: why it failed; ``stopped``: it ended at a recovery point
    (a planned resize), at the engine's global step ``stopped_at``. ``timings`` and ``resumed`` come once,
    with the rank's first report: its start-up seconds by phase (``Attempt.phases``) and where its
    ``zt.prepare`` resumed from ("memory" | "replica" | "storage", step). ``stopped_with``: the recovery point
    the loop stopped at (on a preemption notice or for a planned resize) and why; ``sigterm``: the rank's
    process got SIGTERM (a notice for this rank, with the grace left).
    """

    reports: tuple[Report, ...] = ()
    done: bool = False
    failure: WorkerFailure | None = None
    stopped: bool = False
    stopped_at: int | None = None
    timings: dict[str, float] | None = None
    resumed: tuple[Literal["memory", "replica", "storage"], int] | None = None
    stopped_with: RecoveryChoice | None = None
    sigterm: PreemptionInfo | None = None


@dataclass
class PollStatus:
    """What one poll of every rank found (``WorkerGroup.poll``)."""

    reports: list[Report] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)
    failures: list[WorkerFailure] = field(default_factory=list)
    stopped: list[bool] = field(default_factory=list)  # the loop ended at a recovery point
    stopped_at: int | None = None
    timings: dict[str, float] | None = None  # rank 0's start-up seconds, with its first report
    resumed: tuple[Literal["memory", "replica", "storage"], int] | None = None  # with them: what the group resumed from
    stopped_with: RecoveryChoice | None = None  # rank 0's, once it stopped at a recovery point
    sigterms: list[PreemptionInfo] = field(default_factory=list)  # ranks whose process got SIGTERM

    @property
    def finished(self) -> bool:
        return bool(self.done) and all(self.done) and not self.failures and not any(self.stopped)

    @property
    def all_stopped(self) -> bool:
        return bool(self.stopped) and all(self.stopped) and not self.failures
