"""What a preemption notice says, in Ray Train V2's shape (``ray.train.v2.api.preemption.PreemptionInfo``).

The driver builds one from Ray's drain notices (driver/drain_watcher.py) and from the SIGTERMs its ranks
report (worker/preemption.py), hands it to every rank, and ``zt.get_preemption_info()`` returns it in the loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class PreemptionInfo:
    """An imminent preemption of some of the group's nodes or ranks.

    ``deadline_ms``: the earliest deadline (UNIX time in milliseconds) across the preempted nodes, None when
    none was given; ``preempted_node_to_ranks``: each preempted Ray node id (hex) and the group's world ranks
    that leave with it. A SIGTERM to one rank's process names that rank only, on its node."""

    deadline_ms: int | None
    preempted_node_to_ranks: dict[str, list[int]]

    @property
    def preempted_node_ids(self) -> list[str]:
        """Preempted node ids, sorted."""
        return sorted(self.preempted_node_to_ranks)

    @property
    def preempted_ranks(self) -> list[int]:
        """Every rank that leaves, sorted."""
        return sorted({r for ranks in self.preempted_node_to_ranks.values() for r in ranks})

    def remaining_s(self, now: float | None = None) -> float | None:
        """Seconds left until the deadline (negative once it passed); None without a deadline."""
        if self.deadline_ms is None:
            return None
        return self.deadline_ms / 1000.0 - (time.time() if now is None else now)


def merge(*infos: PreemptionInfo | None) -> PreemptionInfo | None:
    """One notice for several (the union of their ranks, the earliest deadline); None when all are None."""
    present = [i for i in infos if i is not None]
    if not present:
        return None
    by_node: dict[str, set[int]] = {}
    for info in present:
        for node, ranks in info.preempted_node_to_ranks.items():
            by_node.setdefault(node, set()).update(ranks)
    deadlines = [i.deadline_ms for i in present if i.deadline_ms is not None]
    return PreemptionInfo(min(deadlines, default=None), {n: sorted(r) for n, r in sorted(by_node.items())})


@dataclass(frozen=True)
class RecoveryChoice:
    """The recovery point the ranks took on a notice, and why (the driver logs it; ``Attempt.message`` keeps it).

    ``kind``: "replica" (hybrid sharding: the live state of the ranks that stay holds every shard, nothing
    written), "snapshot" (in-memory, to buddies on nodes that stay), "checkpoint" (to storage) or "none" (the
    deadline left too little time for either: the next group resumes from the newest earlier one, as after a
    crash); a planned resize's is "replica" or "checkpoint", with no deadline and no estimates; ``step``: the engine's global step then (None: no engine); ``remaining_s``: seconds to the deadline at
    that step boundary (None: no deadline); ``needed_s``: the estimated seconds of each kind that was possible,
    ``how``: how each was estimated ("measured", "already taken at this step", "estimated from N MB",
    "kept in memory": the replicas' copies, taken before the choice);
    ``unavailable``: why a kind could not serve; ``took_s``: what the chosen one took."""

    kind: str
    step: int | None
    remaining_s: float | None
    needed_s: dict[str, float]
    how: dict[str, str]
    unavailable: dict[str, str]
    took_s: float = 0.0

    def explain(self) -> str:
        """One line: the time left, each kind's estimate or why it could not serve."""
        left = "no deadline" if self.remaining_s is None else f"{self.remaining_s:.1f}s left to the deadline"
        parts = [f"a {k} needs about {self.needed_s[k]:.2f}s ({self.how[k]})" for k in self.needed_s]
        parts += [f"no {k}: {why}" for k, why in self.unavailable.items()]
        return f"{left}; " + "; ".join(parts)
