"""The worker group: one RankActor per rank on its placement-group bundle, and their lifecycle.

``WorkerGroup.start`` places the ranks, orders them so that ranks on one node are contiguous (node rank
and local rank follow), creates the actors that are missing, runs the rendezvous and starts the loop.
``poll`` gathers reports and failures without blocking on the loop: it waits on every rank at once
(``ray.wait``), with at most one poll in flight per rank, so a dead rank is seen as soon as Ray reports
its actor dead and a rank that stops answering (SIGSTOPped, hung) is a failure once it has been silent
for ``hang_timeout_s``.

A group's end keeps what can serve the next one (``disband``): the ranks that failed first-hand, died
or hung are killed; every other rank's actor is released (its loop ended, its process group left) and
handed, with its bundle, to the next ``start`` as a :class:`RankSlot`. So a restart or a resize starts
new processes (and pays for their placement, imports and set-up) only on new capacity. The killed ranks'
deaths are awaited in the background (:class:`Dying`): only a ``start`` that places new actors waits for
them (a lost node's are confirmed only once Ray marks the node dead). Elastic runs give
every rank a placement group of its own (one bundle), so a dead node takes only its ranks' groups with
it and a resize adds or removes single ranks; a fixed-size run keeps one placement group with the
configured strategy. ``shutdown`` kills every actor, waits until Ray reports them dead, and removes the
placement groups, whatever state they are in.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from zeroray.train.errors import WorkerFailure
from zeroray.train.group.poll import PollAnswer, PollStatus
from zeroray.train.group.priority import RANK_RUNTIME_ENV
from zeroray.train.group.rank_actor import RankActor, actor_name
from zeroray.train.report import Report
from zeroray.train.run_spec import RankInfo, RunSpec
from zeroray.train.sizing import ScalingDecision

logger = logging.getLogger(__name__)

ACTOR_CALL_TIMEOUT_S = 120.0  # node_info / rendezvous / setup calls; generous for slow image pulls
ACTOR_RELEASE_SLACK_S = 10.0  # beyond the release wait itself: the call's round trip on a busy node


class WorkerGroupStartError(RuntimeError):
    """The group could not be started (placement, actor creation or rendezvous failed).

    ``what`` names the step that failed; ``rank`` the rank whose call failed, when one did.
    """

    def __init__(self, what: str, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.what, self.rank = what, rank
        self.kept: list[RankSlot] = []  # a placement timeout gives the kept slots back to the caller


def orphan_timeout_s(spec: RunSpec, hang_timeout_s: float | None) -> float | None:
    """How long a rank whose loop runs waits without a poll from the driver before it stops its own process
    (None: never): ``FailureConfig.worker_heartbeat_timeout_s + collective_timeout_s``. The driver polls ten
    times a second; it stops only while it handles a failure, which it ends within about the collective timeout
    (waiting for the root cause) by releasing the rank or killing it. So a rank silent for longer is cut off
    (a partition) or has lost its driver, and nobody else can stop it."""
    return None if hang_timeout_s is None else hang_timeout_s + spec.collective_timeout_s


def placement_group_name(run: str, slot: str | None = None) -> str:
    """The group's placement group (fixed size); ``slot``: one rank's own (elastic runs)."""
    return f"zeroray:{run}" if slot is None else f"zeroray:{run}:slot-{slot}"


def rank_layout(bundle_nodes: list[str]) -> tuple[list[int], list[RankInfo]]:
    """Order bundles so each node's ranks are contiguous (nodes in order of first appearance).

    Returns (bundle index of each rank, RankInfo of each rank). Pure, so it is tested on its own.
    """
    nodes: list[str] = []
    for n in bundle_nodes:
        if n not in nodes:
            nodes.append(n)
    order = sorted(range(len(bundle_nodes)), key=lambda b: (nodes.index(bundle_nodes[b]), b))
    infos = []
    for rank, b in enumerate(order):
        node = bundle_nodes[b]
        same_node = [r for r, bb in enumerate(order) if bundle_nodes[bb] == node]
        infos.append(
            RankInfo(
                world_rank=rank,
                world_size=len(order),
                local_rank=same_node.index(rank),
                local_world_size=len(same_node),
                node_rank=nodes.index(node),
            )
        )
    return order, infos


def _place(spec: RunSpec, decision: ScalingDecision, kept: list[RankSlot],
           timeout_s: float | None) -> list[tuple[PlacementGroup, int, bool, str]]:
    """The bundles the ranks beyond ``kept`` go on, placed: (placement group, bundle index, own group, node id).

    Elastic: a one-bundle placement group per new rank. Fixed size: the kept ranks' group when they have one
    (its free bundles: the failed ranks'), else a new group of ``num_workers`` bundles with the strategy."""
    per_worker = dict(decision.resources_per_worker)
    count = decision.num_workers - len(kept)
    if decision.elastic:
        pgs = [placement_group([per_worker], strategy="PACK", name=placement_group_name(spec.name, uuid.uuid4().hex[:8]))
               for _ in range(count)]
        try:
            _wait_for_placement([pg.ready() for pg in pgs], [per_worker] * count, "one placement group per rank",
                                timeout_s, spec.placement_timeout_s)
        except BaseException:
            _remove_pgs(pgs)
            raise
        return [(pg, 0, True, placement_group_table(pg)["bundles_to_node_id"][0]) for pg in pgs]
    if kept:
        pg = kept[0].pg
        used = {s.bundle for s in kept}
        nodes = placement_group_table(pg)["bundles_to_node_id"]
        return [(pg, b, False, nodes[b]) for b in range(decision.num_workers) if b not in used]
    bundles = [per_worker] * decision.num_workers
    pg = placement_group(bundles, strategy=spec.placement_strategy, name=placement_group_name(spec.name))
    try:
        _wait_for_placement([pg.ready()], bundles, spec.placement_strategy, timeout_s, spec.placement_timeout_s)
    except BaseException:
        _remove_pgs([pg])
        raise
    nodes = placement_group_table(pg)["bundles_to_node_id"]
    return [(pg, b, False, nodes[b]) for b in range(decision.num_workers)]


def _wait_for_placement(ready: list[Any], bundles: list[dict[str, float]], strategy: str,
                        timeout_s: float | None, configured_s: float | None = None) -> None:
    """Wait for the placement groups' ``ready()`` refs; after ``timeout_s`` raise, naming ``configured_s``
    (placement_timeout_s: what the user set, of which ``timeout_s`` may be the rest)."""
    configured_s = timeout_s if configured_s is None else configured_s
    start = time.monotonic()
    pending = list(ready)
    while pending:
        wait_s = 30.0 if timeout_s is None else max(min(30.0, timeout_s - (time.monotonic() - start)), 0.0)
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
        if not pending:
            return
        waited = time.monotonic() - start
        what = (
            f"{len(bundles)} bundle(s) of {bundles[0]} ({strategy}) for the worker group: waited {waited:.0f}s "
            f"(cluster has {ray.cluster_resources()}, available {ray.available_resources()})"
        )
        if timeout_s is not None and waited >= timeout_s:
            raise WorkerGroupStartError(
                "placement", f"could not place {what}; gave up after ScalingConfig.placement_timeout_s={configured_s:g}"
            )
        logger.warning("zeroray: still waiting to place %s", what)


class Dying:
    """Killed actors whose deaths Ray has not confirmed yet: each batch is ended (:func:`end_slots`: the deaths
    awaited, the placement groups removed) in a thread of its own, so whoever does not need their resources,
    bundles or names does not wait for it (a lost node's actors are confirmed dead only once Ray's health check
    marks the node dead). :meth:`wait` before placing new actors and before the run ends."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []

    def add(self, slots: list[RankSlot], keep_pg: PlacementGroup | None = None) -> None:
        if slots:
            thread = threading.Thread(target=end_slots, args=(slots, keep_pg), name="zeroray-dying", daemon=True)
            thread.start()
            self._threads.append(thread)

    def wait(self) -> None:
        """Until every actor handed over is confirmed dead (bounded: end_slots' own timeout) and its placement
        group removed."""
        while self._threads:
            self._threads.pop().join()


@dataclass
class RankSlot:
    """A rank's bundle and the actor on it; handed from one group to the next while both live.

    ``pg``/``bundle``: where it is placed; ``own_pg``: the placement group is the slot's own (elastic runs)
    and goes with it; ``name``: the Ray actor name it was created with (a kept actor keeps it when its rank
    changes); ``node``: its ``node_info`` (node id, ip, pid, GPU ids, the niceness its start ran at and its threads' now)."""

    actor: Any
    pg: PlacementGroup
    bundle: int
    own_pg: bool
    name: str
    node: dict[str, Any] = field(default_factory=dict)
    spare: bool = False  # started ahead of a grow, not yet in a group


@dataclass
class Spares:
    """New ranks' actors started ahead of a grow while the group still trains, so their placement, process
    start and imports overlap training instead of stopping it. ``ready`` polls them; the grow then hands
    them to the next ``WorkerGroup.start`` like kept slots; ``end`` gives them back."""

    slots: list[RankSlot] = field(default_factory=list)
    refs: list[Any] = field(default_factory=list)  # their node_info calls

    def ready(self, timeout_s: float = 0.0) -> bool:
        """Whether every spare is up (placed, started, imported); raises when one died."""
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout_s)
        if len(ready) < len(self.refs):
            return False
        for slot, node in zip(self.slots, ray.get(self.refs)):
            slot.node = node
        return True

    def end(self) -> None:
        end_slots(self.slots)


class WorkerGroup:
    """A started group of rank actors. Create with :meth:`start`; end with :meth:`disband` or :meth:`shutdown`."""

    def __init__(self, run: str, hang_timeout_s: float | None = None) -> None:
        self.run = run
        self.hang_timeout_s = hang_timeout_s
        self.slots: list[RankSlot] = []  # in rank order once started
        self.started_at = time.monotonic()
        self.phases: dict[str, float] = {}  # seconds of each start-up step (Attempt.phases)
        self.kept = 0  # ranks whose actor came from the previous group
        self._in_flight: dict[int, Any] = {}  # rank -> its unanswered poll
        self._last_answer: list[float] = []
        self._done: list[bool] = []
        self._stopped: list[bool] = []
        self._stopped_at: int | None = None
        self._gone: set[int] = set()  # dead or declared hung: not polled again
        self._seen = 0  # the index of the newest report taken from the ranks

    @property
    def actors(self) -> list[Any]:
        return [s.actor for s in self.slots]

    @property
    def node_infos(self) -> list[dict[str, Any]]:
        return [s.node for s in self.slots]

    @classmethod
    def start(
        cls,
        *,
        spec: RunSpec,
        decision: ScalingDecision,
        per_rank_datasets: Callable[[list[str]], list[dict[str, Any]]],
        placement_timeout_s: float | None = None,
        hang_timeout_s: float | None = None,
        kept: list[RankSlot] | None = None,
        epoch: int | None = None,
        dying: Dying | None = None,
    ) -> WorkerGroup:
        """Place, create, rendezvous, start the loop, reusing the ``kept`` slots of the previous group (the
        group owns them from here). ``placement_timeout_s``: None = the spec's. On a placement timeout the new
        bundles are given back and the error's ``kept`` returns the kept slots to the caller; on any other
        error the whole partial group, kept slots included, is torn down. ``epoch``: the group's fencing epoch,
        which its saves carry. Each rank stops its own process once the driver has not polled it for
        ``hang_timeout_s + spec.collective_timeout_s`` (:func:`orphan_timeout_s`). ``dying``: the last group's
        killed actors; a group that places new actors first waits until Ray confirms them dead (their
        resources and names are free only then; counted in the "placement" phase), one made of kept ranks
        alone does not."""
        group = cls(spec.name, hang_timeout_s)
        kept = list(kept or [])
        extra = kept[decision.num_workers:]  # a smaller group: the last ranks go
        kept = kept[:decision.num_workers]
        end_slots(extra, keep_pg=kept[0].pg if kept and not kept[0].own_pg else None)
        timeout = spec.placement_timeout_s if placement_timeout_s is None else placement_timeout_s
        t0 = time.monotonic()
        if dying is not None and decision.num_workers > len(kept):
            dying.wait()
        try:
            new = _place(spec, decision, kept, timeout)
        except WorkerGroupStartError as e:
            e.kept = kept
            raise
        except BaseException:
            end_slots(kept)
            raise
        group.kept = sum(not s.spare for s in kept)
        for s in kept:
            s.spare = False
        try:
            t1 = time.monotonic()
            group._create_actors(kept, new, decision.resources_per_worker, spec.use_gpu)
            t2 = time.monotonic()
            actors = group.actors
            addr, port = group._get([actors[0].rendezvous_address.remote()], "rendezvous")[0]
            shards = per_rank_datasets([s.node["node_id"] for s in group.slots])
            spec_ref = ray.put(spec)  # one copy of the loop and its config for every rank
            _, infos = rank_layout([s.node["node_id"] for s in group.slots])
            orphan_s = orphan_timeout_s(spec, hang_timeout_s)
            group._get(
                [a.setup.remote(addr, port, infos[r], spec_ref, shards[r], decision.batch, decision.elastic, epoch,
                                orphan_s)
                 for r, a in enumerate(actors)],
                "setup (torch.distributed rendezvous)",
            )
            group._get([a.start.remote() for a in actors], "start")
            group.phases = {"placement": t1 - t0, "actors": t2 - t1, "rendezvous": time.monotonic() - t2}
            n = len(actors)
            group._last_answer = [time.monotonic()] * n
            group._done, group._stopped = [False] * n, [False] * n
        except BaseException:
            group.shutdown()
            end_slots(kept)  # those not in the group yet, when creating the actors failed
            _remove_pgs([pg for pg, *_ in new])
            raise
        return group

    def _create_actors(self, kept: list[RankSlot], new: list[tuple[PlacementGroup, int, bool, str]],
                       resources: dict[str, float], use_gpu: bool) -> None:
        """The slots in rank order: the kept ones and an actor on each new bundle (``new``: placement group,
        bundle index, whether the group is the slot's own, node id). The new actors' node_info is their process
        start and imports."""
        nodes = [s.node["node_id"] for s in kept] + [node for *_, node in new]
        order, infos = rank_layout(nodes)
        taken = {s.name for s in kept}
        slots: list[RankSlot] = []
        for i, info in zip(order, infos):
            if i < len(kept):
                slots.append(kept[i])
                continue
            pg, bundle, own, _ = new[i - len(kept)]
            slots.append(_new_slot(self.run, info.world_rank, taken, pg, bundle, own, resources, use_gpu))
        self.slots = slots
        fresh = [r for r, s in enumerate(slots) if not s.node]
        for r, node in zip(fresh, self._get([slots[r].actor.node_info.remote() for r in fresh], "node_info", fresh)):
            slots[r].node = node

    def start_spares(self, spec: RunSpec, decision: ScalingDecision) -> Spares:
        """Ahead of a grow to ``decision``: a placement group and an actor for each rank to add, started while
        this group trains (see :class:`Spares`)."""
        per_worker = dict(decision.resources_per_worker)
        taken = {s.name for s in self.slots}
        spares = Spares()
        for k in range(decision.num_workers - len(self.slots)):
            pg = placement_group([per_worker], strategy="PACK", name=placement_group_name(spec.name, uuid.uuid4().hex[:8]))
            slot = _new_slot(self.run, len(self.slots) + k, taken, pg, 0, True, per_worker, spec.use_gpu)
            slot.spare = True
            spares.slots.append(slot)
            spares.refs.append(slot.actor.node_info.remote())
        return spares

    def _get(self, refs: list[Any], what: str, ranks: list[int] | None = None) -> list[Any]:
        """The results of one call per rank (``ranks``: whose; default every rank in order), within the group's
        timeout, waiting on all at once: the first call that raises (or whose actor dies) fails the start at
        once, naming its rank, instead of after the calls of the ranks before it, which may be waiting for it
        (a rendezvous with a dead rank)."""
        deadline = time.monotonic() + ACTOR_CALL_TIMEOUT_S
        ranks = list(range(len(refs))) if ranks is None else ranks
        rank_of = dict(zip(refs, ranks))
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
            if not ready:
                late = sorted(rank_of[r] for r in pending)
                raise WorkerGroupStartError(
                    what, f"{what} did not finish in {ACTOR_CALL_TIMEOUT_S:.0f}s on rank(s) {late}", late[0]
                )
            try:
                ray.get(ready[0])
            except Exception as e:  # the call raised, or the actor died
                rank = rank_of[ready[0]]
                raise WorkerGroupStartError(what, f"{what} failed on rank {rank}: {type(e).__name__}: {e}", rank) from e
        return ray.get(list(refs))

    # ------------------------------------------------------------------ running
    def poll(self, timeout_s: float = 0.1) -> PollStatus:
        """Reports (from rank 0), per-rank done flags, and failures (loop errors, dead actors, ranks silent
        for ``hang_timeout_s``). Waits up to ``timeout_s`` for every rank's answer, all at once."""
        for rank, actor in enumerate(self.actors):
            if rank not in self._in_flight and rank not in self._gone:
                self._in_flight[rank] = actor.poll.remote(self._seen, rank == 0)
        refs = list(self._in_flight.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
        ready_set = set(ready)
        status = PollStatus()
        answers: dict[int, PollAnswer] = {}
        now = time.monotonic()
        for rank, ref in list(self._in_flight.items()):
            if ref not in ready_set:
                continue
            del self._in_flight[rank]
            try:
                answers[rank] = ray.get(ref)
            except RayActorError as e:
                self._gone.add(rank)
                self._done[rank] = True
                status.failures.append(
                    WorkerFailure(rank, f"the rank's actor process died{self.where(rank)}", str(e), actor_died=True)
                )
                continue
            self._last_answer[rank] = now
        for rank in sorted(answers):
            answer = answers[rank]
            if rank == 0:
                status.reports.extend(answer.reports)
                self._seen = max([self._seen, *(r.index for r in answer.reports)])
                status.timings = answer.timings
                status.resumed = answer.resumed
                status.stopped_with = answer.stopped_with
            if answer.sigterm is not None:
                status.sigterms.append(answer.sigterm)
            self._done[rank] = answer.done
            if answer.stopped:
                self._stopped[rank] = True
                self._stopped_at = answer.stopped_at
            if answer.failure is not None:
                status.failures.append(answer.failure)
        if self.hang_timeout_s is not None:
            for rank, last in enumerate(self._last_answer):
                if rank not in self._gone and now - last > self.hang_timeout_s:
                    self._gone.add(rank)
                    status.failures.append(WorkerFailure(
                        rank,
                        f"the rank's actor has not answered for {now - last:.0f}s (hung: stopped, or stuck without "
                        f"releasing the GIL){self.where(rank)}; FailureConfig.worker_heartbeat_timeout_s="
                        f"{self.hang_timeout_s:g}",
                        "",
                        hung=True,
                    ))
        status.done = list(self._done)
        status.stopped = list(self._stopped)
        status.stopped_at = self._stopped_at
        return status

    def last_reports(self, timeout_s: float, skip: set[int]) -> PollStatus:
        """The group's reports that no poll has taken yet, before the group ends: a poll that finds a failure
        may return before rank 0 answers, and the reports queued before the failure (the steps the group
        completed, which the next group resumes after) must reach the driver. Every rank queues them
        (worker/reporting.py): rank 0's unanswered poll is taken first, and each live rank not in ``skip`` (dead
        with its node, hung) is asked for those it holds; rank 0's answer settles it, else the others' within
        ``timeout_s`` (rank 0 died, or does not answer)."""
        status = PollStatus()
        asked = [r for r in range(len(self.slots)) if r not in self._gone and r not in skip]
        unanswered = self._in_flight.pop(0, None) if 0 in asked else None
        held = {self.actors[r].held_reports.remote(self._seen): r for r in asked}  # after the poll: calls keep order
        pending = ([unanswered] if unanswered is not None else []) + list(held)
        by_index: dict[int, Report] = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
            if not ready:
                break
            try:
                got = ray.get(ready[0])
            except Exception:  # the actor died meanwhile: what it held is gone with it
                continue
            if isinstance(got, PollAnswer):
                got, status.timings, status.resumed = got.reports, got.timings, got.resumed
            rank = held.get(ready[0], 0)
            by_index.update({r.index: r for r in got if rank == 0 or r.index not in by_index})
            if ready[0] in held and rank == 0 and unanswered not in pending:
                break  # rank 0 has handed over every report the group made
        status.reports = [by_index[i] for i in sorted(by_index) if i > self._seen]
        self._seen = max([self._seen, *by_index])
        return status

    def where(self, rank: int) -> str:
        """Where ``rank`` runs, for messages: " (node <id>, pid <pid>)"."""
        info = self.node_infos[rank] if rank < len(self.node_infos) else {}
        return f" (node {info.get('node_id', '?')[:12]}, pid {info.get('pid', '?')})" if info else ""

    def silent_since(self, t: float) -> list[int]:
        """Ranks (not already failed) whose last answer to a poll is older than ``t`` (``time.monotonic()``)."""
        return [r for r, last in enumerate(self._last_answer) if r not in self._gone and last < t]

    def node_of(self, rank: int | None) -> str | None:
        """The Ray node id the rank ran on."""
        if rank is None or rank >= len(self.node_infos):
            return None
        return self.node_infos[rank].get("node_id")

    def node_to_ranks(self) -> dict[str, list[int]]:
        """Each Ray node id of the group and its ranks."""
        out: dict[str, list[int]] = {}
        for rank, info in enumerate(self.node_infos):
            out.setdefault(info.get("node_id", "?"), []).append(rank)
        return out

    def mark_preempt(self, info: Any, keeps_ranks: bool) -> None:
        """Hand every rank a preemption notice (``RankActor.mark_preempt``); fire and forget: the ranks stop at a
        recovery point at their next report, which ``poll`` says (``all_stopped``, ``stopped_with``)."""
        for rank, actor in enumerate(self.actors):
            if rank not in self._gone:
                actor.mark_preempt.remote(info, keeps_ranks)

    def request_recovery_point(self, num_workers: int) -> None:
        """Ask every rank to stop at a recovery point at its next report (a planned resize to ``num_workers``,
        which keeps this group's first ``num_workers`` ranks); fire and forget: the answer comes through
        ``poll`` (``all_stopped``, ``stopped_with``)."""
        for rank, actor in enumerate(self.actors):
            if rank not in self._gone:
                actor.request_recovery_point.remote(num_workers)

    @property
    def pids(self) -> list[int]:
        return [info["pid"] for info in self.node_infos]

    # ------------------------------------------------------------------ teardown
    def disband(self, failed: set[int], release_timeout_s: float, dying: Dying) -> list[RankSlot]:
        """End the group, keeping what can serve the next one; returns the kept slots in rank order.

        The ``failed`` ranks (first-hand failures), the dead and the hung are killed first (their sockets close,
        so the others' collectives fail instead of waiting for them); every other rank is asked to release
        within ``release_timeout_s`` (its loop ends: a loop still waiting in a collective has its group's
        connections shut, group_sockets.py; its process group is left), and killed when it does not. The
        killed ranks go to ``dying``, which waits for Ray to confirm them dead (a lost node's: once Ray marks the
        node dead) and removes their placement groups in the background: the next group waits for that only
        when it places new actors (:meth:`start`). A fixed-size group's placement group is kept only when every
        bundle of it is still placed."""
        doomed = [r for r in range(len(self.slots)) if r in failed or r in self._gone]
        _send_kill([self.slots[r].actor for r in doomed])  # their deaths are awaited by ``dying``, not here
        candidates = [r for r in range(len(self.slots)) if r not in doomed]
        if candidates and not self.slots[0].own_pg and not _placed(self.slots[0].pg):
            candidates = []  # a node of the group is gone: Ray re-places its bundles; start afresh
        released: list[bool] = []
        if candidates:
            refs = [self.slots[r].actor.release.remote(release_timeout_s) for r in candidates]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=release_timeout_s + ACTOR_RELEASE_SLACK_S)
            ready_set = set(ready)
            for rank, ref in zip(candidates, refs):
                try:
                    why = ray.get(ref) if ref in ready_set else "it did not answer"
                except Exception as e:  # the actor died meanwhile
                    why = f"{type(e).__name__}"
                released.append(why is None)
                if why is not None:
                    logger.warning("zeroray: rank %d%s is not kept for the next group: %s", rank, self.where(rank), why)
        kept = [self.slots[r] for r, ok in zip(candidates, released) if ok]
        kept_ids = {id(s) for s in kept}
        dying.add([s for s in self.slots if id(s) not in kept_ids], keep_pg=kept[0].pg if kept and not kept[0].own_pg
                  else None)
        self.slots = []
        return kept

    def shutdown(self, graceful: bool = False, timeout_s: float = 30.0) -> None:
        """Kill every actor, wait until Ray reports them dead, remove the placement group(s)."""
        if graceful and self.slots:
            try:
                ray.get([a.shutdown.remote() for a in self.actors], timeout=5.0)
            except Exception:
                pass  # they are killed below anyway
        end_slots(self.slots, timeout_s=timeout_s)
        self.slots = []


def _placed(pg: PlacementGroup) -> bool:
    try:
        return placement_group_table(pg).get("state") == "CREATED"
    except Exception:
        return False


def _kill(actors: list[Any], timeout_s: float = 30.0) -> None:
    """Kill the actors and wait (bounded) until Ray reports each dead (a lost node's: once Ray marks the node
    dead)."""
    _send_kill(actors)
    deadline = time.monotonic() + timeout_s
    for a in actors:
        while time.monotonic() < deadline:
            try:
                ray.get(a.__ray_ready__.remote(), timeout=1.0)
            except RayActorError:
                break  # dead, as we want
            except GetTimeoutError:
                continue
            except Exception:
                break
            time.sleep(0.05)


def _send_kill(actors: list[Any]) -> None:
    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:
            pass


def _new_slot(run: str, rank: int, taken: set[str], pg: PlacementGroup, bundle: int, own_pg: bool,
              resources: dict[str, float], use_gpu: bool) -> RankSlot:
    """A RankActor on the bundle, named after ``rank`` unless an actor in ``taken`` has that name."""
    name = actor_name(run, rank)
    if name in taken:  # a kept actor created as this rank now has another rank
        name = f"{name}.{uuid.uuid4().hex[:6]}"
    taken.add(name)
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU", "memory")}
    actor = ray.remote(RankActor).options(
        name=name,
        num_cpus=resources.get("CPU", 0),
        num_gpus=resources.get("GPU", 0),
        memory=resources.get("memory"),
        resources=custom or None,
        max_restarts=0,
        runtime_env=RANK_RUNTIME_ENV,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
    ).remote(run, use_gpu)
    return RankSlot(actor, pg, bundle, own_pg, name)


def _remove_pgs(pgs: list[PlacementGroup]) -> None:
    for pg in pgs:
        try:
            remove_placement_group(pg)
        except Exception:
            pass


def end_slots(slots: list[RankSlot], keep_pg: PlacementGroup | None = None, timeout_s: float = 30.0) -> None:
    """Kill the slots' actors and remove their placement groups (each once), except ``keep_pg``."""
    _kill([s.actor for s in slots], timeout_s)
    pgs: dict[Any, PlacementGroup] = {}
    for s in slots:
        if keep_pg is None or s.pg.id != keep_pg.id:
            pgs[s.pg.id] = s.pg
    _remove_pgs(list(pgs.values()))
