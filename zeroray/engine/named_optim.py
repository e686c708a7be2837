"""Optimizers and LR schedules named in a DeepSpeed config (``{"type": ..., "params": {...}}``).

DeepSpeed users write ``"optimizer": {"type": "AdamW", "params": {...}}`` and a ``"scheduler"``
block instead of constructing them; :func:`build_optimizer` and :func:`build_scheduler` turn those
blocks into plain ``torch.optim`` objects with DeepSpeed's meaning, so the same JSON trains the same
way. Everything here is plain PyTorch (no Ray), and every unknown name fails loudly with the
supported alternatives, because a silently dropped hyperparameter is a silently different run.

DeepSpeed semantics kept on purpose:

- ``"Adam"`` is AdamW (decoupled weight decay) unless ``"adam_w_mode": false``, as DeepSpeed's
  FusedAdam/CPUAdam do; ``"torch_adam"`` only picks DeepSpeed's kernel and is accepted without effect;
  ``"bias_correction": true`` is what torch always does (``false`` is refused).
- For Adam/AdamW a missing ``weight_decay`` is 0.0, DeepSpeed's default (torch's AdamW uses 0.01).
- ``WarmupLR`` / ``WarmupDecayLR`` reproduce ``deepspeed/runtime/lr_schedules.py`` step for step:
  the learning rate the optimizer sees at its k-th ``step()`` equals DeepSpeed's at the same point,
  provided ``scheduler.step()`` is called after each optimizer step (as DeepSpeed's engine does).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from zeroray.config import ConfigError
from zeroray.config.optim_spec import (
    ADAM_EXTRAS,
    SCHEDULER_PARAMS,
    SUPPORTED_OPTIMIZERS,
    SUPPORTED_SCHEDULERS,
    optimizer_class_name,
    optimizer_spec_problems,
    scheduler_spec_problems,
)

__all__ = [
    "SUPPORTED_OPTIMIZERS",
    "SUPPORTED_SCHEDULERS",
    "WarmupDecayLR",
    "WarmupLR",
    "build_optimizer",
    "build_scheduler",
]


def _raise(problems: list[tuple[str, str]]) -> None:
    if problems:
        raise ConfigError.of(problems)


def _resolve_optimizer(spec: dict[str, Any]) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """Map an optimizer block to (torch class, constructor kwargs); the names are checked by optim_spec."""
    _raise(optimizer_spec_problems(spec))
    params = dict(spec.get("params") or {})
    name = optimizer_class_name(spec["type"], params)
    assert name is not None  # optimizer_spec_problems refused unknown types
    cls: type[torch.optim.Optimizer] = getattr(torch.optim, name)
    if name in ("Adam", "AdamW"):
        for extra in ADAM_EXTRAS:  # kernel choice / DeepSpeed switches, checked above; numerics are torch's
            params.pop(extra, None)
        params.setdefault("weight_decay", 0.0)  # DeepSpeed's Adam default; torch's AdamW has 0.01
    if isinstance(params.get("betas"), list):
        params["betas"] = tuple(params["betas"])
    return cls, params


def build_optimizer(
    spec: dict[str, Any], params: Iterable[torch.Tensor] | Iterable[dict[str, Any]]
) -> torch.optim.Optimizer:
    """Build the torch optimizer a DeepSpeed ``optimizer`` block names.

    ``params`` is what a torch optimizer takes: tensors or param-group dicts.
    """
    cls, kwargs = _resolve_optimizer(spec)
    return cls(list(params), **kwargs)


# ---------------------------------------------------------------------------------- schedulers
_WARMUP_TYPES = ("log", "linear")


class WarmupLR(LRScheduler):
    """DeepSpeed's WarmupLR: min -> max lr over ``warmup_num_steps`` ("log" or "linear"), then max.

    DeepSpeed counts ``last_batch_iteration`` from -1 (lr = min lr before the first step); torch's
    ``last_epoch`` is 0 after construction, so DeepSpeed's iteration is ``last_epoch - 1`` here.
    Everything kept in the state is plain numbers and strings, so ``state_dict()`` is plain data.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        if (
            not isinstance(warmup_num_steps, int)
            or isinstance(warmup_num_steps, bool)
            or warmup_num_steps < 0
        ):
            raise ValueError(
                f"scheduler.params.warmup_num_steps must be an integer >= 0, got {warmup_num_steps!r}"
            )
        if warmup_type not in _WARMUP_TYPES:
            raise ValueError(f"scheduler.params.warmup_type must be 'log' or 'linear', got {warmup_type!r}")
        if last_batch_iteration != -1:
            raise ValueError(
                "scheduler.params.last_batch_iteration must be -1: resume a schedule with load_state_dict()"
            )
        groups = optimizer.param_groups
        if warmup_max_lr is None:
            # DeepSpeed >= 0.16 warms up to the optimizer's lr; it uses the first group's lr for all
            # groups, zeroray each group's own (the same with one group).
            warmup_max_lr = [float(g["lr"]) for g in groups]
        self.min_lrs = self._per_group(warmup_min_lr, len(groups), "warmup_min_lr")
        self.max_lrs = self._per_group(warmup_max_lr, len(groups), "warmup_max_lr")
        self.warmup_num_steps = max(2, warmup_num_steps)  # as DeepSpeed: log(1) would divide by 0
        self.warmup_type = warmup_type
        super().__init__(optimizer)

    @staticmethod
    def _per_group(value: Any, n: int, name: str) -> list[float]:
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ValueError(f"scheduler.params.{name} has {len(value)} values for {n} param groups")
            return [float(v) for v in value]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"scheduler.params.{name} must be a number or a list of numbers, got {value!r}")
        return [float(value)] * n

    def _warmup_gamma(self, it: int) -> float:
        if self.warmup_type == "log":
            return math.log(it + 1) / math.log(self.warmup_num_steps)
        return it / self.warmup_num_steps

    def _gamma(self, it: int) -> float:
        """Fraction of (max - min) at DeepSpeed iteration ``it`` (>= 0)."""
        if it < self.warmup_num_steps:
            return self._warmup_gamma(it)
        return 1.0

    def get_lr(self) -> list[float]:  # type: ignore[override]
        it = self.last_epoch - 1
        if it < 0:
            return list(self.min_lrs)
        gamma = self._gamma(it)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """DeepSpeed's WarmupDecayLR: WarmupLR's warmup, then linear decay to 0 at ``total_num_steps``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        if not isinstance(total_num_steps, int) or isinstance(total_num_steps, bool) or total_num_steps <= 0:
            raise ValueError(
                f"scheduler.params.total_num_steps must be a positive integer, got {total_num_steps!r}"
            )
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration
        )

    def _gamma(self, it: int) -> float:
        if it < self.warmup_num_steps:
            return self._warmup_gamma(it)
        return max(0.0, (self.total_num_steps - it) / max(1.0, self.total_num_steps - self.warmup_num_steps))


_SCHEDULERS: dict[str, type[WarmupLR]] = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR}


def _resolve_scheduler(spec: dict[str, Any]) -> tuple[type[WarmupLR], dict[str, Any]]:
    _raise(scheduler_spec_problems(spec))
    cls = _SCHEDULERS[SCHEDULER_PARAMS[spec["type"].lower()][0]]
    params = dict(spec.get("params") or {})
    for name in ("warmup_num_steps", "total_num_steps"):
        v = params.get(name)
        if isinstance(v, float) and v.is_integer():  # JSON 1e3
            params[name] = int(v)
    return cls, params


def build_scheduler(spec: dict[str, Any] | None, optimizer: torch.optim.Optimizer) -> LRScheduler | None:
    """Build the LR schedule a DeepSpeed ``scheduler`` block names; ``None`` means no schedule."""
    if spec is None:
        return None
    cls, kwargs = _resolve_scheduler(spec)
    return cls(optimizer, **kwargs)
