"""The loop and configs the offload tests share: a TinyLM trained with AdamW over two param groups,
gradient accumulation and clipping, through a zeroray engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

import zeroray
from tests.models import param_groups

GAS, STEPS, CLIP, LR = 2, 3, 0.5, 1e-2


def offload_config(stage: int, precision: str, offload: dict | None, **extra) -> zeroray.ZeroConfig:
    return zeroray.ZeroConfig(
        stage=stage,
        precision=precision,
        gradient_accumulation_steps=GAS,
        gradient_clipping=CLIP,
        comm={"reduce_bucket_size": 500, "allgather_bucket_size": 700},
        **(offload or {}),
        **extra,
    )


def train_run(model, data, cfg) -> tuple[list[float], dict[str, torch.Tensor], dict[str, int]]:
    engine = zeroray.initialize(model, torch.optim.AdamW(param_groups(model), lr=LR), cfg)
    losses = []
    for x, y in data:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = engine.full_state_dict()
    mem = engine.memory_report()
    engine.close()
    return losses, state, mem


def nvme_offload(path: str, rank: int, **kw) -> dict:
    return {"offload_optimizer": {"device": "nvme", "nvme_path": path, **kw}}


def run_rss_probe(script: str, *args: str) -> dict:
    """Runs a peak-RSS probe in a fresh process and returns the JSON on its last line. The mmap
    threshold is fixed: glibc otherwise raises it after the first large free and keeps later freed
    temporaries in its heap, so a peak measured malloc's caching (39-127 MB over runs of the NVMe
    step probe) rather than what zeroray holds (44 MB every run with the threshold fixed)."""
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])
