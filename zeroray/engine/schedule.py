"""UnitScheduler: when stage-3 units gather and free, and what is prefetched.

Hooks on the user's modules (removed by ``remove()``; nothing is patched):

- the model's forward pre-hook gathers the root unit; its post-hook records this forward's unit
  order (the prefetch order of the next forward and, reversed, of the backward) and frees what was
  prefetched but not used, and the root when no backward will follow;
- a unit's forward pre-hook gathers it (usually prefetched already) and prefetches the next units
  in the last forward's order, up to ``prefetch_bucket_size`` elements; its post-hook frees it
  and hooks its outputs, so the gradient arriving at them gathers the unit again for its backward
  and prefetches the next one in backward order;
- the reducer tells each unit when its groups are reduced (see :class:`~zeroray.engine.unit.Unit`);
  ``after_backward()`` frees everything;
- the root unit is freed early, at a unit's backward, once no tensor saved by the forward views its
  memory (:class:`~zeroray.engine.saved_views.SavedViews`); a module holding root parameters that
  runs in backward after that (an activation-checkpointed region recomputing) gathers it again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zeroray.engine.compiled import outside_graph
from zeroray.engine.flat_group import FlatGroup, ParamState
from zeroray.engine.quantized_comm import Phase
from zeroray.engine.saved_views import SavedViews
from zeroray.engine.unit import TrainingState, Unit


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in a module's output: nested lists, tuples, dicts and dataclasses."""
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from tensors_in(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors_in(o)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, f.name))


class UnitScheduler:
    def __init__(
        self,
        model: nn.Module,
        root: Unit,
        units: Sequence[Unit],
        prefetch_numel: int,
        read_ahead: Callable[[Iterable[FlatGroup]], None] | None = None,
    ):
        self.root = root
        self.read_ahead = read_ahead
        self.units = list(units)
        self.prefetch_numel = prefetch_numel
        self.order: list[Unit] = list(self.units)  # unit order of the last forward
        self._fwd: list[Unit] = []
        self._bwd_order: list[Unit] = []
        self._bwd_pos = 0
        self._root_views = SavedViews()
        self._hooks: list[RemovableHandle] = [
            model.register_forward_pre_hook(outside_graph(self._root_pre, "gather of the root unit")),
            # (also when the forward raises)
            model.register_forward_hook(outside_graph(self._stop_watching, "end of forward"), always_call=True),
            model.register_forward_hook(outside_graph(self._root_post, "end of forward")),
        ]
        root_params = {p for g in root.groups for p in g.params}
        unit_modules = {m for u in self.units for m in u.module.modules()}
        for name, m in model.named_modules():
            if m not in unit_modules and any(p in root_params for p in m.parameters(recurse=False)):
                check = outside_graph(self._root_module_pre, f"root-unit check of {name or 'the model'}")
                self._hooks.append(m.register_forward_pre_hook(check))
        for unit in self.units:
            self._hooks.append(unit.module.register_forward_pre_hook(
                outside_graph(partial(self._pre_forward, unit), f"gather of unit {unit.name!r}")))
            self._hooks.append(unit.module.register_forward_hook(
                outside_graph(partial(self._post_forward, unit), f"free of unit {unit.name!r}")))

    @property
    def all_units(self) -> list[Unit]:
        """The root unit, then the units."""
        return [self.root, *self.units]

    def _prefetch(self, order: list[Unit], start: int, phase: Phase) -> None:
        budget = self.prefetch_numel
        for unit in order[start:]:
            if budget <= 0:
                break
            unit.prefetch(phase)
            budget -= unit.numel
        self._read_ahead(order[start:])

    def _read_ahead(self, units: Sequence[Unit]) -> None:
        """Parameters in files: start reading the freed groups of ``units``, in this order."""
        if self.read_ahead is not None:
            self.read_ahead(g for u in units for g in u.groups if g.state is ParamState.FREED)

    # ------------------------------------------------------------------ forward
    def _root_pre(self, module: nn.Module, args: Any) -> None:
        self._fwd = []
        self._read_ahead([self.root, *self.order])
        self.root.pre_forward()
        if torch.is_grad_enabled() and self.root.groups:
            self._root_views.start(self.root.groups)

    def _root_module_pre(self, module: nn.Module, args: Any) -> None:
        """A module holding root parameters runs after the root was freed early in this backward
        (a checkpointed region recomputing): gather it again until the backward ends."""
        if self.root.state is TrainingState.POST_BACKWARD and not self.root.gathered:
            self.root.gather("forward")  # what the first forward computed with (int8 under qwZ)

    def _pre_forward(self, unit: Unit, module: nn.Module, args: Any) -> None:
        self._fwd.append(unit)
        unit.pre_forward()
        pos = len(self._fwd)
        if pos <= len(self.order) and self.order[pos - 1] is unit:
            self._prefetch(self.order, pos, "forward")

    def _post_forward(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        backward_follows = False
        if torch.is_grad_enabled():
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(partial(self._pre_backward, unit))
                    backward_follows = True
        unit.post_forward(backward_follows)

    def _stop_watching(self, module: nn.Module, args: Any, output: Any) -> None:
        self._root_views.stop()

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._fwd:
            self.order = self._fwd
        for unit in self.units:  # prefetched but not used
            unit.free()
            unit.expect_backward()
        self.root.expect_backward()
        self._bwd_order = list(reversed(self.order))
        self._bwd_pos = 0
        self._read_ahead(self._bwd_order)
        self.root.post_forward(torch.is_grad_enabled() and any(t.requires_grad for t in tensors_in(output)))

    # ------------------------------------------------------------------ backward
    def _pre_backward(self, unit: Unit, grad: torch.Tensor) -> None:
        try:
            pos = self._bwd_order.index(unit, self._bwd_pos)
            self._bwd_pos = pos + 1
        except ValueError:  # a unit's second output, or an order the last forward did not show
            pos = None
        if pos is None and unit.gathered:
            return
        unit.prefetch("backward")
        if pos is not None:
            self._prefetch(self._bwd_order, pos + 1, "backward")
        unit.pre_backward()
        if self.root.state is TrainingState.BACKWARD and self._root_views.all_read:
            self.root.free_unused()

    def after_backward(self) -> None:
        for unit in self.units:
            unit.post_backward()
        self.root.post_backward()
        self._root_views.reset()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
