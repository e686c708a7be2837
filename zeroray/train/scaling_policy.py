"""Scaling policy: how many ranks the next group gets, and with what resources.

Only the fixed policy exists now. An elastic policy (between a min and a max number of workers) plugs
in here: ``decide_for_new_group`` may return fewer workers after a failure, and
``decide_while_running`` may ask the controller to resize a healthy group.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from zeroray.train.config import ScalingConfig


@dataclass(frozen=True)
class ScalingDecision:
    """Start (or resize to) ``num_workers`` ranks of ``resources_per_worker`` each."""

    num_workers: int
    resources_per_worker: dict[str, float]


class ScalingPolicy(ABC):
    """Base: decisions for a group about to start and for a running one."""

    def __init__(self, scaling_config: ScalingConfig) -> None:
        self.scaling_config = scaling_config

    @abstractmethod
    def decide_for_new_group(self) -> ScalingDecision:
        """How many ranks, with what resources, the next group starts with."""

    def decide_while_running(self, num_workers: int) -> ScalingDecision | None:
        """None = keep the group as it is."""
        return None


class FixedScalingPolicy(ScalingPolicy):
    """Always ``num_workers`` ranks; never resizes."""

    def decide_for_new_group(self) -> ScalingDecision:
        return ScalingDecision(self.scaling_config.num_workers, self.scaling_config.worker_resources)
