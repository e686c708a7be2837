"""Sharded checkpoint speed: zeroray.checkpoint against plain fsspec writing the same bytes.

    python benchmarks/checkpoint_bench.py [--params 25e6] [--world-size 2] [--storage file,s3] [--repeats 3]

A GPT of ``--params`` parameters trains one AdamW step at stage 3 on ``--world-size`` gloo ranks
(one thread each). Per repeat, on the same storage:

- save: ``zeroray.checkpoint.save`` (sync) against each rank ``fs.pipe_file``-ing as many bytes;
- load: ``zeroray.checkpoint.load`` at the same layout against each rank ``fs.cat_file``-ing them;
- stall: how long a training step is held up by an async save (the copy into the host buffer)
  against a sync save (the whole write and commit);
- resharded load: the same checkpoint loaded at stage 1 on the same ranks, and at world size 1,
  stage 0 in the driver.

Each timed operation is bracketed by barriers and counts from the first rank's start to the last
rank's end. "s3" is a moto server on loopback spoken to over HTTP by s3fs (a real S3 protocol
path, but a single Python process serves it). Results: benchmarks/results/checkpoint.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import zeroray  # noqa: E402
import zeroray.checkpoint as zc  # noqa: E402
from zeroray.checkpoint.storage import open_url  # noqa: E402
from zeroray.models.gpt import GPT, GPTConfig  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_engine(params: float, stage: int) -> zeroray.ZeroEngine:
    torch.manual_seed(0)
    model = GPT(GPTConfig.for_params(params))
    return zeroray.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), {"zero_optimization": {"stage": stage}})


def train_step(engine: zeroray.ZeroEngine, rank: int) -> None:
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(engine.module.config.vocab_size, (2, 33), generator=g)
    _, loss = engine(tokens[:, :-1], tokens[:, 1:])
    engine.backward(loss)
    engine.step()


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
    """Seconds of ``fn(*args, **kwargs)`` from the first rank's start to the last rank's end."""
    if dist.is_initialized():
        dist.barrier()
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    if dist.is_initialized():
        dist.barrier()
    return time.perf_counter() - t0


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, base: str, options: dict, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    engine = make_engine(args.params, 3)
    train_step(engine, rank)
    fs, root = open_url(base, options)
    fs.makedirs(f"{root}/plain", exist_ok=True)
    payload = np.random.default_rng(rank).bytes(
        sum(t.numel() * t.element_size() for g in engine.shard_state() for t in g.tensors.values())
    )
    saver = zc.AsyncSaver(engine)
    r: dict[str, list[float]] = {k: [] for k in ("save", "plain_write", "load", "plain_read", "async_stall", "async_total")}
    for rep in range(args.repeats):
        url = zc.checkpoint_url(f"{base}/run", rep)
        plain = f"{root}/plain/rank{rank}-{rep}"
        r["save"].append(timed(zc.save, engine, url, storage_options=options))
        r["plain_write"].append(timed(fs.pipe_file, plain, payload))
        r["load"].append(timed(zc.load, engine, url, storage_options=options))
        r["plain_read"].append(timed(fs.cat_file, plain))
        dist.barrier()
        t0 = time.perf_counter()
        saver.save(zc.checkpoint_url(f"{base}/async", rep), storage_options=options)
        r["async_stall"].append(slowest(time.perf_counter() - t0))
        train_step(engine, rank)  # runs while the shards upload
        saver.wait()
        r["async_total"].append(slowest(time.perf_counter() - t0))
    engine.close()
    reshard = make_engine(args.params, 1)
    r["load_stage3_to_stage1"] = [timed(zc.load, reshard, zc.checkpoint_url(f"{base}/run", 0), storage_options=options)]
    if rank == 0:
        r["checkpoint_bytes"] = [zc.list_checkpoints(f"{base}/run", options)[0].size_bytes]
        r["params"] = [reshard.module.num_params()]
        Path(out).write_text(json.dumps(r))
    dist.destroy_process_group()


def run_storage(storage: str, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    server = None
    if storage == "s3":
        import s3fs
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
        port = free_port()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "bench", "secret": "bench"}
        s3fs.S3FileSystem(**options).mkdir("bench")
        base = "s3://bench"
    else:
        base = f"file://{tmp}/{storage}"
    try:
        out = f"{tmp}/{storage}.json"
        mp.spawn(rank_main, args=(args.world_size, free_port(), args, base, options, out), nprocs=args.world_size)
        r = json.loads(Path(out).read_text())
        torch.set_num_threads(1)
        single = make_engine(args.params, 0)
        r["load_world1_stage0"] = [timed(zc.load, single, zc.checkpoint_url(f"{base}/run", 0), storage_options=options)]
        single.close()
    finally:
        if server is not None:
            server.stop()
    return summarize(storage, r, args)


def summarize(storage: str, r: dict[str, list[float]], args: argparse.Namespace) -> dict[str, Any]:
    med = {k: statistics.median(v) for k, v in r.items()}
    gb = med["checkpoint_bytes"] / 1e9
    return {
        "storage": storage,
        "world_size": args.world_size,
        "params": int(med["params"]),
        "checkpoint_gb": round(gb, 3),
        "save_s": med["save"],
        "plain_write_s": med["plain_write"],
        "save_GBps": gb / med["save"],
        "save_vs_plain": med["plain_write"] / med["save"],
        "load_s": med["load"],
        "plain_read_s": med["plain_read"],
        "load_GBps": gb / med["load"],
        "load_vs_plain": med["plain_read"] / med["load"],
        "sync_stall_s": med["save"],
        "async_stall_s": med["async_stall"],
        "async_total_s": med["async_total"],
        "load_stage3_to_stage1_s": med["load_stage3_to_stage1"],
        "load_world1_stage0_s": med["load_world1_stage0"],
        "repeats": args.repeats,
    }


def to_markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| storage | params | ckpt GB | save s (GB/s) | plain write s | save/plain | load s (GB/s) | plain read s "
        "| load/plain | sync stall s | async stall s | reshard load: stage 3->1 s | world N->1, stage 3->0 s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in rows:
        lines.append(
            f"| {x['storage']} (world {x['world_size']}) | {x['params'] / 1e6:.1f}M | {x['checkpoint_gb']:.2f} "
            f"| {x['save_s']:.2f} ({x['save_GBps']:.2f}) | {x['plain_write_s']:.2f} | {x['save_vs_plain']:.0%} "
            f"| {x['load_s']:.2f} ({x['load_GBps']:.2f}) | {x['plain_read_s']:.2f} | {x['load_vs_plain']:.0%} "
            f"| {x['sync_stall_s']:.2f} | {x['async_stall_s']:.3f} | {x['load_stage3_to_stage1_s']:.2f} "
            f"| {x['load_world1_stage0_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=25e6)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--storage", default="file,s3", help="comma list of: file, s3")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_storage(s, args, tmp) for s in args.storage.split(",")]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "checkpoint.json").write_text(json.dumps(rows, indent=2))
    (Path(args.out) / "checkpoint.md").write_text(to_markdown(rows))
    print(to_markdown(rows))


if __name__ == "__main__":
    main()
