"""The README Quickstart's main job runs end to end: a real subprocess with its own embedded Ray
cluster, a tiny GPT, sharded checkpoints, and a resume of the same run by name."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(tmp_path: Path, *args: str, returncode: int = 0, address: str | None = None) -> subprocess.CompletedProcess:
    """The example in a subprocess: on an embedded Ray cluster, or on the one at ``address`` (RAY_ADDRESS)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if address:
        env["RAY_ADDRESS"] = address
    cmd = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--storage-path", str(tmp_path),
           "--name", "smoke", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block", "32", *args]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == returncode, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_train_gpt_trains_checkpoints_and_resumes(tmp_path: Path, ray_cluster: dict[str, str]) -> None:
    out = _run(tmp_path, "--steps", "6").stdout
    assert "loss: " in out and "at step 6" in out
    assert f"newest checkpoint: {tmp_path}/smoke/checkpoint_6 (step 6)" in out
    assert "memory per rank at the end (MiB):" in out
    assert (tmp_path / "smoke" / "checkpoint_6" / "manifest.json").exists()

    # Same run name: resumes at step 6, at another stage and world size (more ranks than cores: --num-cpus).
    done = _run(tmp_path, "--steps", "8", "--stage", "2", "--workers", "3", "--num-cpus", "3")
    assert "at step 7 ->" in done.stdout and "at step 8" in done.stdout and "3 ranks" in done.stdout
    assert f"newest checkpoint: {tmp_path}/smoke/checkpoint_8 (step 8)" in done.stdout
    assert "resuming from checkpoint_6 (written at world 2, stage 3)" in done.stderr

    # Resumed past --steps, on a running cluster (RAY_ADDRESS): nothing to train, said so (not an
    # IndexError); the history keeps every fit's lines.
    done = _run(tmp_path, "--steps", "5", address=ray_cluster["address"])
    assert "no training step: the run is at step 8 and --steps is 5" in done.stdout, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    lines = (tmp_path / "smoke" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 6 + 1 + 2 + 1 + 1  # 6 steps + sample, 2 steps + sample, sample


def test_train_gpt_refuses_bad_workers_before_starting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples" / "train_gpt.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setattr(sys, "argv", ["train_gpt.py", "--workers", "two"])
    with pytest.raises(SystemExit) as exited:  # refused by the argument parser, before any Ray start
        example.main()
    assert exited.value.code == 2 and "--workers: expected N or MIN-MAX, got 'two'" in capsys.readouterr().err
    for bad in ("3-2", "0"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"expected 1 <= MIN <= MAX, got '{bad}'"):
            example.workers_arg(bad)

    workers = str((os.cpu_count() or 1) + 1)
    done = _run(tmp_path, "--workers", workers, "--steps", "1", returncode=2)
    assert f"--workers {workers} needs {workers} CPUs" in done.stderr and f"--num-cpus {workers}" in done.stderr
    assert "Traceback" not in done.stderr


def test_finetune_hf_loads_pretrained_into_shards_and_exports_for_transformers(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, str(ROOT / "examples" / "finetune_hf.py"), "--storage-path", str(tmp_path),
           "--name", "ft", "--steps", "3", "--hidden", "32", "--layers", "2", "--heads", "2", "--block", "32"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "val loss: " in out and "at step 1 ->" in out and "at step 3" in out
    assert "loaded pretrained weights from" in done.stdout + done.stderr  # zt.prepare logs what it read
    exported = sorted(p.name for p in (tmp_path / "ft" / "export").iterdir())
    assert "config.json" in exported and any(n.endswith(".safetensors") for n in exported)
    line = next(x for x in out.splitlines() if x.startswith("from_pretrained(export) val loss:"))
    reloaded = float(line.split(":")[1].split()[0])
    engine = float(line.rsplit(":", 1)[1].rstrip(")"))
    assert abs(reloaded - engine) < 1e-4, line
