"""The rank's half of a preemption: SIGTERM as a notice, ``zt.get_preemption_info()``, and the recovery point
the group takes at the step boundary after a notice.

**SIGTERM** is how Kubernetes and Ray's cluster launcher stop a pod or a node's processes: some seconds of grace
(Kubernetes' ``terminationGracePeriodSeconds``, 30 s by default), then SIGKILL. The rank actor installs
:class:`SigtermNotice` in its own process (never in the user's driver); a SIGTERM then becomes a notice for
this rank with ``FailureConfig.sigterm_grace_s`` left, which the driver handles like a drain notice, instead
of the process ending at once with the steps since the last recovery point lost.

**The recovery point** (:func:`take_recovery_point`). The driver hands every rank the notice
(``RankActor.mark_preempt``); the ranks agree on it in the exchange of their next ``zt.report`` (so all act at
the same report). Under hybrid sharding with replica recovery every rank first keeps its live state, and
when the ranks that stay hold every shard that is the recovery point ("replica": nothing is written, the next
group restores from them). Else they exchange their measured durations and each computes the same
:func:`choose`: an in-memory snapshot to buddies on ranks that stay (when snapshots are on, the group keeps its
surviving ranks, and every leaving rank's buddy stays), else a checkpoint, whichever fits the time left
(estimate x ``SAFETY_FACTOR`` + ``MARGIN_S``). When neither fits, the ranks stop with no recovery point and the
next group resumes from the newest earlier one, as after a crash. The loop then ends with
:class:`RecoveryPointReached`.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from zeroray.checkpoint import snapshot
from zeroray.train.preemption import PreemptionInfo, RecoveryChoice, merge
from zeroray.train.worker import recovery
from zeroray.train.worker.context import Session, get_session

logger = logging.getLogger(__name__)

# A kind fits when its estimate x SAFETY_FACTOR + MARGIN_S is within the time left: the margin covers the stop,
# the driver's teardown of the leaving ranks and a slower-than-measured write.
SAFETY_FACTOR = 1.5
MARGIN_S = 1.0
# Before any was measured, a kind is estimated from the rank's shard bytes at these (low) rates.
UNMEASURED_SNAPSHOT_BYTES_PER_S = 200e6  # a host copy plus one send to the buddy
UNMEASURED_CHECKPOINT_BYTES_PER_S = 50e6  # a write to shared storage, plus the commit
UNMEASURED_CHECKPOINT_OVERHEAD_S = 1.0


class SigtermNotice:
    """SIGTERM to this rank's process as a preemption notice with ``grace_s`` left (a second SIGTERM changes
    nothing), while ``training()`` says a loop runs; otherwise (an idle rank between groups, one being torn
    down) the process's previous handling (Ray's: exit). Installed in the rank actor's process only, from its
    main thread (Python's rule for handlers)."""

    def __init__(self, training: Callable[[], bool], grace_s: float = 30.0) -> None:
        self.training, self.grace_s = training, grace_s
        self.received_at: float | None = None  # time.time() of the first SIGTERM
        self._previous: Any = signal.SIG_DFL

    def install(self) -> bool:
        """Handle SIGTERM in this process from now on; False (nothing installed) off the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        return True

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received_at is None and not self.training():
            if callable(self._previous):
                self._previous(signum, frame)
                return
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if self.received_at is None:
            self.received_at = time.time()
            os.write(2, f"zeroray: rank process {os.getpid()} got SIGTERM: handled as a preemption notice with "
                        f"{self.grace_s:g}s of grace (FailureConfig.sigterm_grace_s)\n".encode())

    def notice(self, node_id: str, rank: int) -> PreemptionInfo | None:
        """The notice for ``rank`` on ``node_id``, once a SIGTERM came; else None."""
        if self.received_at is None:
            return None
        return PreemptionInfo(int((self.received_at + self.grace_s) * 1000), {node_id: [rank]})


def get_preemption_info() -> PreemptionInfo | None:
    """Inside the loop: the preemption notice the group got, or None (as ``ray.train.get_preemption_info``).

    The same answer on every rank (rank 0's, broadcast): call it on every rank the same number of times, like a
    collective. zeroray acts on a notice by itself at the next ``zt.report`` (a recovery point, then a smaller
    or moved group), so a loop needs it only to do something of its own first (e.g. flush its own files)."""
    session = get_session("get_preemption_info()")
    return session.report_comm.broadcast_object(session.preemption, src=0)


def agreed(gathered: list[Any]) -> tuple[PreemptionInfo, bool] | None:
    """From a report's exchange: the notice any rank was handed (merged), and whether the group keeps its
    surviving ranks (so their memory can hold the recovery point); the same on every rank."""
    notices = [g["preempt"] for g in gathered if isinstance(g, dict) and g.get("preempt") is not None]
    if not notices:
        return None
    return merge(*(n for n, _ in notices)), all(keep for _, keep in notices)


def choose(remaining_s: float | None, needed_s: dict[str, float]) -> str:
    """The first of snapshot, checkpoint among ``needed_s`` (the possible kinds' estimates) that fits the time
    left (None: no deadline, the first possible); "none" when none fits. Pure."""
    for kind in ("snapshot", "checkpoint"):
        if kind in needed_s and (remaining_s is None or needed_s[kind] * SAFETY_FACTOR + MARGIN_S <= remaining_s):
            return kind
    return "none"


def _own_durations(session: Session) -> tuple[float | None, float | None, int]:
    """This rank's measured seconds of its last snapshot and sync checkpoint, and its shard bytes."""
    return (session.measured_s.get("snapshot"), session.measured_s.get("checkpoint"),
            recovery.shard_bytes(session.engine))


def estimates(session: Session, info: PreemptionInfo, keeps_ranks: bool,
              durations: list[tuple[float | None, float | None, int]]) -> tuple[dict[str, float], dict[str, str],
                                                                                    dict[str, str]]:
    """(seconds each possible kind needs, how each was estimated, why the others cannot serve); the same on
    every rank (from every rank's ``durations``)."""
    step = int(session.engine.global_step)
    most_bytes = max(b for _, _, b in durations)
    needed: dict[str, float] = {}
    how: dict[str, str] = {}
    unavailable: dict[str, str] = {}
    why_not = _no_snapshot(session, info, keeps_ranks)
    if why_not:
        unavailable["snapshot"] = why_not
    elif session.last_snapshot_step == step:
        needed["snapshot"], how["snapshot"] = 0.0, "already taken at this step"
    elif any(s is not None for s, _, _ in durations):
        needed["snapshot"], how["snapshot"] = max(s for s, _, _ in durations if s is not None), "measured"
    else:
        needed["snapshot"] = 2 * most_bytes / UNMEASURED_SNAPSHOT_BYTES_PER_S
        how["snapshot"] = f"estimated from {most_bytes / 1e6:.1f} MB a rank"
    if session.last_saved_step == step:
        needed["checkpoint"], how["checkpoint"] = 0.0, "already saved at this step"
    elif any(c is not None for _, c, _ in durations):
        needed["checkpoint"], how["checkpoint"] = max(c for _, c, _ in durations if c is not None), "measured"
    else:
        needed["checkpoint"] = most_bytes / UNMEASURED_CHECKPOINT_BYTES_PER_S + UNMEASURED_CHECKPOINT_OVERHEAD_S
        how["checkpoint"] = f"estimated from {most_bytes / 1e6:.1f} MB a rank"
    return needed, how, unavailable


def _no_snapshot(session: Session, info: PreemptionInfo, keeps_ranks: bool) -> str | None:
    """Why an in-memory snapshot cannot be the recovery point, or None when it can."""
    if not session.spec.snapshot_interval or session.snapshots is None or session.snapshot_group is None:
        return "in-memory snapshots are off (FailureConfig.snapshot_interval=0)"
    if not keeps_ranks:
        return "the group moves to a new placement group (a fixed-size run off a draining node), which keeps no rank"
    leaving = set(info.preempted_ranks)
    world = session.context.get_world_size()
    if world == 1 or leaving >= set(range(world)):
        return "no rank stays to hold the copies"
    to = snapshot.buddies(session.snapshot_group[1])
    lost = sorted(r for r in leaving if r < world and to[r] in leaving)
    if lost:
        return f"the buddies of rank(s) {lost} leave too"
    return None


def _keep_replicas(session: Session, info: PreemptionInfo, keeps_ranks: bool) -> tuple[str | None, float] | None:
    """Under hybrid sharding with replica recovery (else None), collective: every rank keeps its live state and
    the ranks agree whether the ranks that stay hold every shard (``recovery.keep_replicas``): (None when they do,
    else why not; the seconds it took)."""
    if not recovery.offers_replicas(session):
        return None
    if not keeps_ranks:
        return "the group moves to a new placement group (a fixed-size run off a draining node), which keeps no rank", 0.0
    stay = sorted(set(range(session.context.get_world_size())) - set(info.preempted_ranks))
    if not stay:
        return "no rank stays to hold the copies", 0.0
    start = time.perf_counter()
    why_not = recovery.keep_replicas(session, stay)
    return why_not, time.perf_counter() - start


def take_recovery_point(session: Session, info: PreemptionInfo, keeps_ranks: bool) -> None:
    """Collective, at the end of the ``zt.report`` whose exchange agreed on ``info``: take the recovery point that
    fits the deadline (or none), end the loop (:class:`RecoveryPointReached`; ``zt.report`` queues its report)."""
    engine = session.engine
    choice = RecoveryChoice("none", None, info.remaining_s(), {}, {}, {"any": "no engine (zt.prepare not called)"})
    if engine is not None:
        durations = session.report_comm.all_gather_object(_own_durations(session))
        start = time.perf_counter()
        replica = _keep_replicas(session, info, keeps_ranks)
        needed, how, unavailable = estimates(session, info, keeps_ranks, durations)
        remaining = info.remaining_s()  # after the exchange: the same moment, give or take, on every rank
        remaining = session.report_comm.broadcast_object(remaining, src=0)  # exactly the same choice everywhere
        if replica is not None and replica[0] is None:  # taken already: nothing is left to do but stop
            kind = "replica"
            needed, how = {"replica": replica[1], **needed}, {"replica": "kept in memory", **how}
        else:
            if replica is not None:
                unavailable = {"replica": replica[0], **unavailable}
            kind = choose(remaining, needed)
        if kind == "snapshot" and session.last_snapshot_step != engine.global_step:
            recovery.take_snapshot(session)
        elif kind == "checkpoint":
            if session.last_saved_step != engine.global_step:
                recovery.save_checkpoint(session)
            recovery.wait_for_save(session)
        choice = RecoveryChoice(kind, int(engine.global_step), remaining, needed, how, unavailable,
                                time.perf_counter() - start)
    raise recovery.RecoveryPointReached(choice.step, choice)
