"""Train a small GPT with ZeRO on Ray: the README Quickstart.

    python examples/train_gpt.py                         # ZeRO-3, 2 workers, local embedded Ray cluster
    python examples/train_gpt.py --stage 2 --workers 3 --steps 300 --num-cpus 3
    python examples/train_gpt.py --workers 2-4 --resize-check 5  # elastic: 2 to 4 ranks, as nodes come and go
    python examples/train_gpt.py --deepspeed-config ds_config.json --storage-path s3://bucket/runs

A byte-level GPT (about 3M parameters) learns examples/data/corpus.txt, a synthetic text shipped with
the repo (examples/data/make_corpus.py rewrites it; --data takes any text file). The data arrives as a
Ray user's would: the text is cut once into a Parquet file of windows at random offsets (pyarrow, under
the temp dir, reused after), read into a Ray Dataset and passed as ``datasets={"train": ...}``; each rank
iterates ``zt.get_dataset_shard("train")``, whose position is saved with the checkpoints, so a run
resumed after a failure or resized takes the same windows in the same steps. The loss falls within a
couple of minutes on a 2-core laptop. At the end the script prints a sample from the model and each
rank's memory by category.

A DeepSpeed config is run as written: its "auto" values are resolved here, before the run, as Hugging
Face's Trainer does from its flags (--lr, this script's AdamW betas, eps and weight decay; the GPT's
hidden size), its optimizer block builds the optimizer and its scheduler block sets the learning rate
(otherwise this script's AdamW and warm-up + cosine schedule); --stage overrides its stage. Every
argument and the config are checked before Ray starts: a bad one is one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

try:
    import zeroray  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import zeroray.train as zt
from zeroray import ZeroConfig
from zeroray.config.load import load_config
from zeroray.models.gpt import GPT, GPTConfig
from zeroray.storage import StorageError
from zeroray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, ZeroTrainer
from zeroray.train.driver.run_dir import RunStorage

DATA = Path(__file__).resolve().parent / "data" / "corpus.txt"
BETAS, EPS, WEIGHT_DECAY = (0.9, 0.95), 1e-8, 0.1  # this script's AdamW (a DeepSpeed config's "auto"s read them)


def get_batch(data: torch.Tensor, batch: int, block: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``block + 1`` bytes: inputs and next-byte targets."""
    ix = torch.randint(len(data) - block - 1, (batch,), generator=gen)
    x = torch.stack([data[i : i + block] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + block] for i in ix])
    return x.long(), y.long()


def windows_parquet(text: bytes, block: int) -> Path:
    """The training text as a Parquet file of ``block + 1``-byte windows (inputs and next-byte targets) at
    seeded random offsets, as many as there are ``block // 2`` bytes: the form a Ray user's data arrives in.
    Written once per text and block under the temp dir, then reused."""
    digest = hashlib.sha256(text).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / "zeroray_data" / f"windows-{digest}-block{block}.parquet"
    if not path.exists():
        data = np.frombuffer(text, dtype=np.uint8)
        starts = np.random.default_rng(1337).integers(0, len(data) - block, (len(data) - block) // max(1, block // 2))
        windows = data[starts[:, None] + np.arange(block + 1)]
        table = pa.table({"window": pa.FixedSizeListArray.from_arrays(pa.array(windows.ravel()), block + 1)})
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f"{path.name}.{os.getpid()}.part")  # written whole, then renamed: no torn file
        pq.write_table(table, part)
        os.replace(part, path)
    return path


def lr_at(step: int, cfg: dict[str, Any]) -> float:
    """Linear warm-up, then cosine decay to a tenth (as nanoGPT)."""
    warmup, total, lr = cfg["warmup"], cfg["steps"], cfg["lr"]
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def gpt_config(config: dict[str, Any]) -> GPTConfig:
    return GPTConfig(vocab_size=256, block_size=config["block"], n_layer=config["n_layer"],
                     n_head=config["n_head"], n_embd=config["n_embd"])


def adamw(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)


