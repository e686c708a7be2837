"""The worker group: one placement group, one RankActor per rank, and their lifecycle.

``WorkerGroup.start`` reserves the bundles, orders ranks so that ranks on one node are contiguous
(node rank and local rank follow), creates the actors on their bundles, runs the rendezvous and starts
the loop. ``poll`` gathers reports and failures without blocking on the loop: it waits on every rank at
once (``ray.wait``), with at most one poll in flight per rank, so a dead rank is seen as soon as Ray
reports its actor dead and a rank that stops answering (SIGSTOPped, hung) is a failure once it has
been silent for ``hang_timeout_s``. ``shutdown`` kills the actors, waits until Ray reports them dead,
and removes the placement group, whatever state they are in.
"""

from __future__ import annotations

import logging
import time
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

from zeroray.train.context import RankInfo
from zeroray.train.errors import WorkerFailure
from zeroray.train.rank_actor import RankActor, actor_name
from zeroray.train.report import Report
from zeroray.train.run_spec import RunSpec
from zeroray.train.scaling_policy import ScalingDecision

logger = logging.getLogger(__name__)

ACTOR_CALL_TIMEOUT_S = 120.0  # node_info / rendezvous / setup calls; generous for slow image pulls


# Ray starts worker processes at niceness 15, below the node's other work; the ranks are the job's main work
# (as Ray Jobs does for its drivers). Ray merges these env_vars into the job's runtime_env.
_RANK_RUNTIME_ENV = {"env_vars": {"RAY_worker_niceness": "0"}}


class WorkerGroupStartError(RuntimeError):
    """The group could not be started (placement, actor creation or rendezvous failed).

    ``what`` names the step that failed; ``rank`` the rank whose call failed, when one did.
    """

    def __init__(self, what: str, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.what, self.rank = what, rank


def placement_group_name(run: str) -> str:
    return f"zeroray:{run}"


@dataclass
class PollStatus:
    """What one poll of every rank found."""

    reports: list[Report] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)
    failures: list[WorkerFailure] = field(default_factory=list)
    stopped: list[bool] = field(default_factory=list)  # the loop ended at a recovery point
    stopped_at: int | None = None

    @property
    def finished(self) -> bool:
        return bool(self.done) and all(self.done) and not self.failures and not any(self.stopped)

    @property
    def all_stopped(self) -> bool:
        return bool(self.stopped) and all(self.stopped) and not self.failures


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


def _wait_for_placement(pg: PlacementGroup, bundles: list[dict[str, float]], strategy: str,
                        timeout_s: float | None, configured_s: float | None = None) -> None:
    """Wait for the bundles; after ``timeout_s`` raise, naming ``configured_s`` (placement_timeout_s: what the
    user set, of which ``timeout_s`` may be the rest)."""
    configured_s = timeout_s if configured_s is None else configured_s
    start = time.monotonic()
    while True:
        ready, _ = ray.wait([pg.ready()], timeout=30.0 if timeout_s is None else min(30.0, timeout_s))
        if ready:
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


