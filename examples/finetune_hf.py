"""Fine-tune a Hugging Face Llama-family model with ZeRO-3 on Ray, from pretrained weights that no rank
ever holds whole.

    pip install -e ".[hf]"
    python examples/finetune_hf.py                        # 2 workers, local embedded Ray cluster
    python examples/finetune_hf.py --workers 3 --num-cpus 3 --steps 20

1. The "pretrained" checkpoint: a freshly initialized small Llama (byte-level, vocab 256) saved with
   ``save_pretrained`` (safetensors, ``config.json``). No hub download: any Llama-family directory
   works with ``--pretrained``.
2. Each rank builds the model on the meta device (no memory), ``zt.prepare`` allocates only the rank's
   stage-3 shards, unit by unit, and loads the pretrained weights into them: each rank reads only the
   byte ranges of the safetensors file that its shards hold.
3. A few fine-tuning steps on examples/data/corpus.txt, a map-style dataset of windows read through a torch
   ``DataLoader`` with ``zt.DistributedSampler`` (each rank its part of every step's global batch; the
   position is saved with the checkpoint, so a restarted or resized run takes the same windows in the
   same steps); a sharded checkpoint at the end.
4. ``zeroray export`` turns the checkpoint into safetensors plus ``config.json``, and
   ``from_pretrained`` loads it with no extra step: its loss on a held-out batch equals the engine's.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

try:
    import zeroray  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import zeroray.train as zt
from zeroray import ZeroConfig
from zeroray.checkpoint import export
from zeroray.train import CheckpointConfig, RunConfig, ScalingConfig, ZeroTrainer
from zeroray.train.driver.cluster import ensure_ray, started_here

DATA = Path(__file__).resolve().parent / "data" / "corpus.txt"


def make_pretrained(out_dir: Path, args: argparse.Namespace) -> None:
    """Stand-in for a downloaded model: a fresh small Llama saved the Hugging Face way."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=args.block,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out_dir)


