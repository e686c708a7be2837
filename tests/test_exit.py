"""Issue #8: world-2 runs sometimes ended with SIGABRT at interpreter exit ("terminate called
without an active exception"), after all their output.

The cause: a gloo worker thread marks a collective done before it drops its own reference to the
work. A tensor whose Python object had gone by then was freed by that worker, which had to take the
GIL; at interpreter exit ``pthread_exit`` then unwinds that C++ thread through a ``noexcept``
destructor. zeroray's collectives now keep their tensors until the worker has let go
(:mod:`zeroray.engine.comm`), so every tensor is freed on the thread that issued the collective.

The first test checks that property directly (it fails reliably without the fix); the second
launches real world-2 jobs a bounded number of times. ``python -m tests.jobs.exit_loop`` runs hundreds.
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch
import torch.distributed as dist

from tests.support.dist import run_ranks
from tests.support.jobs import launch_exit_job
from zeroray.engine.comm import Comm


def _where_tensors_are_freed(rank: int, world: int, reduce_scatter: bool) -> tuple[int, int]:
    main = threading.get_ident()
    off_main: list[bool] = []

    class Tracked(torch.Tensor):
        def __del__(self) -> None:
            off_main.append(threading.get_ident() != main)

    comm = Comm(dist.group.WORLD, reduce_scatter=reduce_scatter, all_gather_by_broadcast=not reduce_scatter)
    n = 1024 * world
    full = torch.zeros(n).as_subclass(Tracked)
    for _ in range(200):
        shard = torch.full((n // world,), float(rank)).as_subclass(Tracked)
        comm.all_gather(full, shard, async_op=True).wait()
        h = comm.all_reduce(full, async_op=True)  # waited after the next one was issued, as InFlight does
        comm.reduce_scatter(torch.empty(n // world).as_subclass(Tracked), full, async_op=True).wait()
        h.wait()
        comm.all_reduce(torch.ones(4).as_subclass(Tracked))  # synchronous, on a temporary
        comm.broadcast(torch.ones(4).as_subclass(Tracked))
    comm.close()
    del full, shard, h
    gc.collect()
    return len(off_main), sum(off_main)


@pytest.mark.parametrize("reduce_scatter", [False, True])
def test_collective_tensors_are_freed_on_the_calling_thread(reduce_scatter: bool) -> None:
    for freed, off_main in run_ranks(_where_tensors_are_freed, 2, reduce_scatter):
        assert freed > 800  # the probe sees the aliases the collectives were given
        assert off_main == 0, f"{off_main} of {freed} tensors were freed by a backend thread"


def test_world2_jobs_exit_cleanly() -> None:
    """A bounded number of real launches (2 interpreters each, all stages, with and without
    destroy_process_group): every rank exits with 0."""
    failures = []
    for i in range(2):
        for rank, (rc, err) in enumerate(launch_exit_job(2, destroy=i % 2 == 1)):
            if rc != 0:
                failures.append(f"launch {i} rank {rank}: exit {rc}: {err[-500:]}")
    assert not failures, "\n".join(failures)
