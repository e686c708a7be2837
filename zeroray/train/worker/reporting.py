"""``zt.report``: a barrier across ranks that carries rank 0's metrics and every rank's memory and step time.

Every rank calls it the same number of times (as in Ray Train). The ranks exchange their small stats
with one ``all_gather_object`` on a separate gloo group, so the barrier never touches the engine's
(possibly NCCL) streams; each rank then queues the same combined report (rank 0's metrics, every rank's
stats). The driver polls rank 0's, and reads a surviving rank's when rank 0 died with reports it had not
handed over.

When a rank's loop ends it joins one last exchange marked "done"; a rank still inside ``report`` then
sees the marker and both raise ReportMismatchError instead of hanging. ``checkpoint=True`` travels in
the same exchange, so ranks that disagree on it fail the same way before any rank starts a save (a
collective of its own, see recovery.py).
"""

from __future__ import annotations

import dataclasses
import numbers
import resource
import time
from typing import Any

import psutil
import torch

from zeroray.train.errors import ReportMismatchError
from zeroray.train.report import RankStats, Report
from zeroray.train.worker import preemption, recovery
from zeroray.train.worker.context import Session, get_session

_DONE = "__zeroray_done__"


def process_memory() -> dict[str, int]:
    """This process's resident memory now and its peak, in bytes, with ``process_peak_rss >=
    process_rss``. The kernel's high-water mark (``ru_maxrss``, KiB on Linux) comes from approximate
    per-CPU counters while /proc (psutil) sums them exactly, so read on its own it can lag the current
    RSS by a few hundred KiB: the peak is never below what was just measured."""
    rss = int(psutil.Process().memory_info().rss)
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    return {"process_rss": rss, "process_peak_rss": max(peak, rss)}


def _plain(value: Any) -> Any:
    """Make a metric value cheap to send: 0-d tensors become Python numbers."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"zt.report: tensor metrics must have one element, got shape {tuple(value.shape)}")
        return value.item()
    return value


def _rank_stats(session: Session) -> RankStats:
    """This rank's memory by category, the optimizer steps since its previous report and their time
    per step. A report with no step since the previous one (a sample after the loop) has no step time,
    and the next step's time counts from the last report that took a step."""
    now = time.perf_counter()
    engine = session.engine
    global_step = int(getattr(engine, "global_step", 0)) if engine is not None else session.num_reports + 1
    steps = max(global_step - session.last_global_step, 1) if global_step != session.last_global_step else 0
    step_time = None
    if steps:
        if session.last_report_time is not None:
            step_time = (now - session.last_report_time) / steps
        session.last_report_time, session.last_global_step = now, global_step
    memory: dict[str, int] = {}
    phases: dict[str, float] = {}
    comm: dict[str, int] = {}
    offload: dict[str, int] = {}
    if engine is not None:
        memory = {str(k): int(v) for k, v in engine.memory_report().items() if isinstance(v, numbers.Number)}
        times = engine.phase_report()
        phases = times.as_dict() if times.steps else {}
        comm = {str(k): int(v) for k, v in engine.comm_report(by_scope=True).items()}  # zt.prepare gave the nodes
        offload_report = getattr(engine, "offload_report", None)  # engines that offload (cpu, nvme) have it
        if offload_report is not None:
            offload = {str(k): int(v) for k, v in offload_report().items()}
    device = session.context.device
    if device.type == "cuda":
        memory["cuda_allocated"] = int(torch.cuda.memory_allocated(device))
        memory["cuda_max_allocated"] = int(torch.cuda.max_memory_allocated(device))
    if session.snapshots is not None and (session.spec.snapshot_interval or session.snapshots.held):
        memory["snapshots"] = session.snapshots.nbytes  # host copies held: this rank's, its buddies', live ones
    memory.update(process_memory())
    return RankStats(
        rank=session.context.get_world_rank(),
        global_step=global_step if engine is not None else None,
        step_time_s=step_time,
        memory=memory,
        phases=phases,
        comm_bytes=comm,
        offload_bytes=offload,
        steps=steps if engine is not None else None,
    )


