"""Recovery points: a planned resize stops the loop right after a checkpoint, so it loses no step.

The driver cannot stop the user's loop from outside without losing the steps since the last
checkpoint, so it asks the ranks (``RankActor.request_recovery_point``) and they stop at their next
``zt.report``: in an elastic run every report ends with one more small exchange on the report group,
in which the ranks agree whether any of them was asked (they may hear the request at different
reports; the exchange makes it the same report for all). Then every rank saves the engine at its
current step, unless that step is already saved, waits for the commit, and leaves its loop by raising
:class:`RecoveryPointReached`, which the actor reports as "stopped at step N", not as a failure.
"""

from __future__ import annotations

import time
from typing import Any

from zeroray.train import checkpoint_manager
from zeroray.train.context import ReportCallback, Session
from zeroray.train.report import RankStats, Report


class RecoveryPointReached(BaseException):  # noqa: N818 - a control-flow signal, not an error
    """Raised out of ``zt.report`` to end the loop at a recovery point; a BaseException so that a loop's
    ``except Exception`` does not swallow it. ``step``: the engine's global step saved (None: no engine)."""

    def __init__(self, step: int | None) -> None:
        super().__init__(f"stopped at a recovery point (step {step})")
        self.step = step


class RecoveryPointCallback(ReportCallback):
    """In each rank of an elastic run, the last thing a report does (see the module docstring)."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def after_report(self, metrics: dict[str, Any], stats: RankStats, num_reports: int) -> None:
        session = self.session
        gathered = session.report_comm.all_gather_object((session.stop_requested, stats))
        if not any(asked for asked, _ in gathered):
            return
        engine = session.engine
        step = None
        if engine is not None:
            step = int(engine.global_step)
            if session.last_saved_step != step:
                checkpoint_manager.save(session)
            checkpoint_manager.wait(session)
        if session.context.get_world_rank() == 0:  # the report this exchange ended: zt.report queues it after us
            ranks = tuple(s for _, s in gathered)
            session.reports.put(Report(index=num_reports, time=time.time(), metrics=metrics, ranks=ranks))
        raise RecoveryPointReached(step)
