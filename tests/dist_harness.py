"""Run a function on N real processes joined in a gloo group (CPU), and collect what each returns."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, out_dir: str, fn: Callable, args: tuple, backend: str) -> None:
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
    """``fn(rank, world, *args)`` on ``world`` spawned processes; returns each rank's result.

    ``backend="nccl"`` puts rank r on CUDA device r (mod the count) first."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_entry, args=(world, out_dir, fn, args, backend), nprocs=world, join=True)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
