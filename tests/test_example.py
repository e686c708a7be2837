"""The README Quickstart's main job runs end to end: a real subprocess with its own embedded Ray
cluster, a tiny GPT, sharded checkpoints, and a resume of the same run by name.

An embedded cluster costs a Ray start and stop (several seconds on 2 cores) per run: the runs that test
something else than the embedded start (a resume, a DeepSpeed config, the fine-tuning example) go to the
session's running cluster (RAY_ADDRESS), as a job on a ``ray start`` cluster would. The embedded start is
in the resume test's second run (with ``--num-cpus``) and in the refusal of too many workers."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HF_ZERO3 = ROOT / "tests" / "data" / "hf_deepspeed" / "ds_config_zero3.json"
# Runs the example once per case in one process (torch and zeroray imported once, not once a case), each case
# with its own argv and with fd 2 on a file of its own (what the case writes to stderr, Python's or C's); prints
# per case its exit code, its stderr and whether Ray is imported by then (it starts Ray only after every check).
_CASES_PROBE = (
    "import json, logging, os, runpy, sys, tempfile\n"
    "example, cases, said = sys.argv[1], json.loads(sys.argv[2]), []\n"
    "for args in cases:\n"
    "    logging.root.handlers.clear()  # the example's basicConfig binds the stderr of the case it runs in\n"
    "    sys.argv, saved = [example, *args], os.dup(2)\n"
    "    with tempfile.TemporaryFile(mode='w+') as err:\n"
    "        sys.stderr.flush()\n"
    "        os.dup2(err.fileno(), 2)\n"
    "        try:\n"
    "            runpy.run_path(example, run_name='__main__')\n"
    "            code = 0\n"
    "        except SystemExit as e:\n"
    "            code = e.code\n"
    "        finally:\n"
    "            sys.stderr.flush()\n"
    "            os.dup2(saved, 2)\n"
    "            os.close(saved)\n"
    "        err.seek(0)\n"
    "        said.append({'code': code, 'stderr': err.read(), 'ray': 'ray' in sys.modules})\n"
    "print(json.dumps(said))\n"
)


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
    out = _run(tmp_path, "--steps", "6", address=ray_cluster["address"]).stdout
    assert "loss: " in out and "at step 6" in out
    assert f"newest checkpoint: {tmp_path}/smoke/checkpoint_6 (step 6)" in out
    assert "memory per rank at the end (MiB):" in out
    assert (tmp_path / "smoke" / "checkpoint_6" / "manifest.json").exists()

    # Same run name, on an embedded cluster: resumes at step 6, at another stage and world size (more ranks than
    # cores: --num-cpus).
    done = _run(tmp_path, "--steps", "8", "--stage", "2", "--workers", "3", "--num-cpus", "3")
    assert "at step 7 ->" in done.stdout and "at step 8" in done.stdout and "3 ranks" in done.stdout
    assert f"newest checkpoint: {tmp_path}/smoke/checkpoint_8 (step 8)" in done.stdout
    assert "resuming from checkpoint_6 (written at world 2, stage 3)" in done.stderr

    # Resumed past --steps, on a running cluster (RAY_ADDRESS): nothing to train, said so (not an
    # IndexError); the history keeps every fit's lines, and this one, with no step, adds none.
    done = _run(tmp_path, "--steps", "5", address=ray_cluster["address"])
    assert "no training step: the run is at step 8 and --steps is 5" in done.stdout, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    lines = (tmp_path / "smoke" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 6 + 1 + 2 + 1  # 6 steps + sample, 2 steps + sample; the sample of no step: none


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


def test_train_gpt_refuses_bad_input_in_one_line_before_ray(tmp_path: Path) -> None:
    """A bad stage, config file, config key, storage path or data file: one line on stderr, exit 2, and
    Ray never imported (so never started: that takes 25-60 s)."""
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"zero_optimization": {"stgae": 3}, "optimizer": {"type": "AdamW",
                                                                                  "params": {"betass": [0.9, 0.9]}}}))
    (tmp_path / "a-file").write_text("not a directory")
    cases = [
        (["--stage", "7"], "argument --stage: invalid choice: 7 (choose from 0, 1, 2, 3)"),
        (["--deepspeed-config", str(tmp_path / "missing.json")], "DeepSpeed config file not found: "),
        (["--deepspeed-config", str(typo)],
         "2 problems in the DeepSpeed config (all of them): - unknown DeepSpeed config key 'zero_optimization.stgae'; "
         "did you mean 'stage'? - DeepSpeed config key 'optimizer.params.betass': is not a parameter"),
        (["--storage-path", str(tmp_path / "a-file" / "runs")], "RunConfig.storage_path "),
        (["--storage-path", "memory://runs"], "is process-local storage"),
        (["--data", str(tmp_path / "typo.json")], "a --block of 128 needs more than 1300"),
        (["--n-embd", "30"], "n_embd (30) must be divisible by n_head (4)"),
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, "-c", _CASES_PROBE, str(ROOT / "examples" / "train_gpt.py"),
           json.dumps([["--name", "bad", *args] for args, _ in cases])]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    said = json.loads(done.stdout.splitlines()[-1])
    assert len(said) == len(cases), said
    for (args, message), case in zip(cases, said):
        assert case["code"] == 2, (args, case)
        assert case["stderr"].count("\n") == 1 and case["stderr"].startswith("train_gpt.py: error: "), (args, case)
        assert message in case["stderr"], (args, case)
        assert not case["ray"], (args, case)  # Ray never imported, by this case or any before it


def test_train_gpt_runs_a_stock_hf_deepspeed_config_as_written(tmp_path: Path, ray_cluster: dict[str, str]) -> None:
    """HF's ZeRO-3 JSON ("auto" nearly everywhere, the bf16 block of HF's docs added): every "auto" resolved
    and logged once, on the driver, before the run, as HF's Trainer with no flags; its WarmupLR sets the
    learning rate (0 warm-up steps: DeepSpeed's two steps at warmup_min_lr, then warmup_max_lr = --lr); its
    AdamW block builds the optimizer; no UserWarning, no "optimizer block ignored"."""
    config = tmp_path / "zero3.json"
    config.write_text(json.dumps({**json.loads(HF_ZERO3.read_text()), "bf16": {"enabled": "auto"}}))
    done = _run(tmp_path, "--steps", "4", "--lr", "0.002", "--deepspeed-config", str(config),
                address=ray_cluster["address"])
    err = done.stderr
    for line in (
        "resolved 'zero_optimization.reduce_bucket_size': auto -> 1024 (hidden_size 32 squared, as HF)",
        "resolved 'zero_optimization.stage3_prefetch_bucket_size': auto -> 921 (0.9 x hidden_size 32 squared, as HF)",
        "resolved 'fp16.enabled': auto -> false (HF's Trainer without --fp16)",
        "resolved 'bf16.enabled': auto -> false (HF's Trainer without --bf16)",
        "resolved 'scheduler.params.warmup_num_steps': auto -> 0 (HF's Trainer without --warmup_steps or --warmup_ratio)",
        "resolved 'scheduler.params.warmup_max_lr': auto -> 0.002 (the lr of the AdamW passed to initialize, as HF's learning_rate)",
        "zeroray ignores DeepSpeed config key 'steps_per_print': ",
    ):
        assert err.count(line) == 1, (line, err[-5000:])  # once: the driver's, not once per rank
    assert "optimizer: the DeepSpeed config's AdamW" in err and "learning rate: the DeepSpeed config's WarmupLR" in err
    assert "UserWarning" not in err and "is ignored" not in err and "Traceback" not in err
    history = [json.loads(x) for x in (tmp_path / "smoke" / "metrics.jsonl").read_text().splitlines()]
    assert [h["lr"] for h in history if "loss" in h] == [0.0, 0.0, 0.002, 0.002]


def test_finetune_hf_loads_pretrained_into_shards_and_exports_for_transformers(tmp_path: Path,
                                                                             ray_cluster: dict[str, str]) -> None:
    env = {**os.environ, "RAY_ADDRESS": ray_cluster["address"]}
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
