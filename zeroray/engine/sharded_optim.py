"""Rebuild the user's optimizer over this rank's shards.

The user builds an optimizer over ``model.parameters()`` (or passes a callable, or names one in the
config). zeroray keeps its class, its param groups and their hyperparameters, and builds the same
optimizer over the flat fp32 master shards this rank owns, one shard list per param group, so a
no-weight-decay group stays one group and an LR scheduler sees the groups the user made.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zeroray.config import ZeroConfig
from zeroray.engine.flat_group import FlatGroup

OptimizerArg = torch.optim.Optimizer | Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None


def template_optimizer(model: nn.Module, optimizer: OptimizerArg, config: ZeroConfig) -> torch.optim.Optimizer:
    """The optimizer over the model's parameters whose shape zeroray reproduces over the shards."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if optimizer is None:
        if config.optimizer is None:
            raise ValueError(
                "no optimizer: pass one to zeroray.initialize(model, optimizer, ...) or name one in the "
                "config's 'optimizer' block"
            )
        from zeroray.engine.named_optim import build_optimizer

        opt = build_optimizer(config.optimizer, trainable)
    elif isinstance(optimizer, torch.optim.Optimizer):
        opt = optimizer
    elif callable(optimizer):
        opt = optimizer(trainable)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"the optimizer callable returned {type(opt).__name__}, not a torch.optim.Optimizer")
    else:
        raise TypeError(
            "optimizer must be a torch.optim.Optimizer over model.parameters(), a callable params -> "
            f"Optimizer, or None; got {type(optimizer).__name__}"
        )
    in_model = {id(p) for p in model.parameters()}
    foreign = [p for g in opt.param_groups for p in g["params"] if id(p) not in in_model]
    if foreign:
        shapes = ", ".join(str(tuple(p.shape)) for p in foreign[:5])
        raise ValueError(
            f"the optimizer holds {len(foreign)} parameter(s) that are not parameters of the model "
            f"(shapes {shapes}); build it over model.parameters()"
        )
    if optimizer is not None and config.optimizer is not None:
        # DeepSpeed logs "Using client Optimizer" here; a silent choice would hide a block that does nothing.
        warnings.warn(
            f"zeroray: the config's 'optimizer' block ({config.optimizer.get('type')!r}) is ignored: "
            f"zeroray.initialize was given an optimizer ({type(opt).__name__}), and that one is used",
            UserWarning,
            stacklevel=4,  # the caller of zeroray.initialize
        )
    return opt


def _refuse_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    raise RuntimeError(
        "zeroray: call engine.step(), not optimizer.step(): the optimizer passed to zeroray.initialize "
        "was rebuilt over this rank's shards (engine.optimizer), and stepping the original would do nothing"
    )


def refuse_direct_step(template: torch.optim.Optimizer) -> RemovableHandle:
    """Make ``template.step()`` raise (a per-instance hook, no patching): the user's optimizer holds
    the model's parameters, not the shards the engine trains, so stepping it is silently a no-op."""
    return template.register_step_pre_hook(_refuse_step)


def param_group_index(model: nn.Module, template: torch.optim.Optimizer) -> dict[int, int | None]:
    """id(param) -> index of its optimizer param group, or None for frozen parameters."""
    group_of: dict[int, int | None] = {}
    for gi, g in enumerate(template.param_groups):
        for p in g["params"]:
            group_of[id(p)] = gi if p.requires_grad else None
    for name, p in model.named_parameters():
        if id(p) not in group_of:
            if p.requires_grad:
                raise ValueError(
                    f"parameter {name!r} requires grad but is in no param group of the optimizer; add it to "
                    "the optimizer or set requires_grad=False"
                )
            group_of[id(p)] = None
    return group_of


def _constructor_kwargs(cls: type, defaults: dict) -> dict:
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}


def shard_optimizer(
    template: torch.optim.Optimizer, groups: Sequence[FlatGroup]
) -> tuple[torch.optim.Optimizer, dict[int, FlatGroup]]:
    """The template's optimizer class over the master shards; also id(shard param) -> FlatGroup."""
    owner: dict[int, FlatGroup] = {}
    per_group: list[list[nn.Parameter]] = [[] for _ in template.param_groups]
    for g in groups:
        if g.trainable:
            p = nn.Parameter(g.master, requires_grad=True)  # shares g.master's storage
            g.opt_param = p
            owner[id(p)] = g
            per_group[g.param_group].append(p)
    new_groups = [
        {**{k: v for k, v in tg.items() if k != "params"}, "params": ps}
        for tg, ps in zip(template.param_groups, per_group)
    ]
    cls = type(template)
    return cls(new_groups, **_constructor_kwargs(cls, template.defaults)), owner


def state_tensors(optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter]) -> Iterable[torch.Tensor]:
    """The optimizer's state tensors for ``params`` (for memory accounting)."""
    for p in params:
        for v in optimizer.state.get(p, {}).values():
            if torch.is_tensor(v):
                yield v
