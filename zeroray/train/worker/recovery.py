"""The rank's half of recovery: checkpoints, in-memory snapshots and recovery points, as the loop runs them.

**Checkpoints.** Where ``zt.report(checkpoint=True)`` saves and what a (re)started group resumes from.
Storage is the one source of truth, kept by ``zeroray.checkpoint``: every rank writes its shard, rank 0
commits the manifest and applies ``CheckpointConfig.num_to_keep`` (``zc.save``), and the newest
*valid* committed ``<run>/checkpoint_<global step>`` (its manifest parses, its files are there) is
found by listing the run (``zc.latest_valid``), so a torn or damaged newest one falls back to the one
before it. So a restart after a failure and a new ``fit()`` with the same name and storage path
resume alike, at any world size and stage (the checkpoint reshards). The driver keeps no list of its
own (what it reads, ``Result.checkpoint``, is :func:`zeroray.train.result.latest_checkpoint`). Async
saves go through one ``zc.AsyncSaver`` per rank, held on the session (``checkpoint_saver``) from the
first async save to the end of the loop.

**Snapshots** (``FailureConfig.snapshot_interval``): when a rank takes one, and the group identity they
are filed under (rank 0's id, agreed in ``zt.prepare``). The snapshots, their copies on a buddy rank on
another node and the restore are :mod:`zeroray.checkpoint.snapshot`. The rank actor keeps its
``SnapshotStore`` from one group to the next: that is what lets a restarted group, at any size, recover
from its ranks' memory (:func:`resume`).

**Recovery from replicas** (hybrid sharding, ``FailureConfig.replica_recovery``): when the group fails,
each surviving rank keeps a copy of its live state (:func:`keep_live_state`, called by the rank actor once
the rank has left the group), and so does every rank at a recovery point. Every shard of a lost node
still lives in another replica group, so the next group restores the newest step all of them cover from
the survivors' memory: no snapshot interval, no storage read, no step lost (``resumed=("replica", step)``).
Where the survivors' copies do not cover every shard (a whole shard's column lost, or a rank that
failed inside its optimizer step) the resume falls back to the buddy snapshots, then storage, and says so.
The live copies of a group that failed are dropped at the next group's first report, once every rank
of it runs (a failure before then may still need them).

**Recovery points**: a planned resize stops the loop right after a recovery point, so it loses no step.
The driver cannot stop the user's loop from outside without losing the steps since the last
checkpoint, so it asks the ranks (``RankActor.request_recovery_point``, with the size it resizes to) and
they stop at their next ``zt.report``: in an elastic run every report ends with one more small exchange on
the report group, in which the ranks agree whether any of them was asked (they may hear the request at
different reports; the exchange makes it the same report for all). Then every rank saves the engine at its
current step, unless that step is already saved, waits for the commit, and leaves its loop by raising
:class:`RecoveryPointReached`, which the actor reports as "stopped at step N", not as a failure.
Under hybrid sharding with replica recovery the live state is the recovery point instead: every rank
keeps it (:func:`keep_replicas`), and when the copies of the ranks the next group keeps (a grow: all of
them; a shrink: the first ``resize_to``) hold every shard, nothing is written and the next group restores
from them (``resumed=("replica", step)``, no storage read). Where they do not (a shrink that drops every
copy of some shard), the ranks save the checkpoint as above, and rank 0 logs why.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from typing import Any

import zeroray.checkpoint as zc
from zeroray.checkpoint import snapshot
from zeroray.train.preemption import RecoveryChoice
from zeroray.train.report import RankStats
from zeroray.train.worker.context import ReportCallback, Session

logger = logging.getLogger(__name__)


def resume(session: Session) -> bool:
    """Collective, in ``zt.prepare``: load the run's newest state into the session's engine; False when the
    run has none (it starts fresh).

    The newest is the group's newest complete in-memory snapshot (``FailureConfig.snapshot_interval``, or the
    live copies a failed hybrid group's survivors kept; no storage read) unless a committed checkpoint on
    storage is newer. For storage, rank 0 picks the
    checkpoint and tells the others (on the report group), so every rank loads the same one even if storage
    changes in between.
    """
    comm, engine = session.report_comm, session.engine
    choice = snapshot.choose(comm, session.snapshots) if session.snapshots is not None else None
    url = None
    if choice is None or (choice.newest_saved is not None and choice.newest_saved > choice.step):
        # a checkpoint on storage may be newer than any snapshot: rank 0 looks
        newest = _newest_on_storage(session, fallback=choice is not None) if comm.rank == 0 else None
        newest = comm.broadcast_object(newest, src=0)
        if newest is not None and (choice is None or newest.step > choice.step):
            choice, url = None, newest.url
    if choice is None and url is None:
        return False
    wait_for_save(session)  # an async save of an earlier engine of this loop must not race the read
    start = time.perf_counter()
    if choice is not None:
        snapshot.restore(engine, comm, session.snapshots, choice)
        session.resumed = ("replica" if choice.live else "memory", choice.step)
        session.last_snapshot_step = choice.step  # held already: not snapshotted again
    else:
        zc.load(engine, url, storage_options=session.storage_options)
        session.resumed = ("storage", engine.global_step)
        session.last_saved_step = engine.global_step  # a recovery point at this step need not save it again
    session.checkpoint_load = (time.perf_counter() - start, shard_bytes(engine))
    if session.elastic:
        _realign_accumulation(engine)
    return True


def shard_bytes(engine: Any) -> int:
    """Bytes of this rank's shard state (weights and optimizer states, fp32): what a save writes and a load
    reads. From the streamed view's metadata, so NVMe-offloaded states are not read to be counted."""
    return sum(4 * (gs.hi - gs.lo) * len(gs.keys) for gs in engine.stream_shard_state())


