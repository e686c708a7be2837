"""Models bigger than one rank: stage-3 set-up from a meta build against a whole build, and
``load_pretrained`` against the disk's floor and ``from_pretrained``.

    python benchmarks/pretrained_bench.py [--layers 22] [--world-size 4] [--whole-world-size 2] [--skip-whole]

The model is a Hugging Face Llama of TinyLlama's shape (hidden 2048, 22 layers, GQA 32/4 heads, vocab
32000, untied): 1.1B parameters, 4.4 GB in fp32. Every rank is a fresh process (gloo, one thread), so
its peak RSS (``getrusage``) belongs to the phase measured. The optimizer is fp32 AdamW.

- set-up, whole: each rank builds the model on the CPU (``LlamaForCausalLM(config)``, seeded), then
  ``zeroray.initialize`` at stage 3 shards it (broadcasting every flat group from rank 0);
- set-up, meta: each rank builds it under ``torch.device("meta")`` and ``initialize(init_fn=
  model._init_weights)`` allocates only its shards and initializes them module by module;
  the bound is the rank's persistent model states after set-up + the largest unit's full
  parameters + 10% (peak RSS growth over the process's RSS before the build is compared with it);
- load: the model saved with ``save_pretrained`` (safetensors). Before each read, the files' pages
  are dropped from the page cache (``posix_fadvise(DONTNEED)``), so every read comes from the disk.
  The floor is one sequential read of the files (16 MiB reads); ``load_pretrained`` runs on a
  meta-built stage-3 engine at the world size (barrier-bracketed, first start to last end);
  ``from_pretrained`` loads the whole model in one process. Goal: load ≤ 1.25 × bytes ÷ floor
  bandwidth.

Results: benchmarks/results/pretrained.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import zeroray  # noqa: E402
from tests.support.dist import free_port  # noqa: E402

MiB = 2**20


def llama_config(layers: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                       tie_word_embeddings=False)


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def drop_cache(directory: str) -> None:
    """Evict the files' pages from the page cache so the next read comes from the disk."""
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def safetensors_files(directory: str) -> list[str]:
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".safetensors"))


def build(mode: str, layers: int) -> tuple[torch.nn.Module, Any]:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    if mode == "meta":
        with torch.device("meta"):
            model = LlamaForCausalLM(llama_config(layers))
        return model, model._init_weights
    return LlamaForCausalLM(llama_config(layers)), None


def largest_unit_bytes(engine: zeroray.ZeroEngine) -> int:
    """The largest unit's full parameters (the root unit's included), in compute precision."""
    per_unit: dict[str, int] = {}
    for g in engine.groups:
        per_unit[g.name.split("/")[0]] = per_unit.get(g.name.split("/")[0], 0) + g.numel * g.compute_dtype.itemsize
    return max(per_unit.values())


