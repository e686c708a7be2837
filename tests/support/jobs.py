"""What the scripts under tests/jobs share with the tests: where they are, the launcher of the world-2 exit
job (test_exit.py, and jobs/exit_loop.py hundreds of times), and the peer-loss job's death in the middle
of a backward (which test_elastic_reuse.py's rank loop also dies)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    import zeroray
    from tests.support.models import TinyLM

ROOT = Path(__file__).resolve().parents[2]
JOBS = ROOT / "tests" / "jobs"


def job_env() -> dict[str, str]:
    """This process's environment with the repo root on PYTHONPATH: a job imports the test support
    (package ``tests``)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def launch_exit_job(world: int, destroy: bool, timeout: float = 120.0) -> list[tuple[int, str]]:
    """One run of jobs/exit_job.py: ``world`` interpreters joined by a file store; each rank's (exit code, stderr)."""
    with tempfile.TemporaryDirectory() as d:
        store = os.path.join(d, "store")
        args = ["--destroy"] if destroy else []
        env = job_env()
        procs = [
            subprocess.Popen(
                [sys.executable, str(JOBS / "exit_job.py"), str(r), str(world), store, *args],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for r in range(world)
        ]
        out = []
        for p in procs:
            try:
                _, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
                err += "\n[timed out]"
            out.append((p.returncode, err))
        return out


def die_mid_backward(model: TinyLM, engine: zeroray.ZeroEngine, marker: str) -> None:
    """End this process in the backward of step 2, in a deep block's gradient hook: the bucket reductions of
    the blocks after it are in flight on every rank. First writes the time of death into ``marker``."""

    def die(_: torch.Tensor) -> None:
        if engine.global_step == 2:
            with open(marker, "w") as f:
                f.write(repr(time.time()))
            os._exit(1)

    model.h[3].fc.weight.register_post_accumulate_grad_hook(die)
