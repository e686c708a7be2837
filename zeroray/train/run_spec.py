"""The run spec: everything about a ``fit()`` that does not change while it runs, in one frozen value.

``ZeroTrainer.fit`` builds it once from the checked arguments; the controller, the worker group and
every rank actor read it (the actors get it through one ``ray.put``); :class:`RankInfo` is what a rank is
told of its own place in a group. Adding a setting means adding a
field here, not threading a keyword through the controller, the group, the actor and the session.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zeroray.config.load import ConfigArg
from zeroray.train.config import CheckpointConfig


@dataclass(frozen=True)
class RankInfo:
    """Where a rank sits in the group; computed by the driver from the placement group's nodes."""

    world_rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int


@dataclass(frozen=True)
class RunSpec:
    """One run. ``run_url`` is ``<storage_path>/<name>``; ``pass_config``: the loop takes the config."""

    name: str
    run_url: str
    storage_path: str
    storage_options: dict[str, Any] | None
    train_fn: Callable[..., Any]
    train_loop_config: dict[str, Any] | None
    pass_config: bool
    zero_config: ConfigArg  # as the user gave it: zt.prepare resolves it with the model and optimizer
    use_gpu: bool
    placement_strategy: str
    placement_timeout_s: float | None
    collective_timeout_s: float
    snapshot_interval: int  # FailureConfig's: in-memory snapshots every this many steps (0 = off)
    checkpoint_config: CheckpointConfig
    samples_per_step: int | None
    progress_bar: bool | None
    replica_recovery: bool = True  # FailureConfig's: a failed hybrid group's survivors keep their live state
    sigterm_grace_s: float = 30.0  # FailureConfig's: a rank's SIGTERM is a notice with this much time left

    @property
    def backend(self) -> str:
        """torch.distributed backend: nccl between GPUs, gloo on CPU."""
        return "nccl" if self.use_gpu else "gloo"

    def run_loop(self) -> None:
        """Call the user's loop as it asked to be called (with the config or without)."""
        if self.pass_config:
            self.train_fn(self.train_loop_config)
        else:
            self.train_fn()
