"""The controller: an explicit state machine in the driver that runs the group until it finishes or fails.

It decides and dispatches, in the shape of Ray Train V2's controller: each state has one handler
returning the next state (see state.py for the graph); ``_set_state`` fires the callbacks, which hold
every side effect (history, progress, metrics.jsonl, run.json, Ray gauges: :func:`default_callbacks`;
then the user's ``RunConfig.callbacks``); reports go to the same callbacks. Policies decide, the
controller acts: the scaling policy says how big the next group is and, while RUNNING, whether to
resize; the failure policy whether a failure restarts the group. A
(re)started group resumes from the run's newest committed checkpoint by itself (``zt.prepare``); the
controller reads storage only to log it, to record where each attempt starts and to fill
``Result.checkpoint``. It lives in the driver process, so Ctrl-C reaches it directly and tears the
group down.

Elastic runs (``ScalingConfig(num_workers=(min, max))``): RESTARTING asks the policy for the size the
cluster holds now (a lost node shrinks the group instead of being waited for); RUNNING asks it every
``elastic_resize_monitor_interval_s`` and a different answer is a planned resize: RESIZING asks the
ranks for a recovery point (they save, or under hybrid sharding keep their live replicas, and stop at
their next report: worker/recovery.py), tears the group down and schedules the new size, which resumes
from it with no step lost. A group
that cannot be placed at the size the nodes' capacity promised (a dead node Ray still lists, resources
someone else holds) is retried at the size that is free then.

Preemptions (``PREEMPTING``): the controller watches Ray's drain notices of the group's nodes
(:class:`~zeroray.train.driver.drain_watcher.DrainWatcher`) and the SIGTERMs its ranks report. On a notice it
hands it to every rank; at their next report the ranks take the recovery point that fits the deadline (the
live replicas of the ranks that stay under hybrid sharding, an in-memory snapshot to buddies that stay, else a
checkpoint, else none: worker/preemption.py) and stop; the
controller ends the leaving ranks (a fixed-size group off a draining node: all of them, for a new placement
group) and schedules the next group on nodes that are not draining. A failure of the ranks a notice named
counts as a preemption too (``FailureConfig.max_preemption_failures``), not against ``max_failures``.

Ending a group keeps its healthy rank actors for the next one (``WorkerGroup.disband``): only the ranks
that failed first-hand, died or hung are killed, so a restart or a resize starts new processes only on
new capacity. A group of kept ranks alone does not wait for Ray to confirm the killed ones dead, and a lost
node is proven gone by its raylet's refused port before Ray's health check says so (group/liveness.py;
docs/operations.md, *Detection*). A grow starts its new ranks first, while the group still trains, and asks for the
recovery point only once they are up. Each attempt records how long its start took, by phase
(``Attempt.phases``).
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from typing import Any

from zeroray.train.driver import state as S
from zeroray.train.driver.callbacks import (
    ControllerCallback,
    HistoryCallback,
    MetricsFileCallback,
    ProgressCallback,
    RunInfoCallback,
)
from zeroray.train.driver.drain_watcher import DrainWatcher
from zeroray.train.driver.failure_policy import FailureDecision, FailurePolicy
from zeroray.train.driver.lease import RunLease
from zeroray.train.driver.metrics import ControllerMetrics
from zeroray.train.driver.progress import Progress
from zeroray.train.driver.run_dir import RunStorage
from zeroray.train.driver.scaling_policy import ScalingPolicy
from zeroray.train.errors import CallbackError, Failure, StartFailure, TrainingFailedError, WorkerFailure
from zeroray.train.group.liveness import lost_nodes
from zeroray.train.group.poll import PollStatus
from zeroray.train.group.worker_group import Dying, RankSlot, WorkerGroup, WorkerGroupStartError, end_slots
from zeroray.train.preemption import PreemptionInfo, RecoveryChoice, merge
from zeroray.train.report import Report
from zeroray.train.result import Attempt, Result, latest_checkpoint
from zeroray.train.run_spec import RunSpec
from zeroray.train.sizing import ScalingDecision

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1
FAILURE_GRACE_S = 3.0  # how long to wait for the root-cause failure after a peer's collective failed
# After a collective timeout, the ranks still waiting in theirs time out within the collective timeout: wait for
# them (up to this cap), so the error says where every rank was.
TIMEOUT_GRACE_CAP_S = 60.0
# An elastic group that is not placed this soon is retried at the size the free resources hold now.
ELASTIC_PLACEMENT_RETRY_S = 5.0
# How long a planned resize waits for the ranks to reach a recovery point (their next zt.report) before it
# resizes from the newest checkpoint anyway.
RECOVERY_POINT_WAIT_S = 120.0
# After a preemption deadline passed, how long the driver still waits for the ranks' stop before it ends the
# leaving ranks anyway (the node may outlive its deadline a little; a notice without deadline waits
# RECOVERY_POINT_WAIT_S).
PREEMPTION_STOP_SLACK_S = 5.0
# How long a failed group's ranks get to hand over the reports queued before the failure (a live actor answers at
# once; a dead one fails at once; one behind a cut link is given up on).
LAST_REPORTS_WAIT_S = 2.0
# How long the surviving ranks of a failed group get to leave their loop before they are killed instead of
# kept. A rank whose peer died fails at once (the socket closes); one still waiting in a collective on a peer that
# is alive but unreachable (a cut link) or stopped has its group's connections shut by the release
# (group/group_sockets.py: gloo cannot abort a collective), so its collective fails at once too: the wait
# covers the loop's way out (leaving the group, keeping its state for the next one).
SURVIVOR_RELEASE_S = 3.0
# After a hung rank: the same, with room for a survivor whose loop was busy in user code when the group ended.
SURVIVOR_RELEASE_AFTER_HANG_S = 10.0
# How long the ranks a grow adds may take to be placed and started (while the group trains) before the grow is
# dropped until the policy's next check.
SPARE_START_WAIT_S = 60.0


def default_callbacks(spec: RunSpec, storage: RunStorage) -> list[ControllerCallback]:
    """The built-in callbacks of a fit, in the order they run (``RunConfig.callbacks`` run after them): the
    history that becomes ``Result.metrics_history``, ``metrics.jsonl``, ``run.json``, the controller's Ray
    gauges, then the progress display, so that a step on the console is already counted in the records (a
    Ctrl-C right after it leaves a run.json that has it). A new built-in is a :class:`ControllerCallback` and
    one line here."""
    metrics_file = MetricsFileCallback(storage)
    return [
        HistoryCallback(),
        metrics_file,
        RunInfoCallback(storage, metrics_file, samples_per_step=spec.samples_per_step),
        ControllerMetrics(spec.name),
        ProgressCallback(Progress(spec.progress_bar, spec.samples_per_step)),
    ]


class Controller:
    """Drives one ``fit()``. Use :meth:`run`; it always leaves no actor or placement group behind.

    ``callbacks``: the user's (``RunConfig.callbacks``), run after :func:`default_callbacks`."""

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
        self._kept: list[RankSlot] = []  # the last group's healthy ranks, for the next one
        self._dying = Dying()  # the last groups' killed ranks, until Ray confirms them dead
        self._teardown_s: float | None = None  # how long ending the last group took
        self._spares: list[RankSlot] = []  # ranks started ahead of a grow, while the group trained
        self._prestart_s: float | None = None  # how long they took to start
        self.attempt = 0
        self.state: S.ControllerState | None = None
        self.states: list[S.StateType] = []  # the path taken, for logs and tests
        self.last_pids: list[int] = []
        self.attempt_history: list[Attempt] = []
        self._batch: Any = None  # the last group's BatchSizes
        self._t0 = time.time()
        self.callbacks: list[ControllerCallback] = [*default_callbacks(spec, storage), *(callbacks or [])]
        self.history = next(c for c in self.callbacks if isinstance(c, HistoryCallback))
        self._ending_badly = False  # ERRORED / ABORTED under way: a hook's exception is logged, not raised
        self.drains = DrainWatcher()
        self._notice: PreemptionInfo | None = None  # the notice the current group is handling
        self._leaving: set[int] = set()  # ranks a failure during it must kill too (all, for a fixed group's move)

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
            self._ending_badly = True
            self._shutdown_group()
            self._end_attempt("aborted")
            self._set_state(S.Aborted())
            raise
        except Exception as e:  # a callback's or the driver's own error: end ERRORED in run.json, then raise it
            self._ending_badly = True
            self._shutdown_group()
            self._end_attempt("errored", message=f"{type(e).__name__}: {e}")
            logger.error("zeroray: the controller failed:\n%s", traceback.format_exc())
            if isinstance(e, CallbackError):
                e.result = self._result(e)
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
        if isinstance(state, S.Errored | S.Aborted):
            self._ending_badly = True  # a TrainingFailedError too: it stays what fit() raises
        self._fire("after_state_change", previous, state)

    def _fire(self, hook: str, *args: Any) -> None:
        """Run ``hook`` of every callback, in order. An exception out of one fails the run (CallbackError, which
        the controller's ``run`` turns into ERRORED); once the run ends in ERRORED / ABORTED anyway, it is
        logged and the other callbacks still run."""
        for callback in self.callbacks:
            try:
                getattr(callback, hook)(*args)
            except Exception as e:
                if not self._ending_badly:
                    raise CallbackError(callback, hook, e) from e
                logger.error("zeroray: callback %s.%s raised while the run ended:\n%s", type(callback).__name__,
                             hook, traceback.format_exc())

    def _step(self, state: S.ControllerState) -> S.ControllerState:
        if isinstance(state, S.Initializing):
            self._log_resume()
            return S.Scheduling(self.scaling_policy.decide_for_new_group())
        if isinstance(state, S.Scheduling):
            return self._schedule(state)
        if isinstance(state, S.Running):
            return self._poll()
        if isinstance(state, S.Restarting):
            hung = any(getattr(f, "hung", False) for f in state.failures)
            failed, self._leaving, self._notice = _first_hand(state.failures) | self._leaving, set(), None
            self._end_group(failed, SURVIVOR_RELEASE_AFTER_HANG_S if hung else SURVIVOR_RELEASE_S)
            return S.Scheduling(self.scaling_policy.decide_for_new_group())
        if isinstance(state, S.Resizing):
            return self._resize(state)
        if isinstance(state, S.Preempting):
            return self._preempt(state)
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
        epoch = self._advance_epoch()
        start_step = self._resume_step()
        decision = state.decision
        try:
            self.group, decision = self._start_group(decision, epoch)
        except WorkerGroupStartError as e:
            tb = traceback.format_exc()
            if e.rank is None:
                failure: Failure = StartFailure(e.what, str(e), tb)
            else:
                failure = WorkerFailure(e.rank, str(e), tb)
            self._begin_attempt(decision.num_workers, start_step)
            return self._on_failure([failure])
        self.last_pids = self.group.pids
        self._begin_attempt(decision.num_workers, start_step)
        attempt = self.attempt_history[-1]
        attempt.epoch = epoch
        attempt.kept_ranks = self.group.kept
        if self._prestart_s is not None:
            attempt.phases["prestart"], self._prestart_s = self._prestart_s, None
        if self._teardown_s is not None:
            attempt.phases["teardown"], self._teardown_s = self._teardown_s, None
        attempt.phases.update(self.group.phases)
        self._log_batch(decision)
        return S.Running()

    def _log_batch(self, decision: ScalingDecision) -> None:
        """Say the group's batch arithmetic; a global batch that changed (``elastic_batch='micro'``) is a warning."""
        b = decision.batch
        if b is None:
            return
        previous, self._batch = self._batch, b
        logger.info("zeroray: group of %d: global batch %d = micro %d x accumulation %d x world %d",
                    decision.num_workers, b.train_batch_size, b.micro_batch_size, b.gradient_accumulation_steps,
                    decision.num_workers)
        if previous is not None and previous.train_batch_size != b.train_batch_size:
            logger.warning("zeroray: the global batch changes from %d to %d with the world size (%d workers; "
                           "ScalingConfig.elastic_batch='micro' keeps micro batch and accumulation instead)",
                           previous.train_batch_size, b.train_batch_size, decision.num_workers)

    def _advance_epoch(self) -> int:
        """Fence off every earlier group before this one starts: the run's epoch moves on in storage, and a rank of
        an older epoch (one cut off by a partition, which nobody could stop) can commit nothing from here on."""
        from zeroray.checkpoint.storage import advance_epoch

        epoch = advance_epoch(self.storage.url, self.spec.storage_options)
        logger.info("zeroray: run %r: attempt %d writes as epoch %d", self.spec.name, self.attempt, epoch)
        return epoch

    def _start_group(self, decision: ScalingDecision, epoch: int) -> tuple[WorkerGroup, ScalingDecision]:
        """Start a group at ``decision``; an elastic group above min that cannot be placed soon is retried at
        the size the free resources hold (the overall wait is still ``placement_timeout_s``)."""
        policy, overall = self.scaling_policy, self.spec.placement_timeout_s
        start = time.monotonic()
        while True:
            remaining = None if overall is None else max(overall - (time.monotonic() - start), 1e-3)
            window = remaining
            if policy.elastic and decision.num_workers > policy.scaling_config.min_workers:
                # leave time for a smaller size within placement_timeout_s
                window = ELASTIC_PLACEMENT_RETRY_S if remaining is None else min(ELASTIC_PLACEMENT_RETRY_S, remaining / 2)
            kept, self._kept = self._kept, []  # the group owns them now
            try:
                group = WorkerGroup.start(
                    spec=self.spec,
                    decision=decision,
                    per_rank_datasets=self._split_datasets(decision.num_workers),
                    placement_timeout_s=window,
                    hang_timeout_s=self.failure_policy.heartbeat_timeout_s,
                    kept=kept,
                    epoch=epoch,
                    dying=self._dying,
                )
                return group, decision
            except WorkerGroupStartError as e:
                self._kept = e.kept  # a placement timeout gives them back
                if e.what != "placement" or window == remaining:
                    raise
                smaller = policy.decide_for_new_group(settled=True, held=len(self._kept))
                logger.warning("zeroray: a group of %d could not be placed in %gs; trying %d (what is free now)",
                               decision.num_workers, window, smaller.num_workers)
                decision = smaller

    def _split_datasets(self, num_workers: int) -> Callable[[list[str]], list[dict[str, Any]]]:
        def split(node_ids: list[str]) -> list[dict[str, Any]]:
            if not self.datasets:
                return [{} for _ in range(num_workers)]
            from zeroray.train.dataset import split_datasets

            return split_datasets(self.datasets, num_workers, locality_hints=node_ids)

        return split

    def _poll(self) -> S.ControllerState:
        assert self.group is not None
        t = time.monotonic()
        status = self._poll_group(POLL_INTERVAL_S)
        if status.failures:
            return self._on_failure(self._collect_failures(status.failures))
        if status.finished:
            self._end_attempt("finished")
            return S.Finished()
        if self.lease is not None and self.lease.lost:
            return self._errored([StartFailure("lease", self.lease.lost)])
        notice = merge(self.drains.poll(self.group.node_to_ranks()), *status.sigterms)
        if notice is not None:
            return S.Preempting(notice)
        resize = self.scaling_policy.decide_while_running(len(self.group.actors))
        if resize is not None:
            return S.Resizing(resize)
        time.sleep(max(POLL_INTERVAL_S - (time.monotonic() - t), 0.0))
        return S.Running()

    def _resize(self, state: S.Resizing) -> S.ControllerState:
        """A planned resize: a recovery point first (the ranks save and stop at their next report), then the
        new group at the new size, which resumes from it."""
        assert self.group is not None
        size = len(self.group.actors)
        if state.decision.elastic and state.decision.num_workers > size:
            following = self._start_spares(state.decision)
            if following is not None:
                return following
        self.group.request_recovery_point(state.decision.num_workers)
        wait_s = max(RECOVERY_POINT_WAIT_S, self.spec.collective_timeout_s)
        status = self._await_recovery_point(wait_s, f"zeroray: the ranks reached no recovery point (zt.report) in "
                                                    f"{wait_s:.0f}s: resizing from the newest checkpoint")
        if isinstance(status, S.ControllerState):
            return status
        if status.stopped_at is not None and self.attempt_history:
            self.attempt_history[-1].last_step = status.stopped_at
        point = _resize_point(status.stopped_with if status.all_stopped else None)
        self._end_attempt("resize_up" if state.decision.num_workers > size else "resize_down",
                          message=f"resized from {size} to {state.decision.num_workers} workers{point}")
        # Stopped at a recovery point: every rank is released at once; one that did not stop is killed.
        self._end_group(set(), 0.0 if status.all_stopped else 0.5)
        return S.Scheduling(state.decision)

    def _preempt(self, state: S.Preempting) -> S.ControllerState:
        """A preemption notice: every rank is told; at their next report they take the recovery point that fits
        the deadline and stop (worker/preemption.py); then the leaving ranks end and the next group is scheduled
        on nodes that are not draining. A fixed-size group off a draining node starts afresh (its placement
        group holds a bundle there), so its recovery point is a checkpoint."""
        assert self.group is not None
        info, size = state.info, len(self.group.actors)
        drained = any(self.drains.is_draining(n) for n in info.preempted_node_ids)
        keeps_ranks = self.scaling_policy.elastic or not drained
        self._notice = info
        self._leaving = set(info.preempted_ranks) if keeps_ranks else set(range(size))
        remaining = info.remaining_s()
        logger.warning("zeroray: preemption notice: node(s) %s with rank(s) %s leave %s; the group takes a recovery "
                       "point at its next zt.report and goes on without them",
                       [n[:12] for n in info.preempted_node_ids], info.preempted_ranks,
                       "with no deadline" if remaining is None else f"in {remaining:.1f}s")
        self.group.mark_preempt(info, keeps_ranks)
        wait_s = RECOVERY_POINT_WAIT_S if remaining is None else max(remaining, 0.0) + PREEMPTION_STOP_SLACK_S
        status = self._await_recovery_point(
            wait_s, f"zeroray: the ranks reached no zt.report within {wait_s:.0f}s of the preemption notice; the group "
                    "goes on without the leaving ranks from the newest recovery point, as after a crash")
        if isinstance(status, S.ControllerState):
            return status
        later = merge(*status.sigterms)  # a SIGTERM that came meanwhile: that rank leaves too
        self._leaving |= set(later.preempted_ranks) if later is not None else set()
        if status.stopped_at is not None and self.attempt_history:
            self.attempt_history[-1].last_step = status.stopped_at
        what = _log_recovery_point(status.stopped_with if status.all_stopped else None)
        self._end_attempt("preempted", node=info.preempted_node_ids[0] if info.preempted_node_ids else None,
                          message=f"rank(s) {info.preempted_ranks} preempted: {what}")
        if self.failure_policy.decide_preemption() is FailureDecision.RAISE:
            return self._errored([_too_many_preemptions(self.failure_policy)])
        failed, self._leaving, self._notice = self._leaving, set(), None
        self._end_group(failed, 0.0 if status.all_stopped else 0.5)
        return S.Scheduling(self.scaling_policy.decide_for_new_group())

    def _start_spares(self, decision: ScalingDecision) -> S.ControllerState | None:
        """Start the ranks a grow adds while the group trains (their placement, process start and imports);
        None once they are up (``self._spares``), else the state to go to: the group failed or finished
        meanwhile, or the spares could not start (the grow is dropped; the policy asks again at its next check)."""
        assert self.group is not None
        self._dying.wait()  # the spares take the killed ranks' resources and names
        spares = self.group.start_spares(self.spec, decision)
        start = time.monotonic()
        try:
            while not spares.ready(POLL_INTERVAL_S):
                status = self._poll_group(POLL_INTERVAL_S)
                if status.failures:
                    spares.end()
                    return self._on_failure(self._collect_failures(status.failures))
                if status.finished:
                    spares.end()
                    self._end_attempt("finished")
                    return S.Finished()
                if time.monotonic() - start > SPARE_START_WAIT_S:
                    raise TimeoutError(f"not placed and started within {SPARE_START_WAIT_S:.0f}s")
        except Exception as e:  # the wait timed out, or a spare's actor died while starting
            spares.end()
            logger.warning("zeroray: could not start the %d rank(s) to grow to %d (%s: %s); staying at %d",
                           len(spares.slots), decision.num_workers, type(e).__name__, e, len(self.group.actors))
            return S.Running()
        self._spares = spares.slots
        self._prestart_s = time.monotonic() - start
        return None

    def _await_recovery_point(self, wait_s: float, late: str) -> PollStatus | S.ControllerState:
        """Poll until every rank has stopped at its recovery point (its next zt.report) and return the last poll;
        a failure or the loop's end returns the next state instead. After ``wait_s`` it logs ``late`` and
        returns the last poll."""
        deadline = time.monotonic() + wait_s
        while True:
            status = self._poll_group(POLL_INTERVAL_S)
            if status.failures:
                return self._on_failure(self._collect_failures(status.failures))
            if status.all_stopped:
                return status
            if status.finished:
                self._end_attempt("finished")
                return S.Finished()
            if time.monotonic() > deadline:
                logger.warning("%s", late)
                return status
            time.sleep(POLL_INTERVAL_S)

    def _poll_group(self, timeout_s: float) -> PollStatus:
        """One poll of the group; its reports go to the callbacks, rank 0's start-up timings to the attempt."""
        assert self.group is not None
        return self._take(self.group.poll(timeout_s=timeout_s))

    def _take(self, status: PollStatus) -> PollStatus:
        """A poll's reports to the callbacks, rank 0's start-up timings and resume point to the attempt."""
        for report in status.reports:
            self._on_report(report)
        if status.timings and self.attempt_history:
            self.attempt_history[-1].phases.update(status.timings)
        if status.resumed and self.attempt_history:
            self._resumed_from(*status.resumed)
        return status

    def _resumed_from(self, source: str, step: int) -> None:
        """The group says where it resumed from (an in-memory snapshot may be newer than what storage held
        when the attempt began): the attempt's start step, and the steps the previous one lost, follow."""
        attempt = self.attempt_history[-1]
        attempt.start_step, attempt.recovered_from = step, source
        if len(self.attempt_history) > 1:
            _count_lost(self.attempt_history[-2], step)

    def _on_report(self, report: Report) -> None:
        if self.attempt_history and report.ranks and report.ranks[0].global_step is not None:
            self.attempt_history[-1].last_step = report.ranks[0].global_step
        entry = report.history_entry(self._t0, self.attempt)
        self._fire("after_report", report, entry)

    def _collect_failures(self, failures: list[WorkerFailure]) -> list[Failure]:
        """When only ranks hurt by a peer's failure have reported so far, look for the root cause: ranks whose node
        is gone (its raylet refuses connections: :meth:`_lost_with_their_node`, no wait for Ray's health check),
        else wait briefly for it (after a collective timeout: for the other ranks' timeouts, so the error says
        where each rank was)."""
        assert self.group is not None
        start = time.monotonic()
        by_rank = {f.rank: f for f in failures}

        def unexplained() -> bool:
            return len(by_rank) < len(self.group.actors) and all(f.secondary for f in by_rank.values())

        probed = False
        while unexplained():
            by_rank.update({f.rank: f for f in self._lost_with_their_node(by_rank)})
            probed = True
            if not unexplained():
                break
            grace = FAILURE_GRACE_S
            if any(f.timed_out for f in by_rank.values()):
                grace = max(grace, min(self.spec.collective_timeout_s, TIMEOUT_GRACE_CAP_S))
            if time.monotonic() - start >= grace:
                break
            time.sleep(POLL_INTERVAL_S)
            status = self._poll_group(FAILURE_GRACE_S)
            by_rank.update({f.rank: f for f in status.failures})
            probed = False
        if not probed and any(getattr(f, "actor_died", False) for f in by_rank.values()):
            # Ray named a dead rank first: its node may be gone with it, and with the node the ranks on it that
            # reported only a peer's failure (their processes end a moment later; kept, they would fail the
            # next group's start).
            by_rank.update({f.rank: f for f in self._lost_with_their_node(by_rank)})
        if all(f.secondary for f in by_rank.values()):
            # No root cause yet: a rank that has not answered since its peers failed is the likely one (its
            # process or node is gone, and Ray has not said so yet: a lost node waits for its health check).
            for rank in self.group.silent_since(start - POLL_INTERVAL_S):
                if rank not in by_rank:
                    by_rank[rank] = WorkerFailure(
                        rank, "no answer since its peers' collectives failed: its process or node is likely gone "
                              "(Ray has not reported it dead yet)", "")
        return list(by_rank.values())

    def _lost_with_their_node(self, known: dict[int, Failure]) -> list[WorkerFailure]:
        """The ranks without a first-hand failure in ``known`` (none, or only a peer's: a rank on a lost node may
        report its broken collective before its process ends) whose node is gone now (``liveness.lost_nodes``:
        Ray lists it dead, or its raylet refuses connections, which proves it before Ray's health check does),
        each a first-hand failure; from now on the scaling policy counts those nodes for nothing, so the next
        group neither waits for them nor is placed on them."""
        assert self.group is not None
        group = self.group
        ranks = [r for r in range(len(group.actors)) if r not in known or getattr(known[r], "secondary", False)]
        nodes = {group.node_of(r) for r in ranks} - {None}
        try:
            lost = lost_nodes(nodes)
        except Exception as e:  # the GCS call failed: wait for Ray's own word, as without the probe
            logger.warning("zeroray: could not probe the group's nodes: %s: %s", type(e).__name__, e)
            return []
        self.scaling_policy.exclude_nodes(lost)
        return [WorkerFailure(r, f"the rank's actor process died with its node{group.where(r)}: {lost[group.node_of(r)]}",
                              "", actor_died=True) for r in ranks if group.node_of(r) in lost]

    def _on_failure(self, failures: list[Failure]) -> S.ControllerState:
        if self.group is not None:  # the reports queued before the failure belong to this attempt
            gone = {f.rank for f in failures if getattr(f, "actor_died", False) or getattr(f, "hung", False)}
            self._take(self.group.last_reports(LAST_REPORTS_WAIT_S, skip=gone))
        first = next((f for f in failures if not getattr(f, "secondary", False)), failures[0])
        rank = getattr(first, "rank", None)
        node = self.group.node_of(rank) if self.group is not None else None
        preempted = self._notice is not None and (rank in self._notice.preempted_ranks
                                                  or node in self._notice.preempted_node_ids)
        self._end_attempt("preempted" if preempted else "failure", rank=rank, node=node,
                          message=str(first).splitlines()[0])
        if preempted:  # a rank a notice named went before the recovery point: a preemption, not a failure
            logger.warning("zeroray: rank %s went before the preemption's recovery point: the next group resumes "
                           "from the newest earlier one, as after a crash", rank)
            decision = self.failure_policy.decide_preemption()
            if decision is FailureDecision.RAISE:
                return self._errored([_too_many_preemptions(self.failure_policy), *failures])
        else:
            decision = self.failure_policy.decide(failures)
        if decision is FailureDecision.RESTART:
            latest = self._latest_checkpoint()
            logger.warning(
                "zeroray: group failed (attempt %d), restarting from %s, or from the ranks' memory where newer "
                "(snapshots, replicas):\n%s",
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
        """Kill everything: the group, any kept ranks and spares; wait for the killed ranks' deaths."""
        kept, self._kept, self._spares = self._kept + self._spares, [], []
        end_slots(kept)
        if self.group is not None:
            group, self.group = self.group, None
            group.shutdown(graceful=False)
        self._dying.wait()

    def _end_group(self, failed: set[int], release_timeout_s: float) -> None:
        """End the group for another attempt, keeping its healthy ranks (``failed``: ranks to kill)."""
        if self.group is None:
            return
        start = time.monotonic()
        group, self.group = self.group, None
        self._kept = group.disband(failed, release_timeout_s, self._dying) + self._spares
        self._spares = []
        self._teardown_s = time.monotonic() - start
        logger.info("zeroray: group ended in %.1fs; %d rank(s) kept for the next one", self._teardown_s,
                    len(self._kept))

    def _begin_attempt(self, world_size: int, start_step: int) -> None:
        if self.attempt_history:
            _count_lost(self.attempt_history[-1], start_step)
        attempt = Attempt(index=self.attempt, world_size=world_size, start_step=start_step, started_at=time.time())
        self.attempt_history.append(attempt)
        self._fire("after_attempt_start", attempt)

    def _end_attempt(self, end: str, rank: int | None = None, node: str | None = None,
                     message: str | None = None) -> None:
        if not self.attempt_history or self.attempt_history[-1].end is not None:
            return
        attempt = self.attempt_history[-1]
        attempt.end, attempt.rank, attempt.node, attempt.message = end, rank, node, message
        attempt.ended_at = time.time()
        if end == "finished":
            attempt.steps_lost = 0
        self._fire("after_attempt_end", attempt)

    def _resume_step(self) -> int:
        """The step a new group resumes from: the newest committed checkpoint's (0: none)."""
        latest = self._latest_checkpoint()
        return latest.step if latest is not None else 0

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
            attempt_history=list(self.attempt_history),
        )


