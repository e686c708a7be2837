"""Which parameters share a flat buffer.

Stage 3 gathers parameters a *unit* at a time: by default each block of an ``nn.ModuleList``
(a transformer's layers), else each top-level child, or the modules the user names. A unit must be
a module whose forward runs: a container (a ModuleList or ModuleDict inside the list) is replaced
by its children, recursively. A parameter
that sits in no unit, or in several (tied weights such as embedding = LM head), goes to the root
unit, which stays gathered from the start of forward until backward no longer reads it (see
:mod:`zeroray.engine.schedule`).

Stages 0-2 need no gathering; their flat buffers are reduction buckets of about
``reduce_bucket_size`` elements, filled in reverse registration order (the order gradients tend
to arrive in backward, as DDP does).

Within a unit or bucket, parameters are split by optimizer param group (each keeps its own
hyperparameters), by trainability (frozen ones get no gradient or optimizer state) and by dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from zeroray.engine import names as tensor_names


@dataclass
class GroupPlan:
    """The parameters of one future FlatGroup."""

    name: str
    unit: int | None  # index into the unit list; None = root unit (stage 3) or a bucket (stages 0-2)
    params: list[tuple[str, nn.Parameter]]
    param_group: int | None  # optimizer param group index; None = frozen

    @property
    def numel(self) -> int:
        return sum(p.numel() for _, p in self.params)


def find_units(model: nn.Module, names: Sequence[str] | None = None) -> list[tuple[str, nn.Module]]:
    """The stage-3 units of ``model``, outermost first, in registration order."""
    if names:
        matched = [
            (n, m) for n, m in model.named_modules() if n and (n in names or type(m).__name__ in names)
        ]
        for name in names:
            if not any(n == name or type(m).__name__ == name for n, m in matched):
                raise ValueError(
                    f"ZeroConfig.units names {name!r}, which is neither a submodule name nor a module "
                    f"class in {type(model).__name__}"
                )
        candidates = matched
    else:
        lists = _outermost([(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)])
        candidates = [(f"{n}.{i}", child) for n, m in lists for i, child in enumerate(m)]
        if not candidates:
            candidates = list(model.named_children())
    units = _outermost([u for n, m in candidates for u in _runs(n, m)])
    return [(n, m) for n, m in units if any(True for _ in m.parameters())]


def _runs(name: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``module``, or where it is a container whose forward never runs (a ModuleList of ModuleLists,
    a ModuleDict of blocks), the modules inside it that run: a unit is gathered by its forward hooks."""
    if type(module).forward is not nn.Module.forward:
        return [(name, module)]
    return [u for n, child in module.named_children() for u in _runs(f"{name}.{n}", child)]


def _outermost(mods: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    out: list[tuple[str, nn.Module]] = []
    for n, m in mods:
        if not any(n.startswith(o + ".") for o, _ in out):
            out.append((n, m))
    return out


def _split(params: list[tuple[str, nn.Parameter]], group_of: dict[int, int | None]):
    """Split by (param group, dtype) keeping first-seen order."""
    keyed: dict[tuple, list[tuple[str, nn.Parameter]]] = {}
    for n, p in params:
        keyed.setdefault((group_of[id(p)], p.dtype), []).append((n, p))
    return keyed


def _tag(pg: int | None) -> str:
    return "frozen" if pg is None else f"pg{pg}"


def plan_units(
    model: nn.Module, units: list[tuple[str, nn.Module]], group_of: dict[int, int | None]
) -> list[GroupPlan]:
    """Stage 3: one plan per (unit, param group, dtype); the root unit's plans come first."""
    members: dict[int, list[int]] = {}
    for ui, (_, m) in enumerate(units):
        for p in m.parameters():
            members.setdefault(id(p), []).append(ui)
    per_unit: dict[int | None, list[tuple[str, nn.Parameter]]] = {}
    for n, p in tensor_names.named_parameters(model):
        owners = members.get(id(p), [])
        per_unit.setdefault(owners[0] if len(owners) == 1 else None, []).append((n, p))
    plans = []
    for ui in [None, *range(len(units))]:
        base = "root" if ui is None else units[ui][0]
        keyed = _split(per_unit.get(ui, []), group_of)
        mixed = len(keyed) > len({pg for pg, _ in keyed})
        for (pg, dtype), params in keyed.items():
            suffix = _tag(pg) + (f".{str(dtype).removeprefix('torch.')}" if mixed else "")
            plans.append(GroupPlan(f"{base}/{suffix}", ui, params, pg))
    return plans


def plan_buckets(model: nn.Module, group_of: dict[int, int | None], bucket_size: int) -> list[GroupPlan]:
    """Stages 0-2: buckets of at least ``bucket_size`` elements (the last of each kind may be smaller)."""
    plans: list[GroupPlan] = []
    open_: dict[tuple, GroupPlan] = {}
    for n, p in reversed(list(tensor_names.named_parameters(model))):
        key = (group_of[id(p)], p.dtype)
        plan = open_.get(key)
        if plan is None:
            plan = GroupPlan("", None, [], key[0])
            open_[key] = plan
            plans.append(plan)
        plan.params.append((n, p))
        if plan.numel >= bucket_size:
            del open_[key]
    for i, plan in enumerate(plans):
        plan.name = f"bucket{i}/{_tag(plan.param_group)}"  # the index keeps names unique across dtypes
    return plans
