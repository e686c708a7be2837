"""The price of in-memory snapshots (``FailureConfig.snapshot_interval``): step stall and host memory.

    python benchmarks/snapshot_bench.py [--world 4] [--params 120e6] [--stage 3] [--steps 3]

``--world`` gloo ranks (real processes, no Ray) train a stack of 1024-wide linear layers of about
``--params`` parameters with AdamW at ``--stage``; the ranks are split over two simulated nodes, so each
rank's buddy is on the other half. Per step it times the training step (forward, backward, optimizer
step) and then a snapshot as the trainer takes one at a report: ``take`` (the host copy of the rank's
shards, buffers, RNG and counters) and ``replicate`` (the copy sent to the buddy, on a gloo side group,
and the barrier after it); a barrier before them stands for the report's exchange, so the ranks' skew
in the step is not counted as the snapshot's. Reported: the medians, the stall as a share of the step, the snapshot's bytes
per rank, the host memory the rank's store holds (its own and its buddy's copy), and the restore of a
lost half's state by the other half (``choose`` + ``restore`` at half the world size).

Results: benchmarks/results/snapshot.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import zeroray  # noqa: E402
from zeroray.checkpoint.snapshot import SnapshotStore, choose, replicate, restore, take  # noqa: E402
from zeroray.engine import Comm  # noqa: E402

WIDTH, BATCH = 1024, 8


def _model(params: float) -> torch.nn.Module:
    layers = max(1, round(params / (WIDTH * WIDTH + WIDTH)))
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def _engine(params: float, stage: int, group: dist.ProcessGroup) -> zeroray.ZeroEngine:
    torch.manual_seed(0)
    model = _model(params)
    return zeroray.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                              zeroray.ZeroConfig(stage=stage), process_group=group)


def _rank(rank: int, world: int, store_file: str, out: str, params: float, stage: int, steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    side = dist.new_group(backend="gloo")  # the trainer's report group: snapshots never enter the engine's
    engine = _engine(params, stage, dist.group.WORLD)
    comm, store = Comm(side), SnapshotStore()
    nodes = [r * 2 // world for r in range(world)]
    x = torch.randn(BATCH, WIDTH)
    step_s, take_s, replicate_s = [], [], []
    for i in range(steps + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        comm.all_reduce(torch.zeros(1))  # the report's barrier, before which the trainer never snapshots
        t1 = time.perf_counter()
        snap = take(engine, "bench")
        t2 = time.perf_counter()
        replicate(comm, store, snap, nodes)
        t3 = time.perf_counter()
        if i:
            step_s.append(t1 - t0)
            take_s.append(t2 - t1)
            replicate_s.append(t3 - t2)
    shard = sum(t.numel() * t.element_size() for gs in engine.shard_state() for t in gs.tensors.values())
    result = {"step_s": statistics.median(step_s), "take_s": statistics.median(take_s),
              "replicate_s": statistics.median(replicate_s), "snapshot_bytes": snap.header.nbytes,
              "shard_state_bytes": shard, "store_bytes": store.nbytes}
    engine.close()
    # The second half of the ranks is lost: the first half restores the whole state at half the world size.
    half = dist.new_group(list(range(world // 2)))
    half_side = dist.new_group(list(range(world // 2)), backend="gloo")
    if rank < world // 2:
        fresh = _engine(params, stage, half)
        t0 = time.perf_counter()
        half_comm = Comm(half_side)
        restore(fresh, half_comm, store, choose(half_comm, store))
        result["restore_s"] = time.perf_counter() - t0
        fresh.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--params", type=float, default=120e6)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "snapshot"))
    args = ap.parse_args()
    if args.world < 2 or args.world % 2:
        ap.error("--world must be even (two simulated nodes)")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(args.world, os.path.join(tmp, "store"), tmp, args.params, args.stage, args.steps),
                 nprocs=args.world, join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.world)]
    worst = max(ranks, key=lambda r: r["take_s"] + r["replicate_s"])
    stall = worst["take_s"] + worst["replicate_s"]
    params = sum(p.numel() for p in _model(args.params).parameters())
    out = {"machine": f"{platform.node()} ({os.cpu_count()} cores)", "world": args.world, "stage": args.stage,
           "params": params, "ranks": ranks, "stall_s": stall, "stall_per_step": stall / worst["step_s"]}
    Path(args.out + ".json").write_text(json.dumps(out, indent=1))
    mb = 1e6
    lines = [
        "# The price of in-memory snapshots (benchmarks/snapshot_bench.py)", "",
        f"{out['machine']}; {args.world} gloo ranks on two simulated nodes (loopback), a {params / 1e6:.0f}M-parameter "
        f"stack of linear layers, fp32 AdamW, stage {args.stage}; medians of {args.steps} steps, the slowest rank.", "",
        "| | value |", "|---|---|",
        f"| training step (forward, backward, optimizer step) | {worst['step_s']:.3f} s |",
        f"| snapshot: host copy (`take`) | {worst['take_s']:.3f} s |",
        f"| snapshot: copy to the buddy + barrier (`replicate`) | {worst['replicate_s']:.3f} s |",
        f"| stall per snapshot ÷ step | {out['stall_per_step'] * 100:.0f}% (every step: `snapshot_interval=1`; "
        f"{out['stall_per_step'] * 10:.0f}% at 10) |",
        f"| snapshot per rank (shards + buffers + RNG) | {worst['snapshot_bytes'] / mb:.0f} MB "
        f"(shard state {worst['shard_state_bytes'] / mb:.0f} MB) |",
        f"| host memory held per rank (own + buddy's) | {worst['store_bytes'] / mb:.0f} MB |",
        f"| restore of the whole state by the surviving half (world {args.world} → {args.world // 2}) | "
        f"{max(r.get('restore_s', 0) for r in ranks):.3f} s |",
    ]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
