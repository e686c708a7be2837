"""Ray metrics exported by each rank actor, so the Ray dashboard / Prometheus / Grafana show the run.

Ray names them ``ray_zeroray_*`` on its Prometheus endpoint; tags ``run`` and ``rank`` tell the ranks
apart, ``category`` the engine's memory categories (params, grads, optimizer, ...).
"""

from __future__ import annotations

from typing import Any

from zeroray.train.callbacks import ReportCallback
from zeroray.train.report import RankStats
from zeroray.train.reporting import finite_or_none


class RankMetrics(ReportCallback):
    """Gauges and counters for one rank, updated on every ``zt.report`` (a callback of the rank's
    reports: each rank exports its own values from its own process)."""

    def __init__(self, run: str, rank: int) -> None:
        from ray.util.metrics import Counter, Gauge

        tags = ("run", "rank")
        self._tags = {"run": run, "rank": str(rank)}
        self.step = Gauge("zeroray_step", "Optimizer steps taken (engine.global_step, else reports)", tags)
        self.loss = Gauge("zeroray_loss", "Last loss this rank reported (metrics['loss'])", tags)
        self.step_time = Gauge("zeroray_step_time_seconds", "Wall time per optimizer step", tags)
        self.memory = Gauge("zeroray_memory_bytes", "Rank memory by category", (*tags, "category"))
        self.reports = Counter("zeroray_reports_total", "zt.report calls", tags)

    def after_report(self, metrics: dict[str, Any], stats: RankStats, num_reports: int) -> None:
        """Push one report's values; never raises into the user's loop."""
        try:
            step = stats.global_step
            self.step.set(float(step if step is not None else num_reports), self._tags)
            loss = finite_or_none(metrics.get("loss"))
            if loss is not None:
                self.loss.set(loss, self._tags)
            if stats.step_time_s is not None:
                self.step_time.set(float(stats.step_time_s), self._tags)
            for category, nbytes in stats.memory.items():
                self.memory.set(float(nbytes), {**self._tags, "category": category})
            self.reports.inc(1.0, self._tags)
        except Exception:  # metrics are best effort; training goes on
            pass
