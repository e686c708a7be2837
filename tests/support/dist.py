"""Run a function on N real processes joined in a gloo group (CPU), and collect what each returns.

The processes come from a fork server that imported torch once (``multiprocessing``'s "forkserver"
start method with a preload), not from a fresh interpreter each: every process is still new and
isolated (a crash there fails the test, not the suite), but does not pay torch's import again, the
larger part of a short run's time."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Imported once, in the fork server; a test's own module is imported in each process as its function arrives.
_PRELOAD = ["torch", "torch.distributed", "zeroray.engine", "zeroray.models.gpt", "tests.support.dist"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, out_dir: str, fn: Callable, args: tuple, backend: str, env: dict[str, str]) -> None:
    os.environ.clear()  # the caller's environment now, not the fork server's at its start
    os.environ.update(env)
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    # A file store: no port to pick, so concurrent runs cannot race for one.
    store = os.path.join(out_dir, "rendezvous")
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo") -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` new processes; returns each rank's result.

    ``backend="nccl"`` puts rank r on CUDA device r (mod the count) first. If the wait is interrupted (a
    test's timeout, Ctrl-C), the ranks still running are killed: none outlives the call."""
    mp.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    with tempfile.TemporaryDirectory() as out_dir:
        ranks = mp.start_processes(_entry, args=(world, out_dir, fn, args, backend, dict(os.environ)),
                                   nprocs=world, join=False, start_method="forkserver")
        try:
            while not ranks.join():
                pass
        finally:
            for proc in ranks.processes:
                if proc.is_alive():
                    proc.kill()
                proc.join()
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
