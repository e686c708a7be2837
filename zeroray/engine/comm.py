"""Collectives with byte accounting and a backend-aware choice of primitives.

Every collective the engine issues goes through :class:`Comm`, which counts, per kind, the byte
size of the full (unsharded) tensor it gathers or reduces; an all-reduce counts twice its size
(it moves what a reduce-scatter plus an all-gather move). With world size 1 nothing is sent and
nothing is counted, so the engine also runs without ``torch.distributed`` initialised.

On gloo, an all-reduce is cheaper than a reduce-scatter and one broadcast per rank's shard is
cheaper than ``all_gather`` (see shared/NOTES.md); on NCCL the paper's reduce-scatter/all-gather
are the right primitives. ``ZeroConfig.reduce_scatter`` / ``all_gather_by_broadcast`` override.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist


class Handle:
    """Outstanding collective(s); ``wait()`` blocks until done, then runs the completion callbacks."""

    def __init__(self, works: Sequence[dist.Work | None] = (), then: Callable[[], None] | None = None):
        self._works = [w for w in works if w is not None]
        self._then = then
        self.done = False

    def then(self, fn: Callable[[], None]) -> Handle:
        """The same collectives, with ``fn`` to run once they are done (after this one's callback)."""
        first = self._then
        if first is None:
            return Handle(self._works, then=fn)

        def both() -> None:
            first()
            fn()

        return Handle(self._works, then=both)

    def wait(self) -> None:
        if self.done:
            return
        for w in self._works:
            w.wait()
        self.done = True
        if self._then is not None:
            self._then()


class InFlight:
    """Outstanding collectives, waited oldest first once they hold more than ``limit`` elements
    (one may always be in flight): bounds the temporaries that async collectives keep alive."""

    def __init__(self, limit: int):
        self.limit = limit
        self._queue: deque[tuple[Handle, int]] = deque()
        self._numel = 0

    def add(self, handle: Handle, numel: int) -> None:
        self._queue.append((handle, numel))
        self._numel += numel
        while len(self._queue) > 1 and self._numel > self.limit:
            self._pop()

    def wait_all(self) -> None:
        while self._queue:
            self._pop()

    def _pop(self) -> None:
        handle, numel = self._queue.popleft()
        self._numel -= numel
        handle.wait()


class Comm:
    """The engine's view of its process group."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        reduce_scatter: bool | None = None,
        all_gather_by_broadcast: bool | None = None,
    ):
        self.group = group
        if group is None:
            self.world_size, self.rank, backend = 1, 0, "none"
        else:
            self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
            backend = str(dist.get_backend(group)).lower()
        self.backend = backend
        on_gloo = backend == "gloo"
        self.use_reduce_scatter = (not on_gloo) if reduce_scatter is None else reduce_scatter
        self.gather_by_broadcast = on_gloo if all_gather_by_broadcast is None else all_gather_by_broadcast
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    # ------------------------------------------------------------------ accounting
    def _count(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] += nbytes
        self.calls[kind] += 1

    def report(self) -> dict[str, int]:
        return dict(self.bytes)

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    # ------------------------------------------------------------------ primitives
    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, async_op: bool = False) -> Handle:
        """In-place all-reduce of ``t``."""
        if self.world_size == 1:
            return Handle()
        self._count("all_reduce", 2 * t.numel() * t.element_size())
        return Handle([dist.all_reduce(t, op=op, group=self.group, async_op=async_op)])

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, async_op: bool = False) -> Handle:
        """Sum ``full`` across ranks; ``out`` (``full.numel() / world`` elements) gets this rank's part."""
        if self.world_size == 1:
            out.copy_(full)
            return Handle()
        self._count("reduce_scatter", full.numel() * full.element_size())
        return Handle([dist.reduce_scatter_single(out, full, group=self.group, async_op=async_op)])

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool = False) -> Handle:
        """Fill ``full`` with every rank's ``shard`` (rank r's at ``[r*S, (r+1)*S)``).

        ``shard`` may be the view ``full[rank*S:(rank+1)*S]`` itself.
        """
        if self.world_size == 1:
            if full.data_ptr() != shard.data_ptr():
                full.copy_(shard)
            return Handle()
        self._count("all_gather", full.numel() * full.element_size())
        s = shard.numel()
        mine = full[self.rank * s : (self.rank + 1) * s]
        if self.gather_by_broadcast:
            if mine.data_ptr() != shard.data_ptr():
                mine.copy_(shard)
            works = [
                dist.broadcast(full[r * s : (r + 1) * s], group=self.group, group_src=r, async_op=async_op)
                for r in range(self.world_size)
            ]
            return Handle(works)
        src = shard.clone() if mine.data_ptr() == shard.data_ptr() else shard
        return Handle([dist.all_gather_single(full, src, group=self.group, async_op=async_op)])

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        """Synchronous broadcast from group rank ``src`` (used to start all ranks from rank 0's weights)."""
        if self.world_size == 1:
            return
        self._count("broadcast", t.numel() * t.element_size())
        dist.broadcast(t, group=self.group, group_src=src)

    def any_true(self, flag: bool, device: torch.device) -> bool:
        """True on every rank if ``flag`` is true on any rank (fp16 overflow agreement)."""
        if self.world_size == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        self.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def sum_scalar(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a one-element fp32 tensor across ranks (global gradient norm)."""
        if self.world_size > 1:
            self.all_reduce(value)
        return value
