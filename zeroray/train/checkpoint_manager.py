"""The trainer's checkpoints: where ``zt.report(checkpoint=True)`` saves, what a (re)started group
resumes from, and what ``Result.checkpoint`` names.

Storage is the one source of truth, kept by ``zeroray.checkpoint``: every rank writes its shard, rank 0
commits the manifest and applies ``CheckpointConfig.num_to_keep`` (``zc.save``), and the newest
*valid* committed ``<run>/checkpoint_<global step>`` (its manifest parses, its files are there) is
found by listing the run (``zc.latest_valid``), so a torn or damaged newest one falls back to the one
before it. So a restart after a failure and a new ``fit()`` with the same name and storage path
resume alike, at any world size and stage (the checkpoint reshards). The driver keeps no list of its own.

Async saves go through one ``zc.AsyncSaver`` per rank, held on the session (``checkpoint_saver``)
from the first async save to the end of the loop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import zeroray.checkpoint as zc
from zeroray.checkpoint import snapshot
from zeroray.train.context import Session

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint of the run, as ``Result.checkpoint`` (like ``ray.train.Checkpoint``).

    ``path``: the checkpoint directory's URL on ``RunConfig.storage_path``; pass it, with
    ``RunConfig.storage_options``, to ``zeroray.checkpoint.load`` / ``export`` /
    ``CheckpointReader(...).verify``.
    ``step``: the engine's ``global_step`` when it was saved.
    """

    path: str
    step: int


def latest_checkpoint(run_url: str, storage_options: dict[str, Any] | None = None) -> Checkpoint | None:
    """Driver side: the run's newest valid committed checkpoint on storage, or None."""
    info = zc.latest_valid(run_url, storage_options)
    return Checkpoint(info.url, info.step) if info is not None else None


def resume(session: Session) -> bool:
    """Collective, in ``zt.prepare``: load the run's newest state into the session's engine; False when the
    run has none (it starts fresh).

    The newest is the group's newest complete in-memory snapshot (``FailureConfig.snapshot_interval``; no
    storage read) unless a committed checkpoint on storage is newer. For storage, rank 0 picks the
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
    wait(session)  # an async save of an earlier engine of this loop must not race the read
    start = time.perf_counter()
    if choice is not None:
        snapshot.restore(engine, comm, session.snapshots, choice)
        session.resumed = ("memory", choice.step)
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


def save(session: Session) -> None:
    """Collective, in ``zt.report`` (after ``require_engine``): save the engine to
    ``<run>/checkpoint_<global step>``, sync or async per ``CheckpointConfig``; retention runs after the
    commit."""
    engine, cfg = session.engine, session.checkpoint_config
    url = zc.checkpoint_url(session.context.trial_dir, engine.global_step)
    session.last_saved_step = engine.global_step
    if session.snapshots is not None:  # a restart then knows storage may hold a state newer than a snapshot
        session.snapshots.saved_step = max(session.snapshots.saved_step or 0, engine.global_step)
    options = {"storage_options": session.storage_options, "num_to_keep": cfg.num_to_keep}
    if not cfg.async_save:
        wait(session)  # a sync save after an async one: one save in flight at a time
        zc.save(engine, url, **options)
        return
    saver = session.checkpoint_saver
    if saver is None or saver.engine is not engine:  # first async save, or a new engine
        wait(session)
        saver = zc.AsyncSaver(engine)
        session.checkpoint_saver = saver
    saver.save(url, **options)


def wait(session: Session) -> None:
    """After the loop returns, before the rank reports done: join this rank's async save (on rank 0:
    until it is committed), so teardown never cuts a checkpoint short."""
    if session.checkpoint_saver is not None:
        session.checkpoint_saver.wait()
