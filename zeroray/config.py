"""ZeroConfig: the settings of a ZeRO run, as dataclasses, with clear errors for bad input.

The field names follow DeepSpeed's JSON keys where DeepSpeed has one, so that a DeepSpeed user
finds what they know; :meth:`ZeroConfig.from_deepspeed` reads such a JSON file or dict.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal

Precision = Literal["fp32", "bf16", "fp16"]
OffloadDevice = Literal["none", "cpu", "nvme"]


@dataclass
class OffloadConfig:
    """Where a state lives between uses (DeepSpeed's ``offload_optimizer`` / ``offload_param``)."""

    device: OffloadDevice = "none"
    nvme_path: str | None = None
    pin_memory: bool = False


@dataclass
class ZeroConfig:
    """All settings of the ZeRO engine. Sizes are in elements, as in DeepSpeed."""

    stage: int = 0
    precision: Precision = "fp32"
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float = 0.0
    train_micro_batch_size_per_gpu: int | None = None
    train_batch_size: int | None = None
    # Communication.
    reduce_bucket_size: int = 5_000_000
    allgather_bucket_size: int = 50_000_000
    prefetch_bucket_size: int = 5_000_000  # stage 3: gather ahead up to this many elements (>= one unit)
    overlap_comm: bool = True
    # None = chosen by backend: reduce-scatter on NCCL, all-reduce on gloo (cheaper there, NOTES.md).
    reduce_scatter: bool | None = None
    # None = chosen by backend: one broadcast per rank's shard on gloo, all_gather on NCCL.
    all_gather_by_broadcast: bool | None = None
    # Stage 3 units: module names or class names; None = blocks of each nn.ModuleList, else top-level children.
    units: list[str] | None = None
    # fp16 dynamic loss scaling (DeepSpeed's ``fp16`` block). loss_scale > 0 means a static scale.
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    # Optimizer / scheduler named in the config ({"type": ..., "params": {...}}), used when
    # zeroray.initialize gets no optimizer.
    optimizer: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ValueError naming the first bad field; called on construction."""
        if isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeroConfig.stage must be 0, 1, 2 or 3, got {self.stage!r}")
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"ZeroConfig.precision must be 'fp32', 'bf16' or 'fp16', got {self.precision!r}")
        for name in ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu", "train_batch_size"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"ZeroConfig.{name} must be a positive integer, got {v!r}")
        for name in ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ZeroConfig.{name} must be a positive number of elements, got {v!r}")
        if self.gradient_clipping < 0:
            raise ValueError(f"ZeroConfig.gradient_clipping must be >= 0 (0 = off), got {self.gradient_clipping}")
        if self.loss_scale < 0 or self.min_loss_scale <= 0 or self.loss_scale_window < 1 or self.hysteresis < 1:
            raise ValueError(
                "fp16 loss scaling needs loss_scale >= 0, min_loss_scale > 0, loss_scale_window >= 1, "
                f"hysteresis >= 1; got {self.loss_scale}, {self.min_loss_scale}, "
                f"{self.loss_scale_window}, {self.hysteresis}"
            )
        for name in ("offload_optimizer", "offload_param"):
            off = getattr(self, name)
            if isinstance(off, dict):
                off = OffloadConfig(**off)
                setattr(self, name, off)
            if off.device not in ("none", "cpu", "nvme"):
                raise ValueError(f"ZeroConfig.{name}.device must be 'none', 'cpu' or 'nvme', got {off.device!r}")
            if off.device != "none":
                raise ValueError(
                    f"ZeroConfig.{name}.device={off.device!r}: offload is not available in this version of "
                    "zeroray yet; use device='none'"
                )
        if self.units is not None and (
            isinstance(self.units, str) or not all(isinstance(u, str) for u in self.units)
        ):
            raise ValueError(f"ZeroConfig.units must be a list of module or class names, got {self.units!r}")

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
