"""zeroray.train: the Ray layer. Driver side: ZeroTrainer and its configs. Worker side (inside the loop):
get_context, prepare, report, get_dataset_shard, DistributedSampler, get_preemption_info — the same shape as
``ray.train``."""

from zeroray.train.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from zeroray.train.dataset import get_dataset_shard
from zeroray.train.driver.callbacks import ControllerCallback
from zeroray.train.errors import (
    CallbackError,
    ReportMismatchError,
    RunLeaseError,
    TrainingFailedError,
    WorkerFailure,
)
from zeroray.train.preemption import PreemptionInfo
from zeroray.train.result import Checkpoint, Result
from zeroray.train.sampler import DistributedSampler
from zeroray.train.trainer import ZeroTrainer
from zeroray.train.worker.context import TrainContext, get_context
from zeroray.train.worker.preemption import get_preemption_info
from zeroray.train.worker.preparation import prepare
from zeroray.train.worker.reporting import report

__all__ = [
    "ZeroTrainer",
    "ScalingConfig",
    "RunConfig",
    "FailureConfig",
    "CheckpointConfig",
    "ControllerCallback",
    "Result",
    "Checkpoint",
    "TrainContext",
    "TrainingFailedError",
    "CallbackError",
    "ReportMismatchError",
    "RunLeaseError",
    "WorkerFailure",
    "PreemptionInfo",
    "get_context",
    "prepare",
    "report",
    "get_dataset_shard",
    "get_preemption_info",
    "DistributedSampler",
]
