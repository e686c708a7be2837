"""Where a run is in its data, counted in global samples: the state that ``zt.DistributedSampler`` and
``zt.get_dataset_shard`` save with every checkpoint and snapshot (``ZeroEngine.register_stateful``).

The position moves with the optimizer steps, not with what a loader has fetched: every optimizer step takes
one global batch ``B`` (micro x world x accumulation) of the current epoch. So it is the same on every rank,
a loader that prefetches does not move it, and a save between two steps records exactly the samples the
saved weights were trained on. It is kept as an *anchor* (``epoch``, ``index``: the samples of that epoch
consumed, at optimizer step ``step``) from which any later step's position follows; a new epoch, or a group
with another global batch (``ScalingConfig.elastic_batch="micro"``), sets a new anchor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_KEYS = ("epoch", "index", "step", "num_samples", "seed", "shuffle")


class DataPosition:
    """The (epoch, global samples consumed) of one data source. ``clock()`` gives the engine's (global
    step, global batch) now; ``num_samples``: the samples per epoch when known (a map-style dataset's
    length; None for a stream, whose end is seen when it runs out). ``seed``/``shuffle``: the order's, saved
    so that a resume with another order is refused rather than silently mixed."""

    def __init__(self, what: str, clock: Callable[[], tuple[int, int]], num_samples: int | None = None,
                 seed: int | None = None, shuffle: bool | None = None) -> None:
        self.what, self.clock = what, clock
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self.epoch, self.index, self.step = 0, 0, 0

    def at(self, step: int, global_batch: int) -> tuple[int, int]:
        """(epoch, samples of it consumed) at optimizer step ``step``. A loop re-anchors at every epoch
        (:meth:`start`), so steps past the anchor's epoch only come from a run resumed without a saved position
        (an older checkpoint): with a known epoch length they are counted into the epochs that follow."""
        k, spe = step - self.step, (self.num_samples or 0) // global_batch
        left = (self.num_samples - self.index) // global_batch if self.num_samples is not None else k
        if k <= left or spe == 0:
            return self.epoch, self.index + k * global_batch
        done, at = divmod(k - left, spe)
        return self.epoch + 1 + done, at * global_batch

    def start(self, step: int, global_batch: int) -> tuple[int, int]:
        """Where an iteration that begins at ``step`` starts: the next epoch once fewer than a global batch
        of this one is left (the tail is dropped, as ``drop_last``). Re-anchors there."""
        epoch, index = self.at(step, global_batch)
        if self.num_samples is not None and index + global_batch > self.num_samples:
            epoch, index = epoch + 1, 0
        self.epoch, self.index, self.step = epoch, index, step
        return epoch, index

    def end_epoch(self, step: int) -> None:
        """A stream ran out at ``step``: the next iteration starts the next epoch."""
        self.epoch, self.index, self.step = self.epoch + 1, 0, step

    def state_dict(self) -> dict[str, Any]:
        step, global_batch = self.clock()
        epoch, index = self.at(step, global_batch)
        return {"epoch": epoch, "index": index, "step": step, "num_samples": self.num_samples,
                "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Checked before anything is set: a bad state raises ValueError in one line naming the field."""
        where = f"the saved position of {self.what}"
        if not isinstance(state, dict) or sorted(state) != sorted(_KEYS):
            raise ValueError(f"{where} is not valid: expected the fields {list(_KEYS)}, got "
                             f"{sorted(state) if isinstance(state, dict) else type(state).__name__}")
        for key in ("epoch", "index", "step"):
            v = state[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{where} is not valid: {key} is {v!r}, not an integer >= 0")
        for key, mine in (("num_samples", self.num_samples), ("seed", self.seed), ("shuffle", self.shuffle)):
            if state[key] != mine:
                raise ValueError(f"{where} was saved with {key}={state[key]!r}, but this one has {key}={mine!r}: "
                                 "resuming would not continue the same order (start a new run name to change it)")
        if self.num_samples is not None and state["index"] > self.num_samples:
            raise ValueError(f"{where} is not valid: index {state['index']} is past the epoch's "
                             f"{self.num_samples} samples")
        self.epoch, self.index, self.step = state["epoch"], state["index"], state["step"]


def step_batch(engine: Any, what: str) -> tuple[int, int, int]:
    """(global batch, micro batch, accumulation) of ``engine``'s config, or a clear error when it has none."""
    c = engine.config
    if c.train_batch_size is None or c.train_micro_batch_size_per_gpu is None:
        raise RuntimeError(f"{what} hands out one global batch per optimizer step and needs the batch sizes: set "
                           "train_batch_size and/or train_micro_batch_size_per_gpu in the ZeroConfig")
    return c.train_batch_size, c.train_micro_batch_size_per_gpu, engine.gradient_accumulation_steps


def bind(name: str, position: DataPosition, what: str) -> Callable[[], Any]:
    """In a rank: save ``position`` under ``name`` with the run's checkpoints and snapshots (now, or when
    ``zt.prepare`` builds the engine; restored with them), and return the function that gives the engine
    (an error naming ``what`` before ``zt.prepare``)."""
    from zeroray.train.worker.context import get_session

    session = get_session(what)
    session.register_stateful(name, position)

    def engine() -> Any:
        if session.engine is None:
            raise RuntimeError(f"iterate {what} after zt.prepare(...): it follows the engine's optimizer steps")
        return session.engine

    position.clock = lambda: (engine().global_step, step_batch(engine(), what)[0])
    return engine
