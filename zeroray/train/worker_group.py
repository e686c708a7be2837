"""The worker group: one placement group, one RankActor per rank, and their lifecycle.

``WorkerGroup.start`` reserves the bundles, orders ranks so that ranks on one node are contiguous
(node rank and local rank follow), creates the actors on their bundles, runs the rendezvous and starts
the loop. ``poll`` gathers reports and failures without blocking on the loop. ``shutdown`` kills the
actors, waits until Ray reports them dead, and removes the placement group, whatever state they are in.
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

    @property
    def finished(self) -> bool:
        return bool(self.done) and all(self.done) and not self.failures


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
                        timeout_s: float | None) -> None:
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
                "placement", f"could not place {what}; gave up after ScalingConfig.placement_timeout_s={timeout_s:g}"
            )
        logger.warning("zeroray: still waiting to place %s", what)


class WorkerGroup:
    """A started group of rank actors. Create with :meth:`start`; always :meth:`shutdown`."""

    def __init__(self, run: str, pg: PlacementGroup) -> None:
        self.run = run
        self.pg = pg
        self.actors: list[Any] = []
        self.node_infos: list[dict[str, Any]] = []

    @classmethod
    def start(
        cls,
        *,
        spec: RunSpec,
        decision: ScalingDecision,
        per_rank_datasets: Callable[[list[str]], list[dict[str, Any]]],
    ) -> WorkerGroup:
        """Reserve, create, rendezvous, start the loop. On any error the partial group is torn down."""
        bundles = [dict(decision.resources_per_worker) for _ in range(decision.num_workers)]
        pg = placement_group(bundles, strategy=spec.placement_strategy, name=placement_group_name(spec.name))
        group = cls(spec.name, pg)
        try:
            _wait_for_placement(pg, bundles, spec.placement_strategy, spec.placement_timeout_s)
            table = placement_group_table(pg)
            bundle_nodes = [table["bundles_to_node_id"][b] for b in range(len(bundles))]
            order, infos = rank_layout(bundle_nodes)
            group._create_actors(order, infos, decision.resources_per_worker, spec.use_gpu)
            group.node_infos = group._get([a.node_info.remote() for a in group.actors], "node_info")
            addr, port = group._get([group.actors[0].rendezvous_address.remote()], "rendezvous")[0]
            shards = per_rank_datasets([info["node_id"] for info in group.node_infos])
            spec_ref = ray.put(spec)  # one copy of the loop and its config for every rank
            group._get(
                [a.setup.remote(addr, port, spec_ref, shards[r]) for r, a in enumerate(group.actors)],
                "setup (torch.distributed rendezvous)",
            )
            group._get([a.start.remote() for a in group.actors], "start")
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
        """ray.get of one call per rank with the group's timeout, naming the rank that failed."""
        deadline = time.monotonic() + ACTOR_CALL_TIMEOUT_S
        out = []
        for rank, ref in enumerate(refs):
            try:
                out.append(ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0)))
            except GetTimeoutError as e:
                raise WorkerGroupStartError(
                    what, f"{what} did not finish in {ACTOR_CALL_TIMEOUT_S:.0f}s on rank {rank}", rank
                ) from e
            except Exception as e:  # the call raised, or the actor died
                raise WorkerGroupStartError(what, f"{what} failed on rank {rank}: {type(e).__name__}: {e}", rank) from e
        return out

    # ------------------------------------------------------------------ running
    def poll(self, timeout_s: float = 30.0) -> PollStatus:
        """Reports (from rank 0), per-rank done flags, and failures (loop errors or dead actors)."""
        status = PollStatus()
        refs = [a.poll.remote() for a in self.actors]
        for rank, ref in enumerate(refs):
            try:
                out = ray.get(ref, timeout=timeout_s)
            except RayActorError as e:
                status.done.append(True)
                status.failures.append(
                    WorkerFailure(rank, "the rank's actor process died", str(e), actor_died=True)
                )
                continue
            except GetTimeoutError:
                status.done.append(False)  # busy (e.g. holding the GIL); asked again next poll
                continue
            if rank == 0:
                status.reports.extend(out["reports"])
            status.done.append(out["done"])
            if out["failure"] is not None:
                status.failures.append(out["failure"])
        return status

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
