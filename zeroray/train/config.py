"""The run's settings as Ray Train users know them: ScalingConfig, RunConfig, FailureConfig, CheckpointConfig.

Every field is checked on construction, so a bad value fails in the driver before any actor starts.
"""

from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal

PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


ElasticBatch = Literal["global", "micro"]


@dataclass
class ScalingConfig:
    """How many ranks, and what each rank's actor holds (one bundle of the placement group per rank).

    ``num_workers``: an int is a fixed size; ``(min, max)`` makes the run elastic (Ray Train V2's
    name and meaning): the group starts with as many workers as the cluster holds, at most ``max``,
    shrinks (to at least ``min``) when a rank or node is lost instead of waiting for it, and grows
    when resources appear, checked every ``elastic_resize_monitor_interval_s`` while it runs (V2's
    name; a planned resize first saves a checkpoint, so it loses no step).

    ``elastic_batch`` says what a resize keeps. "global" (default): ``train_batch_size`` stays the
    same and ``gradient_accumulation_steps`` becomes train ÷ (micro x world); only world sizes where
    that division is exact are used (the largest such size that fits, as DeepSpeed's elasticity
    does), so a resized run takes the same optimizer steps on the same samples as a fixed one.
    "micro": the micro batch and the accumulation stay, so the global batch changes with the world
    size (logged at every resize).

    ``resources_per_worker`` overrides the defaults (1 CPU, plus 1 GPU when ``use_gpu``); keys are Ray
    resource names. ``placement_timeout_s`` bounds the wait for the placement group (None = wait,
    logging what is missing, as long as the cluster could ever hold it).
    """

    num_workers: int | tuple[int, int] = 1
    use_gpu: bool = False
    resources_per_worker: dict[str, float] | None = None
    placement_strategy: PlacementStrategy = "PACK"
    placement_timeout_s: float | None = None
    elastic_resize_monitor_interval_s: float = 60.0
    elastic_batch: ElasticBatch = "global"

    def __post_init__(self) -> None:
        if isinstance(self.num_workers, list):
            self.num_workers = tuple(self.num_workers)
        if isinstance(self.num_workers, tuple):
            if len(self.num_workers) != 2 or not all(_is_int(n) for n in self.num_workers):
                raise ValueError(
                    f"ScalingConfig.num_workers must be an integer or a (min, max) pair of integers, "
                    f"got {self.num_workers!r}"
                )
            lo, hi = self.num_workers
            if lo < 1:
                raise ValueError(f"ScalingConfig.num_workers=(min, max): min must be >= 1, got {self.num_workers!r}")
            if lo > hi:
                raise ValueError(
                    f"ScalingConfig.num_workers=(min, max): min ({lo}) must be <= max ({hi}), got {self.num_workers!r}"
                )
        elif not _is_int(self.num_workers) or self.num_workers < 1:
            raise ValueError(
                f"ScalingConfig.num_workers must be a positive integer or a (min, max) pair, got {self.num_workers!r}"
            )
        if not _is_number(self.elastic_resize_monitor_interval_s) or self.elastic_resize_monitor_interval_s < 0:
            raise ValueError(
                f"ScalingConfig.elastic_resize_monitor_interval_s must be a number of seconds >= 0, "
                f"got {self.elastic_resize_monitor_interval_s!r}"
            )
        if self.elastic_batch not in ("global", "micro"):
            raise ValueError(f"ScalingConfig.elastic_batch must be 'global' or 'micro', got {self.elastic_batch!r}")
        self._check_rest()

    @property
    def min_workers(self) -> int:
        return self.num_workers[0] if isinstance(self.num_workers, tuple) else self.num_workers

    @property
    def max_workers(self) -> int:
        return self.num_workers[1] if isinstance(self.num_workers, tuple) else self.num_workers

    @property
    def elasticity_enabled(self) -> bool:
        """Ray Train V2's name: the size may change while the run goes on."""
        return isinstance(self.num_workers, tuple)

    def _check_rest(self) -> None:
        if not isinstance(self.use_gpu, bool):
            raise ValueError(f"ScalingConfig.use_gpu must be True or False, got {self.use_gpu!r}")
        if self.placement_strategy not in _STRATEGIES:
            raise ValueError(
                f"ScalingConfig.placement_strategy must be one of {_STRATEGIES}, got {self.placement_strategy!r}"
            )
        if self.resources_per_worker is not None:
            if not isinstance(self.resources_per_worker, dict):
                raise ValueError(
                    f"ScalingConfig.resources_per_worker must be a dict like {{'CPU': 2}}, "
                    f"got {self.resources_per_worker!r}"
                )
            for k, v in self.resources_per_worker.items():
                if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                    raise ValueError(
                        f"ScalingConfig.resources_per_worker[{k!r}] must be a number >= 0, got {v!r}"
                    )
            if not self.use_gpu and self.resources_per_worker.get("GPU", 0) > 0:
                raise ValueError("ScalingConfig.resources_per_worker asks for GPUs but use_gpu is False")
            if self.use_gpu and self.resources_per_worker.get("GPU", 1) <= 0:
                raise ValueError("ScalingConfig.use_gpu is True but resources_per_worker['GPU'] is 0")
        if self.placement_timeout_s is not None and not self.placement_timeout_s > 0:
            raise ValueError(
                f"ScalingConfig.placement_timeout_s must be > 0 or None, got {self.placement_timeout_s!r}"
            )

    @property
    def worker_resources(self) -> dict[str, float]:
        """The Ray resources of one rank's bundle."""
        res: dict[str, float] = {"CPU": 1.0}
        if self.use_gpu:
            res["GPU"] = 1.0
        if self.resources_per_worker:
            res.update({k: float(v) for k, v in self.resources_per_worker.items()})
        return {k: v for k, v in res.items() if v > 0}

    @property
    def backend(self) -> str:
        """torch.distributed backend: nccl between GPUs, gloo on CPU."""
        return "nccl" if self.use_gpu else "gloo"


