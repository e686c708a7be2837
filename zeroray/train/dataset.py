"""Ray Datasets passed as ``datasets={...}``: split once per group start, one shard per rank.

Driver side: ``split_datasets`` uses ``Dataset.streaming_split(n, equal=True)`` as Ray Train does, so
data streams into the ranks without being materialized; with ``equal=True`` every rank sees the same
number of rows (up to ``n - 1`` trailing rows may be dropped), which keeps ZeRO's collectives in step.
Worker side: ``get_dataset_shard(name)`` returns this rank's ``DataIterator``.
"""

from __future__ import annotations

from typing import Any


def validate_datasets(datasets: Any) -> dict[str, Any]:
    """Check ``datasets`` in the driver before any actor starts."""
    if datasets is None:
        return {}
    if not isinstance(datasets, dict):
        raise TypeError(f"datasets must be a dict of name -> ray.data.Dataset, got {type(datasets).__name__}")
    from ray.data import Dataset

    for name, ds in datasets.items():
        if not isinstance(name, str):
            raise TypeError(f"datasets keys must be strings, got {name!r}")
        if not isinstance(ds, Dataset):
            raise TypeError(f"datasets[{name!r}] must be a ray.data.Dataset, got {type(ds).__name__}")
    return dict(datasets)


def split_datasets(
    datasets: dict[str, Any], num_shards: int, locality_hints: list[str] | None = None
) -> list[dict[str, Any]]:
    """One ``{name: DataIterator}`` per rank."""
    per_rank: list[dict[str, Any]] = [{} for _ in range(num_shards)]
    for name, ds in datasets.items():
        its = ds.streaming_split(num_shards, equal=True, locality_hints=locality_hints)
        for rank, it in enumerate(its):
            per_rank[rank][name] = it
    return per_rank


def get_dataset_shard(name: str) -> Any:
    """This rank's part of ``datasets[name]`` as a ``ray.data.DataIterator`` (runs in the rank: imported
    here, the driver's imports stay free of the loop's code)."""
    from zeroray.train.worker.context import get_session

    session = get_session("get_dataset_shard()")
    if name not in session.dataset_shards:
        have = sorted(session.dataset_shards) or "none"
        raise KeyError(f"zt.get_dataset_shard({name!r}): no such dataset was passed to ZeroTrainer (have: {have})")
    return session.dataset_shards[name]
