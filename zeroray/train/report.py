"""What one ``zt.report`` carries from the ranks to the driver: each rank's stats and rank 0's metrics.

Built in the ranks (reporting.py), queued by rank 0, polled by the driver and handed to the
controller's callbacks (history, progress, metrics.jsonl, run.json). ``Report.history_entry`` is the
one place that turns a report into a row of ``Result.metrics_history`` and ``metrics.jsonl``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RankStats:
    """One rank at one report: its engine step (None without ``zt.prepare``), the wall time per
    optimizer step since its previous report that took a step (None at the first, and in a report that
    took none: a final sample or evaluation is no step to time), its memory by category, the
    engine's mean seconds per step by phase (``engine.phase_report()``), its bytes moved per
    collective kind (``engine.comm_report()``) and to or from its offload tiers (an engine's
    ``offload_report()``, keyed ``"<tier>:<direction>"``, when it offloads); ``checkpoint_s`` / ``checkpoint_bytes``: how long
    this report's checkpoint save blocked the loop and the bytes of this rank's shard (None when
    the report saved none; the driver's copy never has them, the save comes after the exchange);
    ``snapshot_s`` / ``snapshot_bytes``: the same for this report's in-memory snapshot
    (``FailureConfig.snapshot_interval``), its copy to the buddy rank included; ``steps``: the optimizer
    steps the engine took since the previous report (since ``zt.prepare`` at the first; 0 for a report
    that is not a training step; None without an engine, where every report counts as one step)."""

    rank: int
    global_step: int | None
    step_time_s: float | None
    memory: dict[str, int] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    comm_bytes: dict[str, int] = field(default_factory=dict)
    offload_bytes: dict[str, int] = field(default_factory=dict)
    checkpoint_s: float | None = None
    checkpoint_bytes: int | None = None
    snapshot_s: float | None = None
    snapshot_bytes: int | None = None
    steps: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Report:
    """One report of the whole group: ``index`` counts this group's reports from 1, ``time`` is rank 0's
    wall clock, ``metrics`` are rank 0's, ``ranks`` every rank's stats in rank order."""

    index: int
    time: float
    metrics: dict[str, Any]
    ranks: tuple[RankStats, ...]

    @property
    def global_step(self) -> int | None:
        return self.ranks[0].global_step if self.ranks else None

    @property
    def is_step(self) -> bool:
        """Whether the group took an optimizer step since its previous report: a report after the
        loop (a text sample, a final evaluation) or of a resume with nothing left to train is not one,
        and must not be read as a step (its time, its throughput)."""
        return not self.ranks or self.ranks[0].steps != 0

    @property
    def slowest_step_time_s(self) -> float | None:
        times = [r.step_time_s for r in self.ranks if r.step_time_s is not None]
        return max(times) if times else None

    def history_entry(self, started_at: float, attempt: int) -> dict[str, Any]:
        """The row of the metrics history: the user's metrics plus zeroray's ``_``-prefixed fields
        (``_steps``: rank 0's optimizer steps since the previous report, 0 in a report that is no step)."""
        return {
            **self.metrics,
            "_report": self.index,
            "_global_step": self.global_step,
            "_steps": self.ranks[0].steps if self.ranks else None,
            "_time_s": self.time - started_at,
            "_step_time_s": self.slowest_step_time_s,
            "_attempt": attempt,
            "_ranks": [r.as_dict() for r in self.ranks],
        }


def finite_or_none(value: Any) -> float | None:
    """A float metric for gauges and the progress bar, or None when not a finite number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    v = float(value)
    return v if math.isfinite(v) else None
