"""The worker side's view of the run: who am I (rank, node, device), and the per-process session state.

One Ray actor hosts one rank, so the current context is a process-wide singleton set by the actor
before it runs the user's loop, like ``ray.train.get_context()``.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Any

import torch

from zeroray.train.config import CheckpointConfig
from zeroray.train.run_spec import RunSpec


@dataclass(frozen=True)
class RankInfo:
    """Where a rank sits in the group; computed by the driver from the placement group's nodes."""

    world_rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int


@dataclass
class TrainContext:
    """What ``zt.get_context()`` returns inside a train loop."""

    rank_info: RankInfo
    experiment_name: str
    storage_path: str
    device: torch.device
    trial_dir: str = ""

    def get_world_size(self) -> int:
        return self.rank_info.world_size

    def get_world_rank(self) -> int:
        return self.rank_info.world_rank

    def get_local_rank(self) -> int:
        return self.rank_info.local_rank

    def get_local_world_size(self) -> int:
        return self.rank_info.local_world_size

    def get_node_rank(self) -> int:
        return self.rank_info.node_rank

    def get_device(self) -> torch.device:
        return self.device

    def get_experiment_name(self) -> str:
        return self.experiment_name

    def get_storage_path(self) -> str:
        """The run's directory URL, ``<storage_path>/<name>``."""
        return self.trial_dir


@dataclass
class Session:
    """Mutable per-rank state shared by prepare/report/get_dataset_shard and the hosting actor.

    ``report_callbacks`` run on every ``zt.report`` in this rank (the Ray metrics). ``waiting_in`` says
    where a failure happened: "report" (inside the barrier of a ``zt.report``), "end" (the closing
    exchange after the loop returned) or None (in the user's loop).
    """

    context: TrainContext
    spec: RunSpec
    dataset_shards: dict[str, Any]
    report_comm: Any  # zeroray.engine.Comm over the gloo side group: report barriers, resume choice
    report_callbacks: list[Any] = field(default_factory=list)
    reports: queue.Queue = field(default_factory=queue.Queue)
    engine: Any = None
    num_reports: int = 0
    waiting_in: str | None = None
    last_report_time: float | None = None
    last_global_step: int = 0
    checkpoint_saver: Any = None  # the rank's zeroray.checkpoint.AsyncSaver, from its first async save

    @property
    def zero_config(self) -> Any:
        return self.spec.zero_config

    @property
    def storage_options(self) -> dict[str, Any] | None:
        """RunConfig's, for the checkpoint writes and reads."""
        return self.spec.storage_options

    @property
    def checkpoint_config(self) -> CheckpointConfig:
        return self.spec.checkpoint_config


_SESSION: Session | None = None


def set_session(session: Session | None) -> None:
    """Install (or clear) this process's session; called by the rank actor only."""
    global _SESSION
    _SESSION = session


def get_session(caller: str = "this function") -> Session:
    """The current session, or a clear error when called outside a ZeroTrainer worker."""
    if _SESSION is None:
        raise RuntimeError(
            f"zeroray.train.{caller} can only be called inside a train loop run by ZeroTrainer.fit()"
        )
    return _SESSION


def get_context() -> TrainContext:
    """The rank's context: world size and rank, local rank, node rank, device, experiment name."""
    return get_session("get_context()").context