def _newest_on_storage(session: Session, fallback: bool) -> zc.CheckpointInfo | None:
    """Rank 0: the run's newest valid committed checkpoint. With a snapshot to fall back on (``fallback``), a
    storage that cannot be listed is logged instead of failing the start."""
    try:
        return zc.latest_valid(session.context.trial_dir, session.storage_options)
    except Exception as e:
        if not fallback:
            raise
        logger.warning("zeroray: could not list the checkpoints in %s (%s: %s); resuming from the in-memory "
                       "snapshot", session.context.trial_dir, type(e).__name__, e)
        return None


def _realign_accumulation(engine: Any) -> None:
    """A checkpoint saved at another world size counted micro-steps with that size's accumulation; the engine
    restores that count as it is, so the next optimizer step would come after the wrong number of
    micro-batches. Partial accumulations are not saved, so the run resumes at the step's first micro-batch.
    (The engine's own load should do this once it records the accumulation in the checkpoint.)"""
    engine.micro_step = engine.global_step * engine.gradient_accumulation_steps


def require_engine(session: Session) -> None:
    """``zt.report(checkpoint=True)`` saves the engine ``zt.prepare`` built; say so when there is none."""
    if session.engine is None:
        raise RuntimeError(
            "zt.report(..., checkpoint=True) saves the ZeRO engine built by zt.prepare(), but zt.prepare() "
            "has not been called in this train loop yet: call engine = zt.prepare(model, optimizer) first"
        )


