"""Clear errors for the ways user code reaches a stage-3 parameter while it is freed.

A freed parameter points at a placeholder of its shape over one NaN element (see
:mod:`zeroray.engine.flat_group`), so nothing can ever read freed memory. While the engine holds
the model, each sharded parameter's class is a subclass of its own (``nn.Parameter`` or the user's)
whose ``__torch_function__`` checks its arguments: a torch call that would read or write a freed
parameter raises an error naming it and the way out instead of computing with the placeholder:

- outside forward/backward: ``with engine.gathered_parameters(...)``, or ``engine.full_state_dict()``;
- during forward (another module reaching into a unit): choose ``ZeroConfig(units=...)``.

Metadata (``p.shape``, ``p.dtype``, ``p.numel()``, ``p.grad``, ...) works at any time, and
``print(p)`` describes the sharded parameter instead of printing values. A gathered parameter
behaves like any parameter (the check costs a few microseconds a call). ``module.state_dict()`` /
``load_state_dict()`` get hooks of their own with the recipe for whole models. ``engine.close()``
gives every parameter its class back and removes the hooks.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zeroray.engine.compiled import outside_graph
from zeroray.engine.flat_group import FlatGroup, ParamState

# Properties are metadata (shape, dtype, grad, is_* flags, ...) except these, which hand out the values.
_VALUE_PROPERTIES = frozenset("data T mT H mH real imag".split())
# Methods that only read metadata: allowed on a freed parameter (every other call refuses it).
_METADATA_METHODS = frozenset(
    getattr(torch.Tensor, name)
    for name in (
        "size dim ndimension numel nelement element_size get_device stride storage_offset data_ptr "
        "untyped_storage __len__ requires_grad_ register_hook register_post_accumulate_grad_hook __hash__"
    ).split()
)
_DESCRIBE = frozenset((torch.Tensor.__repr__, torch.Tensor.__format__))


def _reads_metadata_only(func: Any) -> bool:
    """Allowed on a freed parameter: the metadata methods, ``p.is_conj()``-style flags of the tensor
    (what torch.compile and other introspection ask; ``is_nonzero`` reads the value), and property
    reads and writes other than the values' (``.data``, ``.T``, ...). Asked only of freed parameters,
    so gathered ones pay nothing for it."""
    if func in _METADATA_METHODS:
        return True
    name = getattr(func, "__name__", "")
    if type(func).__name__ == "method-wrapper":
        return name != "__get__" or func.__self__.__name__ not in _VALUE_PROPERTIES
    return name.startswith(("is_", "_is_")) and name != "is_nonzero"


class _Owner:
    """Where a sharded parameter lives: its group, its name and its unit's name."""

    __slots__ = ("group", "guard", "name", "unit")

    def __init__(self, group: FlatGroup, name: str, unit: str, guard: ParamGuard):
        self.group, self.name, self.unit, self.guard = group, name, unit, guard

    @property
    def freed(self) -> bool:
        return self.group.state is not ParamState.GATHERED

    def describe(self, p: torch.Tensor) -> str:
        return (
            f"Parameter(zeroray stage-3 shard of {self.name!r} in unit {self.unit!r}, not gathered: "
            f"shape={tuple(p.shape)}, dtype={p.dtype}; read it inside `with engine.gathered_parameters():`)"
        )

    def error(self, func: Any) -> RuntimeError:
        fname = getattr(func, "__name__", str(func))
        fname = f".{func.__self__.__name__}" if fname in ("__get__", "__set__") else f"{fname}()"
        where = f"parameter {self.name!r} of unit {self.unit!r}"
        if self.guard.in_forward:
            return RuntimeError(
                f"zeroray stage 3: {where} was used by {fname} outside that unit's forward, while it is not "
                f"gathered. Choose the units so that every module using it is inside one unit, or leave it out "
                f"of all units (it then goes to the root unit, gathered for the whole step): "
                f"ZeroConfig(units=[...]) naming modules or classes"
            )
        return RuntimeError(
            f"zeroray stage 3: {where} is sharded across ranks and not gathered now, so {fname} cannot use it. "
            f"On every rank, use it inside `with engine.gathered_parameters([p]):` (add modifier_rank=r to keep "
            f"rank r's writes), or take the full weights with engine.full_state_dict()"
        )


def _owner_of(t: Any) -> _Owner | None:
    owners = getattr(type(t), "_zeroray_owners", None)
    return None if owners is None else owners.get(id(t))