def _save(session: Session, stats: RankStats) -> RankStats:
    """Save the checkpoint of this report; ``stats`` with how long the loop was blocked and the
    bytes of this rank's shard."""
    start = time.perf_counter()
    recovery.save_checkpoint(session)
    blocked = time.perf_counter() - start
    if not session.checkpoint_config.async_save:  # an async save's blocked time is not what a recovery point needs
        session.measured_s["checkpoint"] = blocked
    return dataclasses.replace(stats, checkpoint_s=blocked, checkpoint_bytes=recovery.shard_bytes(session.engine))


def _exchange(session: Session, item: Any) -> list[Any]:
    """All-gather one small object per rank on the report group (a barrier)."""
    return session.report_comm.all_gather_object(item)


def _check_mismatch(gathered: list[Any], num_reports: int) -> None:
    done = [r for r, g in enumerate(gathered) if g == _DONE]
    if done and len(done) != len(gathered):
        still = [r for r, g in enumerate(gathered) if g != _DONE]
        raise ReportMismatchError(
            f"zt.report must be called by every rank the same number of times: rank(s) {done} finished "
            f"their loop after {num_reports} reports while rank(s) {still} called report once more"
        )
    if done:
        return
    saving = [r for r, g in enumerate(gathered) if g["checkpoint"]]
    if saving and len(saving) != len(gathered):
        others = [r for r, g in enumerate(gathered) if not g["checkpoint"]]
        raise ReportMismatchError(
            f"zt.report(checkpoint=True) must be called by every rank at the same report: at report "
            f"{num_reports + 1} rank(s) {saving} asked for a checkpoint and rank(s) {others} did not"
        )


def report(metrics: dict[str, Any], checkpoint: bool = False) -> None:
    """Report this step's metrics (rank 0's are kept); blocks until every rank has reported.

    ``checkpoint=True`` (on every rank at the same report) also saves the engine from ``zt.prepare`` to
    ``<storage_path>/<name>/checkpoint_<global step>``, every rank writing its shard, sync or async per
    ``CheckpointConfig``; a restarted or resumed run starts from the newest committed one.
    """
    session = get_session("report()")
    if not isinstance(metrics, dict) or not all(isinstance(k, str) for k in metrics):
        raise TypeError(f"zt.report expects a dict with string keys, got {type(metrics).__name__}")
    if checkpoint:
        recovery.require_engine(session)
    plain = {k: _plain(v) for k, v in metrics.items()}
    stats = _rank_stats(session)
    is_rank0 = session.context.get_world_rank() == 0
    notice = (session.preemption, session.preemption_keeps_ranks) if session.preemption is not None else None
    item = {"metrics": plain if is_rank0 else None, "stats": stats, "checkpoint": checkpoint, "preempt": notice}
    session.waiting_in = "report"
    gathered = _exchange(session, item)
    _check_mismatch(gathered, num_reports=session.num_reports)
    recovery.drop_recovered(session)
    if checkpoint:
        stats = _save(session, stats)
    if recovery.snapshot_due(session):
        seconds, nbytes = recovery.take_snapshot(session)
        session.measured_s["snapshot"] = seconds
        stats = dataclasses.replace(stats, snapshot_s=seconds, snapshot_bytes=nbytes)
    session.num_reports += 1
    session.waiting_in = None
    # Every rank queues the group's report (rank 0's metrics): the driver takes rank 0's, and another rank's when
    # rank 0 died before handing its last ones over (WorkerGroup.last_reports). Queued however the report ends,
    # at a recovery point (a resize's or a preemption's, which end the loop) too: its step is complete.
    queued = Report(index=session.num_reports, time=time.time(), metrics=gathered[0]["metrics"],
                    ranks=tuple(g["stats"] for g in gathered))
    try:
        for callback in session.report_callbacks:
            callback.after_report(plain, stats, session.num_reports)
        agreed = preemption.agreed(gathered)
        if agreed is not None:  # a preemption notice: the recovery point that fits its deadline, then the loop ends
            preemption.take_recovery_point(session, *agreed)
    finally:
        session.reports.put(queued)


def finish(session: Session) -> None:
    """Called by the actor after the loop returned: the closing exchange that detects report mismatches."""
    session.waiting_in = "end"
    gathered = _exchange(session, _DONE)
    _check_mismatch(gathered, num_reports=session.num_reports)
