"""CPU offload on a GPU, in parts: the copies, the CPU optimizer step, and whether the gradient copies hide
behind backward.

    python benchmarks/gpu_offload_bench.py                 # all three, writes benchmarks/results/gpu/offload.*

- ``copies``: host <-> device bandwidth, pinned and pageable, per direction (CUDA events, median of 5);
- ``adam``: ``torch.optim.AdamW`` on fp32 CPU tensors (single-tensor, foreach, fused) and DeepSpeed's
  ``DeepSpeedCPUAdam`` when it builds, against the host's memory bandwidth (a large copy); an Adam step
  moves 28 bytes a parameter (reads weight, gradient and two moments, writes weight and moments);
- ``overlap``: one profiled training step of zeroray with ``offload_optimizer.device: cpu`` (a bf16 GPT,
  world 1 on NCCL). From the trace: the GPU time span of backward's kernels, and each device->host copy
  of a gradient shard: how many started, and how many bytes moved, before backward's last kernel ended.
  The trace is kept (``offload_trace.json.gz``) for Perfetto / chrome://tracing.

Skipped (exit 0 with a message) where torch sees no CUDA device.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9


def _cuda_time(fn: Any, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copies(sizes_mb: list[int]) -> list[dict]:
    """GB/s of host->device and device->host copies, pinned and pageable."""
    rows = []
    for mb in sizes_mb:
        n = mb * 2**20
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        for pinned in (True, False):
            host = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
            host.fill_(1)
            h2d = _cuda_time(partial(dev.copy_, host, non_blocking=pinned))
            d2h = _cuda_time(partial(host.copy_, dev, non_blocking=pinned))
            rows.append({"mb": mb, "pinned": pinned, "h2d_gbs": n / h2d / GB, "d2h_gbs": n / d2h / GB})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _wall(fn: Any, repeat: int = 5) -> float:
    fn()  # warm up (first touch, lazy state)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def adam(numel: int) -> dict:
    """Seconds and GB/s of one AdamW step over ``numel`` fp32 CPU parameters, per implementation."""
    src = torch.ones(numel * 2)
    dst = torch.empty_like(src)
    copy_s = _wall(partial(dst.copy_, src))
    out: dict[str, Any] = {"numel": numel, "threads": torch.get_num_threads(),
                           "memory_copy_gbs": 2 * src.nbytes / copy_s / GB}  # read + write
    del src, dst
    for name, kw in {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}.items():
        p = torch.nn.Parameter(torch.randn(numel))
        p.grad = torch.randn(numel)
        opt = torch.optim.AdamW([p], lr=1e-4, **kw)
        s = _wall(opt.step)
        out[name] = {"step_s": s, "gbs": 28 * numel / s / GB}
        print(name, json.dumps(out[name]), flush=True)
        del p, opt
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        p = torch.nn.Parameter(torch.randn(numel))
        p.grad = torch.randn(numel)
        opt = DeepSpeedCPUAdam([p], lr=1e-4, adamw_mode=True)
        s = _wall(opt.step)
        out["deepspeed_cpu_adam"] = {"step_s": s, "gbs": 28 * numel / s / GB}
    except Exception as e:  # reported, not fatal: the op is compiled at first use
        out["deepspeed_cpu_adam"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
    print("deepspeed_cpu_adam", json.dumps(out["deepspeed_cpu_adam"]), flush=True)
    return out


def _in(ts: float, span: tuple[float, float]) -> bool:
    return span[0] <= ts <= span[1]


def overlap(params: float, seq: int, micro_batch: int, stage: int, trace_path: Path) -> dict:
    """Profile one step of zeroray CPU offload; when each gradient copy ran against backward's kernels."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    import zeroray
    from zeroray.models.gpt import GPT, GPTConfig

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", "RANK": "0", "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(k, v)
    dist.init_process_group("nccl", device_id=dev)
    cfg = GPTConfig.for_params(params, vocab_size=32000, block_size=seq, head_dim=128)
    torch.manual_seed(0)
    with dev:
        model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    zcfg = zeroray.ZeroConfig(stage=stage, precision="bf16", offload_optimizer={"device": "cpu", "pin_memory": True})
    engine = zeroray.initialize(model, opt, zcfg)
    g = torch.Generator(device=dev).manual_seed(0)

    def step(label: str) -> None:
        tokens = torch.randint(cfg.vocab_size, (micro_batch, seq + 1), device=dev, generator=g)
        with record_function(f"{label}.forward"):
            _, loss = engine(tokens[:, :-1], tokens[:, 1:])
        with record_function(f"{label}.backward"):
            engine.backward(loss)
        with record_function(f"{label}.step"):
            engine.step()
        torch.cuda.synchronize()

    for _ in range(2):
        step("warmup")
    before = dict(engine.optim.io_report())
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step("zr")
    after = engine.optim.io_report()
    prof.export_chrome_trace(str(trace_path.with_suffix("")))
    raw = Path(str(trace_path.with_suffix(""))).read_bytes()
    trace_path.write_bytes(gzip.compress(raw))
    os.remove(str(trace_path.with_suffix("")))
    events = json.loads(raw)["traceEvents"]
    engine.close()
    dist.destroy_process_group()

    def cpu_span(name: str) -> tuple[float, float]:
        e = next(e for e in events if e.get("name") == name and e.get("ph") == "X" and e.get("cat") in ("user_annotation", "cpu_op"))
        return e["ts"], e["ts"] + e["dur"]

    backward_cpu, step_cpu = cpu_span("zr.backward"), cpu_span("zr.step")
    launched_in_backward = {e["args"]["correlation"] for e in events
                            if e.get("cat") == "cuda_runtime" and _in(e["ts"], backward_cpu) and "correlation" in e.get("args", {})}
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("args", {}).get("correlation") in launched_in_backward]
    bw_start = min(e["ts"] for e in kernels)
    bw_end = max(e["ts"] + e["dur"] for e in kernels)
    d2h = [e for e in events if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "") and e["args"].get("bytes", 0) >= 2**20]
    hidden = [e for e in d2h if e["ts"] + e["dur"] <= bw_end]
    started = [e for e in d2h if e["ts"] < bw_end]
    total_bytes = sum(e["args"]["bytes"] for e in d2h)
    copy_s = sum(e["dur"] for e in d2h) / 1e6
    out = {
        "params": model.num_params(), "stage": stage, "seq": seq, "micro_batch": micro_batch,
        "backward_gpu_s": (bw_end - bw_start) / 1e6,
        "d2h_copies": len(d2h), "d2h_bytes": total_bytes, "d2h_copy_s": copy_s,
        "d2h_started_before_backward_end": len(started),
        "d2h_done_before_backward_end": len(hidden),
        "d2h_bytes_done_before_backward_end": sum(e["args"]["bytes"] for e in hidden),
        "d2h_last_end_after_backward_s": max(0.0, (max((e["ts"] + e["dur"] for e in d2h), default=bw_end) - bw_end) / 1e6),
        "step_cpu_s": (step_cpu[1] - step_cpu[0]) / 1e6,
        "grad_wait_s": after["grad_wait_s"] - before["grad_wait_s"],
        "grad_copies_in_backward": after["grad_copies_in_backward"] - before["grad_copies_in_backward"],
        "grad_copies_in_step": after["grad_copies_in_step"] - before["grad_copies_in_step"],
    }
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="copies,adam,overlap")
    ap.add_argument("--sizes-mb", default="64,256,1024")
    ap.add_argument("--adam-numel", type=float, default=2.5e8)
    ap.add_argument("--params", type=float, default=1.3e9)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu" / "offload"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_offload_bench: no CUDA device here; nothing to measure")
        return
    parts = set(args.parts.split(","))
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                              "cpus": os.cpu_count()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if "copies" in parts:
        result["copies"] = copies([int(v) for v in args.sizes_mb.split(",")])
    if "adam" in parts:
        result["adam"] = adam(int(args.adam_numel))
    if "overlap" in parts:
        result["overlap"] = overlap(args.params, args.seq, args.micro_batch, args.stage,
                                    out.with_name(out.name + "_trace.json.gz"))
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
