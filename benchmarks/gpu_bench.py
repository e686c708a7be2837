"""One GPU, world 1, a bf16 GPT: zeroray stage 0 and 3 against plain PyTorch, FSDP2 and DeepSpeed.

    python benchmarks/gpu_bench.py                       # 1.3B, seq 2048, micro-batch 8, all systems
    python benchmarks/gpu_bench.py --params 2.7e9 --systems torch,zeroray-0,zeroray-3 --largest 3,4,5

Each measurement runs in its own process (a fresh CUDA context, so peaks do not leak between systems),
joined in a one-rank NCCL group. Every system gets the same model, data, ``AdamW(fused=True)`` and bf16
compute:

- ``torch``: fp32 parameters under ``torch.autocast(bf16)`` (the usual PyTorch recipe);
- ``zeroray-S``: ``precision="bf16"`` (bf16 parameters, fp32 master weights), ZeRO stage S;
  ``zeroray-S-offload`` keeps masters and Adam moments in pinned host memory (``offload_optimizer``),
  stepped there by the same ``AdamW(fused=True)`` on the CPU;
- ``fsdp2``: ``fully_shard`` per block and the root, ``MixedPrecisionPolicy(bf16, reduce fp32)``;
  ``fsdp2-offload`` adds ``CPUOffloadPolicy(pin_memory=True)`` (parameters, gradients and the optimizer
  step on the CPU);
- ``deepspeed-S``: ``bf16.enabled`` and ZeRO stage S, the same client optimizer; ``deepspeed-S-offload``
  is ZeRO-Offload (``offload_optimizer.device: cpu``, pinned, ``overlap_comm``) with DeepSpeed's own
  ``DeepSpeedCPUAdam`` (an AVX C++ op it compiles at first use), as its docs recommend;
- ``zeroray-0-compiled``, ``zeroray-3-compiled``, ``fsdp2-compiled`` (opt-in, issue 31): the same with each
  transformer block compiled (``block.compile()``, inductor), after ``zeroray.initialize`` and before
  ``fully_shard`` (torchtitan's order). The warm-up's first step holds the compilation: it is reported as
  ``first_step_s``, outside the median, beside dynamo's graph count and recompiles after step 2.

Reported: median step time, tokens/s, MFU (model FLOPs 6N + 12·L·d·T per token, over the device's dense
bf16 peak), peak allocated memory; ``--largest`` adds the largest model (of the sizes given, in
billions) each system trains for two steps without running out of memory. Writes ``--out``.json and .md.
Skipped (exit 0 with a message) where torch sees no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from measure import dynamo_counts
from systems import COMPILED, compile_blocks

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ["torch", "zeroray-0", "zeroray-3", "zeroray-3-offload", "fsdp2", "deepspeed-0", "deepspeed-3",
           "zeroray-2", "zeroray-2-offload", "fsdp2-offload", "deepspeed-2-offload",
           "zeroray-0-compiled", "zeroray-3-compiled", "fsdp2-compiled"]
# Dense bf16 peak (no sparsity), by substring of torch.cuda.get_device_name().
PEAK_BF16 = {"H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "A100": 312e12, "L4": 121e12}
LR = 1e-4


def peak_flops(name: str) -> float | None:
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def flops_per_token(cfg: Any, n_params: int, seq: int) -> float:
    """Training FLOPs per token: 6 per parameter (forward 2, backward 4) plus attention's 12·L·d·T."""
    return 6 * n_params + 12 * cfg.n_layer * cfg.n_embd * seq


