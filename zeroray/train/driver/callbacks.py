"""The controller's callbacks: the interface, the built-ins, and the one list of them.

The controller decides and dispatches (as Ray Train V2's ``_set_state`` does); everything that only
observes the run is a :class:`ControllerCallback`: the history that becomes ``Result.metrics_history``,
the progress display, ``metrics.jsonl``, ``run.json`` and the controller's Ray gauges. The controller
runs the built-ins that :func:`default_callbacks` lists (``controller.py``), then the user's own from
``RunConfig(callbacks=[...])``, in that order, for every event. A storage hiccup in a built-in is
logged and never fails the run; an exception out of any hook fails it (:class:`~zeroray.train.errors.CallbackError`).

A rank's own side effects of a report (its Ray metrics, a recovery point) are
:class:`~zeroray.train.worker.context.ReportCallback` s, run inside the rank; they are not user-registrable.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from zeroray.train.driver import state as S
from zeroray.train.driver.progress import Progress
from zeroray.train.driver.run_dir import RunStorage
from zeroray.train.report import Report

if TYPE_CHECKING:
    from zeroray.train.result import Attempt

logger = logging.getLogger(__name__)

HISTORY_WRITE_INTERVAL_S = 5.0  # metrics.jsonl and run.json while running (object stores rewrite whole files)


class ControllerCallback:
    """Hooks of one ``fit()``'s controller: subclass it, override the hooks you need, and pass instances
    in ``RunConfig(callbacks=[...])`` (Ray Train V2's ``UserCallback``). Every hook does nothing by default.

    **Where they run**: in the driver process, in the thread that called ``fit()``, one after the other
    between two polls of the group (about ten a second): never in a rank. A slow hook delays the next
    poll (the ranks train on meanwhile), so hand long work to a thread of your own. Nothing is pickled:
    a callback may hold a lock, a file or a client.

    **Order**: for each event, the built-ins (``default_callbacks``) first, then ``RunConfig.callbacks``
    in list order. A fit's events come in this order::

        after_state_change(None, INITIALIZING)
        after_state_change(INITIALIZING, SCHEDULING)
        after_attempt_start(attempt)                 # a group started (or failed to start)
        after_state_change(SCHEDULING, RUNNING)
        after_report(report, entry) ...              # each zt.report, in order
        after_state_change(RUNNING, RUNNING) ...     # at every poll, between the reports
        after_attempt_end(attempt)                   # end="finished"
        after_state_change(RUNNING, FINISHED)

    A failure the failure policy restarts goes ``after_attempt_end`` ("failure"), RESTARTING,
    SCHEDULING, ``after_attempt_start`` of the next attempt; a planned resize goes through RESIZING, a
    preemption notice through PREEMPTING.
    The run ends in FINISHED, ERRORED or ABORTED (Ctrl-C), always with an ``after_state_change``.

    **Errors**: an exception out of a hook fails the run: the group is torn down, the controller
    moves to ERRORED (``run.json`` says so) and ``fit()`` raises
    :class:`~zeroray.train.errors.CallbackError`, naming the callback and the hook, with the hook's
    exception as its ``__cause__``; the failure policy does not restart it. Catch inside the hook what may
    fail and should not end the run. Once the run is already ending in ERRORED or ABORTED, a hook's
    exception is logged and the original error is what ``fit()`` raises.
    """

    def after_state_change(self, previous: S.ControllerState | None, current: S.ControllerState) -> None:
        """The controller moved from ``previous`` (None at the start) to ``current`` (``zeroray.train.driver.state``:
        ``current.type`` is a ``StateType``; ``Scheduling.decision`` / ``Resizing.decision`` the world size,
        ``Restarting.failures``, ``Errored.error``). RUNNING -> RUNNING comes at every poll; compare the
        types for a real change."""

    def after_report(self, report: Report, entry: dict[str, Any]) -> None:
        """A ``zt.report`` of the group arrived (``zeroray.train.report.Report``: ``index``, ``time``,
        ``metrics`` as rank 0 gave them, ``ranks``: every rank's ``RankStats``); ``entry`` is its row of
        ``Result.metrics_history`` (the metrics plus ``_report``, ``_global_step``, ``_time_s``, ...).
        Treat both as read-only: the built-ins keep them."""

    def after_attempt_start(self, attempt: Attempt) -> None:
        """A group started, or tried to (``zeroray.train.result.Attempt``: ``index``, ``world_size``,
        ``start_step``, the step it resumes from). The controller fills in the same object as the
        attempt goes on."""

    def after_attempt_end(self, attempt: Attempt) -> None:
        """A group ended; ``attempt.end`` says why: "finished", "failure" (``rank``, ``node``,
        ``message``), "resize_up" / "resize_down" (a planned resize), "preempted" (a preemption notice, or a
        failure of the ranks one named; ``message`` says the recovery point taken), "aborted", "errored"."""


class HistoryCallback(ControllerCallback):
    """Keeps every report of this ``fit()`` for the Result."""

    def __init__(self) -> None:
        self.history: list[dict[str, Any]] = []
        self.last_metrics: dict[str, Any] | None = None

    def after_report(self, report: Report, entry: dict[str, Any]) -> None:
        self.history.append(entry)
        self.last_metrics = dict(report.metrics)


class ProgressCallback(ControllerCallback):
    """Step, loss and samples/s on the progress display."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress

    def after_report(self, report: Report, entry: dict[str, Any]) -> None:
        self.progress.update(report)

    def after_state_change(self, previous: S.ControllerState | None, current: S.ControllerState) -> None:
        if current.is_terminal:
            self.progress.close()


class MetricsFileCallback(ControllerCallback):
    """Appends reports to ``metrics.jsonl`` at most every few seconds, on restarts and at the end.

    Entries that could not be written (a full disk) stay pending and are retried; the file only ever
    grows by whole lines. A ``fit()`` that takes no optimizer step (a resume with nothing left to train)
    adds no line: its reports (a text sample after the loop) are in ``Result.metrics_history`` only.
    """

    def __init__(self, storage: RunStorage, interval_s: float = HISTORY_WRITE_INTERVAL_S) -> None:
        self.storage, self.interval_s = storage, interval_s
        self.pending: list[dict[str, Any]] = []
        self._last_write = float("-inf")
        self.error: str | None = None  # the last write error, for run.json
        self.trained = False  # a report of this fit() took an optimizer step

    def after_report(self, report: Report, entry: dict[str, Any]) -> None:
        self.trained = self.trained or report.is_step
        self.pending.append(entry)
        if time.monotonic() - self._last_write >= self.interval_s:
            self.flush()

    def after_state_change(self, previous: S.ControllerState | None, current: S.ControllerState) -> None:
        # The controller passes RUNNING -> RUNNING at every poll: reports that came in a burst and
        # then a quiet loop are written once the interval has passed, not only at the next report.
        due = self.pending and time.monotonic() - self._last_write >= self.interval_s
        if current.is_terminal or isinstance(current, S.Restarting) or due:
            self.flush()

    def flush(self) -> None:
        self._last_write = time.monotonic()
        if not self.trained:
            return
        try:
            self.storage.append_history(self.pending)
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
            logger.warning("zeroray: could not append %d report(s) to %s/metrics.jsonl: %s",
                           len(self.pending), self.storage.url, self.error)
            return
        self.pending = []
        self.error = None


class RunInfoCallback(ControllerCallback):
    """``run.json``: the controller's state, attempts, world size, report count and the error, rewritten
    atomically on every state change and every few seconds of reports."""

    def __init__(self, storage: RunStorage, metrics_file: MetricsFileCallback | None = None,
                 interval_s: float = HISTORY_WRITE_INTERVAL_S, samples_per_step: int | None = None) -> None:
        self.storage, self.metrics_file, self.interval_s = storage, metrics_file, interval_s
        # samples_per_step lets `zeroray watch` / `plot` show samples/s rather than steps/s.
        self.info: dict[str, Any] = {"name": storage.name, "status": None, "attempts": 0, "num_workers": None,
                                     "num_reports": 0, "started_at": time.time(), "updated_at": None, "error": None,
                                     "samples_per_step": samples_per_step}
        self._last_write = float("-inf")
        self.attempts: list[Attempt] = []

    def after_state_change(self, previous: S.ControllerState | None, current: S.ControllerState) -> None:
        changed = previous is None or previous.type != current.type
        self.info["status"] = current.type.value
        if isinstance(current, S.Scheduling):
            self.info["attempts"] += 1
            self.info["num_workers"] = current.decision.num_workers
        if isinstance(current, S.Errored):
            self.info["error"] = str(current.error)
        # RUNNING -> RUNNING at every poll (0.1 s) is no news: an object store would take ten uploads a second.
        if changed or time.monotonic() - self._last_write >= self.interval_s:
            self.write()

    def after_attempt_start(self, attempt: Attempt) -> None:
        self.attempts.append(attempt)  # the controller fills it in (last step, end, steps lost); read at each write

    def after_attempt_end(self, attempt: Attempt) -> None:
        self.write()

    def after_report(self, report: Report, entry: dict[str, Any]) -> None:
        self.info["num_reports"] += 1
        if time.monotonic() - self._last_write >= self.interval_s:
            self.write()

    def write(self) -> None:
        self._last_write = time.monotonic()
        self.info["updated_at"] = time.time()
        self.info["metrics_error"] = self.metrics_file.error if self.metrics_file is not None else None
        self.info["attempt_history"] = [a.as_dict() for a in self.attempts]
        try:
            self.storage.write_run_info(self.info)
        except Exception as e:
            logger.warning("zeroray: could not write %s/run.json: %s: %s", self.storage.url, type(e).__name__, e)