class Windows(torch.utils.data.Dataset):
    """A map-style dataset: the text's windows of ``block`` bytes, one every ``block // 2`` (the model shifts
    the labels itself)."""

    def __init__(self, data: torch.Tensor, block: int) -> None:
        self.data, self.block = data, block
        self.starts = range(0, len(data) - block + 1, max(1, block // 2))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[self.starts[i] : self.starts[i] + self.block].long()


def held_out(text: bytes, batch: int, block: int) -> torch.Tensor:
    """The same validation windows for the engine and for the reloaded export: random ones of the last tenth."""
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)[-len(text) // 10 :]
    ix = torch.randint(len(data) - block, (batch,), generator=torch.Generator().manual_seed(7))
    return torch.stack([data[i : i + block] for i in ix]).long()


def train_loop(config: dict[str, Any]) -> None:
    """Runs on every rank (one Ray actor each)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    ctx = zt.get_context()
    hf_config = AutoConfig.from_pretrained(config["pretrained"])
    with torch.device("meta"):  # no memory: zt.prepare allocates this rank's shards only
        model = AutoModelForCausalLM.from_config(hf_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=0.0)
    # init_fn sets what the checkpoint does not hold (the rotary inv_freq buffers); on a restart the
    # run's own newest checkpoint is loaded instead of the pretrained weights.
    engine = zt.prepare(model, optimizer, init_fn=model._init_weights, pretrained=config["pretrained"])
    device = ctx.get_device()

    data = torch.frombuffer(bytearray(config["text"]), dtype=torch.uint8)
    train = Windows(data[: -len(data) // 10], config["block"])
    # This rank's windows of each step's global batch, shuffled per epoch; its position is saved with the
    # checkpoints, so a restarted or resized run goes on with the same windows in the same steps.
    loader = torch.utils.data.DataLoader(train, batch_size=config["batch"], sampler=zt.DistributedSampler(train))
    val = held_out(config["text"], config["batch"], config["block"]).to(device)
    while engine.global_step < config["steps"]:
        for x in loader:  # the rest of this epoch
            x = x.to(device)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            last = engine.global_step == config["steps"]
            metrics = {"loss": loss.item()}
            if last or engine.global_step == 1:
                model.eval()
                with torch.no_grad():
                    metrics["val_loss"] = engine(input_ids=val, labels=val).loss.item()
                model.train()
            zt.report(metrics, checkpoint=last)
            if last:
                break


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="ranks, one Ray actor each (one CPU each)")
    p.add_argument("--num-cpus", type=int, default=None, help="logical CPUs of the embedded Ray cluster")
    p.add_argument("--steps", type=int, default=10, help="fine-tuning steps")
    p.add_argument("--storage-path", default=str(Path.home() / "zeroray_results"), help="a local directory")
    p.add_argument("--name", default=None, help="run name (default: finetune-<time>)")
    p.add_argument("--pretrained", default=None,
                   help="a Hugging Face model directory (safetensors); default: make a small Llama in the run")
    p.add_argument("--data", default=str(DATA), help="a text file to fine-tune on")
    p.add_argument("--batch", type=int, default=4, help="micro-batch per rank")
    p.add_argument("--block", type=int, default=64, help="context length in bytes")
    p.add_argument("--hidden", type=int, default=128, help="hidden size of the made-up pretrained model")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args()
    if args.steps < 1 or args.workers < 1:
        p.error("--steps and --workers must be >= 1")
    if "://" in args.storage_path and not args.storage_path.startswith("file://"):
        p.error("--storage-path must be a local directory here: from_pretrained reads the export from local files")
    args.storage_path = args.storage_path.removeprefix("file://")
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # zeroray's load and progress lines
    ensure_ray(num_cpus=args.num_cpus)
    import ray

    if started_here() and ray.cluster_resources().get("CPU", 0) < args.workers:
        p.error(f"--workers {args.workers} needs {args.workers} CPUs: pass --num-cpus {args.workers}")

    name = args.name or "finetune-" + time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(args.storage_path) / name
    pretrained = args.pretrained
    if pretrained is None:
        pretrained = str(run_dir / "pretrained")
        if not Path(pretrained, "config.json").exists():
            make_pretrained(Path(pretrained), args)
            print(f"made the 'pretrained' model: {pretrained}")
    text = Path(args.data).read_bytes()

    result = ZeroTrainer(
        train_loop,
        train_loop_config={"text": text, "steps": args.steps, "batch": args.batch, "block": args.block,
                           "lr": args.lr, "pretrained": pretrained},
        zero_config=ZeroConfig(stage=3, train_micro_batch_size_per_gpu=args.batch),
        scaling_config=ScalingConfig(num_workers=args.workers),
        run_config=RunConfig(name=name, storage_path=args.storage_path,
                             checkpoint_config=CheckpointConfig(num_to_keep=1)),
    ).fit()

    history = [h for h in result.metrics_history if "val_loss" in h]
    print(f"\nval loss: {history[0]['val_loss']:.4f} at step {history[0]['_global_step']} -> "
          f"{history[-1]['val_loss']:.4f} at step {history[-1]['_global_step']}")

    # The round trip: export the sharded checkpoint, load it with transformers as it is.
    from transformers import AutoModelForCausalLM

    out_dir = str(run_dir / "export")
    export(result.checkpoint.path, out_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    val = held_out(text, args.batch, args.block)
    with torch.no_grad():
        reloaded_loss = reloaded(input_ids=val, labels=val).loss.item()
    print(f"exported {result.checkpoint.path} -> {out_dir}: {sorted(os.listdir(out_dir))}")
    print(f"from_pretrained(export) val loss: {reloaded_loss:.6f} (engine at the end: {history[-1]['val_loss']:.6f})")


if __name__ == "__main__":
    main()
