"""Result: what ``ZeroTrainer.fit()`` returns (the names follow Ray Train's Result)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import zeroray.checkpoint as zc
from zeroray.train.report import RankStats


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint of the run, as ``Result.checkpoint`` (like ``ray.train.Checkpoint``).

    ``path``: the checkpoint directory's URL on ``RunConfig.storage_path``; pass it, with
    ``RunConfig.storage_options``, to ``zeroray.checkpoint.load`` / ``export`` /
    ``CheckpointReader(...).verify``.
    ``step``: the engine's ``global_step`` when it was saved.
    """

    path: str
    step: int


def latest_checkpoint(run_url: str, storage_options: dict[str, Any] | None = None) -> Checkpoint | None:
    """Driver side: the run's newest valid committed checkpoint on storage, or None."""
    info = zc.latest_valid(run_url, storage_options)
    return Checkpoint(info.url, info.step) if info is not None else None


@dataclass
class Attempt:
    """One group of the run, from its start to its end (``Result.attempt_history``, ``run.json``).

    ``world_size``: its ranks; ``start_step``: the global step it resumed from (the newest committed
    checkpoint when it started; 0 = from scratch); ``last_step``: the global step of its last report
    (None: it reported nothing); ``end``: "finished", "failure", "resize_up", "resize_down",
    "preempted" (a preemption notice; ``node``: the preempted node, ``message``: the recovery point taken and
    why), "aborted" or "errored" (the driver's own error), None while it runs; ``rank`` / ``node``: the rank
    that failed first-hand and its Ray node id (failures only); ``steps_lost``: the steps the next
    attempt redid (``last_step`` - the next ``start_step``; 0 for a planned resize). Times are
    ``time.time()``: ``ended_at`` is when the driver noticed the end.

    ``recovered_from``: where the group's state came from, "memory" (the ranks' in-memory snapshots,
    ``FailureConfig.snapshot_interval``), "replica" (hybrid sharding: the live state of the replicas that
    survived a failure, or that stayed at a resize's or a preemption's recovery point,
    ``FailureConfig.replica_recovery``), "storage" (a committed checkpoint) or None (from scratch).

    ``epoch``: the fencing epoch the driver gave the group (increasing over the run's life, across fits): its
    saves carry it, and a rank of an older epoch commits nothing once it began.

    ``kept_ranks``: ranks whose actor (process, imports, bundle) came from the previous attempt; the others
    were started for it. ``phases``: seconds of its start, in order: ``prestart`` (a grow only: starting
    the added ranks while the previous group still trained, not counted against training), ``teardown`` (ending the previous
    group: killing its failed ranks, releasing the others), ``placement`` (the new ranks' bundles),
    ``actors`` (the new ranks' processes: start and imports), ``rendezvous`` (torch.distributed set-up
    on every rank), then on rank 0 ``build`` (the loop's start to ``zt.prepare`` having the engine: model
    and engine built), ``load`` (reading the checkpoint) and ``first_step`` (to the first report).
    """

    index: int
    world_size: int
    start_step: int
    started_at: float
    last_step: int | None = None
    end: str | None = None
    rank: int | None = None
    node: str | None = None
    message: str | None = None
    ended_at: float | None = None
    steps_lost: int | None = None
    kept_ranks: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    recovered_from: str | None = None
    epoch: int | None = None  # its fencing epoch: what its checkpoints carry (zeroray/checkpoint/fence.py)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Result:
    """``metrics``: rank 0's last report; ``metrics_history``: every report in order, each with
    ``_report``, ``_time_s`` and ``_ranks`` (per-rank step time and memory); ``path``: the run's
    directory URL; ``checkpoint``: the run's newest committed checkpoint on storage, a
    ``zeroray.train.Checkpoint`` (``.path`` URL, ``.step``), or None; ``error``: the
    TrainingFailedError when the run failed; ``attempts``: how many groups ran; ``attempt_history``:
    each group's :class:`Attempt` (size, steps, why it ended)."""

    metrics: dict[str, Any] | None
    metrics_history: list[dict[str, Any]]
    path: str
    checkpoint: Checkpoint | None = None
    error: BaseException | None = None
    attempts: int = 1
    attempt_history: list[Attempt] = field(default_factory=list)

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
