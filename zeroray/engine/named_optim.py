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

import inspect
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

__all__ = [
    "SUPPORTED_OPTIMIZERS",
    "SUPPORTED_SCHEDULERS",
    "WarmupDecayLR",
    "WarmupLR",
    "build_optimizer",
    "build_scheduler",
    "validate_optimizer_spec",
    "validate_scheduler_spec",
]

# Lower-case name -> torch class. "adam" resolves to AdamW unless adam_w_mode is false.
_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adam": torch.optim.AdamW,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
    "rmsprop": torch.optim.RMSprop,
}
SUPPORTED_OPTIMIZERS: tuple[str, ...] = ("Adam", "AdamW", "SGD", "Adagrad", "RMSprop")
SUPPORTED_SCHEDULERS: tuple[str, ...] = ("WarmupLR", "WarmupDecayLR")
_SPEC_KEYS = ("type", "params")


def _split_spec(spec: Any, what: str) -> tuple[str, dict[str, Any]]:
    """Check the ``{"type": str, "params": dict}`` shape; return (type, a copy of params)."""
    if not isinstance(spec, dict):
        raise ValueError(f"{what} must be a dict like {{'type': ..., 'params': {{...}}}}, got {spec!r}")
    extra = sorted(set(spec) - set(_SPEC_KEYS))
    if extra:
        raise ValueError(f"{what} has unknown key(s) {extra}; expected only 'type' and 'params'")
    kind = spec.get("type")
    if not isinstance(kind, str):
        raise ValueError(f"{what}.type must be a string, got {kind!r}")
    params = spec.get("params") or {}
    if not isinstance(params, dict):
        raise ValueError(f"{what}.params must be a dict, got {params!r}")
    for key, value in params.items():
        if value == "auto":
            raise ValueError(
                f"{what}.params.{key} is 'auto': zeroray has no trainer arguments to fill it in; give a value"
            )
    return kind, dict(params)


def _constructor_keys(cls: type) -> list[str]:
    """Keyword arguments ``cls.__init__`` accepts, except ``self`` and ``params``."""
    sig = inspect.signature(cls.__init__)
    return [
        name
        for name, p in sig.parameters.items()
        if name not in ("self", "params") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


def _resolve_optimizer(spec: dict[str, Any]) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """Map a DeepSpeed optimizer block to (torch class, constructor kwargs), raising on anything unknown."""
    kind, params = _split_spec(spec, "optimizer")
    key = kind.lower()
    if key not in _OPTIMIZERS:
        raise ValueError(
            f"optimizer.type {kind!r} is not supported; supported types (case-insensitive): "
            f"{', '.join(SUPPORTED_OPTIMIZERS)}"
        )
    cls = _OPTIMIZERS[key]
    if key in ("adam", "adamw"):
        params.pop("torch_adam", None)  # chooses DeepSpeed's kernel only; numerics are the same
        adam_w_mode = params.pop("adam_w_mode", True)
        if not isinstance(adam_w_mode, bool):
            raise ValueError(f"optimizer.params.adam_w_mode must be true or false, got {adam_w_mode!r}")
        if key == "adam" and not adam_w_mode:
            cls = torch.optim.Adam  # L2 regularisation added to the gradient, as torch's Adam
        if params.pop("bias_correction", True) is not True:
            raise ValueError(
                "optimizer.params.bias_correction=false is not supported: torch's Adam/AdamW always "
                "apply bias correction"
            )
        params.setdefault("weight_decay", 0.0)  # DeepSpeed's Adam default; torch's AdamW has 0.01
    allowed = _constructor_keys(cls)
    for name in params:
        if name not in allowed:
            raise ValueError(
                f"optimizer.params.{name} is not a parameter of torch.optim.{cls.__name__} "
                f"(type {kind!r}); accepted: {', '.join(allowed)}"
            )
    if isinstance(params.get("betas"), list):
        params["betas"] = tuple(params["betas"])
    return cls, params


def validate_optimizer_spec(spec: dict[str, Any]) -> None:
    """Raise ValueError if :func:`build_optimizer` would reject ``spec`` (no parameters needed)."""
    _resolve_optimizer(spec)


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
            or warmup_num_steps <= 0
        ):
            raise ValueError(
                f"scheduler.params.warmup_num_steps must be a positive integer, got {warmup_num_steps!r}"
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


_SCHEDULERS: dict[str, type[WarmupLR]] = {"warmuplr": WarmupLR, "warmupdecaylr": WarmupDecayLR}


def _resolve_scheduler(spec: dict[str, Any]) -> tuple[type[WarmupLR], dict[str, Any]]:
    kind, params = _split_spec(spec, "scheduler")
    cls = _SCHEDULERS.get(kind.lower())
    if cls is None:
        raise ValueError(
            f"scheduler.type {kind!r} is not supported; supported types: {', '.join(SUPPORTED_SCHEDULERS)}"
        )
    allowed = [k for k in _constructor_keys(cls) if k != "optimizer"]
    for name in params:
        if name not in allowed:
            raise ValueError(
                f"scheduler.params.{name} is not a parameter of {kind}; accepted: {', '.join(allowed)}"
            )
    if cls is WarmupDecayLR and "total_num_steps" not in params:
        raise ValueError("scheduler.params.total_num_steps is required for WarmupDecayLR")
    for name in ("warmup_num_steps", "total_num_steps"):
        v = params.get(name)
        if isinstance(v, float) and v.is_integer():  # JSON 1e3
            params[name] = int(v)
    return cls, params


def validate_scheduler_spec(spec: dict[str, Any]) -> None:
    """Raise ValueError if :func:`build_scheduler` would reject ``spec``'s type or parameter names."""
    _resolve_scheduler(spec)


def build_scheduler(spec: dict[str, Any] | None, optimizer: torch.optim.Optimizer) -> LRScheduler | None:
    """Build the LR schedule a DeepSpeed ``scheduler`` block names; ``None`` means no schedule."""
    if spec is None:
        return None
    cls, kwargs = _resolve_scheduler(spec)
    return cls(optimizer, **kwargs)
