"""The README Quickstart's main job runs end to end: a real subprocess with its own embedded Ray
cluster, a tiny GPT, sharded checkpoints, and a resume of the same run by name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(tmp_path: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--storage-path", str(tmp_path),
           "--name", "smoke", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block", "32", *args]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_train_gpt_trains_checkpoints_and_resumes(tmp_path: Path) -> None:
    out = _run(tmp_path, "--steps", "6")
    assert "loss: " in out and "at step 6" in out
    assert f"newest checkpoint: {tmp_path}/smoke/checkpoint_6 (step 6)" in out
    assert "memory per rank at the end (MiB):" in out
    assert (tmp_path / "smoke" / "checkpoint_6" / "manifest.json").exists()

    out = _run(tmp_path, "--steps", "8", "--stage", "2")  # same run name: resumes at step 6
    assert "at step 7 ->" in out and "at step 8" in out
    assert f"newest checkpoint: {tmp_path}/smoke/checkpoint_8 (step 8)" in out
