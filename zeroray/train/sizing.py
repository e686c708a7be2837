"""The batch arithmetic of a group and the size it gets: what the driver's scaling policy decides
(:class:`ScalingDecision`, with its :class:`BatchSizes`, from the user's :class:`BatchPlan`) and what a
rank is told. Plain data, shared by the driver, the group and the rank."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zeroray.train.config import ScalingConfig


@dataclass(frozen=True)
class BatchSizes:
    """The batch arithmetic of one group: train = micro x accumulation x world."""

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int

    def as_zero_config(self) -> dict[str, int]:
        """The ZeroConfig fields (also the DeepSpeed JSON keys) these sizes set."""
        return {
            "train_batch_size": self.train_batch_size,
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
        }


@dataclass(frozen=True)
class BatchPlan:
    """What a resize keeps (``ScalingConfig.elastic_batch``), from the batch sizes the user gave.

    ``keep="global"``: ``train_batch_size`` stays and the accumulation (or, when no micro batch was
    given, the micro batch) is recomputed; only world sizes where that is exact are feasible.
    ``keep="micro"``: micro batch and accumulation stay, the global batch follows the world size.
    ``keep="none"``: no batch size was given (the loop batches as it likes) or the size is fixed:
    every size is feasible and the ranks get the config as it is.

    ``multiple_of``: an integer ``shard_group_size`` (or hpZ's ``hpz_partition_size``): only world sizes it
    divides are feasible, so a resize keeps whole shard groups (``"auto"`` follows the nodes by itself).
    """

    keep: str
    train_batch_size: int | None = None
    micro_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    multiple_of: int = 1

    @classmethod
    def from_config(cls, zero_config: Any, scaling: ScalingConfig) -> BatchPlan:
        """``zero_config``: the checked ZeroConfig (``load_config(..., defer=True)``). Raises ValueError when
        the rule cannot hold (a global batch that no size between min and max keeps exact)."""
        tb = zero_config.train_batch_size
        mb = zero_config.train_micro_batch_size_per_gpu
        gas = zero_config.gradient_accumulation_steps
        # Integer group sizes (validated positive by ZeroConfig); "auto" and None do not constrain the world size.
        sizes = (zero_config.shard_group_size, zero_config.hpz_partition_size)
        multiple = math.lcm(1, *(k for k in sizes if isinstance(k, int)))
        if not scaling.elasticity_enabled or (tb is None and mb is None):
            plan = cls("none")
        elif scaling.elastic_batch == "global":
            if tb is None:
                raise ValueError(
                    "ScalingConfig(elastic_batch='global') keeps train_batch_size constant across resizes, but the "
                    "ZeroConfig sets only the micro batch: set train_batch_size, or elastic_batch='micro' to let "
                    "the global batch follow the world size"
                )
            # With a micro batch, the accumulation is what a resize recomputes; without, the micro batch.
            plan = cls("global", tb, mb, None if mb is not None else (gas or 1))
        else:
            if mb is None:
                raise ValueError(
                    "ScalingConfig(elastic_batch='micro') keeps the micro batch across resizes, but the ZeroConfig "
                    "sets only train_batch_size: set train_micro_batch_size_per_gpu"
                )
            if gas is None:
                gas = 1 if tb is None else tb // (mb * scaling.max_workers)
                if tb is not None and (gas < 1 or tb % (mb * scaling.max_workers)):
                    raise ValueError(
                        f"ScalingConfig(elastic_batch='micro'): train_batch_size ({tb}) is not micro "
                        f"({mb}) x accumulation x max_workers ({scaling.max_workers}); set gradient_accumulation_steps"
                    )
            plan = cls("micro", None, mb, gas)
        if scaling.elasticity_enabled and multiple > 1:
            plan = dataclasses.replace(plan, multiple_of=multiple)
            if not any(w % multiple == 0 for w in range(scaling.min_workers, scaling.max_workers + 1)):
                raise ValueError(
                    f"no world size between min_workers={scaling.min_workers} and max_workers={scaling.max_workers} "
                    f"is a multiple of shard_group_size / hpz_partition_size ({multiple}); widen the range or use "
                    f"shard_group_size='auto'"
                )
        feasible = [w for w in range(scaling.min_workers, scaling.max_workers + 1) if plan.feasible(w)]
        if not feasible:
            raise ValueError(
                f"no world size between min_workers={scaling.min_workers} and max_workers={scaling.max_workers} keeps "
                f"the global batch: train_batch_size={tb} must be divisible by "
                f"{'train_micro_batch_size_per_gpu=' + str(mb) if mb else 'gradient_accumulation_steps=' + str(gas or 1)}"
                f" x world size for at least one of them (ScalingConfig.elastic_batch='global')"
            )
        return plan

    def for_world(self, world_size: int) -> BatchSizes | None:
        """The sizes at ``world_size`` (None: the ranks keep the config as given). Raises ValueError when the
        size is not feasible."""
        w = world_size
        if w % self.multiple_of:
            raise ValueError(f"world {w} is not a multiple of the shard group size {self.multiple_of}")
        if self.keep == "none":
            return None
        if self.keep == "micro":
            mb, gas = self.micro_batch_size, self.gradient_accumulation_steps
            return BatchSizes(mb * gas * w, mb, gas)
        tb = self.train_batch_size
        if self.micro_batch_size is not None:
            mb = self.micro_batch_size
            if tb % (mb * w):
                raise ValueError(f"train_batch_size {tb} is not micro {mb} x accumulation x world {w}")
            return BatchSizes(tb, mb, tb // (mb * w))
        gas = self.gradient_accumulation_steps
        if tb % (gas * w):
            raise ValueError(f"train_batch_size {tb} is not micro x accumulation {gas} x world {w}")
        return BatchSizes(tb, tb // (gas * w), gas)

    def feasible(self, world_size: int) -> bool:
        try:
            self.for_world(world_size)
        except ValueError:
            return False
        return True

    @property
    def samples_per_step(self) -> int | None:
        """The global batch when it does not depend on the world size."""
        return self.train_batch_size if self.keep == "global" else None


@dataclass(frozen=True)
class ScalingDecision:
    """Start (or resize to) ``num_workers`` ranks of ``resources_per_worker`` each; ``batch``: the batch
    sizes the ranks' ZeroConfig gets at that size (None: the config as given); ``elastic``: the ranks
    agree on recovery points at each report (what a planned resize needs)."""

    num_workers: int
    resources_per_worker: dict[str, float]
    batch: BatchSizes | None = None
    elastic: bool = False
