"""The worker side's view of the run: who am I (rank, node, device), and the per-process session state.

One Ray actor hosts one rank, so the current context is a process-wide singleton set by the actor
before it runs the user's loop, like ``ray.train.get_context()``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from zeroray.config.load import ConfigArg
from zeroray.train.config import CheckpointConfig
from zeroray.train.report import RankStats, Report
from zeroray.train.run_spec import RankInfo, RunSpec
from zeroray.train.sizing import BatchSizes

if TYPE_CHECKING:
    from zeroray.checkpoint import AsyncSaver
    from zeroray.checkpoint.snapshot import SnapshotStore
    from zeroray.engine import ZeroEngine
    from zeroray.engine.comm import Comm
    from zeroray.train.dataset import DataShard
    from zeroray.train.group.group_sockets import GroupSockets
    from zeroray.train.preemption import PreemptionInfo


@dataclass
class TrainContext:
    """What ``zt.get_context()`` returns inside a train loop."""

    rank_info: RankInfo
    experiment_name: str
    storage_path: str
    device: torch.device
    trial_dir: str = ""
    batch: BatchSizes | None = None  # this group's batch sizes, when they are known
    epoch: int | None = None  # the group's fencing epoch: its saves carry it (zeroray/checkpoint/fence.py)

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

    def sample_indices(self, step: int, micro_step: int = 0) -> range:
        """The global sample indices this rank trains on in optimizer step ``step`` (0-based, i.e.
        ``engine.global_step`` before the step), micro-batch ``micro_step`` of its accumulation.

        Step ``s`` always covers samples ``[s*B, (s+1)*B)`` of the global batch ``B``, whatever the world
        size: each rank takes a contiguous ``B / world`` of them, micro-batch by micro-batch. So a run
        that is resized (same global batch, ``ScalingConfig.elastic_batch='global'``) sees the same
        samples in the same steps as a fixed-size run; index a map-style dataset with it.
        """
        b = self.batch
        if b is None:
            raise RuntimeError(
                "zt.get_context().sample_indices needs the batch sizes: set train_batch_size and/or "
                "train_micro_batch_size_per_gpu in the ZeroConfig"
            )
        if not 0 <= micro_step < b.gradient_accumulation_steps:
            raise ValueError(f"micro_step must be in [0, {b.gradient_accumulation_steps}), got {micro_step}")
        per_rank = b.micro_batch_size * b.gradient_accumulation_steps
        start = step * b.train_batch_size + self.get_world_rank() * per_rank + micro_step * b.micro_batch_size
        return range(start, start + b.micro_batch_size)


class ReportCallback:
    """Hooks of one rank's ``zt.report``, run in the rank's process (the loop's thread) after the report's
    exchange; the rank actor installs them (``Session.report_callbacks``: its Ray metrics, the recovery
    point of an elastic run). The default does nothing."""

    def after_report(self, metrics: dict[str, Any], stats: RankStats, num_reports: int) -> None:
        """This rank's view of the report: rank 0's metrics on rank 0 (else this rank's), its stats."""

    def close(self) -> None:
        """The rank leaves its group (its actor may be kept for the next group, as another rank)."""


@dataclass
class Session:
    """Mutable per-rank state shared by prepare/report/get_dataset_shard and the hosting actor.

    ``report_callbacks`` run on every ``zt.report`` in this rank (the Ray metrics). ``waiting_in`` says
    where a failure happened: "report" (inside the barrier of a ``zt.report``), "end" (the closing
    exchange after the loop returned) or None (in the user's loop).
    """

    context: TrainContext
    spec: RunSpec
    dataset_shards: dict[str, DataShard]  # this rank's part of each of the trainer's datasets
    report_comm: Comm  # over the gloo side group: report barriers, resume choice
    report_callbacks: list[ReportCallback] = field(default_factory=list)
    reports: queue.Queue[Report] = field(default_factory=queue.Queue)  # rank 0's, until the driver polls
    _engine: ZeroEngine | None = field(default=None, repr=False)
    num_reports: int = 0
    waiting_in: Literal["report", "end"] | None = None
    last_report_time: float | None = None
    last_global_step: int = 0
    checkpoint_saver: AsyncSaver | None = None  # from the rank's first async save
    elastic: bool = False  # the ranks agree at each report whether to stop at a recovery point
    resize_to: int | None = None  # the driver asked for a recovery point: a planned resize to this many ranks
    last_saved_step: int | None = None  # global step of this engine's newest save
    checkpoint_load: tuple[float, int] | None = None  # (seconds, bytes) of the resume load, for the metrics
    engine_ready_at: float | None = None  # time.time() when zt.prepare built the engine (before its resume load)
    snapshots: SnapshotStore | None = None  # the rank actor's, kept across groups (snapshots, live copies)
    snapshot_group: tuple[str, list[int]] | None = None  # this group's id and its ranks' node ranks
    last_snapshot_step: int | None = None
    resumed: tuple[Literal["memory", "replica", "storage"], int] | None = None  # where zt.prepare's resume came from, and its step
    preemption: PreemptionInfo | None = None  # the driver's notice (RankActor.mark_preempt): zt.get_preemption_info
    preemption_keeps_ranks: bool = True  # the next group keeps the ranks that stay (their memory can hold a snapshot)
    measured_s: dict[str, float] = field(default_factory=dict)  # seconds of the last "snapshot" / sync "checkpoint"
    stateful: dict[str, Any] = field(default_factory=dict)  # saved with the engine's state (data positions)
    group_sockets: GroupSockets | None = None  # the rank actor's: zt.prepare records the engine's groups in it

    @property
    def engine(self) -> ZeroEngine | None:
        """The engine ``zt.prepare`` built (None before)."""
        return self._engine

    @engine.setter
    def engine(self, engine: ZeroEngine | None) -> None:
        # Stamped here, where zt.prepare hands the engine over, so a (re)start's time splits into building the
        # model and engine, reading the checkpoint and the first step (Attempt.phases).
        self._engine = engine
        self.engine_ready_at = time.time() if engine is not None else None

    def register_stateful(self, name: str, obj: Any) -> None:
        """Save ``obj``'s state with every checkpoint and snapshot (``ZeroEngine.register_stateful``): on the
        engine now, or on the one ``zt.prepare`` builds, before it resumes."""
        self.stateful[name] = obj
        if self._engine is not None:
            self._engine.register_stateful(name, obj)

    @property
    def zero_config(self) -> ConfigArg:
        """The trainer's config, with this group's batch sizes when the run is elastic (the accumulation
        follows the world size)."""
        return with_batch(self.spec.zero_config, self.context.batch)

    @property
    def storage_options(self) -> dict[str, Any] | None:
        """RunConfig's, for the checkpoint writes and reads."""
        return self.spec.storage_options

    @property
    def checkpoint_config(self) -> CheckpointConfig:
        return self.spec.checkpoint_config


def with_batch(config: ConfigArg, batch: BatchSizes | None) -> ConfigArg:
    """``config`` (a ZeroConfig, a DeepSpeed dict or JSON path, or None) with ``batch``'s sizes set."""
    if batch is None:
        return config
    sizes = batch.as_zero_config()
    from zeroray.config import ZeroConfig

    if config is None:
        return ZeroConfig(**sizes)
    if isinstance(config, ZeroConfig):
        return dataclasses.replace(config, **sizes)
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    return {**config, **sizes}


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
