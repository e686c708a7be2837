"""``zt.DistributedSampler``: a map-style dataset's samples by global sample index, resumable at any world size.

Each epoch has one order of the dataset, a seeded permutation (``seed + epoch``, as torch's
``DistributedSampler``) or the identity. Optimizer step ``s`` of the epoch takes its samples
``[s*B, (s+1)*B)``, ``B`` the global batch (micro x world x accumulation, the engine's); rank ``r`` takes a
contiguous ``B / world`` of them, micro-batch by micro-batch (as ``TrainContext.sample_indices``). The last
``len(dataset) % B`` samples of each epoch's order are dropped, so every step has a whole global batch.
So a run resized with the global batch kept (``ScalingConfig.elastic_batch="global"``) takes the same
samples in the same optimizer steps as a fixed-size run.

The position (epoch, global samples consumed) follows the optimizer steps (:mod:`zeroray.train.data_position`)
and is saved with every checkpoint and in-memory snapshot or replica recovery point; ``zt.prepare`` restores it
with the engine, at any world size, so a loop needs no code of its own to resume its data.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from zeroray.train.data_position import DataPosition, bind, step_batch


class DistributedSampler(torch.utils.data.Sampler[int]):
    """This rank's sample indices of ``dataset`` (anything with ``__len__``) for the rest of the current epoch,
    from where the run is: ``DataLoader(dataset, batch_size=micro, sampler=zt.DistributedSampler(dataset))``
    gives this rank's micro-batches, one optimizer step's worth per ``gradient_accumulation_steps`` of them.
    Each ``iter()`` covers what is left of the current epoch; the next one starts the next epoch.

    Made in the train loop (before or after ``zt.prepare``); iterate it after ``zt.prepare``. ``name``: its key
    in the checkpoint (give two samplers of one loop different names; a new sampler of the same name replaces
    the old one). Resuming with another ``seed``, ``shuffle`` or dataset length is refused.
    """

    def __init__(self, dataset: Any, *, shuffle: bool = True, seed: int = 0, name: str = "train") -> None:
        if not hasattr(dataset, "__len__"):
            raise TypeError(f"zt.DistributedSampler needs a map-style dataset (with __len__), got {type(dataset).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"zt.DistributedSampler: seed must be an integer, got {seed!r}")
        self.num_samples = len(dataset)
        self.shuffle, self.seed = bool(shuffle), seed
        what = f"zt.DistributedSampler({name!r})"
        self.position = DataPosition(what, lambda: (0, 0), self.num_samples, seed, self.shuffle)
        self._engine = bind(f"sampler:{name}", self.position, what)
        self._what = what

    @property
    def epoch(self) -> int:
        """The epoch the run is in (the one the next ``iter()`` continues, unless it is used up)."""
        engine = self._engine()
        b = step_batch(engine, self._what)[0]
        epoch, index = self.position.at(engine.global_step, b)
        return epoch + (index + b > self.num_samples)

    def order(self, epoch: int) -> torch.Tensor:
        """The epoch's order of the dataset's indices (the same on every rank and at every world size)."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        return torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))

    def __iter__(self) -> Iterator[int]:
        engine = self._engine()
        b, m, accumulation = step_batch(engine, self._what)
        if b > self.num_samples:
            raise ValueError(f"{self._what}: the dataset has {self.num_samples} samples, fewer than one global "
                             f"batch of {b}")
        epoch, index = self.position.start(engine.global_step, b)
        first_micro = engine.micro_step % accumulation  # a loop that iterates again inside an accumulation
        yield from rank_indices(self.order(epoch), index, m, accumulation, engine.world_size, engine.rank, first_micro)

    def __len__(self) -> int:
        """The indices the next ``iter()`` yields on this rank."""
        engine = self._engine()
        b, m, accumulation = step_batch(engine, self._what)
        epoch, index = self.position.at(engine.global_step, b)
        if index + b > self.num_samples:
            index = 0
        return (self.num_samples - index) // b * m * accumulation - (engine.micro_step % accumulation) * m


def rank_indices(order: torch.Tensor, index: int, micro: int, accumulation: int, world: int, rank: int,
                 first_micro: int = 0) -> Iterator[int]:
    """``rank``'s indices of ``order`` from global sample ``index`` to the epoch's last whole global batch:
    per step ``[s*B, (s+1)*B)`` (``B = micro x accumulation x world``), its contiguous ``B / world``, micro-batch
    by micro-batch, from micro-batch ``first_micro`` of the first step."""
    b, per_rank = micro * accumulation * world, micro * accumulation
    for s in range((len(order) - index) // b):
        base = index + s * b + rank * per_rank
        for k in range(first_micro if s == 0 else 0, accumulation):
            yield from order[base + k * micro : base + (k + 1) * micro].tolist()
