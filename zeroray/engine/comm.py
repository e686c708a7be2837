"""Collectives with byte accounting and a backend-aware choice of primitives.

Every collective the engine issues goes through :class:`Comm`, which counts, per kind, the byte
size of the full (unsharded) tensor it gathers or reduces; an all-reduce counts twice its size
(it moves what a reduce-scatter plus an all-gather move). With world size 1 nothing is sent and
nothing is counted, so the engine also runs without ``torch.distributed`` initialised.

On gloo, an all-reduce is cheaper than a reduce-scatter and one broadcast per rank's shard is
cheaper than ``all_gather`` (see docs/platform-notes.md); on NCCL the paper's reduce-scatter/all-gather
are the right primitives. ``ZeroConfig.reduce_scatter`` / ``all_gather_by_broadcast`` override.

Tensors and backend threads: a collective is given private aliases of its tensors (``detach()``),
which its :class:`Handle` keeps until the backend has let go of them. While C++ holds a tensor
that has a Python object, torch keeps a reference to that object, and drops it, taking the GIL,
on whichever thread drops the last C++ reference. Gloo's worker threads do that *after* marking a
work done, so it may come after ``wait()`` returned; and if it comes while the interpreter exits,
the worker is killed by ``pthread_exit`` while unwinding through a ``noexcept`` destructor:
``std::terminate``, "terminate called without an active exception", SIGABRT after all output
(issue #8). So on gloo ``Handle.wait()`` returns only once the workers hold no reference to its
tensors, C++ or Python, and every tensor is freed on the thread that issued the collective.
Nothing is left in flight past ``wait()``; ``Comm.close()`` waits for handles nobody waited.

A failed collective gives the group up (:meth:`Comm.abort`): every work object still held is
dropped, and the group with it. On gloo a work keeps its transport's connections open, so a rank
that kept its failed bucket reductions kept its sockets, and a peer blocked in a collective with it
(not with the rank that died) waited out the whole collective timeout (issue #12).
"""

from __future__ import annotations

import importlib
import pickle
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

# A gloo worker lets go of a finished work within microseconds; this bounds a stuck one.
_RELEASE_TIMEOUT_S = 120.0

# torch modules with functions whose default argument is ``group=dist.group.WORLD``: imported while a
# group exists (``AdamW()`` imports the first two lazily), they hold that group for the life of the process.
_WORLD_DEFAULT_MODULES = (
    "torch.distributed.nn.functional",
    "torch.distributed.fsdp.sharded_grad_scaler",
    "torch.distributed.optim.zero_redundancy_optimizer",
)


def import_before_group() -> None:
    """Import the torch modules that bind the default group into default arguments, while no group exists.

    Why: a default argument keeps the group alive after ``destroy_process_group``, and with it gloo's
    connections, so a peer blocked in a collective with this process waits out the whole collective
    timeout instead of failing when this process leaves the group. A process that will leave a failed
    group and live on (a rank actor kept for the next group) calls this before its first
    ``init_process_group``."""
    if dist.is_available() and dist.is_initialized():
        return  # too late for this process: its defaults would bind the live group
    for name in _WORLD_DEFAULT_MODULES:
        importlib.import_module(name)


class GroupAborted(RuntimeError):
    """A collective on a group that was given up after an earlier failure (:meth:`Comm.abort`)."""


class Handle:
    """Outstanding collective(s); ``wait()`` blocks until done, then runs the completion callbacks."""

    def __init__(
        self,
        works: Sequence[dist.Work | None] = (),
        then: Callable[[], None] | None = None,
        *,
        tensors: list[torch.Tensor] | None = None,
        own_refs: list[int] | None = None,
        comm: Comm | None = None,
    ):
        self._works = [w for w in works if w is not None]
        self._tensors = tensors or []  # what the backend was given; freed here, not on its threads
        self._own_refs = own_refs or []  # their Python reference counts before the backend got them
        self._comm = comm
        self._then = then
        self.done = False

    def then(self, fn: Callable[[], None]) -> Handle:
        """Add ``fn`` to run once the collectives are done (after the callbacks added before);
        returns this handle."""
        first = self._then
        if first is None:
            self._then = fn
        else:

            def both() -> None:
                first()
                fn()

            self._then = both
        return self

    def ready(self) -> bool:
        """True when every collective has finished (never blocks): waiting now would not stall."""
        return self.done or all(w.is_completed() for w in self._works)

    def wait(self) -> None:
        if self.done:
            return
        if self._comm is not None and self._comm.aborted is not None:  # given up while this was in flight
            raise GroupAborted(self._comm.aborted)
        while self._works:  # only Comm._issue gives a handle works, so it has a comm
            try:
                self._works[0].wait()
            except Exception as e:  # the group is broken: drop its works (no local holds one), then re-raise
                self._comm.abort(f"{type(e).__name__}: {e}")
                raise
            self._works.pop(0)  # each Python work object goes once waited: the backend's reference is the last
        self.done = True
        if self._comm is not None:
            self._comm._release(self)
        if self._then is not None:
            self._then()


