"""What the offload tests share: a run of the recipe (tests.support.recipe) through an engine with its
memory report, the NVMe offload section, and a peak-RSS probe in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

import zeroray
from tests.support.recipe import optimizer, train


def train_run(model, data, cfg) -> tuple[list[float], dict[str, torch.Tensor], dict[str, int]]:
    """``data`` through an engine of ``model`` with the recipe's optimizer and ``cfg``: the losses, the
    final (full) weights and the memory report."""
    engine = zeroray.initialize(model, optimizer(model), cfg)
    losses = train(engine, data)
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
