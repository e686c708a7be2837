"""Stage 3 parameter fetching: gather a unit right before it runs, free it right after.

Hooks on the user's modules (removed by ``remove()``; nothing is patched):

- forward pre-hook of a unit: wait for its all-gather (issuing it if no prefetch did), then
  prefetch the next units in the last forward's order, up to ``prefetch_bucket_size`` elements;
- forward post-hook: free the unit, and hook the unit's outputs so that the gradient arriving at
  them gathers the unit again (and prefetches the next one in backward order);
- after backward: the reducer reports each group it reduced; a unit whose trainable groups are all
  reduced is freed at once (a unit with frozen parameters waits for the end of backward, since an
  op may still need those after the last trainable gradient).

The root unit (parameters in no unit, or in several: tied weights) is gathered at the start of the
model's forward and freed after backward, or right after forward when no backward will follow.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zeroray.engine.flat_group import FlatGroup, ParamState


def _tensors(obj: Any):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


class UnitFetcher:
    def __init__(
        self,
        model: nn.Module,
        units: Sequence[tuple[str, nn.Module]],
        groups: Sequence[FlatGroup],
        group_unit: dict[FlatGroup, int | None],
        prefetch_numel: int,
    ):
        self.root = [g for g in groups if group_unit[g] is None]
        self.unit_groups: list[list[FlatGroup]] = [[] for _ in units]
        for g in groups:
            if group_unit[g] is not None:
                self.unit_groups[group_unit[g]].append(g)
        self.unit_numel = [sum(g.padded for g in gs) for gs in self.unit_groups]
        self.free_early = [all(g.trainable for g in gs) for gs in self.unit_groups]
        self._pending_reduce = [sum(g.trainable for g in gs) for gs in self.unit_groups]
        self.group_unit = group_unit
        self.prefetch_numel = prefetch_numel
        self.order: list[int] = list(range(len(units)))  # unit order of the last forward
        self._fwd: list[int] = []
        self._bwd_order: list[int] = []
        self._bwd_pos = 0
        self._hooks: list[RemovableHandle] = [
            model.register_forward_pre_hook(self._root_pre),
            model.register_forward_hook(self._root_post),
        ]
        for ui, (_, m) in enumerate(units):
            self._hooks.append(m.register_forward_pre_hook(partial(self._pre_forward, ui)))
            self._hooks.append(m.register_forward_hook(partial(self._post_forward, ui)))

    # ------------------------------------------------------------------ helpers
    def _gather(self, ui: int | None) -> None:
        gs = self.root if ui is None else self.unit_groups[ui]
        for g in gs:
            g.start_gather()
        for g in gs:
            g.wait_gather()

    def _free(self, ui: int) -> None:
        for g in self.unit_groups[ui]:
            g.free()

    def _prefetch(self, order: list[int], start: int) -> None:
        budget = self.prefetch_numel
        for ui in order[start:]:
            if budget <= 0:
                break
            for g in self.unit_groups[ui]:
                g.start_gather()
            budget -= self.unit_numel[ui]

    # ------------------------------------------------------------------ forward
    def _root_pre(self, module: nn.Module, args: Any) -> None:
        self._fwd = []
        self._gather(None)

    def _pre_forward(self, ui: int, module: nn.Module, args: Any) -> None:
        self._fwd.append(ui)
        self._gather(ui)
        pos = len(self._fwd)
        if pos <= len(self.order) and self.order[pos - 1] == ui:
            self._prefetch(self.order, pos)

    def _post_forward(self, ui: int, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(partial(self._pre_backward, ui))
        self._free(ui)

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._fwd:
            self.order = self._fwd
        for ui in range(len(self.unit_groups)):  # prefetched but not used
            self._free(ui)
        self._bwd_order = list(reversed(self.order))
        self._bwd_pos = 0
        self._pending_reduce = [sum(g.trainable for g in gs) for gs in self.unit_groups]
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in _tensors(output))):
            for g in self.root:
                g.free()

    # ------------------------------------------------------------------ backward
    def _pre_backward(self, ui: int, grad: torch.Tensor) -> None:
        try:
            pos = self._bwd_order.index(ui, self._bwd_pos)
            self._bwd_pos = pos + 1
        except ValueError:  # a unit's second output, or an order the last forward did not show
            pos = None
        if pos is None and all(g.state is ParamState.GATHERED for g in self.unit_groups[ui]):
            return
        for g in self.unit_groups[ui]:
            g.start_gather()
        if pos is not None:
            self._prefetch(self._bwd_order, pos + 1)
        for g in self.unit_groups[ui]:
            g.wait_gather()

    def on_reduced(self, g: FlatGroup) -> None:
        """Called by the reducer when it launched ``g``'s reduction."""
        ui = self.group_unit[g]
        if ui is None:
            return
        self._pending_reduce[ui] -= 1
        if self._pending_reduce[ui] == 0 and self.free_early[ui]:
            self._free(ui)

    def after_backward(self) -> None:
        for ui in range(len(self.unit_groups)):
            self._free(ui)
        for g in self.root:
            g.free()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