def save_checkpoint(session: Session) -> None:
    """Collective, in ``zt.report`` (after ``require_engine``): save the engine to
    ``<run>/checkpoint_<global step>``, sync or async per ``CheckpointConfig``; retention runs after the
    commit."""
    engine, cfg = session.engine, session.checkpoint_config
    url = zc.checkpoint_url(session.context.trial_dir, engine.global_step)
    session.last_saved_step = engine.global_step
    if session.snapshots is not None:  # a restart then knows storage may hold a state newer than a snapshot
        session.snapshots.saved_step = max(session.snapshots.saved_step or 0, engine.global_step)
    options = {"storage_options": session.storage_options, "num_to_keep": cfg.num_to_keep,
               "epoch": session.context.epoch}
    if not cfg.async_save:
        wait_for_save(session)  # a sync save after an async one: one save in flight at a time
        zc.save(engine, url, **options)
        return
    saver = session.checkpoint_saver
    if saver is None or saver.engine is not engine:  # first async save, or a new engine
        wait_for_save(session)
        saver = zc.AsyncSaver(engine)
        session.checkpoint_saver = saver
    saver.save(url, **options)


def wait_for_save(session: Session) -> None:
    """After the loop returns, before the rank reports done: join this rank's async save (on rank 0:
    until it is committed), so teardown never cuts a checkpoint short."""
    if session.checkpoint_saver is not None:
        session.checkpoint_saver.wait()


def snapshot_due(session: Session) -> bool:
    """A snapshot at this report: every ``snapshot_interval`` optimizer steps, once per step (the same answer
    on every rank: their engines are at the same step)."""
    if not session.spec.snapshot_interval or session.snapshots is None or session.engine is None:
        return False
    step = int(session.engine.global_step)
    return step > 0 and step % session.spec.snapshot_interval == 0 and step != session.last_snapshot_step


def take_snapshot(session: Session) -> tuple[float, int]:
    """Collective, in ``zt.report``: snapshot this rank, replicate it on its buddy; (seconds the loop was
    blocked, bytes of this rank's snapshot)."""
    start = time.perf_counter()
    group_id, nodes = session.snapshot_group
    snap = snapshot.take(session.engine, group_id)
    snapshot.replicate(session.report_comm, session.snapshots, snap, nodes)
    session.last_snapshot_step = snap.header.step
    return time.perf_counter() - start, snap.header.nbytes


def keep_live_state(session: Session) -> bool:
    """Copy this rank's live engine state into its snapshot store (no collective), for a recovery from
    replicas: after its group failed (the rank has left it), or at a recovery point. Only under hybrid
    sharding (flat shards have no other copy), and only a completed optimizer step: a rank that failed inside
    one (or inside a load) offers nothing, and says so. Whether it kept a copy; never raises: the rank's
    failure is already reported."""
    engine = session.engine
    if not offers_replicas(session):
        return False
    rank = session.context.get_world_rank()
    if engine.mid_update:
        logger.warning("zeroray: rank %d stopped inside an optimizer step (or a load); its state is not offered "
                       "for recovery from replicas", rank)
        return False
    start = time.perf_counter()
    try:
        snap = snapshot.take(engine, session.snapshot_group[0], live=True)
    except Exception as e:  # e.g. a device lost with the node: the other replicas may still cover this shard
        logger.warning("zeroray: rank %d could not copy its state for recovery from replicas (%s: %s)", rank,
                       type(e).__name__, e)
        return False
    session.snapshots.add(snap)
    logger.info("zeroray: rank %d kept its state of step %d for recovery from replicas (%.1f MB in %.2f s)", rank,
                snap.header.step, snap.header.nbytes / 1e6, time.perf_counter() - start)
    return True


def offers_replicas(session: Session) -> bool:
    """Whether this group's live state can serve a recovery from replicas: an engine, hybrid sharding (a shard
    has copies in other replica groups) and ``FailureConfig.replica_recovery``. The same on every rank."""
    engine = session.engine
    return (engine is not None and session.snapshots is not None and session.snapshot_group is not None
            and session.spec.replica_recovery and engine.topology.replica_ranks is not None)


