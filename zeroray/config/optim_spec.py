"""Which optimizers and LR schedules a config may name (``{"type": ..., "params": {...}}``), as tables.

Pure data and checks, no torch: :class:`~zeroray.config.ZeroConfig` validates a named optimizer with
them before any model exists, and ``zeroray.engine.named_optim`` builds the torch objects from the
same tables. The parameter lists mirror the torch constructors; a test compares them with
``inspect.signature`` of the installed torch, so a drift fails loudly instead of silently.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "OPTIMIZER_PARAMS",
    "SCHEDULER_PARAMS",
    "SUPPORTED_OPTIMIZERS",
    "SUPPORTED_SCHEDULERS",
    "optimizer_class_name",
    "optimizer_spec_problems",
    "scheduler_spec_problems",
]

_ADAM_COMMON = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused")
# torch.optim class name -> its constructor's keyword arguments (except ``params``).
OPTIMIZER_PARAMS: dict[str, tuple[str, ...]] = {
    "AdamW": _ADAM_COMMON,
    "Adam": (*_ADAM_COMMON, "decoupled_weight_decay"),
    "SGD": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach", "differentiable", "fused"),
    "Adagrad": (
        "lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps", "foreach", "maximize", "differentiable", "fused",
    ),
    "RMSprop": (
        "lr", "alpha", "eps", "weight_decay", "momentum", "centered", "capturable", "foreach", "maximize", "differentiable",
    ),
}
# DeepSpeed-only Adam/AdamW switches, consumed by named_optim (see its module doc).
ADAM_EXTRAS = ("torch_adam", "adam_w_mode", "bias_correction")
# Config type (case-insensitive) -> torch class name; "adam" is AdamW unless adam_w_mode is false.
_TYPES = {"adam": "AdamW", "adamw": "AdamW", "sgd": "SGD", "adagrad": "Adagrad", "rmsprop": "RMSprop"}
SUPPORTED_OPTIMIZERS: tuple[str, ...] = ("Adam", "AdamW", "SGD", "Adagrad", "RMSprop")

_WARMUP = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration")
# Schedule name (case-insensitive key) -> (its name, its parameters, the required ones).
SCHEDULER_PARAMS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "warmuplr": ("WarmupLR", _WARMUP, ()),
    "warmupdecaylr": ("WarmupDecayLR", ("total_num_steps", *_WARMUP), ("total_num_steps",)),
}
SUPPORTED_SCHEDULERS: tuple[str, ...] = ("WarmupLR", "WarmupDecayLR")

Problem = tuple[str, str]  # (dotted field, message)


def _shape(spec: Any, what: str) -> tuple[list[Problem], str | None, dict[str, Any]]:
    """Check ``{"type": str, "params": dict}``; return (problems, type, params)."""
    if not isinstance(spec, dict):
        return [(what, f"must be a dict like {{'type': ..., 'params': {{...}}}}, got {spec!r}")], None, {}
    problems: list[Problem] = [
        (f"{what}.{k}", "unknown key; expected only 'type' and 'params'") for k in spec if k not in ("type", "params")
    ]
    kind = spec.get("type")
    if not isinstance(kind, str):
        problems.append((f"{what}.type", f"must be a string, got {kind!r}"))
        kind = None
    params = spec.get("params") or {}
    if not isinstance(params, dict):
        return [*problems, (f"{what}.params", f"must be a dict, got {params!r}")], kind, {}
    for key, value in params.items():
        if value == "auto":
            problems.append(
                (f"{what}.params.{key}", "is 'auto'; zeroray.load_config resolves it from the optimizer passed to "
                 "initialize, otherwise give a value")
            )
    return problems, kind, params


def optimizer_class_name(kind: str, params: dict[str, Any]) -> str | None:
    """The torch.optim class a config's optimizer type means (None if unknown)."""
    name = _TYPES.get(kind.lower())
    if name == "AdamW" and kind.lower() == "adam" and params.get("adam_w_mode", True) is False:
        return "Adam"  # L2 regularisation added to the gradient, as torch's Adam
    return name


def optimizer_spec_problems(spec: Any) -> list[Problem]:
    """Everything wrong with an ``optimizer`` block, as (dotted field, message) pairs."""
    problems, kind, params = _shape(spec, "optimizer")
    if kind is None:
        return problems
    cls = optimizer_class_name(kind, params)
    if cls is None:
        return [
            *problems,
            ("optimizer.type", f"{kind!r} is not supported; supported types (case-insensitive): "
             f"{', '.join(SUPPORTED_OPTIMIZERS)}"),
        ]
    allowed = OPTIMIZER_PARAMS[cls]
    is_adam = cls in ("Adam", "AdamW")
    for name, value in params.items():
        if is_adam and name == "adam_w_mode" and not isinstance(value, bool):
            problems.append(("optimizer.params.adam_w_mode", f"must be true or false, got {value!r}"))
        elif is_adam and name == "bias_correction" and value is not True:
            problems.append(
                ("optimizer.params.bias_correction", "false is not supported: torch's Adam/AdamW always apply bias "
                 "correction")
            )
        elif name not in allowed and not (is_adam and name in ADAM_EXTRAS):
            problems.append(
                (f"optimizer.params.{name}", f"is not a parameter of torch.optim.{cls} (type {kind!r}); accepted: "
                 f"{', '.join(allowed)}")
            )
    return problems


def scheduler_spec_problems(spec: Any) -> list[Problem]:
    """Everything wrong with a ``scheduler`` block's type and parameter names."""
    problems, kind, params = _shape(spec, "scheduler")
    if kind is None:
        return problems
    entry = SCHEDULER_PARAMS.get(kind.lower())
    if entry is None:
        return [
            *problems,
            ("scheduler.type", f"{kind!r} is not supported; supported types: {', '.join(SUPPORTED_SCHEDULERS)}"),
        ]
    name, allowed, required = entry
    problems += [
        (f"scheduler.params.{k}", f"is not a parameter of {name}; accepted: {', '.join(allowed)}")
        for k in params
        if k not in allowed
    ]
    problems += [(f"scheduler.params.{k}", f"is required for {name}") for k in required if k not in params]
    return problems
