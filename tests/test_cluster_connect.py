"""Connecting to Ray: a leftover ``ray_current_cluster`` file naming a dead cluster (one killed, not
stopped) makes a plain ``ray.init()`` wait for it; zeroray starts a local cluster instead."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.support.dist import free_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = """
import ray
from zeroray.train.driver.cluster import ensure_ray
ensure_ray(num_cpus=1)
print("CPUS", ray.cluster_resources()["CPU"], flush=True)
ray.shutdown()
"""


def test_a_stale_cluster_file_starts_a_local_cluster_instead_of_waiting() -> None:
    tmp = tempfile.mkdtemp(prefix="zr", dir="/tmp")  # Ray's socket paths must stay short
    try:
        (Path(tmp) / "ray").mkdir()
        (Path(tmp) / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{free_port()}")  # nothing listens
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(RAY_TMPDIR=tmp, PYTHONPATH=str(ROOT))
        done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "CPUS 1.0" in done.stdout
        assert "no Ray cluster answers at 127.0.0.1:" in done.stderr and "starting a local one" in done.stderr
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
