"""Resolve the ``"auto"`` values of Hugging Face-style DeepSpeed configs, without HF's Trainer.

HF's Trainer fills ``"auto"`` from its TrainingArguments and the model
(``transformers/integrations/deepspeed.py``). Here the model and the optimizer passed to
``zeroray.initialize`` play that part, for every key whose meaning is unambiguous without the
Trainer (:data:`RULES`), and for the switches and counts HF's Trainer takes from its flags, as the
Trainer does when no flag is given (fp16/bf16 off, no warm-up steps). Each resolution is logged at INFO
on the ``"zeroray"`` logger. Every other ``"auto"`` (``total_num_steps``, which the Trainer computes
from the length of the run) is reported, all in one error.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["NOT_GIVEN", "RULES", "log_resolutions", "resolve_autos"]

logger = logging.getLogger("zeroray")

NOT_GIVEN: Any = object()  # "auto" means the key was not written (the batch sizes)
OFF: Any = object()  # "auto" means false for an on-switch: it sets nothing (another key may set the same field)


class _Missing(Exception):
    """The model or the optimizer this rule reads was not passed."""


class _Unresolvable(Exception):
    pass


@dataclass(frozen=True)
class Sources:
    model: Any
    optimizer: Any
    config_lr: Any  # optimizer.params.lr of the config, when it is a number


@dataclass(frozen=True)
class Rule:
    """``doc``: what "auto" becomes (for docs/configuration.md); ``resolve``: -> (value, how, for the log)."""

    doc: str
    resolve: Callable[[Sources], tuple[Any, str]]


def _hidden_size(src: Sources) -> int:
    """As HF's Trainer: ``model.config.hidden_size``, else the largest of ``model.config.hidden_sizes``."""
    if src.model is None:
        raise _Missing("it is computed from the model's hidden size; pass the model (zeroray.initialize does)")
    cfg = getattr(src.model, "config", None)
    if hasattr(cfg, "hidden_size"):
        h = cfg.hidden_size
    elif hasattr(cfg, "hidden_sizes"):
        h = max(cfg.hidden_sizes)
    else:
        raise _Unresolvable(
            f"HF computes it from model.config.hidden_size (or hidden_sizes), which this "
            f"{type(src.model).__name__} does not have; give a number"
        )
    if not isinstance(h, int) or isinstance(h, bool) or h < 1:
        raise _Unresolvable(f"model.config's hidden size is {h!r}, not a positive integer; give a number")
    return h


def _bucket(factor: float, what: str) -> Callable[[Sources], tuple[Any, str]]:
    def resolve(src: Sources) -> tuple[Any, str]:
        h = _hidden_size(src)
        return int(factor * h * h), f"{what}hidden_size {h} squared, as HF"

    return resolve


def _from_optimizer(name: str) -> Callable[[Sources], tuple[Any, str]]:
    def resolve(src: Sources) -> tuple[Any, str]:
        if src.optimizer is None:
            raise _Missing(f"HF fills it from its arguments; zeroray from the {name} of the optimizer passed to "
                           "initialize, and none was passed; give a value")
        defaults = getattr(src.optimizer, "defaults", None)
        if not isinstance(defaults, dict):
            raise _Unresolvable(f"the optimizer passed ({type(src.optimizer).__name__}) is not a torch optimizer "
                                f"instance with a {name}; give a value")
        if name not in defaults:
            raise _Unresolvable(f"the {type(src.optimizer).__name__} passed to initialize has no {name}; give a value")
        value = defaults[name]
        value = list(value) if isinstance(value, tuple) else value
        return value, f"the {name} of the {type(src.optimizer).__name__} passed to initialize"

    return resolve


def _warmup_max_lr(src: Sources) -> tuple[Any, str]:
    if src.optimizer is None and isinstance(src.config_lr, numbers.Real):
        return src.config_lr, "optimizer.params.lr, as HF's learning_rate"
    value, how = _from_optimizer("lr")(src)
    return value, f"{how}, as HF's learning_rate"


_NOT_GIVEN_DOC = "not given: derived from the other batch sizes and the world size"

