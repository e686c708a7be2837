"""A save killed midway (SIGKILL, a real process) leaves the previous checkpoint the newest, loadable;
the next commit's retention removes the dead save's files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import zeroray.checkpoint as zc
from tests.support.checkpoint import make_engine
from tests.support.models import batches
from tests.support.recipe import train

REPO = Path(__file__).resolve().parent.parent
MODEL = {"vocab": 4000, "d": 384}  # ~4.6M parameters: ~55 MB per save with Adam's states

SCRIPT = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
import zeroray.checkpoint as zc
from tests.support.models import batches
from tests.support.checkpoint import make_engine
from tests.support.recipe import train
engine = make_engine(2, **{MODEL!r})
for step in (1, 2):
    train(engine, batches(0, 1, vocab={MODEL['vocab']}))
    zc.save(engine, zc.checkpoint_url(sys.argv[1], step))
    print("committed", step, flush=True)
"""


def test_save_killed_midway_leaves_previous_checkpoint(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, run], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().split() == ["committed", "1"]
        shard = tmp_path / "run" / "checkpoint_2" / "rank-00000.bin"
        deadline = time.monotonic() + 120
        while not shard.exists() and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert shard.exists() and not (shard.parent / "manifest.json").exists(), "the save was not killed midway"

    infos = zc.list_checkpoints(run)
    assert [(i.step, i.committed) for i in infos] == [(1, True), (2, False)]
    assert zc.latest_committed(run) == zc.checkpoint_url(run, 1)
    assert zc.apply_retention(run, 1) == []  # a newer incomplete save may still be in flight

    engine = make_engine(2, seed=1, **MODEL)
    zc.load(engine, zc.latest_committed(run))
    assert engine.global_step == 1
    train(engine, batches(0, 1, vocab=MODEL["vocab"]))
    zc.save(engine, zc.checkpoint_url(run, 3), num_to_keep=1)
    engine.close()
    assert [(i.step, i.committed) for i in zc.list_checkpoints(run)] == [(3, True)]