class _Guarded:
    """Mixed in before a parameter's own class while the engine holds it (see the module doc)."""

    _zeroray_owners: ClassVar[dict[int, _Owner]]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence = (), kwargs: dict | None = None) -> Any:
        if torch.compiler.is_compiling():  # see zeroray.engine.compiled
            return super().__torch_function__(func, types, args, kwargs or {})  # type: ignore[misc]
        for a in (*args, *(kwargs or {}).values()):
            for t in a if isinstance(a, (list, tuple)) else (a,):
                owner = _owner_of(t)
                if owner is not None and owner.freed and not _reads_metadata_only(func):
                    if func in _DESCRIBE:
                        return owner.describe(t)
                    raise owner.error(func)
        return super().__torch_function__(func, types, args, kwargs or {})  # type: ignore[misc]


class ParamGuard:
    """Makes a freed parameter's misuse an error naming it (see the module doc)."""

    def __init__(self, model: nn.Module, groups: Sequence[FlatGroup], unit_of: dict[FlatGroup, str]):
        self.in_forward = False
        self.owners: dict[int, _Owner] = {}
        self._classes: dict[int, type] = {}  # each parameter's own class, given back on remove()
        guarded: dict[type, type] = {}
        for g in groups:
            for name, p in zip(g.param_names, g.params):
                self.owners[id(p)] = _Owner(g, name, unit_of.get(g, "root"), self)
                base = type(p)
                if base not in guarded:
                    guarded[base] = type(base.__name__, (_Guarded, base), {"_zeroray_owners": self.owners})
                self._classes[id(p)] = base
                p.__class__ = guarded[base]
        self._params = [p for g in groups for p in g.params]
        self._hooks: list[RemovableHandle] = []
        for module in model.modules():
            if any(id(p) in self.owners for p in module._parameters.values() if p is not None):
                # (partials: torch marks the hook object with an attribute, which a bound method refuses)
                self._hooks.append(module.register_state_dict_pre_hook(partial(ParamGuard._state_dict_pre_hook, self)))
                self._hooks.append(module.register_state_dict_post_hook(partial(ParamGuard._state_dict_hook, self)))
                self._hooks.append(module.register_load_state_dict_pre_hook(self._load_hook))
        self._hooks.append(model.register_forward_pre_hook(outside_graph(self._enter_forward, "start of forward")))
        self._hooks.append(model.register_forward_hook(outside_graph(self._leave_forward, "end of forward"), always_call=True))

    def _sharded(self, module: nn.Module, prefix: str) -> list[tuple[str, nn.Parameter, _Owner]]:
        return [
            (prefix + n, p, self.owners[id(p)])
            for n, p in module._parameters.items()
            if p is not None and id(p) in self.owners
        ]

    def _state_dict_pre_hook(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if keep_vars:  # the live objects, as asked (e.g. to list names)
            return
        for key, _, owner in self._sharded(module, prefix):
            if owner.freed:
                raise RuntimeError(
                    f"zeroray stage 3: {key!r} is sharded across ranks, so module.state_dict() cannot return "
                    "it. On every rank: sd = engine.full_state_dict() (then e.g. rank 0: "
                    "model.save_pretrained(dir, state_dict=sd) or torch.save(sd, path)); or call state_dict() "
                    "inside `with engine.gathered_parameters():`"
                )

    def _state_dict_hook(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        for key, p, _ in self._sharded(module, prefix):
            if key in state_dict and state_dict[key] is not p:
                state_dict[key] = state_dict[key].clone()  # the gathered memory is freed on exit

    def _load_hook(self, module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        for key, _, owner in self._sharded(module, prefix):
            if key in state_dict and owner.freed:
                raise RuntimeError(
                    f"zeroray stage 3: {key!r} is sharded across ranks, so load_state_dict() cannot write it. "
                    "On every rank: `with engine.gathered_parameters(modifier_rank=0): "
                    "model.load_state_dict(sd)` (rank 0's values reach every rank's shard and master)"
                )

    def _enter_forward(self, module: nn.Module, args: Any) -> None:
        self.in_forward = True

    def _leave_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self.in_forward = False

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for p in self._params:
            p.__class__ = self._classes[id(p)]
        self._params.clear()
        self.owners.clear()  # copies made inside gathered_parameters() keep the class: they know no owner