class WorkerGroup:
    """A started group of rank actors. Create with :meth:`start`; always :meth:`shutdown`."""

    def __init__(self, run: str, pg: PlacementGroup, hang_timeout_s: float | None = None) -> None:
        self.run = run
        self.pg = pg
        self.hang_timeout_s = hang_timeout_s
        self.actors: list[Any] = []
        self.node_infos: list[dict[str, Any]] = []
        self.started_at = time.monotonic()
        self._in_flight: dict[int, Any] = {}  # rank -> its unanswered poll
        self._last_answer: list[float] = []
        self._done: list[bool] = []
        self._stopped: list[bool] = []
        self._stopped_at: int | None = None
        self._gone: set[int] = set()  # dead or declared hung: not polled again

    @classmethod
    def start(
        cls,
        *,
        spec: RunSpec,
        decision: ScalingDecision,
        per_rank_datasets: Callable[[list[str]], list[dict[str, Any]]],
        placement_timeout_s: float | None = None,
        hang_timeout_s: float | None = None,
    ) -> WorkerGroup:
        """Reserve, create, rendezvous, start the loop. On any error the partial group is torn down.
        ``placement_timeout_s``: None = the spec's."""
        bundles = [dict(decision.resources_per_worker) for _ in range(decision.num_workers)]
        pg = placement_group(bundles, strategy=spec.placement_strategy, name=placement_group_name(spec.name))
        group = cls(spec.name, pg, hang_timeout_s)
        timeout = spec.placement_timeout_s if placement_timeout_s is None else placement_timeout_s
        try:
            _wait_for_placement(pg, bundles, spec.placement_strategy, timeout, spec.placement_timeout_s)
            table = placement_group_table(pg)
            bundle_nodes = [table["bundles_to_node_id"][b] for b in range(len(bundles))]
            order, infos = rank_layout(bundle_nodes)
            group._create_actors(order, infos, decision.resources_per_worker, spec.use_gpu)
            group.node_infos = group._get([a.node_info.remote() for a in group.actors], "node_info")
            addr, port = group._get([group.actors[0].rendezvous_address.remote()], "rendezvous")[0]
            shards = per_rank_datasets([info["node_id"] for info in group.node_infos])
            spec_ref = ray.put(spec)  # one copy of the loop and its config for every rank
            group._get(
                [a.setup.remote(addr, port, spec_ref, shards[r], decision.batch, decision.elastic)
                 for r, a in enumerate(group.actors)],
                "setup (torch.distributed rendezvous)",
            )
            group._get([a.start.remote() for a in group.actors], "start")
            n = len(group.actors)
            group._last_answer = [time.monotonic()] * n
            group._done, group._stopped = [False] * n, [False] * n
        except BaseException:
            group.shutdown()
            raise
        return group

    def _create_actors(
        self, order: list[int], infos: list[RankInfo], resources: dict[str, float], use_gpu: bool
    ) -> None:
        remote_cls = ray.remote(RankActor)
        custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU", "memory")}
        for bundle, info in zip(order, infos):
            name = actor_name(self.run, info.world_rank)
            actor = remote_cls.options(
                name=name,
                num_cpus=resources.get("CPU", 0),
                num_gpus=resources.get("GPU", 0),
                memory=resources.get("memory"),
                resources=custom or None,
                max_restarts=0,
                runtime_env=_RANK_RUNTIME_ENV,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle),
            ).remote(self.run, info, use_gpu)
            self.actors.append(actor)

    def _get(self, refs: list[Any], what: str) -> list[Any]:
        """The results of one call per rank, within the group's timeout, waiting on all at once: the first call
        that raises (or whose actor dies) fails the start at once, naming its rank, instead of after the
        calls of the ranks before it, which may be waiting for it (a rendezvous with a dead rank)."""
        deadline = time.monotonic() + ACTOR_CALL_TIMEOUT_S
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
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
                self._in_flight[rank] = actor.poll.remote()
        refs = list(self._in_flight.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
        ready_set = set(ready)
        status = PollStatus()
        answers: dict[int, dict[str, Any]] = {}
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
                    WorkerFailure(rank, f"the rank's actor process died{self._where(rank)}", str(e), actor_died=True)
                )
                continue
            self._last_answer[rank] = now
        for rank in sorted(answers):
            out = answers[rank]
            if rank == 0:
                status.reports.extend(out["reports"])
            self._done[rank] = out["done"]
            if out.get("stopped"):
                self._stopped[rank] = True
                self._stopped_at = out.get("stopped_at")
            if out["failure"] is not None:
                status.failures.append(out["failure"])
        if self.hang_timeout_s is not None:
            for rank, last in enumerate(self._last_answer):
                if rank not in self._gone and now - last > self.hang_timeout_s:
                    self._gone.add(rank)
                    status.failures.append(WorkerFailure(
                        rank,
                        f"the rank's actor has not answered for {now - last:.0f}s (hung: stopped, or stuck without "
                        f"releasing the GIL){self._where(rank)}; FailureConfig.worker_heartbeat_timeout_s="
                        f"{self.hang_timeout_s:g}",
                        "",
                        hung=True,
                    ))
        status.done = list(self._done)
        status.stopped = list(self._stopped)
        status.stopped_at = self._stopped_at
        return status

    def _where(self, rank: int) -> str:
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

    def request_recovery_point(self) -> None:
        """Ask every rank to stop at its next report after saving (a planned resize); fire and forget: the
        answer comes through ``poll`` (``all_stopped``)."""
        for rank, actor in enumerate(self.actors):
            if rank not in self._gone:
                actor.request_recovery_point.remote()

    @property
    def pids(self) -> list[int]:
        return [info["pid"] for info in self.node_infos]

    # ------------------------------------------------------------------ teardown
    def shutdown(self, graceful: bool = False, timeout_s: float = 30.0) -> None:
        """Kill every actor, wait until Ray reports them dead, remove the placement group."""
        if graceful and self.actors:
            try:
                ray.get([a.shutdown.remote() for a in self.actors], timeout=5.0)
            except Exception:
                pass  # they are killed below anyway
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        deadline = time.monotonic() + timeout_s
        for a in self.actors:
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
        self.actors = []
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None
