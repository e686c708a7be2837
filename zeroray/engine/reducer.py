"""Gradient reduction during backward: parameter grads -> flat buckets -> reduced shards.

A post-accumulate-grad hook on every trainable parameter copies its gradient into its group's
flat gradient buffer (and drops ``param.grad``). When the last parameter of a group has arrived,
the group's reduction is launched asynchronously, overlapping the rest of backward:

- stages 0-1 accumulate into a persistent full buffer and reduce only on the accumulation
  boundary (no communication on the other micro-steps);
- stages 2-3 reduce every micro-step from a temporary buffer and keep only their shard.

``finish()`` (end of backward) reduces groups whose parameters got no gradient, so every rank issues
the same collectives, and waits for all. In-flight temporaries are bounded by
``reduce_bucket_size`` elements (at least one reduction may always be in flight) so stages 2-3
never hold the full gradients at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch

from zeroray.engine.comm import InFlight
from zeroray.engine.flat_group import FlatGroup


class GradReducer:
    def __init__(
        self,
        groups: Sequence[FlatGroup],
        *,
        stage: int,
        overlap: bool,
        max_inflight: int,
        on_reduced: Callable[[FlatGroup], None] | None = None,
    ):
        self.groups = [g for g in groups if g.trainable]
        self.stage = stage
        self.overlap = overlap
        self.on_reduced = on_reduced
        self.active = False
        self.boundary = True
        self._bufs: dict[FlatGroup, torch.Tensor] = {}
        self._written: dict[FlatGroup, list[bool]] = {}  # per fresh buffer: slots copied so far
        self._remaining: dict[FlatGroup, int] = {}
        self._inflight = InFlight(max_inflight)
        # Temporaries of stages 2-3, reused across backwards (as DeepSpeed's reduce bucket), so
        # a step does not pay fresh allocations and page faults for every bucket.
        self._pool: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
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

    @property
    def _reduces_now(self) -> bool:
        return self.stage >= 2 or self.boundary

    def _buffer(self, g: FlatGroup) -> torch.Tensor:
        buf = self._bufs.get(g)
        if buf is None:
            buf, fresh = g.grad_buffer()
            if buf is None:
                free = self._pool.get((g.padded, g.compute_dtype))
                buf = free.pop() if free else torch.empty(g.padded, dtype=g.compute_dtype, device=g.device)
            self._bufs[g] = buf
            if fresh:
                self._written[g] = [False] * len(g.slots)
        return buf

    def _seal(self, g: FlatGroup, buf: torch.Tensor) -> None:
        written = self._written.pop(g, None)
        if written is not None:
            g.seal(buf, written)

    def _on_grad(self, g: FlatGroup, i: int, p: torch.nn.Parameter) -> None:
        if not self.active:
            raise RuntimeError(
                "zeroray: call engine.backward(loss), not loss.backward(), so the engine can scale and "
                "reduce gradients"
            )
        buf = self._buffer(g)
        slot = g.slots[i]
        written = self._written.get(g)
        if written is not None and not written[i]:
            buf[slot.offset : slot.end].copy_(p.grad.reshape(-1))
            written[i] = True
        else:
            buf[slot.offset : slot.end].add_(p.grad.reshape(-1))
        p.grad = None
        self._remaining[g] -= 1
        if self._remaining[g] == 0 and self._reduces_now and self.overlap:
            self._launch(g)

    def _launch(self, g: FlatGroup) -> None:
        buf = self._buffer(g)
        self._seal(g, buf)
        del self._bufs[g]
        self._remaining[g] = -1  # launched
        handle = g.reduce(buf, async_op=True)
        temporary = buf is not g.grad_full
        if temporary:
            handle = handle.then(lambda: self._pool.setdefault((g.padded, g.compute_dtype), []).append(buf))
        # Only temporaries count against the bound: persistent buffers (stages 0-1) cost nothing.
        self._inflight.add(handle, g.padded if temporary else 0)
        if self.on_reduced is not None:
            self.on_reduced(g)

    def finish(self) -> None:
        """End of backward: launch what is left, wait for every reduction."""
        if not self.active:
            return
        if self._reduces_now:
            for g in self.groups:
                if self._remaining[g] != -1:
                    self._launch(g)
        else:  # accumulating locally: what was not written this micro-step must read as zero
            for g, buf in self._bufs.items():
                self._seal(g, buf)
        self._inflight.wait_all()
        self.active = False

    def cached_bytes(self) -> int:
        """Bytes of reusable temporaries held between steps."""
        return sum(t.numel() * t.element_size() for ts in self._pool.values() for t in ts)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