def _first_hand(failures: list[Failure]) -> set[int]:
    """Ranks that failed on their own (not through a peer's failure): never reused."""
    return {f.rank for f in failures if isinstance(f, WorkerFailure) and not f.secondary}


def _log_recovery_point(choice: RecoveryChoice | None) -> str:
    """Log the recovery point the ranks took on a notice, and why (a warning when there was none); returns
    what to record as the attempt's message."""
    if choice is None:
        logger.warning("zeroray: preemption: no recovery point (the ranks did not stop in time); the next group "
                       "resumes from the newest earlier one, as after a crash")
        return "no recovery point (the ranks did not stop in time)"
    if choice.kind == "none":
        needed = min(choice.needed_s.values(), default=None)
        logger.warning(
            "zeroray: preemption: the deadline is too short for a recovery point at step %s (%s): the recovery "
            "point needed about %s; the next group resumes from the newest earlier one, as after a crash (the "
            "steps since are lost)", choice.step, choice.explain(),
            "?" if needed is None else f"{needed:.2f}s (x1.5 + 1s of margin)")
        return f"no recovery point at step {choice.step}: {choice.explain()}"
    where = {"replica": "the live replicas of the ranks that stay (no checkpoint)",
             "snapshot": "in-memory snapshot to buddies on ranks that stay"}.get(choice.kind, "checkpoint")
    logger.warning("zeroray: preemption: %s at step %s, took %.2fs (%s)", where, choice.step, choice.took_s,
                   choice.explain())
    return f"{choice.kind} at step {choice.step} in {choice.took_s:.2f}s ({choice.explain()})"


def _resize_point(choice: RecoveryChoice | None) -> str:
    """What a resize's attempt message says of its recovery point (the ranks logged why)."""
    if choice is None or choice.step is None:
        return ""
    if choice.kind == "replica":
        return f"; recovery point at step {choice.step}: the live replicas of the ranks that stay (no checkpoint)"
    why = f" (no recovery from replicas: {choice.unavailable['replica']})" if "replica" in choice.unavailable else ""
    return f"; recovery point at step {choice.step}: a checkpoint{why}"


def _too_many_preemptions(policy: FailurePolicy) -> StartFailure:
    return StartFailure("preemption", f"preempted {policy.num_preemptions} time(s), more than "
                                      f"FailureConfig.max_preemption_failures={policy.max_preemptions}")


def _count_lost(previous: Attempt, start_step: int) -> None:
    """The steps ``previous`` reached that the attempt after it, starting at ``start_step``, has to redo."""
    reached = previous.last_step if previous.last_step is not None else previous.start_step
    previous.steps_lost = max(reached - start_step, 0)
