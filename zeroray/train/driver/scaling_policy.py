"""Scaling policy: how many ranks the next group gets, with what batch arithmetic, and when to resize.

(Elastic sizing only; the fp16 loss scale is the engine's loss scaler, ``zeroray/engine/loss_scaler.py``.)

``FixedScalingPolicy`` always answers ``num_workers``. ``ElasticScalingPolicy`` (``num_workers=(min,
max)``, after Ray Train V2's) counts the workers the cluster's live nodes can hold, takes the largest
*feasible* size (one the batch rule allows, :class:`BatchPlan`) between min and max (a draining node, one
with a preemption notice, counts for nothing), and while the
group runs asks again every ``elastic_resize_monitor_interval_s``: the controller resizes when the
answer differs. A failed group is restarted at whatever is there now (shrinking instead of waiting
for a lost node), a grown cluster is used at the next check.

A new policy is a :class:`ScalingPolicy` subclass (the two ``decide_*`` methods; ``elastic = True`` when
its sizes may change while the run goes on) and one line in :func:`make_scaling_policy`.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection

from zeroray.train.config import ScalingConfig
from zeroray.train.driver.drain_watcher import draining_nodes
from zeroray.train.sizing import BatchPlan, ScalingDecision

logger = logging.getLogger(__name__)


class ScalingPolicy(ABC):
    """Base: decisions for a group about to start and for a running one. ``plan``: the batch arithmetic a
    size gets (``BatchPlan("none")``: the ranks keep the config as given). ``elastic``: the policy answers
    sizes between ``min_workers`` and ``max_workers``, so a group that cannot be placed soon is retried at
    what is free (its decisions say ``ScalingDecision.elastic``: a placement group per rank, recovery points)."""

    elastic: bool = False

    def __init__(self, scaling_config: ScalingConfig, plan: BatchPlan | None = None) -> None:
        self.scaling_config = scaling_config
        self.plan = plan if plan is not None else BatchPlan("none")
        self.lost_nodes: set[str] = set()  # nodes found gone before Ray reported them dead (exclude_nodes)

    def exclude_nodes(self, node_ids: Collection[str]) -> None:
        """Count ``node_ids`` for nothing from now on: the controller found them gone (their raylet refuses
        connections, group/liveness.py) while Ray may still list them alive until its health check says so. A
        node that comes back joins as a new node id."""
        self.lost_nodes |= set(node_ids)

    @abstractmethod
    def decide_for_new_group(self, settled: bool = False, held: int = 0) -> ScalingDecision:
        """How many ranks, with what resources, the next group starts with. ``settled``: a group of the last
        answer could not be placed, so count what is free now rather than what the nodes hold, plus ``held``
        workers whose bundles the kept ranks of the last group still hold."""

    def decide_while_running(self, num_workers: int) -> ScalingDecision | None:
        """None = keep the group as it is."""
        return None


class FixedScalingPolicy(ScalingPolicy):
    """Always ``num_workers`` ranks; never resizes."""

    def decide_for_new_group(self, settled: bool = False, held: int = 0) -> ScalingDecision:
        return ScalingDecision(self.scaling_config.num_workers, self.scaling_config.worker_resources)


def fitting_workers(per_node: dict[str, dict[str, float]], per_worker: dict[str, float]) -> int:
    """How many bundles of ``per_worker`` the nodes' resources hold (whole bundles per node). Pure."""
    needed = {k: v for k, v in per_worker.items() if v > 0}
    if not needed:
        return 1 << 30
    return sum(int(min(res.get(k, 0.0) / v + 1e-9 for k, v in needed.items())) for res in per_node.values())


def _total_per_node(lost: Collection[str] = ()) -> dict[str, dict[str, float]]:
    """The live nodes' resources; a draining node (a preemption notice) and a ``lost`` one hold nothing for a
    group."""
    from ray._private import state

    try:
        draining = draining_nodes()
    except Exception as e:  # the GCS call failed: count every live node, as before drains were known
        logger.warning("zeroray: could not read Ray's draining nodes: %s: %s", type(e).__name__, e)
        draining = {}
    return {n: r for n, r in state.total_resources_per_node().items() if n not in draining and n not in lost}


def _available_per_node(lost: Collection[str] = ()) -> dict[str, dict[str, float]]:
    from ray._private import state

    alive = set(_total_per_node(lost))
    return {n: r for n, r in state.available_resources_per_node().items() if n in alive}


class ElasticScalingPolicy(ScalingPolicy):
    """Between ``min_workers`` and ``max_workers``: the largest feasible size the live nodes hold."""

    elastic = True

    def __init__(self, scaling_config: ScalingConfig, plan: BatchPlan | None = None) -> None:
        super().__init__(scaling_config, plan)
        self._last_check = time.monotonic()

    def largest_feasible(self, available: int) -> int | None:
        """The largest size the batch rule allows in [min, min(max, available)], or None."""
        sc = self.scaling_config
        for w in range(min(sc.max_workers, available), sc.min_workers - 1, -1):
            if self.plan.feasible(w):
                return w
        return None

    def decision(self, num_workers: int) -> ScalingDecision:
        return ScalingDecision(num_workers, self.scaling_config.worker_resources, self.plan.for_world(num_workers),
                               elastic=True)

    def decide_for_new_group(self, settled: bool = False, held: int = 0) -> ScalingDecision:
        """Live nodes' capacity (``settled``: what is free now, plus the ``held`` workers). Fewer than min: ask
        for min, and the group waits in placement (bounded by ``placement_timeout_s``)."""
        per_node = _available_per_node(self.lost_nodes) if settled else _total_per_node(self.lost_nodes)
        count = fitting_workers(per_node, self.scaling_config.worker_resources) + (held if settled else 0)
        size = self.largest_feasible(count)
        self._last_check = time.monotonic()
        if size is None:
            logger.warning("zeroray: the cluster holds %d worker(s), fewer than min_workers=%d: waiting for resources",
                           count, self.scaling_config.min_workers)
            size = next(w for w in range(self.scaling_config.min_workers, self.scaling_config.max_workers + 1)
                        if self.plan.feasible(w))
        return self.decision(size)

    def decide_while_running(self, num_workers: int) -> ScalingDecision | None:
        """Every ``elastic_resize_monitor_interval_s``: the group's own workers plus what the free resources
        hold; a different feasible size is a resize."""
        now = time.monotonic()
        if now - self._last_check < self.scaling_config.elastic_resize_monitor_interval_s:
            return None
        self._last_check = now
        count = num_workers + fitting_workers(_available_per_node(self.lost_nodes), self.scaling_config.worker_resources)
        size = self.largest_feasible(count)
        if size is None or size == num_workers:
            return None
        logger.warning("zeroray: resources for %d worker(s) now: resizing the group from %d to %d", count,
                       num_workers, size)
        return self.decision(size)


# Which policy a ScalingConfig gets: the first whose test holds. A new policy is a subclass and one line here.
SCALING_POLICIES: tuple[tuple[Callable[[ScalingConfig], bool], type[ScalingPolicy]], ...] = (
    (lambda sc: sc.elasticity_enabled, ElasticScalingPolicy),  # num_workers=(min, max)
    (lambda sc: True, FixedScalingPolicy),
)


def make_scaling_policy(scaling_config: ScalingConfig, plan: BatchPlan | None = None) -> ScalingPolicy:
    """The policy ``scaling_config`` asks for (:data:`SCALING_POLICIES`), with the run's batch plan."""
    policy = next(cls for applies, cls in SCALING_POLICIES if applies(scaling_config))
    return policy(scaling_config, plan)
