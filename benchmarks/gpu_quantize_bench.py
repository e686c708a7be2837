"""ZeRO++'s block quantizer on a CUDA GPU: throughput against the memory bandwidth and DeepSpeed's CUDA
quantizer, and qwZ's numerics on one bf16 block of the 1.39B GPT at world 1.

    PYTHONPATH=. python benchmarks/gpu_quantize_bench.py [--numel 268435456] [--out DIR]

1. Bandwidth: a device-to-device ``copy_`` of ``--numel`` fp32 values, GB/s counting bytes read and written.
2. zeroray's ``BlockQuantizer`` (the same torch ops as on CPU), eager, fp32 and bf16 input, int8 and int4,
   blocks 64..2048; quantize and dequantize GB/s of the full-precision input's bytes, and the share of the
   copy bandwidth that the least traffic (input read + quantized row written, or the reverse) would need.
   The same compiled by inductor into Triton kernels (``QuantizeKernels``, what the engine runs on CUDA) at the
   default block, with the share of codes that differ from eager's and by how much.
3. DeepSpeed's CUDA quantizer (``QuantizerBuilder().load()``, the kernels its qwZ ``CUDAQuantizer`` and qgZ
   ``swizzle_quant`` build on; fp16 in, as its kernel reads ``__half``), when it builds here, at int8 and int4
   with groups of 256 and 2048 elements: quantize and dequantize GB/s, and its error next to ours on the same
   values. Built in a child process with a time limit, so a failed build is reported, not fatal.
4. qwZ numerics: zeroray's GPT with the 1.39B model's width (``GPTConfig.for_params(1.39e9, vocab 32000,
   seq 2048, head_dim 128)``) and one transformer block, stage 3, bf16, world 1 on NCCL, with and without
   ``quantize.weights``: the relative error per element of the gathered (dequantized) block weights, of the
   block's output, of the loss and of the gradients, and the losses of a few AdamW steps.
5. The quantizer's cost in a step: the whole 1.39B GPT, stage 3 bf16, world 1, unquantized and with qwZ on the
   compiled kernels and on the eager ops.

Writes ``gpu_quantize.json`` and ``gpu_quantize.md`` in ``--out`` (default benchmarks/results/gpu/).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_offload_bench import _cuda_time  # noqa: E402  (median seconds by CUDA events)
from zeroray.engine.quantize import BlockQuantizer, QuantizeKernels  # noqa: E402

BLOCKS = (64, 128, 256, 512, 1024, 2048)
DEFAULT_BLOCK = 256
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def cuda_time(fn: Callable[[], Any], reps: int = 10) -> float:
    """Median seconds of ``fn`` on the current stream, after two warm-up calls."""
    for _ in range(2):
        fn()
    return _cuda_time(fn, reps)


def bandwidth(numel: int) -> float:
    x = torch.randn(numel, device="cuda")
    y = torch.empty_like(x)
    t = cuda_time(lambda: y.copy_(x))
    return 2 * x.numel() * x.element_size() / t / 1e9


def ours(numel: int, bw: float) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    x32 = torch.randn(1, numel, device="cuda", generator=g)
    rows = []
    for dname, dtype in DTYPES.items():
        x = x32.to(dtype)
        in_bytes = x.numel() * x.element_size()
        for bits in (8, 4):
            for block in BLOCKS:
                q = BlockQuantizer(bits, block)
                packed = q.quantize(x)
                t_q = cuda_time(lambda q=q, x=x, packed=packed: q.quantize(x, out=packed))
                t_d = cuda_time(lambda q=q, packed=packed: q.dequantize(packed, numel))
                least = (in_bytes + packed.numel()) / 1e9  # read the input, write the row (and the reverse)
                deq_least = (packed.numel() + numel * 4) / 1e9  # dequantize writes fp32
                rows.append({"impl": "zeroray eager", "dtype": dname, "bits": bits, "block": block,
                             "quantize_gbs": in_bytes / 1e9 / t_q, "dequantize_gbs": in_bytes / 1e9 / t_d,
                             "quantize_bw_share": least / t_q / bw, "dequantize_bw_share": deq_least / t_d / bw})
                print(json.dumps(rows[-1]), flush=True)
        del x
    return rows


def compiled(numel: int, bw: float) -> list[dict]:
    """inductor's kernels for the same ops (QuantizeKernels, as the engine runs them on CUDA), at the default
    block, against eager: the share of codes that differ (values within an ulp of a half-step) and by how much."""
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for dname in ("bf16", "fp32"):
        x = torch.randn(1, numel, device="cuda", generator=g).to(DTYPES[dname])
        in_bytes = x.numel() * x.element_size()
        for bits in (8, 4):
            q = BlockQuantizer(bits, DEFAULT_BLOCK)
            k = QuantizeKernels(q, compiled=True)
            t0 = time.perf_counter()
            packed = k.quantize(x)
            k.dequantize(packed, numel)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            eager = q.quantize(x)
            cb = q.code_bytes(numel)
            diff = (q.dequantize(packed, numel) - q.dequantize(eager, numel)).abs()
            scale = eager[:, cb:].view(torch.float32).repeat_interleave(q.block, dim=1)[:, :numel]
            t_q = cuda_time(lambda k=k, x=x: k.quantize(x))
            t_d = cuda_time(lambda k=k, packed=packed: k.dequantize(packed, numel))
            least = (in_bytes + packed.numel()) / 1e9
            deq_least = (packed.numel() + numel * 4) / 1e9
            rows.append({"impl": "zeroray torch.compile", "dtype": dname, "bits": bits, "block": DEFAULT_BLOCK,
                         "quantize_gbs": in_bytes / 1e9 / t_q, "dequantize_gbs": in_bytes / 1e9 / t_d,
                         "quantize_bw_share": least / t_q / bw, "dequantize_bw_share": deq_least / t_d / bw,
                         "code_bytes_differing": (packed[:, :cb] != eager[:, :cb]).float().mean().item(),
                         "max_diff_in_steps": (diff / scale.clamp_min(1e-30)).max().item(),
                         "scales_equal": bool(torch.equal(packed[:, cb:], eager[:, cb:])), "compile_s": compile_s})
            print(json.dumps(rows[-1]), flush=True)
            del packed, eager, diff, scale
        del x
    return rows


def step_times(steps: int) -> list[dict]:
    """Step seconds of the 1.39B GPT (seq 2048, micro-batch 8), stage 3 bf16, world 1: unquantized, and qwZ with
    the compiled kernels (the engine's choice on CUDA) and with the eager ops (set on the engine's gathers)."""
    import zeroray
    from zeroray.models.gpt import GPT, GPTConfig

    dev = torch.device("cuda", 0)
    world_one(dev)
    cfg = GPTConfig.for_params(1.39e9, vocab_size=32000, block_size=2048, head_dim=128)
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name in ("unquantized", "qwZ compiled kernels", "qwZ eager ops"):
        torch.manual_seed(0)
        with dev:
            model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        quantize = {} if name == "unquantized" else {"weights": True}
        engine = zeroray.initialize(model, opt, zeroray.ZeroConfig(stage=3, precision="bf16", quantize=quantize))
        if name == "qwZ eager ops":
            for grp in engine.groups:
                if grp.qwz is not None:
                    grp.qwz.quantizer = QuantizeKernels(grp.qwz.quantizer.quantizer, compiled=False)
        times, losses = [], []
        for i in range(2 + steps):
            tokens = torch.randint(cfg.vocab_size, (8, 2049), device=dev, generator=g)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            _, loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if i >= 2:
                times.append(time.perf_counter() - t0)
        rows.append({"system": name, "step_s": statistics.median(times), "losses": losses})
        print(json.dumps(rows[-1]), flush=True)
        engine.close()
        del engine, model, opt
        torch.cuda.empty_cache()
    return rows


def deepspeed_child(numel: int, bw: float) -> dict:
    """Runs in a child: build DeepSpeed's quantizer, time it, and compare its error with ours."""
    t0 = time.perf_counter()
    from deepspeed.ops.op_builder import QuantizerBuilder

    m = QuantizerBuilder().load()
    build_s = time.perf_counter() - t0
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(numel, device="cuda", generator=g).half()
    in_bytes = x.numel() * 2
    rows = []
    for bits in (8, 4):
        for block in (DEFAULT_BLOCK, 2048):
            groups = numel // block
            codes, params = m.quantize(x, groups, bits, m.Symmetric)
            t_q = cuda_time(lambda bits=bits, groups=groups: m.quantize(x, groups, bits, m.Symmetric))
            t_d = cuda_time(lambda codes=codes, params=params, groups=groups, bits=bits:
                            m.dequantize(codes, params, groups, bits, m.Symmetric))
            back = m.dequantize(codes, params, groups, bits, m.Symmetric).float()
            mine = BlockQuantizer(bits, block)
            my_back = mine.dequantize(mine.quantize(x.view(1, -1)), numel).view(-1)
            ref = x.float()
            least = (in_bytes + codes.numel() + params.numel() * 4) / 1e9
            rows.append({"impl": "DeepSpeed CUDA quantizer", "dtype": "fp16", "bits": bits, "block": block,
                         "quantize_gbs": in_bytes / 1e9 / t_q, "dequantize_gbs": in_bytes / 1e9 / t_d,
                         "quantize_bw_share": least / t_q / bw,
                         "ds_rel_error": ((back - ref).abs().mean() / ref.abs().mean()).item(),
                         "zeroray_rel_error": ((my_back - ref).abs().mean() / ref.abs().mean()).item()})
            print(json.dumps(rows[-1]), flush=True)
    return {"build_s": build_s, "rows": rows}


