"""Result: what ``ZeroTrainer.fit()`` returns (the names follow Ray Train's Result)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zeroray.train.checkpoint_manager import Checkpoint
from zeroray.train.report import RankStats


@dataclass
class Result:
    """``metrics``: rank 0's last report; ``metrics_history``: every report in order, each with
    ``_report``, ``_time_s`` and ``_ranks`` (per-rank step time and memory); ``path``: the run's
    directory URL; ``checkpoint``: the run's newest committed checkpoint on storage, a
    ``zeroray.train.Checkpoint`` (``.path`` URL, ``.step``), or None; ``error``: the
    TrainingFailedError when the run failed."""

    metrics: dict[str, Any] | None
    metrics_history: list[dict[str, Any]]
    path: str
    checkpoint: Checkpoint | None = None
    error: BaseException | None = None
    attempts: int = 1

    @property
    def metrics_dataframe(self) -> Any:
        """The history as a pandas DataFrame; per-rank values become ``rank<i>/step_time_s`` and
        ``rank<i>/memory/<category>`` columns."""
        import pandas as pd

        rows = []
        for entry in self.metrics_history:
            row = {k: v for k, v in entry.items() if k != "_ranks"}
            for r in _rank_stats(entry):
                row[f"rank{r.rank}/step_time_s"] = r.step_time_s
                for cat, nbytes in r.memory.items():
                    row[f"rank{r.rank}/memory/{cat}"] = nbytes
            rows.append(row)
        return pd.DataFrame(rows)

    @property
    def memory_by_rank(self) -> dict[int, dict[str, int]]:
        """Each rank's memory by category at its last report."""
        if not self.metrics_history:
            return {}
        return {r.rank: dict(r.memory) for r in _rank_stats(self.metrics_history[-1])}


def _rank_stats(entry: dict[str, Any]) -> list[RankStats]:
    """The ranks' stats of one history row (stored as plain dicts, as in metrics.jsonl)."""
    return [RankStats(**r) for r in entry.get("_ranks", [])]
