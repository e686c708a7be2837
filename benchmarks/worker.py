"""One rank of one benchmark job: ``python benchmarks/worker.py --system ddp ...``.

The driver (run.py) starts one such process per rank with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set, as torchrun would. Rank 0 writes the job's result as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from measure import (
    CommCounter,
    HeapPeak,
    current_rss_bytes,
    dynamo_counts,
    live_storages,
    malloc_bytes,
    peak_rss_bytes,
    storages,
)
from systems import System, build

from zeroray.models.gpt import GPT, GPTConfig


def batch(
    cfg: GPTConfig, micro_batch: int, seq: int, rank: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens, the same for every system: seeded by rank and step."""
    g = torch.Generator().manual_seed(1_000_003 * rank + step)
    tokens = torch.randint(cfg.vocab_size, (micro_batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def model_state_bytes(system: System, live: dict[int, int]) -> dict[str, int]:
    """Per-category bytes as the system holds them; gradients are whatever else is live."""
    params_t, opt_t = system.state_tensors()
    params = storages(params_t)
    opt = {k: v for k, v in storages(opt_t).items() if k not in params}
    rest = sum(v for k, v in live.items() if k not in params and k not in opt)
    return {"params": sum(params.values()), "grads": rest, "optimizer": sum(opt.values())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", required=True)
    ap.add_argument("--params", type=float, required=True)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig.for_params(args.params, block_size=max(256, args.seq))
    rss_base = current_rss_bytes()  # after imports and the process group, before the model
    start = malloc_bytes()
    heap_base = 0 if start is None else start["in_use"] + start["mmapped"]  # 0: not glibc's malloc
    torch.manual_seed(0)
    model = GPT(cfg)
    n_params = model.num_params()
    t0 = time.perf_counter()
    system = build(args.system, model, args.precision, args.micro_batch)
    setup_s = time.perf_counter() - t0

    times, cpu_times, losses = [], [], []
    after_two: dict[str, int] = {}
    for step in range(args.warmup + args.steps):
        x, y = batch(cfg, args.micro_batch, args.seq, rank, step)
        dist.barrier()
        t, c = time.perf_counter(), time.process_time()
        losses.append(system.forward_backward(x, y))
        system.optimizer_step()
        times.append(time.perf_counter() - t)  # the warm-up steps too: the first one holds compilation
        # CPU seconds of this rank's threads (gloo's included): the step's work, which other load on a
        # shared machine stretches far less than its wall time.
        cpu_times.append(time.process_time() - c)
        if step == 1:
            after_two = dynamo_counts()
    dynamo = dynamo_counts()
    # Every frame a step runs was compiled by the end of step 2: any compile after it is a recompile.
    dynamo["recompiles_after_step2"] = dynamo["frames_compiled"] - after_two.get("frames_compiled", 0)
    # The slowest rank sets the pace of a step.
    all_times = torch.tensor([times, cpu_times], dtype=torch.float64)
    dist.all_reduce(all_times, op=dist.ReduceOp.MAX)
    warmup_times, step_times = all_times[0, : args.warmup], all_times[0, args.warmup :]
    cpu_step_times = all_times[1, args.warmup :]

    # One more step, untimed: count its collectives, follow malloc's peak and read memory between
    # backward and step, when gradients and optimizer state both exist.
    x, y = batch(cfg, args.micro_batch, args.seq, rank, args.warmup + args.steps)
    system.reset_comm_report()
    counter = CommCounter()
    with counter, HeapPeak() as heap_peak:
        system.forward_backward(x, y)
        live = live_storages()
        reported_mem = system.memory_report()
        heap = malloc_bytes()
        states = model_state_bytes(system, live) if reported_mem is None else None
        system.optimizer_step()
    reported_comm = system.comm_report()
    per_rank = {
        "states": states,
        "reported_memory": reported_mem,
        "live_tensor_bytes": sum(live.values()),
        "peak_rss": peak_rss_bytes(),
        "rss_base": rss_base,
        "malloc": heap,  # glibc's in-use / free-but-held bytes at the same moment
        # malloc's bytes handed out at their peak in that step, over those before the model (glibc only)
        "heap_peak_growth": heap_peak.peak - heap_base if heap_peak.peak and heap_base else None,
        "comm_measured": counter.bytes,
        "comm_reported": reported_comm,
        "dynamo": dynamo,
    }
    gathered: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(gathered, per_rank)
    if rank == 0:
        result = {
            "system": args.system,
            "world_size": world,
            "precision": args.precision,
            "num_params": n_params,
            "model_config": cfg.__dict__,
            "micro_batch": args.micro_batch,
            "seq": args.seq,
            "setup_s": setup_s,
            "warmup_times": warmup_times.tolist(),
            "step_times": step_times.tolist(),
            "median_step_s": statistics.median(step_times.tolist()),
            "cpu_step_times": cpu_step_times.tolist(),
            "losses": losses,
            "ranks": gathered,
        }
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