def deepspeed(numel: int, bw: float, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--deepspeed-child", "--numel", str(numel), "--bw", str(bw)]
    try:
        # DeepSpeed's op builder cannot parse arch names like "9.0a": name the device's own.
        major, minor = torch.cuda.get_device_capability()
        env = {**os.environ, "TORCH_CUDA_ARCH_LIST": f"{major}.{minor}"}
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"no result within {timeout:.0f} s (the JIT build of QuantizerBuilder)"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-6:]
        return {"ok": False, "error": f"exit {done.returncode}: " + " | ".join(tail)}
    return {"ok": True, **json.loads(lines[-1][len("RESULT "):])}


def rel(a: torch.Tensor, b: torch.Tensor) -> dict:
    a, b = a.float(), b.float()
    return {"mean_abs_rel": ((a - b).abs().mean() / b.abs().mean()).item(), "norm_rel": ((a - b).norm() / b.norm()).item()}


def world_one(dev: torch.device) -> None:
    """The default process group of this one process (NCCL on CUDA), once."""
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 20000), RANK="0", WORLD_SIZE="1")
        if dev.type == "cuda":
            dist.init_process_group("nccl", device_id=dev)
        else:
            dist.init_process_group("gloo")


def qwz_numerics(steps: int, dev: torch.device, params: float = 1.39e9, seq: int = 2048, micro: int = 8) -> dict:
    """One bf16 block of the 1.39B GPT, stage 3, world 1 (NCCL on CUDA): qwZ against unquantized."""

    import zeroray
    from zeroray.models.gpt import GPT, GPTConfig

    world_one(dev)
    cfg = dataclasses.replace(GPTConfig.for_params(params, vocab_size=32000, block_size=seq, head_dim=128), n_layer=1)
    g = torch.Generator(device=dev).manual_seed(0)
    batches = [torch.randint(cfg.vocab_size, (micro, seq + 1), device=dev, generator=g) for _ in range(steps)]
    runs: dict[str, dict] = {}
    for name, quantize in (("unquantized", {}), ("qwZ", {"weights": True})):
        torch.manual_seed(0)
        with dev:
            model = GPT(cfg)
        exact_block = {k: v.detach().to(torch.bfloat16).clone() for k, v in model.transformer.h[0].named_parameters()}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        conf = zeroray.ZeroConfig(stage=3, precision="bf16", quantize=quantize)
        engine = zeroray.initialize(model, opt, conf)
        seen: dict[str, Any] = {}

        block = model.transformer.h[0]

        def grab_weights(module: torch.nn.Module, inp: Any, out: Any, seen: dict = seen, block=block) -> None:
            if "weights" not in seen:  # inside the unit's forward: the gathered (dequantized) weights
                seen["weights"] = {k: v.detach().clone() for k, v in block.named_parameters()}

        def grab_out(module: torch.nn.Module, inp: Any, out: torch.Tensor, seen: dict = seen) -> None:
            seen.setdefault("out", out.detach().float().clone())

        hooks = [block.mlp.register_forward_hook(grab_weights), block.register_forward_hook(grab_out)]
        losses, grads = [], None
        for i, tokens in enumerate(batches):
            _, loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            if i == 0:
                grads = torch.cat([gr.grad_shard.float().clone() for gr in engine.groups if gr.trainable])
            engine.step()
            losses.append(loss.item())
        for h in hooks:
            h.remove()
        runs[name] = {"losses": losses, "grads": grads, **seen, "exact_block": exact_block}
        engine.close()
        del engine, model, opt
        torch.cuda.empty_cache()
    base, q = runs["unquantized"], runs["qwZ"]
    weights = torch.cat([q["weights"][k].float().view(-1) for k in q["weights"]])
    exact = torch.cat([q["exact_block"][k].float().view(-1) for k in q["weights"]])
    return {
        "n_embd": cfg.n_embd, "n_head": cfg.n_head, "block_params": exact.numel(), "seq": seq, "micro_batch": micro,
        "gathered_weights_vs_bf16": rel(weights, exact),
        "block_output": rel(q["out"], base["out"]),
        "first_loss": {"unquantized": base["losses"][0], "qwZ": q["losses"][0],
                       "rel": abs(q["losses"][0] - base["losses"][0]) / base["losses"][0]},
        "gradients_step1": rel(q["grads"], base["grads"]),
        "losses": {"unquantized": base["losses"], "qwZ": q["losses"]},
    }


