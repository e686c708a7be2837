"""The controller: an explicit state machine in the driver that runs the group until it finishes or fails.

It decides and dispatches, in the shape of Ray Train V2's controller: each state has one handler
returning the next state (see state.py for the graph); ``_set_state`` fires the callbacks, which hold
every side effect (history, progress, metrics.jsonl, run.json; callbacks.py); reports go to the same
callbacks. Policies decide, the controller acts: the scaling policy says how big the next group is and,
while RUNNING, whether to resize; the failure policy whether a failure restarts the group. A
(re)started group resumes from the run's newest committed checkpoint by itself (``zt.prepare``); the
controller reads storage only to log it and to fill ``Result.checkpoint``. It lives in the driver
process, so Ctrl-C reaches it directly and tears the group down.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from typing import Any

from zeroray.train import state as S
from zeroray.train.callbacks import (
    ControllerCallback,
    HistoryCallback,
    MetricsFileCallback,
    ProgressCallback,
    RunInfoCallback,
)
from zeroray.train.checkpoint_manager import latest_checkpoint
from zeroray.train.errors import Failure, StartFailure, TrainingFailedError, WorkerFailure
from zeroray.train.failure_policy import FailureDecision, FailurePolicy
from zeroray.train.lease import RunLease
from zeroray.train.progress import Progress
from zeroray.train.report import Report
from zeroray.train.result import Result
from zeroray.train.run_spec import RunSpec
from zeroray.train.scaling_policy import ScalingPolicy
from zeroray.train.storage import RunStorage
from zeroray.train.worker_group import WorkerGroup, WorkerGroupStartError

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1
FAILURE_GRACE_S = 3.0  # how long to wait for the root-cause failure after a peer's collective failed
# After a collective timeout, the ranks still waiting in theirs time out within the collective timeout: wait for
# them (up to this cap), so the error says where every rank was.
TIMEOUT_GRACE_CAP_S = 60.0


class Controller:
    """Drives one ``fit()``. Use :meth:`run`; it always leaves no actor or placement group behind."""

    def __init__(
        self,
        *,
        spec: RunSpec,
        datasets: dict[str, Any],
        storage: RunStorage,
        scaling_policy: ScalingPolicy,
        failure_policy: FailurePolicy,
        lease: RunLease | None = None,
        callbacks: list[ControllerCallback] | None = None,
    ) -> None:
        self.spec, self.datasets, self.storage = spec, datasets, storage
        self.scaling_policy, self.failure_policy = scaling_policy, failure_policy
        self.lease = lease
        self.group: WorkerGroup | None = None
        self.attempt = 0
        self.state: S.ControllerState | None = None
        self.states: list[S.StateType] = []  # the path taken, for logs and tests
        self.last_pids: list[int] = []
        self._t0 = time.time()
        self.history = HistoryCallback()
        metrics_file = MetricsFileCallback(storage)
        self.callbacks: list[ControllerCallback] = [
            self.history,
            ProgressCallback(Progress(spec.progress_bar, spec.samples_per_step)),
            metrics_file,
            RunInfoCallback(storage, metrics_file),
            *(callbacks or []),
        ]

    # ------------------------------------------------------------------ the loop
    def run(self) -> Result:
        """Run the state machine to a terminal state; raise TrainingFailedError / KeyboardInterrupt."""
        try:
            self._set_state(S.Initializing())
            while not self.state.is_terminal:
                following = self._step(self.state)
                if following.is_terminal:
                    self._shutdown_group()  # the group is gone before run.json says how it ended
                self._set_state(following)
        except KeyboardInterrupt:
            self._shutdown_group()
            self._set_state(S.Aborted())
            raise
        except Exception as e:  # the driver's own error: still end ERRORED in run.json, then raise it
            self._shutdown_group()
            logger.error("zeroray: the controller failed:\n%s", traceback.format_exc())
            self._set_state(S.Errored(e))
            raise
        finally:
            self._shutdown_group()
        if isinstance(self.state, S.Errored):
            raise self.state.error
        return self._result(None)

    def _set_state(self, state: S.ControllerState) -> None:
        previous, self.state = self.state, state
        self.states.append(state.type)
        logger.debug("zeroray controller: %s -> %s", previous, state)
        for callback in self.callbacks:
            callback.after_state_change(previous, state)

    def _step(self, state: S.ControllerState) -> S.ControllerState:
        if isinstance(state, S.Initializing):
            self._log_resume()
            return S.Scheduling(self.scaling_policy.decide_for_new_group())
        if isinstance(state, S.Scheduling):
            return self._schedule(state)
        if isinstance(state, S.Running):
            return self._poll()
        if isinstance(state, S.Restarting):
            self._shutdown_group()
            return S.Scheduling(self.scaling_policy.decide_for_new_group())
        if isinstance(state, S.Resizing):
            self._shutdown_group()
            return S.Scheduling(state.decision)
        raise AssertionError(f"no handler for {state}")

    # ------------------------------------------------------------------ handlers
    def _log_resume(self) -> None:
        """Say what a new fit of an existing run continues from (the ranks load it in zt.prepare)."""
        import zeroray.checkpoint as zc

        try:
            committed = [c for c in zc.list_checkpoints(self.storage.url, self.spec.storage_options) if c.committed]
        except Exception as e:
            logger.warning("zeroray: could not list the checkpoints in %s: %s: %s", self.storage.url,
                           type(e).__name__, e)
            return
        if committed:
            c = committed[-1]
            logger.warning("zeroray: run %r: resuming from checkpoint_%d (written at world %s, stage %s): %s",
                           self.spec.name, c.step, c.world_size, c.stage, c.url)

    def _schedule(self, state: S.Scheduling) -> S.ControllerState:
        self.attempt += 1
        try:
            self.group = WorkerGroup.start(
                spec=self.spec,
                decision=state.decision,
                per_rank_datasets=self._split_datasets(state.decision.num_workers),
            )
        except WorkerGroupStartError as e:
            tb = traceback.format_exc()
            if e.rank is None:
                failure: Failure = StartFailure(e.what, str(e), tb)
            else:
                failure = WorkerFailure(e.rank, str(e), tb)
            return self._on_failure([failure])
        self.last_pids = self.group.pids
        return S.Running()

    def _split_datasets(self, num_workers: int) -> Callable[[list[str]], list[dict[str, Any]]]:
        def split(node_ids: list[str]) -> list[dict[str, Any]]:
            if not self.datasets:
                return [{} for _ in range(num_workers)]
            from zeroray.train.dataset import split_datasets

            return split_datasets(self.datasets, num_workers, locality_hints=node_ids)

        return split

    def _poll(self) -> S.ControllerState:
        assert self.group is not None
        status = self.group.poll()
        for report in status.reports:
            self._on_report(report)
        if status.failures:
            return self._on_failure(self._collect_failures(status.failures))
        if status.finished:
            return S.Finished()
        if self.lease is not None and self.lease.lost:
            return self._errored([StartFailure("lease", self.lease.lost)])
        resize = self.scaling_policy.decide_while_running(len(self.group.actors))
        if resize is not None:
            return S.Resizing(resize)
        time.sleep(POLL_INTERVAL_S)
        return S.Running()

    def _on_report(self, report: Report) -> None:
        entry = report.history_entry(self._t0, self.attempt)
        for callback in self.callbacks:
            callback.after_report(report, entry)

    def _collect_failures(self, failures: list[WorkerFailure]) -> list[Failure]:
        """When only ranks hurt by a peer's failure have reported so far, wait briefly for the root cause (after a
        collective timeout: for the other ranks' timeouts, so the error says where each rank was)."""
        assert self.group is not None
        start = time.monotonic()
        by_rank = {f.rank: f for f in failures}
        while len(by_rank) < len(self.group.actors) and all(f.secondary for f in by_rank.values()):
            grace = FAILURE_GRACE_S
            if any(f.timed_out for f in by_rank.values()):
                grace = max(grace, min(self.spec.collective_timeout_s, TIMEOUT_GRACE_CAP_S))
            if time.monotonic() - start >= grace:
                break
            time.sleep(POLL_INTERVAL_S)
            status = self.group.poll(timeout_s=FAILURE_GRACE_S)
            for report in status.reports:
                self._on_report(report)
            by_rank.update({f.rank: f for f in status.failures})
        return list(by_rank.values())

    def _on_failure(self, failures: list[Failure]) -> S.ControllerState:
        decision = self.failure_policy.decide(failures)
        if decision is FailureDecision.RESTART:
            latest = self._latest_checkpoint()
            logger.warning(
                "zeroray: group failed (attempt %d), restarting from %s:\n%s",
                self.attempt, latest.path if latest else "the start (no committed checkpoint)",
                "\n".join(str(f) for f in failures),
            )
            return S.Restarting(failures)
        return self._errored(failures)

    def _errored(self, failures: list[Failure]) -> S.Errored:
        error = TrainingFailedError(failures, attempts=self.attempt)
        error.result = self._result(error)
        return S.Errored(error)

    # ------------------------------------------------------------------ helpers
    def _shutdown_group(self) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            group.shutdown(graceful=False)

    def _latest_checkpoint(self) -> Any:
        """The newest committed checkpoint on storage; a listing that fails is logged, never fails the run."""
        try:
            return latest_checkpoint(self.storage.url, self.spec.storage_options)
        except Exception as e:
            logger.warning("zeroray: could not list the checkpoints in %s: %s: %s", self.storage.url,
                           type(e).__name__, e)
            return None

    def _result(self, error: BaseException | None) -> Result:
        return Result(
            metrics=self.history.last_metrics,
            metrics_history=list(self.history.history),
            path=self.storage.url,
            checkpoint=self._latest_checkpoint(),
            error=error,
            attempts=self.attempt,
        )
