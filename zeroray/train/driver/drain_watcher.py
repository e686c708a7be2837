"""The driver's watch on Ray's drain notices for the nodes that hold the group's ranks.

Ray 2.60 delivers a node's coming end as a *drain*: the cloud's preemption notice reaches the autoscaler
(v2), which calls the GCS's ``DrainNode`` with reason ``DRAIN_NODE_REASON_PREEMPTION`` and a deadline; so do
``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N`` and a raylet that got
SIGTERM (a Kubernetes pod being deleted). The GCS lists draining nodes with their deadlines
(``ray._private.state.state.get_draining_nodes()``: node id -> deadline in ms, 0 = none), which is what Ray
Train V2's ``PreemptionWatcher`` polls too; Ray schedules nothing new on a draining node.

:class:`DrainWatcher` polls that list at most every ``interval_s`` from the controller's loop and turns a
drain that is new for a node holding ranks into a :class:`~zeroray.train.preemption.PreemptionInfo`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from zeroray.train.preemption import PreemptionInfo

logger = logging.getLogger(__name__)

DRAIN_POLL_INTERVAL_S = 1.0  # one GCS call a second: a notice is seen within about a second


def draining_nodes() -> dict[str, int]:
    """Ray's draining nodes: hex node id -> deadline in ms since the epoch (0 = no deadline)."""
    from ray._private import state

    return dict(state.state.get_draining_nodes() or {})


class DrainWatcher:
    """Turns Ray's drains of the group's nodes into notices, each drain once (a changed deadline is new)."""

    def __init__(self, interval_s: float = DRAIN_POLL_INTERVAL_S,
                 source: Callable[[], dict[str, int]] = draining_nodes) -> None:
        self.interval_s, self.source = interval_s, source
        self.draining: dict[str, int] = {}  # the last answer: what Ray drains now
        self._noticed: dict[str, int] = {}  # node -> deadline of the drain already handed out
        self._last_poll = float("-inf")

    def poll(self, node_to_ranks: dict[str, list[int]]) -> PreemptionInfo | None:
        """A notice for the drains of ``node_to_ranks``' nodes not handed out before; None when there is none or
        the last poll is younger than ``interval_s``. A failing GCS call is logged, never raised."""
        now = time.monotonic()
        if now - self._last_poll < self.interval_s:
            return None
        self._last_poll = now
        try:
            self.draining = self.source()
        except Exception as e:
            logger.warning("zeroray: could not read Ray's draining nodes: %s: %s", type(e).__name__, e)
            return None
        new = {n: d for n, d in self.draining.items() if n in node_to_ranks and self._noticed.get(n) != d}
        if not new:
            return None
        self._noticed.update(new)
        deadlines = [d for d in new.values() if d]
        return PreemptionInfo(min(deadlines) if deadlines else None, {n: sorted(node_to_ranks[n]) for n in sorted(new)})

    def is_draining(self, node: str) -> bool:
        """Whether Ray drained ``node`` at the last poll."""
        return node in self.draining