class Chain(Handle):
    """A collective issued once another finished: hybrid sharding reduces a gradient inside its shard
    group, then its shard across the replicas. ``ready()`` issues the second as soon as the first is
    done, so polling keeps both moving while backward runs on."""

    def __init__(self, first: Handle, second: Callable[[], Handle]):
        super().__init__()
        self._first = first
        self._issue_second = second
        self._second: Handle | None = None

    def _start_second(self) -> Handle:
        if self._second is None:
            self._first.wait()
            self._second = self._issue_second()
        return self._second

    def ready(self) -> bool:
        if self.done:
            return True
        if self._second is None and not self._first.ready():
            return False
        return self._start_second().ready()

    def wait(self) -> None:
        if self.done:
            return
        self._start_second().wait()
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

    def poll(self) -> None:
        """Complete the oldest collectives that have already finished (in order, without blocking),
        so their callbacks run now rather than at the next wait."""
        while self._queue and self._queue[0][0].ready():
            self._pop()

    def _pop(self) -> None:
        handle, numel = self._queue.popleft()
        self._numel -= numel
        handle.wait()


# torch 2.13 renamed these two; the earlier releases that zeroray supports (CUDA images ship them) have only
# the old names, with the same arguments.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _as_list(works: dist.Work | list[dist.Work]) -> list[dist.Work]:
    return works if isinstance(works, list) else [works]


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
        self._outstanding: set[Handle] = set()
        self.aborted: str | None = None  # set by abort(): why the group was given up

    # ------------------------------------------------------------------ issuing and releasing
    def _issue(self, call: Callable[..., dist.Work | list[dist.Work]], tensors: Sequence[torch.Tensor], async_op: bool) -> Handle:
        """Run ``call`` on private aliases of ``tensors`` (always asynchronously, so that a
        synchronous collective is released like an async one) and return its handle."""
        if self.aborted is not None:
            raise GroupAborted(self.aborted)
        aliases = [t.detach() for t in tensors]
        own = [sys.getrefcount(aliases[i]) for i in range(len(aliases))]  # the list's and the argument's
        handle = Handle(_as_list(call(*aliases)), tensors=aliases, own_refs=own, comm=self)
        self._outstanding.add(handle)
        if not async_op:
            handle.wait()
        return handle

    def abort(self, reason: str) -> None:
        """Give the group up: drop every collective in flight, and the group, without waiting. For a group
        that failed (a collective raised, a peer died, this rank's loop failed): a work object keeps the
        transport's connections open, so holding them would leave peers blocked in a collective with this
        rank until the collective timeout. Later collectives raise :class:`GroupAborted` naming ``reason``."""
        if self.aborted is not None:
            return
        self.aborted = (f"zeroray: this process group was given up after a failure ({reason}); its collectives "
                        "in flight were dropped, and a new group (and engine) is needed")
        for handle in self._outstanding:
            handle._works, handle._tensors, handle._then = [], [], None
        self._outstanding.clear()
        self.group = None

    def _release(self, handle: Handle) -> None:
        """After ``handle``'s works are done: on gloo, wait until its worker threads hold no
        reference to the handle's tensors (see the module doc), then drop them here."""
        self._outstanding.discard(handle)
        if self.backend == "gloo":
            deadline = time.monotonic() + _RELEASE_TIMEOUT_S
            delay = 0.0
            ts, own = handle._tensors, handle._own_refs
            for i in range(len(ts)):
                # C++ references gone, and the Python reference torch held for them dropped too.
                while ts[i]._use_count() > 1 or sys.getrefcount(ts[i]) > own[i]:
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"zeroray: a finished gloo collective still holds its tensor after {_RELEASE_TIMEOUT_S:.0f} s"
                        )
                    time.sleep(delay)
                    delay = min(2 * delay or 1e-6, 1e-3)
        handle._tensors = []

    def close(self) -> None:
        """Wait for every collective issued and not yet waited (collective: all ranks issued them)."""
        while self._outstanding:
            self._outstanding.pop().wait()

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
        return self._issue(lambda a: dist.all_reduce(a, op=op, group=self.group, async_op=True), [t], async_op)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, async_op: bool = False) -> Handle:
        """Sum ``full`` across ranks; ``out`` (``full.numel() / world`` elements) gets this rank's part."""
        if self.world_size == 1:
            out.copy_(full)
            return Handle()
        self._count("reduce_scatter", full.numel() * full.element_size())
        return self._issue(
            lambda o, f: _reduce_scatter_single(o, f, group=self.group, async_op=True), [out, full], async_op
        )

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool = False,
                   kind: str = "all_gather") -> Handle:
        """Fill ``full`` with every rank's ``shard`` (rank r's at ``[r*S, (r+1)*S)``), counted under ``kind``.

        ``shard`` may be the view ``full[rank*S:(rank+1)*S]`` itself.
        """
        if self.world_size == 1:
            if full.data_ptr() != shard.data_ptr():
                full.copy_(shard)
            return Handle()
        self._count(kind, full.numel() * full.element_size())
        s = shard.numel()
        mine = full[self.rank * s : (self.rank + 1) * s]
        if self.gather_by_broadcast:
            if mine.data_ptr() != shard.data_ptr():
                mine.copy_(shard)
            return self._issue(
                lambda *chunks: [
                    dist.broadcast(c, group=self.group, group_src=r, async_op=True) for r, c in enumerate(chunks)
                ],
                [full[r * s : (r + 1) * s] for r in range(self.world_size)],
                async_op,
            )
        src = shard.clone() if mine.data_ptr() == shard.data_ptr() else shard
        return self._issue(lambda f, x: _all_gather_single(f, x, group=self.group, async_op=True), [full, src], async_op)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, kind: str, async_op: bool = False) -> Handle:
        """Rank r's ``out[s*C:(s+1)*C]`` gets rank s's ``inp[r*C:(r+1)*C]`` (1-D, C = numel / world), counted
        under ``kind`` by the size of ``inp`` (what a reduce-scatter of it counts)."""
        if self.world_size == 1:
            out.copy_(inp)
            return Handle()
        self._count(kind, inp.numel() * inp.element_size())
        return self._issue(
            lambda o, i: dist.all_to_all_single(o, i, group=self.group, async_op=True), [out, inp], async_op
        )

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        """Synchronous broadcast from group rank ``src`` (used to start all ranks from rank 0's weights)."""
        if self.world_size == 1:
            return
        self._count("broadcast", t.numel() * t.element_size())
        self._issue(lambda a: dist.broadcast(a, group=self.group, group_src=src, async_op=True), [t], async_op=False)

    def exchange(self, sends: dict[int, list[torch.Tensor]], recvs: dict[int, list[torch.Tensor]]) -> None:
        """Point-to-point, synchronous: send the tensors ``sends[r]`` to group rank ``r`` and receive ``recvs[r]``
        from ``r`` (in order), all at once (every rank posts its side; a rank with nothing to move passes
        empty dicts). Bulk transfers between chosen pairs, e.g. state copies to a buddy rank."""
        if not sends and not recvs:
            return
        self._count("p2p", sum(t.numel() * t.element_size() for ts in sends.values() for t in ts))
        ops = [(dist.isend, "group_dst", peer, t) for peer, ts in sends.items() for t in ts]
        ops += [(dist.irecv, "group_src", peer, t) for peer, ts in recvs.items() for t in ts]

        def post(*tensors: torch.Tensor) -> list[dist.Work]:
            return [op(t, group=self.group, **{key: peer}) for (op, key, peer, _), t in zip(ops, tensors, strict=True)]

        self._issue(post, [t for *_, t in ops], async_op=False)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (small control messages: agreement on errors,
        report barriers). Unlike ``dist.all_gather_object`` its tensors are released like every other
        collective's (see the module doc); not counted in :meth:`report`."""
        if self.world_size == 1:
            return [obj]
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
        sizes = torch.zeros(self.world_size, dtype=torch.int64, device=device)
        mine = torch.tensor([data.numel()], dtype=torch.int64, device=device)
        self._issue(lambda f, x: _all_gather_single(f, x, group=self.group, async_op=True), [sizes, mine], False)
        width = int(sizes.max())
        padded = torch.zeros(width, dtype=torch.uint8, device=device)
        padded[: data.numel()] = data
        full = torch.empty(width * self.world_size, dtype=torch.uint8, device=device)
        self._issue(lambda f, x: _all_gather_single(f, x, group=self.group, async_op=True), [full, padded], False)
        full, sizes = full.cpu(), sizes.tolist()
        return [pickle.loads(full[r * width : r * width + sizes[r]].numpy().tobytes()) for r in range(self.world_size)]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Group rank ``src``'s ``obj`` on every rank (``obj`` is ignored elsewhere)."""
        return self.all_gather_object(obj if self.rank == src else None)[src]

    def any_each(self, flags: torch.Tensor) -> torch.Tensor:
        """Elementwise OR across ranks of a small 1-D bool tensor (which parameters got a gradient on
        some rank), on the host; a control message, not counted in :meth:`report`."""
        if self.world_size == 1:
            return flags.cpu()
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        t = flags.to(device=device, dtype=torch.int32)
        self._issue(lambda a: dist.all_reduce(a, op=dist.ReduceOp.MAX, group=self.group, async_op=True), [t], False)
        return t.cpu().bool()

    def any_true(self, flag: torch.Tensor) -> bool:
        """True on every rank if the one-element bool tensor ``flag`` is true on any rank (fp16
        overflow agreement); one host sync."""
        if self.world_size == 1:
            return bool(flag)
        t = flag.to(torch.float32).reshape(1)
        self.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def sum_scalar(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a one-element fp32 tensor across ranks (global gradient norm)."""
        if self.world_size > 1:
            self.all_reduce(value)
        return value