@torch.no_grad()
def sample(engine: Any, prompt: bytes, n: int, block: int, device: torch.device) -> str:
    """Greedy-ish sampling; every rank runs it (ZeRO-3 gathers weights collectively) with one seed."""
    gen = torch.Generator().manual_seed(0)
    idx = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    for _ in range(n):
        logits, _ = engine(idx[:, -block:])
        probs = torch.softmax(logits[0, -1].float() / 0.8, dim=-1).cpu()
        nxt = torch.multinomial(probs, 1, generator=gen).to(device)
        idx = torch.cat([idx, nxt.view(1, 1)], dim=1)
    return bytes(idx[0].tolist()).decode("utf-8", errors="replace")


def train_loop(config: dict[str, Any]) -> None:
    """Runs on every rank (one Ray actor each)."""
    ctx = zt.get_context()
    val_data = torch.frombuffer(bytearray(config["val_text"]), dtype=torch.uint8)

    torch.manual_seed(1337)  # same initial weights on every rank
    model = GPT(gpt_config(config))
    # A DeepSpeed config's optimizer block builds the optimizer (zt.prepare with None), as DeepSpeed does.
    engine = zt.prepare(model, None if config["config_optimizer"] else adamw(model, config["lr"]))
    device = ctx.get_device()
    if ctx.get_world_rank() == 0:
        print(f"GPT with {model.num_params() / 1e6:.2f}M parameters, ZeRO stage {engine.stage}, "
              f"{ctx.get_world_size()} ranks")

    # This rank's micro-batches of each step's global batch, from where the run is (saved with the checkpoints).
    shard = zt.get_dataset_shard("train")
    val_gen = torch.Generator().manual_seed(7)  # the same validation windows on every rank
    while engine.global_step < config["steps"]:
        for batch in shard.iter_torch_batches():  # the rest of this pass over the windows
            step = engine.global_step
            if not config["config_schedule"]:  # else the config's schedule, stepped by the engine
                for group in engine.optimizer.param_groups:
                    group["lr"] = lr_at(step, config)
            lr = engine.optimizer.param_groups[0]["lr"]  # the one this step uses
            window = batch["window"].long().to(device)
            _, loss = engine(window[:, :-1], window[:, 1:])
            engine.backward(loss)
            engine.step()
            if engine.global_step == step:  # inside a gradient-accumulation cycle
                continue
            metrics = {"loss": loss.item(), "lr": lr}
            evaluate = engine.global_step % config["eval_every"] == 0 or engine.global_step == config["steps"]
            if evaluate:
                model.eval()
                with torch.no_grad():
                    xv, yv = get_batch(val_data, config["batch"], config["block"], val_gen)
                    metrics["val_loss"] = engine(xv.to(device), yv.to(device))[1].item()
                model.train()
            zt.report(metrics, checkpoint=evaluate)  # every rank writes its shard; rerun with --name to resume
            if engine.global_step == config["steps"]:
                break

    model.eval()
    text = sample(engine, b"Ada ", 160, config["block"], device)
    zt.report({"sample": text})


