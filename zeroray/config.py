"""ZeroConfig: the settings of a ZeRO run, as dataclasses, with clear errors for bad input.

The field names follow DeepSpeed's JSON keys where DeepSpeed has one, so that a DeepSpeed user
finds what they know; :meth:`ZeroConfig.from_deepspeed` reads such a JSON file or dict.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal

Precision = Literal["fp32", "bf16", "fp16"]
OffloadDevice = Literal["none", "cpu", "nvme"]

_PRECISIONS = ("fp32", "bf16", "fp16")


class ConfigError(ValueError):
    """A bad setting. ``field`` is its dotted path in :class:`ZeroConfig` (``comm.reduce_bucket_size``),
    so a reader of another format (DeepSpeed JSON) can name the key the user wrote instead."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"ZeroConfig.{field}: {message}")
        self.field = field
        self.message = message


def _positive_int(field: str, v: Any, what: str = "a positive integer") -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ConfigError(field, f"must be {what}, got {v!r}")


@dataclass(frozen=True)
class PrecisionPolicy:
    """The dtype of each copy of the weights and gradients, like FSDP2's ``MixedPrecisionPolicy``.

    ``param_dtype``: parameters and gradients in forward/backward; ``reduce_dtype``: gradients while
    they are reduced and accumulated (None = ``param_dtype``); ``master_dtype``: the copy the optimizer
    updates. fp16 parameters turn on dynamic loss scaling. ``"bf16"`` is short for
    ``PrecisionPolicy(param_dtype="bf16")``.
    """

    param_dtype: Precision = "fp32"
    reduce_dtype: Precision | None = None
    master_dtype: Precision = "fp32"

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "master_dtype"):
            v = getattr(self, name)
            if v is None and name == "reduce_dtype":
                continue
            if v not in _PRECISIONS:
                raise ConfigError(f"precision.{name}", f"must be 'fp32', 'bf16' or 'fp16', got {v!r}")
        if self.master_dtype != "fp32":
            raise ConfigError("precision.master_dtype", f"only 'fp32' master weights are supported, got {self.master_dtype!r}")

    @classmethod
    def coerce(cls, value: PrecisionPolicy | str) -> PrecisionPolicy:
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value in _PRECISIONS:
            return cls(param_dtype=value)  # type: ignore[arg-type]
        raise ConfigError("precision", f"must be 'fp32', 'bf16', 'fp16' or a PrecisionPolicy, got {value!r}")

    @property
    def loss_scaling(self) -> bool:
        return self.param_dtype == "fp16"

    @property
    def name(self) -> str:
        """``"bf16"`` for the plain policies, else every dtype spelled out."""
        if self.reduce_dtype in (None, self.param_dtype) and self.master_dtype == "fp32":
            return self.param_dtype
        return f"param={self.param_dtype},reduce={self.reduce_dtype or self.param_dtype},master={self.master_dtype}"


@dataclass(frozen=True)
class Sharding:
    """What a ZeRO stage shards, as named flags (stage 1: optimizer states; 2: + gradients; 3: + parameters)."""

    shards_optimizer: bool
    shards_grads: bool
    shards_params: bool

    @classmethod
    def for_stage(cls, stage: int) -> Sharding:
        return cls(shards_optimizer=stage >= 1, shards_grads=stage >= 2, shards_params=stage >= 3)


@dataclass(frozen=True)
class CommConfig:
    """Communication. Sizes are in elements, as in DeepSpeed."""

    reduce_bucket_size: int = 5_000_000
    allgather_bucket_size: int = 50_000_000
    prefetch_bucket_size: int = 5_000_000  # stage 3: gather ahead up to this many elements (>= one unit)
    overlap_comm: bool = True
    # None = chosen by backend: reduce-scatter on NCCL, all-reduce on gloo (cheaper there, NOTES.md).
    reduce_scatter: bool | None = None
    # None = chosen by backend: one broadcast per rank's shard on gloo, all_gather on NCCL.
    all_gather_by_broadcast: bool | None = None

    def validate(self) -> None:
        for name in ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size"):
            _positive_int(f"comm.{name}", getattr(self, name), "a positive number of elements")


@dataclass(frozen=True)
class LossScaleConfig:
    """fp16 dynamic loss scaling (DeepSpeed's ``fp16`` block). ``loss_scale`` > 0 means a static scale."""

    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0

    def validate(self) -> None:
        if not self.loss_scale >= 0:
            raise ConfigError("loss_scaling.loss_scale", f"must be >= 0 (0 = dynamic), got {self.loss_scale!r}")
        if not self.min_loss_scale > 0:
            raise ConfigError("loss_scaling.min_loss_scale", f"must be > 0, got {self.min_loss_scale!r}")
        _positive_int("loss_scaling.loss_scale_window", self.loss_scale_window)
        _positive_int("loss_scaling.hysteresis", self.hysteresis)


@dataclass(frozen=True)
class OffloadConfig:
    """Where a state lives between uses (DeepSpeed's ``offload_optimizer`` / ``offload_param``)."""

    device: OffloadDevice = "none"
    nvme_path: str | None = None
    pin_memory: bool = False

    def validate(self, field: str) -> None:
        if self.device not in ("none", "cpu", "nvme"):
            raise ConfigError(f"{field}.device", f"must be 'none', 'cpu' or 'nvme', got {self.device!r}")
        if self.device != "none":
            raise ConfigError(
                f"{field}.device",
                f"{self.device!r}: offload is not available in this version of zeroray yet; use device='none'",
            )


