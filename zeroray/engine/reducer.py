"""Gradient reduction during backward.

A post-accumulate-grad hook on every trainable parameter writes its gradient into its group's
:class:`GradBuffer` and drops ``param.grad``. When the last parameter of a group has arrived,
the group's reduction is launched asynchronously, overlapping the rest of backward:

- unsharded gradients (stages 0-1) accumulate in the group's persistent buffer and are reduced
  only on the accumulation boundary (no communication on the other micro-steps);
- sharded gradients (stages 2-3) are reduced every micro-step from a pooled temporary buffer,
  keeping only this rank's shard.

A stage-3 :class:`~zeroray.engine.unit.Unit` is told when one of its groups was reduced, so it
can free its parameters early. ``finish()`` (end of backward) reduces groups whose parameters got
no gradient, so every rank issues the same collectives, and waits for all. In-flight temporaries
are bounded by ``reduce_bucket_size`` elements (at least one reduction may always be in flight),
so stages 2-3 never hold the full gradients at once. Temporaries are reused within a backward and
released at its end, so they do not sit idle through the optimizer step, the next forward and the
start of the next backward (stage 3's peak).

With a :class:`~zeroray.engine.heap_trim.HeapTrimmer` (stage 3, ``trim_host_heap``), the C heap's
free pages go back to the OS after each unit's last reduction is launched and at the end of backward.

``on_final(group)`` (optional) is called once a group's gradient shard holds its final value for the
step (its reduction on the accumulation boundary is done): CPU offload on CUDA starts the shard's
device-to-host copy there.

Finished reductions are completed, oldest first, as gradients arrive, so their callbacks run during
backward: the device-to-host copies of the first reduced groups, and under hybrid sharding each group's
all-reduce across the replicas (issued once its reduction inside the shard group is done, like a DDP
bucket's), overlap the rest of backward; only the last groups' are waited at its end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch

from zeroray.engine.comm import InFlight
from zeroray.engine.flat_group import FlatGroup
from zeroray.engine.grad_buffer import GradBuffer
from zeroray.engine.heap_trim import HeapTrimmer

if TYPE_CHECKING:
    from zeroray.engine.unit import Unit


class GradReducer:
    def __init__(
        self,
        groups: Sequence[FlatGroup],
        *,
        reduce_every_micro_step: bool,
        overlap: bool,
        max_inflight: int,
        units: Sequence[Unit] = (),
        on_final: Callable[[FlatGroup], None] | None = None,
        trimmer: HeapTrimmer | None = None,
    ):
        self.groups = [g for g in groups if g.trainable]
        self.reduce_every_micro_step = reduce_every_micro_step
        self.overlap = overlap
        self.active = False
        self.boundary = True
        self._unit_of: dict[FlatGroup, Unit] = {g: u for u in units for g in u.groups}
        self._on_final = on_final
        self._trimmer = trimmer
        self._bufs: dict[FlatGroup, GradBuffer] = {}
        self._remaining: dict[FlatGroup, int] = {}
        self._inflight = InFlight(max_inflight)
        # Temporaries of sharded gradients, reused within a backward (as DeepSpeed's reduce bucket),
        # so a backward allocates only as many as are in use at once. A group takes the smallest
        # pooled tensor that is large enough (a prefix of it), so the root unit borrows a block's
        # temporary instead of allocating one of its own size.
        self._pool: dict[torch.dtype, list[torch.Tensor]] = {}
        self.temporaries_allocated = 0  # in the last backward
        self._base: dict[GradBuffer, torch.Tensor] = {}  # the pooled tensor under a temporary
        # A sharded group's first small gradients (slot, gradient), up to a quarter of the group,
        # wait for the bulk before a temporary is taken: the root unit's layer-norm gradients come
        # at the start of backward and its embedding's at the end, and a temporary held in between
        # would sit idle at the peak (the start of backward).
        self._held: dict[FlatGroup, list[tuple[int, torch.Tensor]]] = {}
        self._held_numel: dict[FlatGroup, int] = {}
        # Which parameters got a gradient since the last optimizer step (see take_used).
        self._used: dict[FlatGroup, list[bool]] = {g: [False] * len(g.params) for g in self.groups}
        self._hooks = [
            p.register_post_accumulate_grad_hook(partial(self._on_grad, g, i))
            for g in self.groups
            for i, p in enumerate(g.params)
        ]

    def begin(self, boundary: bool) -> None:
        """Start a backward pass; ``boundary``: this micro-step ends an accumulation cycle."""
        self.active = True
        self.boundary = boundary
        self._remaining = {g: len(g.params) for g in self.groups}
        self._bufs.clear()
        self._held.clear()
        self._held_numel.clear()
        self.temporaries_allocated = 0

    @property
    def _reduces_now(self) -> bool:
        return self.reduce_every_micro_step or self.boundary

    def _buffer(self, g: FlatGroup) -> GradBuffer:
        buf = self._bufs.get(g)
        if buf is None:
            buf = g.open_grads()
            if buf is None:
                base = self._take(g.padded, g.reduce_dtype)
                self.temporaries_allocated += base is None
                buf = g.new_grad_buffer(None if base is None else base[: g.padded])
                self._base[buf] = buf.data if base is None else base
            self._bufs[g] = buf
            for i, grad in self._held.pop(g, ()):
                buf.write(i, grad)
            self._held_numel.pop(g, None)
        return buf

    def _take(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The smallest pooled tensor of ``dtype`` with at least ``numel`` elements, if any."""
        free = self._pool.get(dtype, [])
        fits = [i for i, t in enumerate(free) if t.numel() >= numel]
        if not fits:
            return None
        return free.pop(min(fits, key=lambda i: free[i].numel()))

    def _hold(self, g: FlatGroup, i: int, grad: torch.Tensor) -> bool:
        """Keep a small first gradient of a sharded group until its bulk arrives; False if it
        must be written now (persistent buffer, temporary already taken, or too much held)."""
        if g.grads is not None or g in self._bufs:
            return False
        held = self._held_numel.get(g, 0) + grad.numel()
        if held > g.padded // 4:
            return False
        self._held_numel[g] = held
        self._held.setdefault(g, []).append((i, grad))
        return True

    def _on_grad(self, g: FlatGroup, i: int, p: torch.nn.Parameter) -> None:
        if not self.active:
            raise RuntimeError(
                "zeroray: call engine.backward(loss), not loss.backward(), so the engine can scale and "
                "reduce gradients"
            )
        grad, p.grad = p.grad, None
        self._used[g][i] = True
        if not self._hold(g, i, grad):
            self._buffer(g).write(i, grad)
        self._remaining[g] -= 1
        if self._remaining[g] == 0 and self._reduces_now and self.overlap:
            self._launch(g)
        # Complete what has finished, in launch order (so every rank issues the same collectives in the same
        # order): a hybrid group's replica all-reduce starts here, as soon as its in-group reduction is done,
        # and runs under the rest of backward instead of after it.
        self._inflight.poll()

    def _launch(self, g: FlatGroup) -> None:
        buf = self._buffer(g)
        del self._bufs[g]
        self._remaining[g] = -1  # launched
        handle = g.reduce(buf, async_op=True)
        temporary = buf is not g.grads
        if temporary:
            base = self._base.pop(buf)
            handle = handle.then(lambda: self._pool.setdefault(base.dtype, []).append(base))
        if self._on_final is not None and self.boundary:
            on_final = self._on_final
            handle = handle.then(lambda: on_final(g))
        # Only temporaries count against the bound: persistent buffers (stages 0-1) cost nothing.
        self._inflight.add(handle, g.padded if temporary else 0)
        unit = self._unit_of.get(g)
        if unit is not None and unit.reduced(g) and self._trimmer is not None:
            self._trimmer.trim()  # the unit's gradients were copied out and dropped

    def finish(self) -> None:
        """End of backward: launch what is left, wait for every reduction."""
        if not self.active:
            return
        if self._reduces_now:
            for g in self.groups:
                if self._remaining[g] != -1:
                    self._launch(g)
        else:  # accumulating locally: what was not written this micro-step must read as zero
            for buf in self._bufs.values():
                buf.seal()
        self._inflight.wait_all()
        self._pool.clear()
        self.active = False
        if self._trimmer is not None:
            self._trimmer.trim()

    def take_used(self) -> dict[FlatGroup, list[bool]]:
        """Per group, which of its parameters got a gradient on this rank since the last call (the
        optimizer step): a parameter without one is not stepped, as under DDP."""
        used = self._used
        self._used = {g: [False] * len(g.params) for g in self.groups}
        return used

    def cached_bytes(self) -> int:
        """Bytes of reusable temporaries held now (none between backwards)."""
        return sum(t.numel() * t.element_size() for ts in self._pool.values() for t in ts)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