@dataclass
class FailureConfig:
    """How many times the whole group may fail before the run fails.

    A restart tears the group down, starts a new one and runs the loop again; ``zt.prepare`` loads the
    newest committed checkpoint, so the loop resumes from ``engine.global_step``. 0 = no restart;
    -1 = restart without limit.

    ``collective_timeout_s`` bounds how long a rank waits inside one collective (``zt.report``'s
    barrier, the engine's gathers and reductions, a checkpoint's commit) for its peers. It is the
    process groups' timeout, and what turns a rank that skipped a ``zt.report`` or called
    ``engine.full_state_dict()`` alone from a silent hang into an error naming the ranks and their
    report counts within about a minute. The default, 60 s, is far above the skew between ranks in one
    step or one rank's checkpoint shard upload at ordinary sizes, and far below torch's 30 minutes;
    raise it when ranks legitimately wait longer for each other (e.g. rank 0 alone evaluating or
    downloading data between two collectives, or steps of minutes on offloaded models).

    ``worker_heartbeat_timeout_s``: the driver polls every rank about ten times a second; the loop runs
    in a thread, so a healthy rank answers even inside a long step or collective. A rank that has not
    answered for this long (its process SIGSTOPped, or stuck in native code that holds the GIL) is a
    failure, handled like a dead one. Together with the collective timeout (a rank waiting on a hung
    peer) this catches a hung rank within about a minute instead of torch's 30. The other way round, a
    rank that the driver has not called for ``worker_heartbeat_timeout_s + collective_timeout_s`` (it is
    cut off by a partition, or its driver died) stops its own process (docs/operations.md).

    ``snapshot_interval``: every this many optimizer steps (at the ``zt.report`` after the step), each rank
    copies its shard state into host memory and sends a copy to a buddy rank on another node, so a
    restart after a lost rank or node rebuilds the state from the survivors' memory (resharded to the new
    world size) instead of reading storage, and loses at most ``snapshot_interval - 1`` steps. It costs
    up to twice the rank's shard state in host memory (four times while a snapshot is sent) and a stall at
    each snapshot. When both copies of a shard are lost, the run falls back to the newest committed
    checkpoint. 0 (the default) = off.

    ``replica_recovery`` (hybrid sharding, ``shard_group_size``): when the group fails, each surviving rank
    keeps a host copy of its live state, and the next group copies a lost node's shards from their replicas
    in the other replica groups: no storage read and no step lost, with no cost while training (one host
    copy of the rank's shard state, from the failure until the next group's first report). Where some shard
    has no surviving copy it falls back to the snapshots, then storage. A planned resize and a preemption
    notice use the same copies as their recovery point (no checkpoint written) when the ranks that stay hold
    every shard. False = off (the copy's host memory is not spared; recovery points write checkpoints).

    ``max_preemption_failures`` (Ray Train V2's name and default): how many preemptions the run recovers
    from, counted apart from ``max_failures`` (-1 = no limit, 0 = none). A preemption is a drain notice of a
    node that holds ranks (``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION``, the autoscaler's, a
    raylet's own on SIGTERM), a SIGTERM to a rank's process, or a failure of the ranks such a notice named.
    On a notice the group takes a recovery point at its next ``zt.report`` that does not depend on the
    leaving ranks (under hybrid sharding the live replicas of the ranks that stay, when they hold every
    shard; else an in-memory snapshot to buddies that stay when ``snapshot_interval`` > 0, else a
    checkpoint; whichever fits the deadline), then goes on without them: 0 steps lost. A deadline too short
    for either degrades to crash recovery (the steps since the last recovery point are lost), with a warning
    saying how long the recovery point needed. See docs/operations.md.

    ``sigterm_grace_s``: a SIGTERM to a rank's process (how Kubernetes and the cluster launcher stop a pod)
    is a notice with this many seconds left; the default is Kubernetes' ``terminationGracePeriodSeconds``
    default, 30. Set it to the grace your platform gives.
    """

    max_failures: int = 0
    collective_timeout_s: float = 60.0
    worker_heartbeat_timeout_s: float = 30.0
    snapshot_interval: int = 0
    replica_recovery: bool = True
    max_preemption_failures: int = -1
    sigterm_grace_s: float = 30.0

    def __post_init__(self) -> None:
        if not _is_int(self.max_failures) or self.max_failures < -1:
            raise ValueError(
                f"FailureConfig.max_failures must be an integer >= 0, or -1 for unlimited, "
                f"got {self.max_failures!r}"
            )
        if not _is_int(self.max_preemption_failures) or self.max_preemption_failures < -1:
            raise ValueError(
                f"FailureConfig.max_preemption_failures must be an integer >= 0, or -1 for unlimited, "
                f"got {self.max_preemption_failures!r}"
            )
        if not _is_int(self.snapshot_interval) or self.snapshot_interval < 0:
            raise ValueError(
                f"FailureConfig.snapshot_interval must be an integer >= 0 (0 = no in-memory snapshots), "
                f"got {self.snapshot_interval!r}"
            )
        if not isinstance(self.replica_recovery, bool):
            raise ValueError(f"FailureConfig.replica_recovery must be True or False, got {self.replica_recovery!r}")
        for name in ("collective_timeout_s", "worker_heartbeat_timeout_s", "sigterm_grace_s"):
            value = getattr(self, name)
            if not _is_number(value) or not value > 0:
                raise ValueError(f"FailureConfig.{name} must be a number of seconds > 0, got {value!r}")