def keep_replicas(session: Session, stay: Collection[int]) -> str | None:
    """Collective, at a recovery point (every rank at the same report): every rank keeps its live state
    (:func:`keep_live_state`), then the ranks agree whether the copies of the ranks in ``stay`` (this group's
    ranks that the next group keeps) hold every shard. None when they do: the recovery point needs no
    checkpoint, the next group restores from them as after a failure (``resumed=("replica", step)``); else
    why not, and the caller saves a checkpoint. Only where :func:`offers_replicas`."""
    kept = keep_live_state(session)
    gathered = session.report_comm.all_gather_object((session.engine.topology.replica_ranks, kept))
    missing = snapshot.uncovered([column for column, _ in gathered], [r for r in stay if gathered[r][1]])
    if missing:
        return f"no rank that stays ({_ranks(stay)}) kept a copy of the shards of rank(s) {missing}"
    return None


def _ranks(ranks: Collection[int]) -> str:
    """``ranks`` for a log line: "ranks 0-3" for a run, else the list."""
    r = sorted(ranks)
    if r and r == list(range(r[0], r[-1] + 1)) and len(r) > 2:
        return f"ranks {r[0]}-{r[-1]}"
    return f"rank(s) {r}"


def drop_recovered(session: Session) -> None:
    """At a report (every rank of this group runs): the live copies of earlier groups are no longer needed."""
    if session.snapshots is not None and session.snapshot_group is not None:
        session.snapshots.drop_live(session.snapshot_group[0])


class RecoveryPointReached(BaseException):  # noqa: N818 - a control-flow signal, not an error
    """Raised out of ``zt.report`` to end the loop at a recovery point; a BaseException so that a loop's
    ``except Exception`` does not swallow it. ``step``: the engine's global step then (None: no engine);
    ``choice``: which recovery point was taken and why (a resize's here, a preemption's: worker/preemption.py)."""

    def __init__(self, step: int | None, choice: RecoveryChoice | None = None) -> None:
        super().__init__(f"stopped at a recovery point (step {step})")
        self.step, self.choice = step, choice


class RecoveryPointCallback(ReportCallback):
    """In each rank of an elastic run, the last thing a report does (see the module docstring's recovery points)."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def after_report(self, metrics: dict[str, Any], stats: RankStats, num_reports: int) -> None:
        session = self.session
        asked = [size for size in session.report_comm.all_gather_object(session.resize_to) if size is not None]
        if not asked:
            return
        engine = session.engine
        step = choice = None
        if engine is not None:
            step = int(engine.global_step)
            choice = self._recovery_point(step, asked[0])
        raise RecoveryPointReached(step, choice)

    def _recovery_point(self, step: int, resize_to: int) -> RecoveryChoice:
        """Collective: under hybrid sharding with replica recovery, the live replicas of the ranks that stay when
        they hold every shard (rank 0 logs which it took, and why); else a checkpoint, as without replicas. A
        resize keeps this group's first ``min(world, resize_to)`` ranks (a grow all of them, a shrink drops the
        last: ``WorkerGroup.start``)."""
        session = self.session
        world = session.context.get_world_size()
        stay = range(min(world, resize_to))
        start = time.perf_counter()
        hybrid = offers_replicas(session)
        why_not = keep_replicas(session, stay) if hybrid else None
        if not hybrid or why_not is not None:
            if session.last_saved_step != step:
                save_checkpoint(session)
        wait_for_save(session)  # this save, or an async one of an earlier step: done before the group ends
        if hybrid and session.context.get_world_rank() == 0:
            if why_not is None:
                logger.info("zeroray: recovery point at step %d for a resize from %d to %d ranks: the live replicas of "
                            "%s hold every shard; no checkpoint written, the next group restores from them", step,
                            world, resize_to, _ranks(stay))
            else:
                logger.warning("zeroray: recovery point at step %d for a resize from %d to %d ranks: a checkpoint, "
                               "no recovery from replicas: %s", step, world, resize_to, why_not)
        kind = "replica" if hybrid and why_not is None else "checkpoint"
        return RecoveryChoice(kind, step, None, {}, {}, {"replica": why_not} if why_not else {},
                              time.perf_counter() - start)
