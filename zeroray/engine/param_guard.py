"""Clear errors for the ways user code reaches a stage-3 parameter while it is freed.

A freed parameter reads as NaN and refuses writes (see :mod:`zeroray.engine.flat_group`); that
never crashes, but the error should name the parameter and the way out. Two places can:

- ``module.state_dict()`` / ``load_state_dict()``: hooks on each module that owns a sharded
  parameter (removed on ``engine.close()``). Inside ``engine.gathered_parameters()`` the state dict
  holds copies of the full values; outside it raises and names ``engine.full_state_dict()``.
  ``state_dict(keep_vars=True)`` (the live parameter objects, e.g. to list names) is left alone.
- a parameter used outside its unit's forward (another module reaching into a unit): the model's
  first forward runs under a :class:`~torch.overrides.TorchFunctionMode` (entered by the root
  pre-hook, left by an always-called post-hook) that checks the arguments of every torch call
  against the parameters freed at that moment. Later forwards run without it (no cost per step).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from zeroray.engine.flat_group import FlatGroup, ParamState


class _Owner:
    """Where a sharded parameter lives: its group, its name and its unit's name."""

    __slots__ = ("group", "name", "unit")

    def __init__(self, group: FlatGroup, name: str, unit: str):
        self.group, self.name, self.unit = group, name, unit

    @property
    def freed(self) -> bool:
        return self.group.state is not ParamState.GATHERED


class _FreedUseCheck(TorchFunctionMode):
    def __init__(self, owners: dict[int, _Owner]):
        super().__init__()
        self.owners = owners

    def __torch_function__(self, func: Any, types: Any, args: Sequence = (), kwargs: dict | None = None) -> Any:
        if type(func).__name__ != "method-wrapper":  # attribute access (p.shape, p.data = ...) is fine
            for a in (*args, *(kwargs or {}).values()):
                for t in a if isinstance(a, (list, tuple)) else (a,):
                    owner = self.owners.get(id(t)) if isinstance(t, torch.Tensor) else None
                    if owner is not None and owner.freed:
                        fname = getattr(func, "__name__", str(func))
                        raise RuntimeError(
                            f"zeroray stage 3: parameter {owner.name!r} of unit {owner.unit!r} was used by "
                            f"{fname}() outside that unit's forward, while it is not gathered. Choose the units "
                            f"so that every module using it is inside one unit, or leave it out of all units "
                            f"(it then goes to the root unit, gathered for the whole step): "
                            f"ZeroConfig(units=[...]) naming modules or classes"
                        )
        return func(*args, **(kwargs or {}))


class ParamGuard:
    """Hooks that turn a freed parameter's misuse into an error naming it."""

    def __init__(self, model: nn.Module, groups: Sequence[FlatGroup], unit_of: dict[FlatGroup, str]):
        self.owners: dict[int, _Owner] = {}
        for g in groups:
            for name, p in zip(g.param_names, g.params):
                self.owners[id(p)] = _Owner(g, name, unit_of.get(g, "root"))
        self._hooks: list[RemovableHandle] = []
        for module in model.modules():
            if any(id(p) in self.owners for p in module._parameters.values() if p is not None):
                # (a partial: torch marks the hook object with an attribute, which a bound method refuses)
                self._hooks.append(module.register_state_dict_post_hook(partial(ParamGuard._state_dict_hook, self)))
                self._hooks.append(module.register_load_state_dict_pre_hook(self._load_hook))
        self._check: _FreedUseCheck | None = None
        self._checked = False
        self._hooks.append(model.register_forward_pre_hook(self._enter_check))
        self._hooks.append(model.register_forward_hook(self._leave_check, always_call=True))

    def _sharded(self, module: nn.Module, prefix: str) -> list[tuple[str, nn.Parameter, _Owner]]:
        return [
            (prefix + n, p, self.owners[id(p)])
            for n, p in module._parameters.items()
            if p is not None and id(p) in self.owners
        ]

    def _state_dict_hook(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        for key, p, owner in self._sharded(module, prefix):
            if key not in state_dict or state_dict[key] is p:  # keep_vars=True: the live objects, as asked
                continue
            if owner.freed:
                raise RuntimeError(
                    f"zeroray stage 3: {key!r} is sharded across ranks, so module.state_dict() cannot return "
                    "it. On every rank: sd = engine.full_state_dict() (then e.g. rank 0: "
                    "model.save_pretrained(dir, state_dict=sd) or torch.save(sd, path)); or call state_dict() "
                    "inside `with engine.gathered_parameters():`"
                )
            state_dict[key] = state_dict[key].detach().clone()  # the gathered memory is freed on exit

    def _load_hook(self, module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        for key, _, owner in self._sharded(module, prefix):
            if key in state_dict and owner.freed:
                raise RuntimeError(
                    f"zeroray stage 3: {key!r} is sharded across ranks, so load_state_dict() cannot write it. "
                    "On every rank: `with engine.gathered_parameters(modifier_rank=0): "
                    "model.load_state_dict(sd)` (rank 0's values reach every rank's shard and master)"
                )

    def _enter_check(self, module: nn.Module, args: Any) -> None:
        if not self._checked and self._check is None:
            self._check = _FreedUseCheck(self.owners)
            self._check.__enter__()

    def _leave_check(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._check is not None:
            check, self._check = self._check, None
            self._checked = True
            check.__exit__(None, None, None)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