@dataclass
class CheckpointConfig:
    """How ``zt.report(metrics, checkpoint=True)`` saves.

    ``num_to_keep``: committed checkpoints kept in the run directory (None = all); older ones are deleted
    after each commit. ``async_save``: return from ``report`` after a host copy of the shards, and upload
    and commit in the background (joined by the next save and at the end of the loop).
    """

    num_to_keep: int | None = None
    async_save: bool = False

    def __post_init__(self) -> None:
        if self.num_to_keep is not None and (not _is_int(self.num_to_keep) or self.num_to_keep < 1):
            raise ValueError(
                f"CheckpointConfig.num_to_keep must be a positive integer or None (keep all), "
                f"got {self.num_to_keep!r}"
            )
        if not isinstance(self.async_save, bool):
            raise ValueError(f"CheckpointConfig.async_save must be True or False, got {self.async_save!r}")


def _default_name() -> str:
    return "zeroray-" + datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


def _default_storage_path() -> str:
    return os.path.join(os.path.expanduser("~"), "zeroray_results")


@dataclass
class RunConfig:
    """Where the run's files go and how it reacts to failures.

    ``storage_path`` is any fsspec URL the driver and every rank share (local or network path,
    ``s3://``, ``gs://``...; ``memory://`` is refused: each process would see only its own);
    ``storage_options`` go to fsspec (e.g. ``{"endpoint_url": ...}`` for an S3-compatible store), in the
    driver and in the rank actors, which write and read the checkpoints themselves. The run directory
    ``<storage_path>/<name>`` is also what a run resumes from: a new ``fit()`` with the same name and
    storage path continues from its newest valid checkpoint.
    ``progress_bar``: True/False, or None = a bar on a terminal and a log line every few seconds otherwise.

    A running ``fit()`` holds a lease on its run directory (``lease.json``: an owner id and a
    heartbeat the driver refreshes), so a second ``fit()`` with the same name and storage path refuses
    to start instead of interleaving checkpoints and history. A lease whose heartbeat is older than
    ``lease_timeout_s`` (its driver died) is taken over with a warning.

    ``callbacks``: your own :class:`~zeroray.train.ControllerCallback` instances (Ray Train's
    ``RunConfig(callbacks=[...])``), run in the driver after the built-in ones, in list order, on every
    state change, report and attempt start and end; an exception out of one fails the run
    (``zeroray.train.CallbackError``). See ``ControllerCallback`` for the hooks and docs/ray-layer.md.
    """

    name: str = field(default_factory=_default_name)
    storage_path: str = field(default_factory=_default_storage_path)
    storage_options: dict[str, Any] | None = None
    failure_config: FailureConfig = field(default_factory=FailureConfig)
    checkpoint_config: CheckpointConfig = field(default_factory=CheckpointConfig)
    progress_bar: bool | None = None
    lease_timeout_s: float = 60.0
    callbacks: list[Any] = field(default_factory=list)  # ControllerCallback (callbacks.py, which imports this module)

    def __post_init__(self) -> None:
        if not _is_number(self.lease_timeout_s) or not self.lease_timeout_s > 0:
            raise ValueError(
                f"RunConfig.lease_timeout_s must be a number of seconds > 0, got {self.lease_timeout_s!r}"
            )
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ValueError(
                f"RunConfig.name must be non-empty and use only letters, digits, '_', '-' and '.', "
                f"got {self.name!r}"
            )
        if hasattr(self.storage_path, "__fspath__"):
            self.storage_path = os.fspath(self.storage_path)
        if not isinstance(self.storage_path, str) or not self.storage_path:
            raise ValueError(f"RunConfig.storage_path must be a path or URL, got {self.storage_path!r}")
        if self.storage_options is not None and not isinstance(self.storage_options, dict):
            raise ValueError(f"RunConfig.storage_options must be a dict, got {self.storage_options!r}")
        if not isinstance(self.failure_config, FailureConfig):
            raise ValueError(f"RunConfig.failure_config must be a FailureConfig, got {self.failure_config!r}")
        if not isinstance(self.checkpoint_config, CheckpointConfig):
            raise ValueError(
                f"RunConfig.checkpoint_config must be a CheckpointConfig, got {self.checkpoint_config!r}"
            )
        self._check_callbacks()

    def _check_callbacks(self) -> None:
        # Imported here: callbacks.py imports the controller's states, which import this module.
        from zeroray.train.driver.callbacks import ControllerCallback

        if not isinstance(self.callbacks, (list, tuple)):
            raise ValueError(
                f"RunConfig.callbacks must be a list of zeroray.train.ControllerCallback, got {self.callbacks!r:.80}"
            )
        for i, callback in enumerate(self.callbacks):
            if isinstance(callback, type) and issubclass(callback, ControllerCallback):
                raise ValueError(
                    f"RunConfig.callbacks[{i}] is the class {callback.__name__}: pass an instance, {callback.__name__}()"
                )
            if not isinstance(callback, ControllerCallback):
                raise ValueError(
                    f"RunConfig.callbacks[{i}] must be a zeroray.train.ControllerCallback (subclass it and override "
                    f"the hooks you need), got {type(callback).__name__}: {callback!r:.80}"
                )
        self.callbacks = list(self.callbacks)

