"""The Ray actor that hosts one rank: its device, its process group, its engine, its loop.

The driver imports this module to start the actors, so it imports the loop's own code
(``zeroray.train.worker``) only inside the methods that run in the actor.

The user's loop runs in a thread of the actor (as in Ray Train V2), so the actor's own methods stay
answerable while it trains: the driver polls for reports and errors with ``poll`` and never blocks on
the loop itself.

One actor serves one group after another: when a group ends (a peer failed, or a planned resize
stopped the loop at a recovery point), ``release`` waits for the loop to end, joins its checkpoint
upload and leaves the process group; the next group's ``setup`` gives it its new rank and world and
runs the loop again (which resumes from the newest checkpoint). So a restart or resize pays for a new
process, its imports and its placement only on new capacity. An actor whose loop does not end (stuck
in a collective or in user code) is killed, never reused.

A rank cut off from the driver (a network partition) cannot be killed by it, so it stops itself: while
it is in a group, a watchdog thread ends the process once the driver has not called it (a poll, a release)
for the group's orphan timeout (``worker_group.orphan_timeout_s``). Whatever it still writes to storage
before then is fenced off by its epoch (zeroray/checkpoint/fence.py).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

import torch

from zeroray.checkpoint.snapshot import SnapshotStore
from zeroray.engine import Comm, import_before_group
from zeroray.train.errors import WorkerFailure, is_collective_error, is_collective_timeout
from zeroray.train.group import rendezvous
from zeroray.train.group.group_sockets import GroupSockets
from zeroray.train.group.poll import PollAnswer
from zeroray.train.group.priority import threads_niceness, to_normal_priority
from zeroray.train.preemption import PreemptionInfo
from zeroray.train.report import Report
from zeroray.train.run_spec import RankInfo, RunSpec
from zeroray.train.sizing import BatchSizes

if TYPE_CHECKING:
    from zeroray.train.worker.context import Session

# How long release lets rank 0's async save commit by itself before it stops the commit's wait for a peer.
COMMIT_GRACE_S = 1.0
ORPHAN_EXIT_CODE = 75  # the process status of a rank that stopped itself, cut off from its driver
_WATCHDOG_PERIOD_S = 0.5


def actor_name(run: str, rank: int) -> str:
    """The Ray actor name, so the dashboard shows who is who."""
    return f"zeroray:{run}:rank-{rank}"


def _log_info_to_stderr() -> None:
    """zeroray's INFO lines in this rank (e.g. what a pretrained load read) go to stderr, which Ray
    forwards to the driver's console, prefixed with the actor's name."""
    log = logging.getLogger("zeroray")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def _import_ahead() -> None:
    """What a new process would otherwise import in its first ``setup`` and first engine build (about 1.5 s of
    CPU here): the modules to import before any group exists, torch's compiler front end (the optimizers'
    first use imports it) and the rank's metrics. Done while the actor is created, so a grow's new rank pays
    it while the old group still trains (its spare start), not while every rank waits in the rendezvous."""
    import_before_group()
    import torch._dynamo  # noqa: F401

    import zeroray.train.worker.metrics  # noqa: F401


class RankActor:
    """One rank. Wrapped with ``ray.remote`` by the worker group (kept a plain class for readability)."""

    def __init__(self, run: str, use_gpu: bool) -> None:
        self.run, self.use_gpu = run, use_gpu
        self.info: RankInfo | None = None  # this group's rank and world, from setup
        # In-memory snapshots (FailureConfig.snapshot_interval), this rank's and its buddies', and the live state
        # a failed hybrid group left (recovery from replicas): kept from one group to the next, so a restarted group
        # recovers from its ranks' memory.
        self.snapshots = SnapshotStore()
        self.sockets = GroupSockets()  # this group's connections, to cut a failed group's loop loose (release)
        self._contact = time.monotonic()  # the driver's last call (a poll, a release)
        self._orphan_s: float | None = None  # this group's orphan timeout (None: no watchdog)
        self._clear_loop()
        threading.Thread(target=self._watchdog, name="zeroray-orphan-watchdog", daemon=True).start()
        _log_info_to_stderr()
        _import_ahead()
        from zeroray.train.worker.preemption import SigtermNotice

        # SIGTERM (a pod or node being stopped) is a preemption notice for this rank, not an abrupt end; this
        # process only: the user's driver keeps its own handling.
        self.sigterm = SigtermNotice(training=lambda: self.thread is not None and not self.done)
        self.sigterm.install()
        import ray

        self._node_id = ray.get_runtime_context().get_node_id()
        self.start_niceness = to_normal_priority()  # the start ran ahead of the node's running ranks (priority.py)
        # What exists now (torch, its compiler front end, Ray: some 300k objects) lives as long as the process. Out
        # of the cyclic collector's reach, the full collection of each release (and every automatic one) scans
        # only what the groups made since: milliseconds instead of 0.2-0.8 s while the next group waits.
        gc.freeze()

    def _clear_loop(self) -> None:
        self.session: Session | None = None
        self.thread: threading.Thread | None = None
        self.failure: WorkerFailure | None = None
        self.done = False
        self.stopped_at: int | None = None  # the step of the recovery point the loop stopped at
        self.stopped = False
        self.stopped_with: Any = None  # the RecoveryChoice the loop stopped with (a preemption's, a resize's)
        self.loop_started_at: float | None = None
        self.timings_sent = False
        self.unsent: list[Report] = []  # the group's reports newer than the driver's last (a rank other than 0)

    def __repr__(self) -> str:  # Ray prefixes the actor's log lines with this
        return actor_name(self.run, self.info.world_rank) if self.info is not None else f"zeroray:{self.run}:idle"

    def _announce_name(self) -> None:
        """Tell Ray's log monitor this actor's new repr, so the driver prefixes what this process prints
        with its rank in the current group. Ray reads the repr once, when the actor is created (still idle,
        no rank yet); a line starting with its marker on stdout and on stderr renames the prefix of what
        follows (Ray prints the same line at creation)."""
        from ray._private.ray_constants import LOG_PREFIX_ACTOR_NAME

        for stream in (sys.stdout, sys.stderr):
            stream.flush()
            print(f"{LOG_PREFIX_ACTOR_NAME}{self!r}", file=stream, flush=True)

    # ------------------------------------------------------------------ placement and rendezvous
    def node_info(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "ip": rendezvous.node_address(), "pid": os.getpid(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "start_niceness": self.start_niceness,
                "niceness": threads_niceness()}

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0 publishes where the group meets."""
        return rendezvous.node_address(), rendezvous.free_port()

    def setup(self, master_addr: str, master_port: int, info: RankInfo, spec: RunSpec,
              dataset_shards: dict[str, Any], batch: BatchSizes | None = None, elastic: bool = False,
              epoch: int | None = None, orphan_timeout_s: float | None = None) -> None:
        """Join the process group as ``info``'s rank and build this rank's session. ``batch``: this group's
        BatchSizes (elastic runs); ``elastic``: agree on recovery points at each report; ``epoch``: the group's
        fencing epoch, which its saves carry; ``orphan_timeout_s``: how long the loop may run without a call from
        the driver before this process stops itself (None: no limit)."""
        if self.thread is not None:
            raise RuntimeError("RankActor.setup while the previous group's loop is not released")
        self.info = info
        self._orphan_s = orphan_timeout_s
        self.sigterm.grace_s = spec.sigterm_grace_s
        self._announce_name()
        device = torch.device("cuda", 0) if self.use_gpu else torch.device("cpu")
        if self.use_gpu:
            torch.cuda.set_device(device)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU(s)
        with self.sockets.recording():
            report_group = rendezvous.init_process_group(master_addr, master_port, info, spec.backend,
                                                         spec.collective_timeout_s)
        from zeroray.train.worker.context import Session, TrainContext, set_session
        from zeroray.train.worker.metrics import RankMetrics

        callbacks = []
        try:
            callbacks.append(RankMetrics(spec.name, self.info.world_rank))
        except Exception:  # no metrics agent (e.g. a minimal cluster): training does not depend on it
            pass
        ctx = TrainContext(self.info, spec.name, spec.storage_path, device, spec.run_url, batch=batch, epoch=epoch)
        self.session = Session(ctx, spec, dataset_shards, Comm(report_group), report_callbacks=callbacks,
                               elastic=elastic, snapshots=self.snapshots, group_sockets=self.sockets)
        if elastic:
            from zeroray.train.worker.recovery import RecoveryPointCallback

            callbacks.append(RecoveryPointCallback(self.session))  # last: it may end the loop
        set_session(self.session)

    # ------------------------------------------------------------------ the loop
    def start(self) -> None:
        """Run the user's loop in a thread; ``poll`` tells how it goes."""
        if self.session is None:
            raise RuntimeError("RankActor.start before setup")
        self._contact = time.monotonic()
        self.thread = threading.Thread(target=self._run, name="zeroray-train-loop", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from zeroray.train.worker.recovery import RecoveryPointReached, keep_live_state, wait_for_save
        from zeroray.train.worker.reporting import finish

        session = self.session
        self.loop_started_at = time.time()
        try:
            if self.use_gpu:
                torch.cuda.set_device(session.context.device)  # the current device is per thread
            session.spec.run_loop()
            wait_for_save(session)  # join an async save (rank 0: committed) before "done"
            finish(session)
        except RecoveryPointReached as e:
            self.stopped_at, self.stopped, self.stopped_with = e.step, True, e.choice
        except BaseException as e:  # noqa: B036 - SystemExit in a loop is a failure too
            self.failure = WorkerFailure(
                rank=self.info.world_rank,
                message=f"{type(e).__name__}: {e}",
                traceback=traceback.format_exc(),
                secondary=is_collective_error(e),
                num_reports=session.num_reports,
                waiting_in=session.waiting_in,
                timed_out=is_collective_timeout(e),
            )
            _leave_failed_group(session, self.failure.message)
            if self.failure.secondary:  # a peer failed: this rank is kept, and its state may serve the next group
                keep_live_state(session)  # after leaving: the peers learn of the failure first
        finally:
            self.done = True

    def poll(self, seen: int = 0, send: bool = True) -> PollAnswer:
        """Reports queued since the last poll, and whether the loop ended or failed. ``send``: this rank hands
        the group's reports to the driver (rank 0); the others keep those newer than ``seen`` (the driver's
        last) for :meth:`held_reports`."""
        self._contact = time.monotonic()
        done, failure = self.done, self.failure  # read first: every report of a done loop is queued by now
        queued = self._queued(seen)
        reports = queued if send else []
        if send:
            self.unsent = []
        timings = resumed = None
        if reports and not self.timings_sent:
            self.timings_sent = True
            timings = self._startup_timings(reports[0].time)
            resumed = self.session.resumed
        sigterm = self.sigterm.notice(self._node_id, self.info.world_rank) if self.info is not None else None
        return PollAnswer(reports=tuple(reports), done=done, failure=failure, stopped=self.stopped and done,
                          stopped_at=self.stopped_at, timings=timings, resumed=resumed,
                          stopped_with=self.stopped_with, sigterm=sigterm)

    def held_reports(self, seen: int) -> tuple[Report, ...]:
        """The group's reports this rank queued that are newer than ``seen``: the driver's last, when rank 0
        went before handing them over."""
        return tuple(self._queued(seen))

    def _queued(self, seen: int) -> list[Report]:
        """The reports queued so far and not yet sent that are newer than ``seen``."""
        if self.session is not None:
            q = self.session.reports
            while not q.empty():
                self.unsent.append(q.get_nowait())
        self.unsent = [r for r in self.unsent if r.index > seen]
        return list(self.unsent)

    def _startup_timings(self, first_report_at: float) -> dict[str, float]:
        """Seconds from the loop's start to its first report: building the model and engine (until zt.prepare
        has the engine), reading the checkpoint, the first step (what is left); Attempt.phases."""
        session, start = self.session, self.loop_started_at
        ready = session.engine_ready_at if session.engine_ready_at is not None else first_report_at
        load = session.checkpoint_load[0] if session.checkpoint_load is not None else 0.0
        return {"build": max(ready - start, 0.0), "load": load,
                "first_step": max(first_report_at - ready - load, 0.0)}

    def mark_preempt(self, info: PreemptionInfo, keeps_ranks: bool) -> None:
        """The driver's preemption notice: ``zt.get_preemption_info()`` returns it, and the group takes a recovery
        point at its next report and stops (worker/preemption.py). ``keeps_ranks``: the next group keeps the
        ranks that stay, so their memory can hold an in-memory snapshot."""
        if self.session is not None:
            self.session.preemption_keeps_ranks = keeps_ranks
            self.session.preemption = info

    def request_recovery_point(self, num_workers: int) -> None:
        """A planned resize to ``num_workers`` ranks: stop the loop at the next report, at a recovery point (the
        live replicas of the ranks that stay, or a checkpoint: worker/recovery.py)."""
        self._contact = time.monotonic()
        if self.session is not None:
            self.session.resize_to = num_workers

    def release(self, timeout_s: float) -> str | None:
        """Make this process ready for another group: wait up to ``timeout_s`` for the loop to end (a failed
        peer makes its collectives fail; a recovery point has ended it already), join its checkpoint upload,
        leave the process group. None when done; else why not (the loop or the upload is still running), and
        the actor must be killed (a stale upload could commit into a checkpoint directory the next group
        writes)."""
        self._contact = time.monotonic()
        deadline = time.monotonic() + timeout_s
        if self.thread is not None:
            if self.thread.is_alive():  # the group is over: a collective waiting on an unreachable peer fails now
                if shut := self.sockets.sever():
                    print(f"zeroray: {self!r}: the group ended while its loop ran; shut its {shut} group "
                          "connection(s) so the loop's collectives fail now", file=sys.stderr, flush=True)
            self.thread.join(timeout_s)
            if self.thread.is_alive():
                where = self.session.waiting_in if self.session is not None else None
                return (f"its loop was still running after {timeout_s:g}s ("
                        f"{'in zt.report' if where == 'report' else 'at its end' if where == 'end' else 'in the loop'}"
                        f"{stack_tail(self.thread)})")
        if self.session is not None and not _join_upload(self.session, max(deadline - time.monotonic(), 0.5)):
            return f"its checkpoint upload was still running after {timeout_s:g}s"
        for callback in self.session.report_callbacks if self.session is not None else []:
            callback.close()  # e.g. RankMetrics: stop re-sending this group's rank's series
        _clear_session()
        rendezvous.destroy_process_group()
        self.sockets.clear()
        self._clear_loop()
        self.info = None
        self._announce_name()  # idle until the next group's setup
        gc.collect()  # the last group's engine and model, before the next one builds its own
        return None

    def _watchdog(self) -> None:
        """Stop this process once it has been in a group (its loop started, not yet released: a loop that failed
        may still upload) for the orphan timeout without a call from the driver: the rank is cut off (a partition)
        or its driver is gone, and nobody else can stop it (see the module docstring)."""
        while True:
            time.sleep(_WATCHDOG_PERIOD_S)
            limit, thread = self._orphan_s, self.thread
            silent = time.monotonic() - self._contact
            if limit is None or thread is None or silent <= limit:
                continue
            rank = self.info.world_rank if self.info is not None else "?"
            print(f"zeroray: rank {rank} (pid {os.getpid()}) has not heard from the driver for {silent:.1f}s "
                  f"(> worker_heartbeat_timeout_s + collective_timeout_s = {limit:g}s): it is cut off, stopping "
                  f"its process", file=sys.stderr, flush=True)
            os._exit(ORPHAN_EXIT_CODE)

    def shutdown(self) -> None:
        """Leave the process group when the loop is not stuck in a collective (else the actor is killed)."""
        _clear_session()
        if self.done:
            rendezvous.destroy_process_group()


def _clear_session() -> None:
    from zeroray.train.worker.context import set_session

    set_session(None)


def stack_tail(thread: threading.Thread, frames: int = 4) -> str:
    """Where ``thread`` is now, innermost frame first: the driver logs it when a rank is not kept, so a loop
    that does not end (a collective that does not return, user code) says where it waits."""
    frame = sys._current_frames().get(thread.ident)
    if frame is None:
        return ""
    inner = reversed(traceback.extract_stack(frame)[-frames:])
    return "; at " + " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in inner)


def _leave_failed_group(session: Session, reason: str) -> None:
    """Leave the group as soon as the loop failed, not when the driver releases the rank: the group is over,
    and a peer blocked in a collective with this rank fails only once this rank's connections close. The
    engine and the report barrier drop their collectives in flight (which keep gloo's connections open)."""
    if session.engine is not None:
        session.engine.abort(reason)
    session.report_comm.abort(reason)
    rendezvous.destroy_process_group()


def _join_upload(session: Session, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for the rank's async checkpoint save in flight (its error does not matter here:
    the group has ended). False when it is still running.

    Rank 0's upload ends with the commit, which waits for every rank's marker: after a peer died it would wait
    for the commit timeout (30 minutes). So after a short wait rank 0 writes an error marker for each rank
    whose marker is missing ("its group ended"), the protocol's own way to stop a commit: the commit fails,
    the checkpoint stays uncommitted (a later save of that step replaces the directory)."""
    saver = session.checkpoint_saver
    if saver is None:
        return True

    def wait() -> None:
        try:
            saver.wait()
        except Exception:  # the save failed with its group; the next group resumes from a committed one
            pass

    waiter = threading.Thread(target=wait, name="zeroray-release-save", daemon=True)
    waiter.start()
    waiter.join(min(timeout_s, COMMIT_GRACE_S))
    if waiter.is_alive() and session.context.get_world_rank() == 0 and session.last_saved_step is not None:
        _abandon_commit(session)
    waiter.join(max(timeout_s - COMMIT_GRACE_S, 0.0))
    return not waiter.is_alive()


def _abandon_commit(session: Session) -> None:
    """Rank 0: error markers for the ranks that have not written theirs into the save in flight."""
    from zeroray.checkpoint.commit import write_error_marker
    from zeroray.checkpoint.manifest import part_file
    from zeroray.checkpoint.storage import checkpoint_url
    from zeroray.storage import open_url

    url = checkpoint_url(session.context.trial_dir, session.last_saved_step)
    try:
        fs, path = open_url(url, session.storage_options)
        fs.invalidate_cache(path)
        present = {os.path.basename(p) for p in fs.ls(path, detail=False)}
        for rank in range(session.context.get_world_size()):
            epoch = session.context.epoch
            if part_file(rank, epoch) not in present:
                write_error_marker(fs, path, rank, "the group ended (a rank failed) before this rank wrote its file",
                                   epoch)
    except Exception:  # storage unreachable: the actor is killed instead of kept
        pass