def workers_arg(text: str) -> tuple[int, int]:
    """``N`` or ``MIN-MAX`` (an elastic run)."""
    try:
        lo, _, hi = text.partition("-")
        bounds = (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN-MAX, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return bounds


class Parser(argparse.ArgumentParser):
    """A bad argument is one line on stderr and exit 2, as the ``zeroray`` CLI."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def zero_config(args: argparse.Namespace, model_cfg: dict[str, Any], elastic: bool, hi: int) -> ZeroConfig:
    """The run's ZeroConfig, every "auto" resolved (the ranks get it as it is and resolve nothing)."""
    if args.deepspeed_config:
        with torch.device("meta"):  # the model's shape and this script's AdamW, for the "auto"s; no memory
            model = GPT(gpt_config(model_cfg))
        zero = load_config(args.deepspeed_config, model=model, optimizer=adamw(model, args.lr))
        if args.stage is not None:
            zero = dataclasses.replace(zero, stage=args.stage)
    else:
        zero = ZeroConfig(stage=3 if args.stage is None else args.stage, gradient_clipping=args.grad_clip)
    if zero.train_micro_batch_size_per_gpu is None and zero.train_batch_size is None:
        # Elastic: the global batch stays --batch x MAX; each size splits it (only sizes that divide it run).
        zero = dataclasses.replace(zero, **({"train_batch_size": args.batch * hi} if elastic
                                            else {"train_micro_batch_size_per_gpu": args.batch}))
    return zero


def describe(zero: ZeroConfig, args: argparse.Namespace) -> str:
    """Where the optimizer and the learning rate come from, said once before the run."""
    opt = (f"the DeepSpeed config's {zero.optimizer['type']} {zero.optimizer.get('params', {})}" if zero.optimizer
           else f"AdamW (lr {args.lr:g}, betas {BETAS}, weight decay {WEIGHT_DECAY})")
    sched = (f"the DeepSpeed config's {zero.scheduler['type']} {zero.scheduler.get('params', {})}" if zero.scheduler
             else "linear warm-up, then cosine decay to a tenth")
    return f"optimizer: {opt}; learning rate: {sched}; gradient clipping: {zero.gradient_clipping or 'off'}"


def fail(p: argparse.ArgumentParser, e: BaseException) -> NoReturn:
    """One line on stderr, exit 2 (a config error listing several problems is joined onto it)."""
    p.exit(2, f"{p.prog}: error: {' '.join(str(e).split())}\n")


def main() -> None:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", type=int, choices=range(4), default=None,
                   help="ZeRO stage 0-3 (default 3, or the DeepSpeed config's)")
    p.add_argument("--workers", type=workers_arg, default=(2, 2),
                   help="ranks, one Ray actor each (one CPU each); MIN-MAX for an elastic run")
    p.add_argument("--resize-check", type=float, default=60.0,
                   help="elastic runs: seconds between checks for a different size (Ray Train V2's default 60)")
    p.add_argument("--num-cpus", type=int, default=None,
                   help="logical CPUs of the embedded Ray cluster (default: the cores); set it to --workers "
                        "to run more ranks than cores")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps (the run's total, across resumes)")
    p.add_argument("--storage-path", default=str(Path.home() / "zeroray_results"), help="any fsspec URL")
    p.add_argument("--name", default=None, help="run name (default: gpt-<time>)")
    p.add_argument("--deepspeed-config", default=None,
                   help="a DeepSpeed JSON config, run as written (its optimizer, schedule, clipping, ZeRO settings)")
    p.add_argument("--data", default=str(DATA), help="a text file to learn")
    p.add_argument("--batch", type=int, default=8, help="micro-batch per rank")
    p.add_argument("--block", type=int, default=128, help="context length in bytes")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--grad-clip", type=float, default=1.0,
                   help="clip the global gradient norm to this (0 = off; a DeepSpeed config's gradient_clipping wins)")
    p.add_argument("--use-gpu", "--gpu", action="store_true", help="one GPU per worker, NCCL")
    p.add_argument("--max-failures", type=int, default=0)
    args = p.parse_args()
    lo, hi = args.workers
    elastic = lo < hi
    if args.steps < 0:
        p.error("--steps must be >= 0")
    if args.num_cpus is not None and (args.num_cpus < 1 or os.environ.get("RAY_ADDRESS")):
        p.error("--num-cpus (>= 1) sizes the embedded Ray cluster; with RAY_ADDRESS set the cluster is given")
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # zeroray's progress and resume lines
    # Everything is checked before Ray starts (25-60 s): a bad argument, config or storage is one line.
    try:
        text = Path(args.data).read_bytes()
        if len(text) // 10 <= args.block + 1:
            raise ValueError(f"--data {args.data} has {len(text)} bytes; a --block of {args.block} needs "
                             f"more than {10 * (args.block + 2)} (a tenth is held out for validation)")
        model_cfg = {"block": args.block, "n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head}
        gpt_config(model_cfg)
        zero = zero_config(args, model_cfg, elastic, hi)
        micro = args.batch if elastic else zero.resolve_batch(lo).train_micro_batch_size_per_gpu or args.batch
        n_val = len(text) // 10
        windows = windows_parquet(text[:-n_val], args.block)  # before Ray: a bad --data fails here
        rows = pq.read_metadata(windows).num_rows
        global_batch = zero.resolve_batch(hi).train_batch_size
        if rows < global_batch:
            raise ValueError(f"--data {args.data} makes {rows} windows of --block {args.block}, fewer than one "
                             f"global batch of {global_batch}")
        name = args.name or "gpt-" + time.strftime("%Y%m%d-%H%M%S")
        loop_config = {
            "val_text": text[-n_val:], "steps": args.steps, "batch": micro, **model_cfg, "lr": args.lr,
            "warmup": max(1, args.steps // 15), "eval_every": max(1, args.steps // 6),
            "config_optimizer": zero.optimizer is not None, "config_schedule": zero.scheduler is not None,
        }
        scaling = ScalingConfig(num_workers=(lo, hi) if elastic else lo, use_gpu=args.use_gpu,
                                elastic_resize_monitor_interval_s=args.resize_check)
        run_config = RunConfig(name=name, storage_path=args.storage_path,
                               failure_config=FailureConfig(max_failures=args.max_failures),
                               checkpoint_config=CheckpointConfig(num_to_keep=2))
        RunStorage(args.storage_path, name).validate(processes=hi + 1)  # every rank, and this driver
    except (OSError, ValueError, TypeError, StorageError) as e:
        fail(p, e)
    logging.getLogger("zeroray").info("%s; data: %d windows of %d bytes in %s", describe(zero, args), rows,
                                      args.block + 1, windows)

    from zeroray.train.driver.cluster import (  # imports Ray: only once everything is checked
        ensure_ray,
        started_here,
    )

    ensure_ray(num_cpus=args.num_cpus)
    import ray

    cpus = ray.cluster_resources().get("CPU", 0)
    if started_here() and not args.use_gpu and cpus < lo:
        p.error(f"--workers {lo} needs {lo} CPUs (one per rank) but the Ray cluster started "
                f"here has {cpus:g}: pass --num-cpus {lo} to share the cores (slower), or fewer --workers")

    # Read here and handed to Ray Data as Arrow: no Ray Data read task holds a CPU that the ranks are sized by.
    dataset = ray.data.from_arrow(pq.read_table(windows))
    dataset.context.execution_options.preserve_order = True  # exact resume: every rank streams the file's order
    dataset.context.enable_progress_bars = dataset.context.print_on_execution_start = False  # zeroray's lines only
    try:
        trainer = ZeroTrainer(train_loop, train_loop_config=loop_config, zero_config=zero, scaling_config=scaling,
                              run_config=run_config, datasets={"train": dataset})
    except (ValueError, TypeError) as e:
        fail(p, e)
    result = trainer.fit()

    history = [h for h in result.metrics_history if "loss" in h]
    if history:
        print(f"\nloss: {history[0]['loss']:.3f} at step {history[0]['_global_step']} -> "
              f"{history[-1]['loss']:.3f} at step {history[-1]['_global_step']}")
    else:
        at = result.metrics_history[-1]["_global_step"]
        print(f"\nno training step: the run is at step {at} and --steps is {args.steps} "
              "(raise --steps to train on, or pick a new --name to start over)")
    for h in history:
        if "val_loss" in h:
            secs = f"{h['_step_time_s']:.2f} s/step" if h["_step_time_s"] is not None else ""
            print(f"  step {h['_global_step']:4d}  train {h['loss']:.3f}  val {h['val_loss']:.3f}  {secs}")
    print(f"\nsample: {result.metrics['sample']!r}")
    print("\nmemory per rank at the end (MiB):")
    cats = ["params", "grads", "optimizer", "buffers", "total", "process_rss"]
    print("  rank " + "".join(f"{c:>13}" for c in cats))
    for rank, mem in sorted(result.memory_by_rank.items()):
        print(f"  {rank:4d} " + "".join(f"{mem.get(c, 0) / 2**20:13.2f}" for c in cats))
    print(f"\nmetrics history: {result.path}/metrics.jsonl")
    if result.checkpoint is not None:
        print(f"newest checkpoint: {result.checkpoint.path} (step {result.checkpoint.step}); "
              f"list them with: zeroray ls {result.path}")


if __name__ == "__main__":
    main()