class Runner:
    """One system's training step over a GPT on cuda:0."""

    def __init__(self, name: str, model: torch.nn.Module, micro_batch: int) -> None:
        self.name, self.autocast = name, False
        compiled = name.endswith(COMPILED)
        if compiled and name.startswith("fsdp2"):
            compile_blocks(model)  # torchtitan's order: compile each block, then fully_shard it
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        if name == "torch":
            self.model, self.opt, self.autocast = model, opt, True
        elif name.startswith("zeroray"):
            import zeroray

            offload = {"device": "cpu", "pin_memory": True} if name.endswith("offload") else {}
            cfg = zeroray.ZeroConfig(stage=int(name.split("-")[1]), precision="bf16", offload_optimizer=offload)
            self.engine = zeroray.initialize(model, opt, cfg)
        elif name.startswith("fsdp2"):
            from torch.distributed.fsdp import (
                CPUOffloadPolicy,
                MixedPrecisionPolicy,
                OffloadPolicy,
                fully_shard,
            )

            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            policy = CPUOffloadPolicy(pin_memory=True) if name.endswith("offload") else OffloadPolicy()
            for block in model.transformer.h:
                fully_shard(block, mp_policy=mp, offload_policy=policy)
            fully_shard(model, mp_policy=mp, offload_policy=policy)
            self.model = model
            self.opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)  # over the DTensor shards
        elif name.startswith("deepspeed"):
            import deepspeed

            zero: dict[str, Any] = {"stage": int(name.split("-")[1])}
            client: torch.optim.Optimizer | None = opt
            config: dict[str, Any] = {
                "train_micro_batch_size_per_gpu": micro_batch,
                "gradient_accumulation_steps": 1,
                "bf16": {"enabled": True},
                "zero_optimization": zero,
                "zero_allow_untested_optimizer": True,
            }
            if name.endswith("offload"):
                zero.update(offload_optimizer={"device": "cpu", "pin_memory": True}, overlap_comm=True,
                            contiguous_gradients=True)
                config["optimizer"] = {"type": "AdamW", "params": {"lr": LR}}  # DeepSpeedCPUAdam
                client = None
            self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client, config=config,
                                                        model_parameters=model.parameters())
        else:
            raise ValueError(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}")
        if compiled and name.startswith("zeroray"):
            compile_blocks(model)  # after zeroray.initialize, as a user does

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "engine"):
            _, loss = self.engine(x, y)
            self.engine.backward(loss)
            self.engine.step()
            return loss
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
            _, loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        return loss


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One measurement in this process: build, warm up, time ``--steps`` steps."""
    import torch.distributed as dist

    from zeroray.models.gpt import GPT, GPTConfig

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    dist.init_process_group("nccl", device_id=dev)
    cfg = GPTConfig.for_params(args.params, vocab_size=32000, block_size=args.seq, head_dim=128)
    torch.manual_seed(0)
    with dev:
        model = GPT(cfg)
    n_params = model.num_params()
    out: dict[str, Any] = {"system": args.one, "params": n_params, "n_layer": cfg.n_layer, "n_embd": cfg.n_embd}
    try:
        runner = Runner(args.one, model, args.micro_batch)
        g = torch.Generator(device=dev).manual_seed(0)
        times, losses, first_step = [], [], 0.0
        after_two: dict[str, int] = {}
        for i in range(args.warmup + args.steps):
            tokens = torch.randint(cfg.vocab_size, (args.micro_batch, args.seq + 1), device=dev, generator=g)
            x, y = tokens[:, :-1], tokens[:, 1:]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = runner.step(x, y)
            losses.append(loss.item())  # syncs: the step is done
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
            elif i == 0:
                first_step = time.perf_counter() - t0  # a compiled system's compilation is in it
            if i == 1:
                after_two = dynamo_counts()
            if i == args.warmup - 1 and args.one.startswith("zeroray"):
                runner.engine.phase_report()  # phase means over the timed steps only
        dynamo = dynamo_counts()
        # Every frame a step runs was compiled by the end of step 2: any compile after it is a recompile.
        dynamo["recompiles_after_step2"] = dynamo["frames_compiled"] - after_two.get("frames_compiled", 0)
        step = statistics.median(times)
        tokens_s = args.micro_batch * args.seq / step
        peak = peak_flops(torch.cuda.get_device_name(dev))
        out.update(
            step_s=step,
            tokens_s=tokens_s,
            mfu=tokens_s * flops_per_token(cfg, n_params, args.seq) / peak if peak else None,
            peak_alloc_gib=torch.cuda.max_memory_allocated(dev) / 2**30,
            peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            first_loss=losses[0],
            last_loss=losses[-1],
            first_step_s=first_step,
            dynamo=dynamo,
            ok=True,
        )
        if args.one.startswith("zeroray"):  # where a step's time goes, and the offload copies
            out.update(phases=runner.engine.phase_report().as_dict(), offload_io=runner.engine.optim.io_report())
    except torch.OutOfMemoryError as e:
        out.update(ok=False, error=f"OutOfMemoryError: {str(e).splitlines()[0]}")
    except Exception as e:  # a system that cannot run this set-up is reported, not fatal
        out.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    dist.destroy_process_group()
    return out


def measure(system: str, params: float, args: argparse.Namespace, steps: int, warmup: int, micro: int) -> dict:
    port = 29500 + (os.getpid() + int(time.time() * 1000)) % 20000
    env = {**os.environ, "MASTER_PORT": str(port), "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, __file__, "--one", system, "--params", str(params), "--seq", str(args.seq),
           "--micro-batch", str(micro), "--steps", str(steps), "--warmup", str(warmup)]
    with tempfile.TemporaryDirectory() as cache:  # an empty inductor cache: each compile time is a cold one
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"system": system, "ok": False, "error": f"exit {done.returncode}: {' | '.join(tail)}"}
    return json.loads(lines[-1][len("RESULT "):])


def table(rows: list[dict], base: str) -> str:
    ref = next((r for r in rows if r["system"] == base and r.get("ok")), None)
    out = [f"| system | step (s) | vs {base} | tokens/s | MFU | peak GiB | first step (s) | graphs | recompiles |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r.get("ok"):
            out.append(f"| {r['system']} | {r.get('error', 'failed')[:90]} | | | | | | | |")
            continue
        ratio = f"{r['step_s'] / ref['step_s']:.3f}" if ref else ""
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "n/a"
        d = r["dynamo"]
        out.append(f"| {r['system']} | {r['step_s']:.3f} | {ratio} | {r['tokens_s']:,.0f} | {mfu} | {r['peak_alloc_gib']:.1f} "
                   f"| {r['first_step_s']:.1f} | {d['unique_graphs']} | {d['recompiles_after_step2']} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=1.3e9)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--systems", default=",".join(SYSTEMS[:7]))
    ap.add_argument("--base", default="torch", help="the system the table's ratios divide by")
    ap.add_argument("--largest", default="", help="model sizes in billions to try, e.g. 3,4,5 (ascending)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu"))
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device here; nothing to measure")
        return
    if args.one:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    if args.warmup < 2:  # (the --largest children take 1: they only check that a size fits)
        ap.error("--warmup must be at least 2: compilation and the recompile check stay out of the median")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        ap.error(f"unknown system(s) {unknown}; known: {', '.join(SYSTEMS)}")
    device = torch.cuda.get_device_name(0)
    rows = []
    for s in systems:
        rows.append(measure(s, args.params, args, args.steps, args.warmup, args.micro_batch))
        print(json.dumps(rows[-1]), flush=True)
        if rows[-1].get("ok"):
            d = rows[-1]["dynamo"]
            print(f"{s}: dynamo unique_graphs {d['unique_graphs']}, graph breaks {d['graph_breaks']}, "
                  f"recompiles after step 2 {d['recompiles_after_step2']}, first step {rows[-1]['first_step_s']:.1f} s",
                  flush=True)
    largest: dict[str, Any] = {}
    for s in systems if args.largest else []:
        largest[s] = None
        for b in (float(v) for v in args.largest.split(",")):
            r = measure(s, b * 1e9, args, 2, 1, 1)
            print(json.dumps(r), flush=True)
            if not r.get("ok"):
                break
            largest[s] = {"params": r["params"], "peak_alloc_gib": r["peak_alloc_gib"]}
    result = {"device": device, "torch": torch.__version__, "params": args.params, "seq": args.seq,
              "micro_batch": args.micro_batch, "rows": rows, "largest": largest, "tried": args.largest}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(result, indent=1))
    md = [f"{device}, torch {torch.__version__}: bf16 GPT of {rows[0].get('params', 0) / 1e9:.2f}B parameters, "
          f"seq {args.seq}, micro-batch {args.micro_batch}, world 1, AdamW(fused=True)", "", table(rows, args.base)]
    if largest:
        md += ["", f"Largest model trained (sizes tried: {args.largest} B; micro-batch 1):", ""]
        md += [f"- {s}: {v['params'] / 1e9:.2f}B ({v['peak_alloc_gib']:.1f} GiB peak)" if v else f"- {s}: none of them"
               for s, v in largest.items()]
    Path(args.out + ".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
