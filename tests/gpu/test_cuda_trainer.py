"""ZeroTrainer with ``use_gpu=True`` on a local Ray cluster that has the GPU, and the Quickstart's
main example with ``--gpu``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.models import TinyLM, batches

ray = pytest.importorskip("ray")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_cluster() -> Iterator[None]:
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(REPO)]
    )
    ray.init(address="local", num_cpus=4, num_gpus=1, include_dashboard=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


def _loop(config: dict) -> None:
    import zeroray.train as zt

    ctx = zt.get_context()
    device = ctx.get_device()
    torch.manual_seed(0)
    model = TinyLM()
    engine = zt.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for x, y in batches(0, config["steps"]):
        loss = engine(x.to(device), y.to(device))
        engine.backward(loss)
        engine.step()
        zt.report(
            {
                "loss": loss.item(),
                "device": str(device),
                "param_devices": sorted({str(p.device) for p in model.parameters()}),
                "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            },
            checkpoint=engine.global_step == config["steps"],
        )


def test_zero_trainer_with_use_gpu_trains_on_the_gpu(gpu_cluster: None, tmp_path: Path) -> None:
    from zeroray import RunConfig, ScalingConfig, ZeroConfig, ZeroTrainer

    result = ZeroTrainer(
        _loop,
        train_loop_config={"steps": 4},
        zero_config=ZeroConfig(stage=3),
        scaling_config=ScalingConfig(num_workers=1, use_gpu=True),
        run_config=RunConfig(name="gpu", storage_path=str(tmp_path)),
    ).fit()
    assert result.error is None
    last = result.metrics
    assert last["device"] == "cuda:0" and last["param_devices"] == ["cuda:0"] and last["visible"] == "0"
    losses = [h["loss"] for h in result.metrics_history]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert result.memory_by_rank[0]["cuda_allocated"] > 0
    assert result.checkpoint is not None and result.checkpoint.step == 4
    assert (tmp_path / "gpu" / "checkpoint_4" / "manifest.json").exists()


def test_train_gpt_example_with_gpu(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, str(REPO / "examples" / "train_gpt.py"), "--gpu", "--workers", "1", "--steps", "30",
           "--storage-path", str(tmp_path), "--name", "gpu"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "at step 30" in done.stdout and "1 ranks" in done.stdout
    print(done.stdout[-2500:])