def markdown(out: dict) -> str:
    lines = [f"# ZeRO++ quantizer on {out['device']} (torch {out['torch']})", "",
             f"Device-to-device copy: {out['copy_gbs']:.0f} GB/s (read + write). Input {out['numel']:,} values.", "",
             "| implementation | input | bits | block | quantize GB/s | dequantize GB/s | quantize % of copy bw | dequantize % of copy bw |",
             "|---|---|---|---|---|---|---|---|"]
    rows = out["zeroray"] + out["compiled"] + (out["deepspeed"].get("rows", []) if out["deepspeed"].get("ok") else [])
    for r in rows:
        d = r.get("dequantize_bw_share")
        lines.append(f"| {r['impl']} | {r['dtype']} | int{r['bits']} | {r['block']} | {r['quantize_gbs']:.0f} | "
                     f"{r['dequantize_gbs']:.0f} | {100 * r['quantize_bw_share']:.0f}% | "
                     f"{'' if d is None else f'{100 * d:.0f}%'} |")
    lines.append("")
    for r in out["compiled"]:
        lines.append(f"- torch.compile, {r['dtype']} int{r['bits']}: {100 * r['code_bytes_differing']:.4f}% of code bytes "
                     f"differ from eager's, by at most {r['max_diff_in_steps']:.2f} step; scales equal: "
                     f"{r['scales_equal']}; first call (compile) {r['compile_s']:.1f} s.")
    if out.get("steps"):
        base = out["steps"][0]["step_s"]
        lines += ["", "1.39B GPT, stage 3, bf16, world 1 (no communication: the quantizer's cost alone):", "",
                  "| system | step (s) | vs unquantized | losses |", "|---|---|---|---|"]
        for r in out["steps"]:
            lines.append(f"| {r['system']} | {r['step_s']:.3f} | {r['step_s'] / base:.3f} | "
                         + ", ".join(f"{v:.4f}" for v in r["losses"]) + " |")
    ds = out["deepspeed"]
    if ds.get("ok"):
        lines.append(f"- DeepSpeed's quantizer built in {ds['build_s']:.0f} s. Mean relative error, DeepSpeed / zeroray "
                     "on the same fp16 values: " + ", ".join(
                         f"int{r['bits']} block {r['block']}: {r['ds_rel_error']:.4f} / {r['zeroray_rel_error']:.4f}"
                         for r in ds["rows"]))
    else:
        lines.append(f"- DeepSpeed's CUDA quantizer did not run: {ds['error']}")
    n = out["qwz"]
    if "error" in n:
        lines.append(f"- qwZ numerics failed: {n['error']}")
    else:
        lines += ["", f"## qwZ on one bf16 block of the 1.39B GPT (n_embd {n['n_embd']}, {n['block_params']:,} "
                      f"parameters in the block, seq {n['seq']}, micro-batch {n['micro_batch']}), world 1 on NCCL, stage 3", "",
                  "| quantity | mean abs rel. error | norm rel. error |", "|---|---|---|"]
        for k in ("gathered_weights_vs_bf16", "block_output", "gradients_step1"):
            lines.append(f"| {k} | {n[k]['mean_abs_rel']:.5f} | {n[k]['norm_rel']:.5f} |")
        lines += ["", f"First loss: unquantized {n['first_loss']['unquantized']:.5f}, qwZ {n['first_loss']['qwZ']:.5f} "
                      f"(relative {n['first_loss']['rel']:.2e}).",
                  "Losses: unquantized " + ", ".join(f"{v:.4f}" for v in n["losses"]["unquantized"])
                  + "; qwZ " + ", ".join(f"{v:.4f}" for v in n["losses"]["qwZ"]) + "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=2**28)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--ds-timeout", type=float, default=240)
    p.add_argument("--deepspeed-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--bw", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.deepspeed_child:
        print("RESULT " + json.dumps(deepspeed_child(args.numel, args.bw)), flush=True)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    bw = bandwidth(args.numel)
    print(f"copy {bw:.0f} GB/s", flush=True)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "numel": args.numel,
                           "copy_gbs": bw, "zeroray": [], "compiled": [], "deepspeed": {"ok": False, "error": "not run"},
                           "qwz": {"error": "not run"}, "steps": []}

    def save() -> None:  # after every part, so a run stopped at its limit keeps what it measured
        (args.out / "gpu_quantize.json").write_text(json.dumps(out, indent=1))
        (args.out / "gpu_quantize.md").write_text(markdown(out))

    out["zeroray"] = ours(args.numel, bw)
    save()
    try:
        out["qwz"] = qwz_numerics(args.steps, torch.device("cuda", 0))
    except Exception as e:  # reported, not fatal: the throughput numbers still stand
        out["qwz"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    print(json.dumps(out["qwz"]), flush=True)
    torch.cuda.empty_cache()
    save()
    out["compiled"] = compiled(args.numel, bw)
    torch.cuda.empty_cache()
    save()
    out["steps"] = step_times(args.steps)
    save()
    out["deepspeed"] = deepspeed(args.numel // 4, bw, args.ds_timeout)  # fp16, in a child process
    save()
    print(markdown(out))


if __name__ == "__main__":
    main()