def rank_main(rank: int, world: int, port: int, phase: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result: dict[str, Any] = {"rank": rank}
        rss_before = psutil.Process().memory_info().rss
        dist.barrier()
        t0 = time.perf_counter()
        mode = "whole" if phase == "setup_whole" else "meta"
        model, init_fn = build(mode, args.layers)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        engine = zeroray.initialize(model, optimizer, {"zero_optimization": {"stage": 3}}, init_fn=init_fn)
        setup_s = time.perf_counter() - t0
        result.update(setup_s=setup_s, rss_before=rss_before, peak_rss=peak_rss(),
                      states=engine.memory_report()["total"], largest_unit=largest_unit_bytes(engine))
        if phase == "load":
            dist.barrier()
            t0 = time.perf_counter()
            report = zeroray.load_pretrained(engine, args.pretrained_dir)
            result.update(load_start=t0, load_end=time.perf_counter(), bytes_read=report.bytes_read,
                          total_bytes_read=report.total_bytes_read, checkpoint_bytes=report.checkpoint_bytes,
                          peak_rss=peak_rss())
        with open(os.path.join(out, f"{phase}-{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_phase(phase: str, args: argparse.Namespace, tmp: str, world: int) -> list[dict[str, Any]]:
    print(f"{time.strftime('%H:%M:%S')} {phase}, world {world}", flush=True)
    mp.spawn(rank_main, args=(world, free_port(), phase, args, tmp), nprocs=world, join=True)
    return [json.loads(Path(tmp, f"{phase}-{r}.json").read_text()) for r in range(world)]


def save_pretrained(args: argparse.Namespace) -> None:
    """In its own process: the whole model exists only there."""
    model, _ = build("whole", args.layers)
    model.save_pretrained(args.pretrained_dir)


def sequential_read(files: list[str]) -> float:
    start = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.read(16 * MiB):
                pass
    return time.perf_counter() - start


def from_pretrained(directory: str, out: str) -> None:
    from transformers import LlamaForCausalLM

    start = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():  # safetensors maps the file: touch every weight so that its bytes are read
        for p in model.parameters():
            p.sum()
    Path(out).write_text(json.dumps({"seconds": time.perf_counter() - start, "peak_rss": peak_rss()}))


def in_process(fn: Any, *fn_args: Any) -> None:
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=fn, args=fn_args)
    p.start()
    p.join()
    if p.exitcode != 0:
        raise RuntimeError(f"{fn.__name__} failed with exit code {p.exitcode}")


def setup_row(name: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    worst = max(ranks, key=lambda r: r["peak_rss"] - r["rss_before"])
    bound = 1.1 * (worst["states"] + worst["largest_unit"])
    return {"build": name, "setup_s": max(r["setup_s"] for r in ranks), "peak_rss": worst["peak_rss"],
            "peak_growth": worst["peak_rss"] - worst["rss_before"], "states": worst["states"],
            "largest_unit": worst["largest_unit"], "bound": bound}


def to_markdown(res: dict[str, Any]) -> str:
    lines = [f"# Models bigger than one rank ({res['params'] / 1e9:.2f}B params, world {res['world_size']}, "
             "stage 3, fp32 AdamW)", "",
             "| set-up | seconds | peak RSS / rank (MiB) | growth over start | states + largest unit + 10% | "
             "within bound |", "|---|---|---|---|---|---|"]
    for row in res["setup"]:
        within = "yes" if row["peak_growth"] <= row["bound"] else "no"
        lines.append(f"| {row['build']} | {row['setup_s']:.1f} | {row['peak_rss'] / MiB:.0f} | "
                     f"{row['peak_growth'] / MiB:.0f} | {row['bound'] / MiB:.0f} | {within} |")
    load = res["load"]
    lines += ["", "| load | seconds | bytes read (all ranks) | ÷ checkpoint bytes | peak RSS / process (MiB) |",
              "|---|---|---|---|---|",
              f"| sequential read (floor, {load['floor_mb_s']:.0f} MB/s) | {load['floor_s']:.2f} | "
              f"{load['checkpoint_bytes'] / 1e9:.2f} GB | 1.00 | |",
              f"| zeroray.load_pretrained, world {res['world_size']} | {load['load_s']:.2f} | "
              f"{load['total_bytes_read'] / 1e9:.2f} GB | {load['read_ratio']:.3f} | {load['load_peak_rss'] / MiB:.0f} |",
              f"| transformers from_pretrained + touch every weight, 1 process | {load['hf_s']:.2f} | | | {load['hf_peak_rss'] / MiB:.0f} |",
              "", f"load ÷ floor: {load['load_s'] / load['floor_s']:.2f} (goal ≤ 1.25); "
              f"largest single rank read: {load['max_rank_bytes'] / 1e9:.2f} GB"]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=22, help="decoder layers (22: 1.1B parameters)")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--skip-whole", action="store_true", help="skip the whole build (it needs world × 4.4 GB)")
    p.add_argument("--whole-world-size", type=int, default=None,
                   help="ranks for the whole build (default --world-size): each rank holds the whole model, so "
                        "world 4 × 1.1B fp32 does not fit 24 GiB; its per-rank peak barely depends on the world size")
    p.add_argument("--out", default=str(HERE / "results"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        args.pretrained_dir = os.path.join(tmp, "pretrained")
        rows = []
        if not args.skip_whole:
            whole = args.whole_world_size or args.world_size
            rows.append(setup_row(f"whole (CPU build, then shard), world {whole}",
                                  run_phase("setup_whole", args, tmp, whole)))
        rows.append(setup_row(f"meta (shards only), world {args.world_size}",
                              run_phase("setup_meta", args, tmp, args.world_size)))
        in_process(save_pretrained, args)
        files = safetensors_files(args.pretrained_dir)
        checkpoint_bytes = sum(os.path.getsize(f) for f in files)
        drop_cache(args.pretrained_dir)
        floor_s = sequential_read(files)
        drop_cache(args.pretrained_dir)
        ranks = run_phase("load", args, tmp, args.world_size)
        drop_cache(args.pretrained_dir)
        hf_out = os.path.join(tmp, "hf.json")
        in_process(from_pretrained, args.pretrained_dir, hf_out)
        hf = json.loads(Path(hf_out).read_text())
    load_s = max(r["load_end"] for r in ranks) - min(r["load_start"] for r in ranks)
    res = {
        "params": checkpoint_bytes / 4,
        "world_size": args.world_size,
        "setup": rows,
        "load": {"floor_s": floor_s, "floor_mb_s": checkpoint_bytes / floor_s / 1e6, "load_s": load_s,
                 "checkpoint_bytes": checkpoint_bytes, "total_bytes_read": ranks[0]["total_bytes_read"],
                 "read_ratio": ranks[0]["total_bytes_read"] / checkpoint_bytes,
                 "max_rank_bytes": max(r["bytes_read"] for r in ranks),
                 "load_peak_rss": max(r["peak_rss"] for r in ranks), "hf_s": hf["seconds"], "hf_peak_rss": hf["peak_rss"]},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pretrained.json").write_text(json.dumps(res, indent=2))
    (out / "pretrained.md").write_text(to_markdown(res))
    print(to_markdown(res))


if __name__ == "__main__":
    main()
