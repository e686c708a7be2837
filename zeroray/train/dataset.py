"""Ray Datasets passed as ``datasets={...}``: one :class:`DataShard` per rank and group start, resumable.

Ray 2.60 has no resumable streaming split: ``DataIterator`` keeps no position, and Ray Data's own checkpointing
(``DataContext.checkpoint_config``) filters rows a *write* already committed, for batch pipelines, not rows a
trainer consumed. So zeroray counts the rows itself, globally: one global batch (micro x world x accumulation)
per optimizer step (:mod:`zeroray.train.data_position`), saved with every checkpoint and snapshot, and a
resumed or resized run skips the rows already consumed in the current epoch. How exact that is depends on
the dataset's execution order:

* **Exact** (``ds.context.execution_options.preserve_order = True``): every rank streams the whole dataset in
  its deterministic order and keeps its own rows of each global batch, by global row index (as
  ``zt.DistributedSampler``); a resumed or resized run sees the same rows in the same optimizer steps. Each
  rank reads the whole stream (world-size times the reads): fine for data that is small or materialized in
  the object store, costly for a large read-and-transform pipeline.
* **Streaming** (the default, as Ray Train): ``Dataset.streaming_split(n, equal=True)``, each rank reads only
  its part, but the split hands blocks to whichever rank asks, so which rows a rank gets is not reproducible.
  A resume skips ``consumed / world`` rows of each rank's split: the right number of rows, not the same rows
  (some rows of that epoch are seen twice, others never); a warning says so at resume.

Driver side: :func:`split_datasets`; worker side: ``get_dataset_shard(name)``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)


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
) -> list[dict[str, DataShard]]:
    """One ``{name: DataShard}`` per rank: the dataset itself where its order is preserved (exact), else
    this rank's part of ``streaming_split(n, equal=True)`` (every rank the same number of rows, up to
    ``n - 1`` trailing rows dropped, which keeps ZeRO's collectives in step)."""
    per_rank: list[dict[str, DataShard]] = [{} for _ in range(num_shards)]
    for name, ds in datasets.items():
        if ds.context.execution_options.preserve_order:
            for rank in range(num_shards):
                per_rank[rank][name] = DataShard(name, ds, None)
            continue
        its = ds.streaming_split(num_shards, equal=True, locality_hints=locality_hints)
        for rank, it in enumerate(its):
            per_rank[rank][name] = DataShard(name, None, it)
    return per_rank


class DataShard:
    """What ``zt.get_dataset_shard(name)`` returns: ``iter_batches(...)`` / ``iter_torch_batches(...)`` yield
    this rank's micro-batches (``train_micro_batch_size_per_gpu`` rows) for the rest of the current epoch, from
    where the run is; the next call starts the next epoch. Other ``ray.data.DataIterator`` methods (``iter_rows``,
    ``stats``, ...) go to the rank's streaming split, unread by the position (streaming datasets only)."""

    def __init__(self, name: str, dataset: Any | None, split: Any | None) -> None:
        self.name, self.dataset, self.split = name, dataset, split
        self.exact = dataset is not None
        self._engine: Callable[[], Any] | None = None
        self.position: Any = None

    def bind(self) -> None:
        """In the rank (``zt.get_dataset_shard``): save the position with the run's checkpoints."""
        if self.position is None:
            from zeroray.train.data_position import DataPosition, bind

            what = f"zt.get_dataset_shard({self.name!r})"
            self.position = DataPosition(what, lambda: (0, 0))
            self._engine = bind(f"dataset:{self.name}", self.position, what)

    def iter_batches(self, **kwargs: Any) -> Iterator[Any]:
        """This rank's micro-batches, as ``DataIterator.iter_batches`` gives them (its other arguments pass
        through; ``batch_size`` and ``drop_last`` are set here)."""
        return self._iter("iter_batches", kwargs)

    def iter_torch_batches(self, **kwargs: Any) -> Iterator[Any]:
        """As :meth:`iter_batches`, as torch tensors (``DataIterator.iter_torch_batches``)."""
        return self._iter("iter_torch_batches", kwargs)

    def __getattr__(self, attr: str) -> Any:
        split = self.__dict__.get("split")
        if split is None:
            raise AttributeError(f"zt.get_dataset_shard({self.__dict__.get('name')!r}) of an order-preserving dataset "
                                 f"has iter_batches and iter_torch_batches only, not {attr!r}")
        return getattr(split, attr)

    def _iter(self, method: str, kwargs: dict[str, Any]) -> Iterator[Any]:
        from zeroray.train.data_position import step_batch

        what = f"zt.get_dataset_shard({self.name!r}).{method}"
        for key in ("batch_size", "drop_last"):
            if key in kwargs:
                raise ValueError(f"{what}: {key} is set by zeroray (the micro batch, whole steps only); leave it out")
        if self.exact and kwargs.get("local_shuffle_buffer_size") and kwargs.get("local_shuffle_seed") is None:
            raise ValueError(f"{what}: a local shuffle without local_shuffle_seed has no reproducible order; give "
                             "local_shuffle_seed (an order-preserving dataset is resumed exactly)")
        engine = self._engine()
        b, m, accumulation = step_batch(engine, what)
        world, rank = engine.world_size, engine.rank
        epoch, index = self.position.start(engine.global_step, b)
        per_step = world * accumulation  # micro-batches of one global batch
        if self.exact:
            source = getattr(self.dataset, method)(batch_size=m, drop_last=True, **kwargs)
            skip = index // m  # the global stream's micro-batches consumed this epoch
        else:
            source = getattr(self.split, method)(batch_size=m, drop_last=True, **kwargs)
            skip = index // world // m
            if skip and rank == 0:
                logger.warning(
                    "zeroray: dataset %r resumes epoch %d at global row %d by skipping %d rows of each rank's "
                    "streaming split; the split hands blocks to ranks as they ask, so these are not exactly the rows "
                    "consumed before (some rows of this epoch may be seen twice, others not at all). For an exact "
                    "resume set ds.context.execution_options.preserve_order = True (each rank then reads the whole "
                    "stream)", self.name, epoch, index, skip * m)
        mine: list[Any] = []
        for j, batch in enumerate(source):
            if j < skip:
                continue
            at = (j - skip) % per_step if self.exact else (j - skip) % accumulation
            if not self.exact or at // accumulation == rank:
                mine.append(batch)
            if at == (per_step if self.exact else accumulation) - 1:  # a whole step: hand this rank's part out
                yield from mine
                mine = []
        self.position.end_epoch(engine.global_step)  # ran out (a loop that breaks early does not get here)


def get_dataset_shard(name: str) -> DataShard:
    """This rank's part of ``datasets[name]``, resumable (see :class:`DataShard`); its position is saved with
    the run's checkpoints and snapshots and restored by ``zt.prepare`` (runs in the rank: imported here, the
    driver's imports stay free of the loop's code)."""
    from zeroray.train.worker.context import get_session

    session = get_session("get_dataset_shard()")
    if name not in session.dataset_shards:
        have = sorted(session.dataset_shards) or "none"
        raise KeyError(f"zt.get_dataset_shard({name!r}): no such dataset was passed to ZeroTrainer (have: {have})")
    shard = session.dataset_shards[name]
    shard.bind()
    return shard