_SUB = {"comm": CommConfig, "loss_scaling": LossScaleConfig, "offload_optimizer": OffloadConfig, "offload_param": OffloadConfig}


@dataclass(frozen=True)
class ZeroConfig:
    """All settings of the ZeRO engine, validated on construction (the only validator).

    Sub-configs may be given as dicts and the precision as a string (``precision="bf16"``).
    """

    stage: int = 0
    precision: PrecisionPolicy = field(default_factory=PrecisionPolicy)
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float = 0.0
    train_micro_batch_size_per_gpu: int | None = None
    train_batch_size: int | None = None
    # Stage 3 units: module names or class names; None = blocks of each nn.ModuleList, else top-level children.
    units: tuple[str, ...] | None = None
    # Optimizer / scheduler named in the config ({"type": ..., "params": {...}}), used when
    # zeroray.initialize gets no optimizer.
    optimizer: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    comm: CommConfig = field(default_factory=CommConfig)
    loss_scaling: LossScaleConfig = field(default_factory=LossScaleConfig)
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", PrecisionPolicy.coerce(self.precision))
        for name, cls in _SUB.items():
            v = getattr(self, name)
            if isinstance(v, dict):
                try:
                    v = cls(**v)
                except TypeError as e:
                    raise ConfigError(name, str(e)) from None
                object.__setattr__(self, name, v)
        if isinstance(self.units, list):
            object.__setattr__(self, "units", tuple(self.units))
        self.validate()

    @property
    def sharding(self) -> Sharding:
        return Sharding.for_stage(self.stage)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first bad field; called on construction."""
        if isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3):
            raise ConfigError("stage", f"must be 0, 1, 2 or 3, got {self.stage!r}")
        for name in ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu", "train_batch_size"):
            v = getattr(self, name)
            if v is not None:
                _positive_int(name, v)
        clip = self.gradient_clipping
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip < 0:
            raise ConfigError("gradient_clipping", f"must be a finite number >= 0 (0 = off), got {clip!r}")
        self.comm.validate()
        self.loss_scaling.validate()
        self.offload_optimizer.validate("offload_optimizer")
        self.offload_param.validate("offload_param")
        if self.units is not None and (isinstance(self.units, str) or not all(isinstance(u, str) for u in self.units)):
            raise ConfigError("units", f"must be a list of module or class names, got {self.units!r}")
        for name in ("optimizer", "scheduler"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, dict):
                raise ConfigError(name, f"must be a dict {{'type': ..., 'params': {{...}}}}, got {v!r}")

    # ------------------------------------------------------------------ batch sizes
    def resolve_batch(self, world_size: int) -> ZeroConfig:
        """Fill in batch sizes as DeepSpeed does: train = micro x accumulation x world size.

        Any two given determine the third; all three must agree. Only ``train_batch_size``: one
        accumulation step. Only the micro batch: one accumulation step. Neither: accumulation as
        given (default 1) and batch sizes left unknown.
        """
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        tb, mb, gas = self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps
        ws = world_size
        if tb is not None and mb is not None and gas is not None:
            if tb != mb * gas * ws:
                raise ValueError(
                    f"train_batch_size ({tb}) must equal train_micro_batch_size_per_gpu ({mb}) x "
                    f"gradient_accumulation_steps ({gas}) x data-parallel world size ({ws}) = {mb * gas * ws}"
                )
        elif tb is not None and mb is not None:
            if tb % (mb * ws):
                raise ValueError(
                    f"train_batch_size ({tb}) is not divisible by train_micro_batch_size_per_gpu ({mb}) x "
                    f"world size ({ws})"
                )
            gas = tb // (mb * ws)
        elif tb is not None and gas is not None:
            if tb % (gas * ws):
                raise ValueError(
                    f"train_batch_size ({tb}) is not divisible by gradient_accumulation_steps ({gas}) x "
                    f"world size ({ws})"
                )
            mb = tb // (gas * ws)
        elif mb is not None:
            gas = gas or 1
            tb = mb * gas * ws
        elif tb is not None:
            gas = 1
            if tb % ws:
                raise ValueError(f"train_batch_size ({tb}) is not divisible by the world size ({ws})")
            mb = tb // ws
        else:
            gas = gas or 1
        return dataclasses.replace(
            self, train_batch_size=tb, train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=gas
        )

    # ------------------------------------------------------------------ DeepSpeed JSON
    @classmethod
    def from_deepspeed(cls, config: dict[str, Any] | str | os.PathLike[str]) -> ZeroConfig:
        """Read a DeepSpeed JSON config (a dict or a path); unsupported keys raise or warn by name."""
        from zeroray.deepspeed_config import parse_deepspeed

        return parse_deepspeed(config)

    @classmethod
    def coerce(cls, config: ZeroConfig | dict[str, Any] | str | None) -> ZeroConfig:
        """Accept a ZeroConfig, a DeepSpeed-style dict, or a path to a DeepSpeed JSON file."""
        if config is None:
            return cls()
        if isinstance(config, cls):
            return config
        if isinstance(config, (dict, str)) or hasattr(config, "__fspath__"):
            return cls.from_deepspeed(config if isinstance(config, dict) else str(config))
        raise TypeError(
            f"config must be a ZeroConfig, a DeepSpeed-style dict or a path to a JSON file, got {type(config)}"
        )
