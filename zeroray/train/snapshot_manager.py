"""The trainer's in-memory snapshots (``FailureConfig.snapshot_interval``): when a rank takes one, and the
group identity they are filed under.

The snapshots, their copies on a buddy rank on another node and the restore are
:mod:`zeroray.checkpoint.snapshot`. The rank actor keeps its ``SnapshotStore`` from one group to the next:
that is what lets a restarted group, at any size, recover from its ranks' memory (checkpoint_manager.resume).
"""

from __future__ import annotations

import time
import uuid

from zeroray.checkpoint import snapshot
from zeroray.train.context import Session


def due(session: Session) -> bool:
    """A snapshot at this report: every ``snapshot_interval`` optimizer steps, once per step (the same answer
    on every rank: their engines are at the same step)."""
    if session.snapshots is None or session.engine is None:
        return False
    step = int(session.engine.global_step)
    return step > 0 and step % session.spec.snapshot_interval == 0 and step != session.last_snapshot_step


def take(session: Session) -> tuple[float, int]:
    """Collective, in ``zt.report``: snapshot this rank, replicate it on its buddy; (seconds the loop was
    blocked, bytes of this rank's snapshot)."""
    start = time.perf_counter()
    if session.snapshot_group is None:  # the group's id and its ranks' nodes, once per group
        gathered = session.report_comm.all_gather_object((session.context.get_node_rank(), uuid.uuid4().hex))
        session.snapshot_group = (gathered[0][1], [node for node, _ in gathered])
    group_id, nodes = session.snapshot_group
    snap = snapshot.take(session.engine, group_id)
    snapshot.replicate(session.report_comm, session.snapshots, snap, nodes)
    session.last_snapshot_step = snap.header.step
    return time.perf_counter() - start, snap.header.nbytes
