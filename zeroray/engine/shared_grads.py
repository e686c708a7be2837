"""SharedGradSum: a tied parameter's gradients are summed in place, not into a new tensor.

A parameter used in two places (a tied embedding and output head) gets two gradients in backward,
and autograd adds them before accumulating the sum. Torch's ``InputBuffer`` adds in place only into
a gradient it holds alone, and the head's is not one: ``nn.Linear`` applies ``weight.t()``, so
its gradient arrives from ``TBackward0`` as a view whose base is still alive. The sum is then a new
tensor of the parameter's size (vocabulary × width for an embedding), made at the end of backward
while both parts are still alive: on a 50257-token GPT at stage 0 it was 96 MiB of backward's
442 MiB malloc peak (docs/architecture.md, "Where the peak is").

Before each backward, :meth:`SharedGradSum.prepare` walks the graph once from the loss and hooks
every node that hands one of the watched parameters a gradient. A hook hands each such gradient
over as a plain alias of its memory (``detach()``), so autograd owns the first one alone and adds
the others into it. The values and the order of the additions are unchanged. Under
``create_graph`` (grad mode on in backward) autograd adds out of place anyway and the hook does
nothing, so higher-order graphs stay whole. Only parameters the model reaches under more than one
name are watched: a model without tied weights pays nothing. Uses inside a reentrant checkpoint
run a backward of their own that the walk does not see; their sum stays as torch makes it.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import torch
from torch.autograd.graph import Node


def _plain_grads(
    slots: tuple[int, ...], grad_inputs: tuple[torch.Tensor | None, ...], grad_outputs: object
) -> tuple[torch.Tensor | None, ...] | None:
    if torch.is_grad_enabled():
        return None
    out = list(grad_inputs)
    for i in slots:
        if out[i] is not None:
            out[i] = out[i].detach()
    return tuple(out)


class SharedGradSum:
    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self._watched = {id(p): p for p in params}
        self.hooked = 0  # nodes hooked for the last backward

    def prepare(self, output: torch.Tensor) -> None:
        """Hook the nodes that feed a watched parameter's gradient in ``output``'s graph."""
        self.hooked = 0
        if not self._watched or output.grad_fn is None:
            return
        feeders: dict[Node, dict[Node, list[int]]] = {}  # accumulator -> node -> its output slots
        seen: set[Node] = {output.grad_fn}
        stack = [output.grad_fn]
        while stack:
            node = stack.pop()
            for slot, (nxt, _) in enumerate(node.next_functions):
                if nxt is None:
                    continue
                variable = getattr(nxt, "variable", None)  # AccumulateGrad: a leaf's accumulator
                if variable is not None:
                    if self._watched.get(id(variable)) is variable:
                        feeders.setdefault(nxt, {}).setdefault(node, []).append(slot)
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        for by_node in feeders.values():
            if sum(len(slots) for slots in by_node.values()) < 2:
                continue  # used once in this forward: nothing to sum
            for node, slots in by_node.items():
                node.register_hook(partial(_plain_grads, tuple(slots)))
                self.hooked += 1
