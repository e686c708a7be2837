"""The controller: an explicit state machine in the driver that runs the group until it finishes or fails.

Each state has one handler returning the next state (see state.py for the graph). Policies decide;
the controller only acts: the scaling policy says how big the next group is, the failure policy whether
a failure restarts the group. A (re)started group resumes from the run's newest committed checkpoint by
itself (``zt.prepare``); the controller only reads storage to log it and to fill ``Result.checkpoint``.
The controller lives in the driver process, so Ctrl-C reaches it directly and tears the group down.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from zeroray.train import state as S
from zeroray.train.checkpoint_manager import Checkpoint, latest_checkpoint
from zeroray.train.config import RunConfig, ScalingConfig
from zeroray.train.errors import TrainingFailedError, WorkerFailure
from zeroray.train.failure_policy import FailureDecision, FailurePolicy
from zeroray.train.progress import Progress
from zeroray.train.result import Result
from zeroray.train.scaling_policy import ScalingPolicy
from zeroray.train.storage import RunStorage
from zeroray.train.worker_group import WorkerGroup

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1
HISTORY_WRITE_INTERVAL_S = 5.0
FAILURE_GRACE_S = 3.0  # how long to wait for the root-cause failure after a peer's collective failed


class Controller:
    """Drives one ``fit()``. Use :meth:`run`; it always leaves no actor or placement group behind."""

    def __init__(
        self,
        *,
        train_fn: Callable[..., Any],
        train_loop_config: dict[str, Any] | None,
        pass_config: bool,
        zero_config: Any,
        scaling_config: ScalingConfig,
        run_config: RunConfig,
        datasets: dict[str, Any],
        storage: RunStorage,
        scaling_policy: ScalingPolicy,
        failure_policy: FailurePolicy,
        samples_per_step: int | None,
    ) -> None:
        self.train_fn, self.train_loop_config, self.pass_config = train_fn, train_loop_config, pass_config
        self.zero_config = zero_config
        self.scaling_config, self.run_config = scaling_config, run_config
        self.datasets, self.storage = datasets, storage
        self.scaling_policy, self.failure_policy = scaling_policy, failure_policy
        self.samples_per_step = samples_per_step
        self.group: WorkerGroup | None = None
        self.history: list[dict[str, Any]] = []
        self.last_metrics: dict[str, Any] | None = None
        self.attempt = 0
        self.states: list[S.StateType] = []  # the path taken, for logs and tests
        self._t0 = time.time()
        self._last_write = 0.0
        self.progress: Progress | None = None
        self.last_pids: list[int] = []

    # ------------------------------------------------------------------ the loop
    def run(self) -> Result:
        """Run the state machine to a terminal state; raise TrainingFailedError / KeyboardInterrupt."""
        state: S.ControllerState = S.Initializing()
        self.progress = Progress(self.run_config.progress_bar, self.samples_per_step)
        try:
            while not state.is_terminal:
                self.states.append(state.type)
                logger.debug("zeroray controller: %s", state)
                state = self._handle(state)
            self.states.append(state.type)
        except KeyboardInterrupt:
            self.states.append(S.StateType.ABORTED)
            self._shutdown_group()
            self._write(status="ABORTED")
            raise
        finally:
            self._shutdown_group()
            self.progress.close()
        if isinstance(state, S.Errored):
            error = TrainingFailedError(state.failures, attempts=self.attempt)
            error.result = self._result(error)
            self._write(status="ERRORED", error=str(error))
            raise error
        self._write(status="FINISHED")
        return self._result(None)

    def _handle(self, state: S.ControllerState) -> S.ControllerState:
        if isinstance(state, S.Initializing):
            return S.Scheduling(self.scaling_policy.decide_for_new_group())
        if isinstance(state, S.Scheduling):
            return self._schedule(state)
        if isinstance(state, S.Running):
            return self._poll()
        if isinstance(state, S.Restarting):
            self._shutdown_group()
            return S.Scheduling(self.scaling_policy.decide_for_new_group())
        raise AssertionError(f"no handler for {state}")  # Resizing arrives with the elastic policy

    # ------------------------------------------------------------------ handlers
    def _schedule(self, state: S.Scheduling) -> S.ControllerState:
        self.attempt += 1
        sc = self.scaling_config
        try:
            self.group = WorkerGroup.start(
                run=self.run_config.name,
                decision=state.decision,
                placement_strategy=sc.placement_strategy,
                use_gpu=sc.use_gpu,
                backend=sc.backend,
                placement_timeout_s=sc.placement_timeout_s,
                setup_kwargs={
                    "experiment_name": self.run_config.name,
                    "storage_path": self.run_config.storage_path,
                    "trial_dir": self.storage.url,
                    "zero_config": self.zero_config,
                    "storage_options": self.run_config.storage_options,
                    "checkpoint_config": self.run_config.checkpoint_config,
                },
                per_rank_datasets=self._split_datasets(state.decision.num_workers),
                train_fn=self.train_fn,
                train_loop_config=self.train_loop_config,
                pass_config=self.pass_config,
            )
        except KeyboardInterrupt:
            raise
        except Exception as e:
            import traceback

            failure = WorkerFailure(-1, f"starting the worker group failed: {type(e).__name__}: {e}",
                                    traceback.format_exc())
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
        if time.monotonic() - self._last_write >= HISTORY_WRITE_INTERVAL_S and status.reports:
            self._write(status="RUNNING")
        time.sleep(POLL_INTERVAL_S)
        return S.Running()

    def _on_report(self, report: dict[str, Any]) -> None:
        ranks = report["ranks"]
        step_times = [r["step_time_s"] for r in ranks if r.get("step_time_s") is not None]
        entry = {
            **report["metrics"],
            "_report": report["index"],
            "_global_step": ranks[0].get("global_step"),
            "_time_s": report["time"] - self._t0,
            "_step_time_s": max(step_times) if step_times else None,
            "_attempt": self.attempt,
            "_ranks": ranks,
        }
        self.history.append(entry)
        self.last_metrics = dict(report["metrics"])
        if self.progress is not None:
            self.progress.update(entry)

    def _collect_failures(self, failures: list[WorkerFailure]) -> list[WorkerFailure]:
        """When only ranks hurt by a peer's failure have reported so far, wait briefly for the root cause."""
        assert self.group is not None
        deadline = time.monotonic() + FAILURE_GRACE_S
        by_rank = {f.rank: f for f in failures}
        while all(f.secondary for f in by_rank.values()) and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL_S)
            status = self.group.poll(timeout_s=FAILURE_GRACE_S)
            for report in status.reports:
                self._on_report(report)
            by_rank.update({f.rank: f for f in status.failures})
        return list(by_rank.values())

    def _on_failure(self, failures: list[WorkerFailure]) -> S.ControllerState:
        decision = self.failure_policy.decide(failures)
        if decision is FailureDecision.RESTART:
            latest = self._latest_checkpoint()
            logger.warning(
                "zeroray: group failed (attempt %d), restarting from %s:\n%s",
                self.attempt, latest.path if latest else "the start (no committed checkpoint)",
                "\n".join(str(f) for f in failures),
            )
            return S.Restarting(failures)
        return S.Errored(failures)

    # ------------------------------------------------------------------ helpers
    def _shutdown_group(self) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            group.shutdown(graceful=False)

    def _write(self, status: str, error: str | None = None) -> None:
        """Persist the history and the run's status; a storage hiccup never fails the run."""
        self._last_write = time.monotonic()
        try:
            self.storage.write_history(self.history)
            self.storage.write_run_info(
                {
                    "name": self.run_config.name,
                    "status": status,
                    "attempts": self.attempt,
                    "num_workers": self.scaling_config.num_workers,
                    "num_reports": len(self.history),
                    "started_at": self._t0,
                    "updated_at": time.time(),
                    "error": error,
                }
            )
        except Exception as e:
            logger.warning("zeroray: could not write the metrics history to %s: %s", self.storage.url, e)

    def _latest_checkpoint(self) -> Checkpoint | None:
        """The newest committed checkpoint on storage; a listing that fails is logged, never fails the run."""
        try:
            return latest_checkpoint(self.storage.url, self.run_config.storage_options)
        except Exception as e:
            logger.warning("zeroray: could not list the checkpoints in %s: %s: %s", self.storage.url,
                           type(e).__name__, e)
            return None

    def _result(self, error: BaseException | None) -> Result:
        return Result(
            metrics=self.last_metrics,
            metrics_history=list(self.history),
            path=self.storage.url,
            checkpoint=self._latest_checkpoint(),
            error=error,
            attempts=self.attempt,
        )