RULES: dict[str, Rule] = {
    **{
        key: Rule(_NOT_GIVEN_DOC, lambda src: (NOT_GIVEN, "derived from the other batch sizes and the world size"))
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    },
    "gradient_clipping": Rule("1.0, HF's default max_grad_norm", lambda src: (1.0, "HF's default max_grad_norm")),
    # HF's Trainer sets these from its --fp16 / --bf16 flags, both off by default: fp32.
    "fp16.enabled": Rule("false (fp32), as HF's Trainer without --fp16", lambda src: (OFF, "HF's Trainer without --fp16")),
    "bf16.enabled": Rule("false (fp32), as HF's Trainer without --bf16", lambda src: (OFF, "HF's Trainer without --bf16")),
    # HF's Trainer: --warmup_steps, else ceil(--warmup_ratio x steps); both 0 by default.
    "scheduler.params.warmup_num_steps": Rule(
        "0, as HF's Trainer without --warmup_steps or --warmup_ratio",
        lambda src: (0, "HF's Trainer without --warmup_steps or --warmup_ratio"),
    ),
    "zero_optimization.reduce_bucket_size": Rule("hidden_size², as HF", _bucket(1.0, "")),
    **{
        key: Rule("the ranks of one node, resolved by ZeroTrainer", lambda src: ("auto", "the ranks of one node (ZeroTrainer)"))
        for key in ("zero_optimization.mics_shard_size", "zero_optimization.zero_hpz_partition_size")
    },
    "zero_optimization.stage3_prefetch_bucket_size": Rule("0.9 × hidden_size², as HF", _bucket(0.9, "0.9 x ")),
    **{
        f"optimizer.params.{name}": Rule(f"the {name} of the optimizer passed to initialize", _from_optimizer(name))
        for name in ("lr", "betas", "eps", "weight_decay")
    },
    "scheduler.params.warmup_min_lr": Rule("0, as HF", lambda src: (0.0, "as HF")),
    "scheduler.params.warmup_max_lr": Rule(
        "the lr of the optimizer passed to initialize (else optimizer.params.lr), as HF", _warmup_max_lr
    ),
}

# Why the other "auto"s have no meaning here (the default: no meaning without HF's Trainer).
_WHY_NOT = {
    "scheduler.params.total_num_steps": "HF's Trainer computes it from the number of training steps; give a number",
}


def resolve_autos(
    autos: dict[str, str], *, model: Any, optimizer: Any, config_lr: Any = None, defer: bool = False
) -> tuple[dict[str, Any], list[tuple[str, str]], list[str]]:
    """Resolve ``{key: ZeroConfig path}`` of "auto" values.

    Returns ``{path: value}`` (``NOT_GIVEN`` where "auto" means "not written", and for every "auto"
    left unresolved, so that no "auto" reaches ZeroConfig; no entry for a switch resolved off, so that
    ``"fp16": "auto"`` leaves ``"bf16": true`` standing), the ``(key, line)`` problems and the
    log lines (see :func:`log_resolutions`). With
    ``defer``, an "auto" that needs a model or optimizer that was not passed is no problem: it is left
    at ZeroConfig's default, for an early check before the model exists.
    """
    src = Sources(model, optimizer, config_lr)
    resolved: dict[str, Any] = {}
    problems: list[tuple[str, str]] = []
    log: list[str] = []
    for key, path in autos.items():
        resolved[path] = NOT_GIVEN
        canonical = "bf16" + key[len("bfloat16"):] if key.startswith("bfloat16.") else key
        rule = RULES.get(canonical)
        try:
            if rule is None:
                raise _Unresolvable(_WHY_NOT.get(canonical, "it has no meaning without HF's Trainer; give a value"))
            value, how = rule.resolve(src)
        except _Missing as e:
            if not defer:
                problems.append((key, f"DeepSpeed config key '{key}' is 'auto', which zeroray cannot resolve: {e}"))
            continue
        except _Unresolvable as e:
            problems.append((key, f"DeepSpeed config key '{key}' is 'auto', which zeroray cannot resolve: {e}"))
            continue
        shown = "not given" if value is NOT_GIVEN else "false" if value is OFF else value
        log.append(f"resolved '{key}': auto -> {shown} ({how})")
        if value is OFF:
            del resolved[path]
        else:
            resolved[path] = value
    return resolved, problems, log


def log_resolutions(lines: list[str]) -> None:
    """Log each resolution at INFO on the "zeroray" logger (once the whole config is known good)."""
    for line in lines:
        logger.info("%s", line)
