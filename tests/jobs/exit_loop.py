"""Launch the world-2 job of tests/exit_job.py many times and count how each rank exited.

    ../shared/tools/under-load -- python -m tests.exit_loop --launches 200

A rank that ends with SIGABRT after its work is done ("terminate called without an active
exception") shows as exit code -6. Prints a histogram of exit codes and the stderr of failures.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "exit_job.py"


def launch(world: int, destroy: bool, timeout: float = 120.0) -> list[tuple[int, str]]:
    """One job: ``world`` interpreters joined by a file store; each rank's (exit code, stderr)."""
    with tempfile.TemporaryDirectory() as d:
        store = os.path.join(d, "store")
        args = ["--destroy"] if destroy else []
        # The job imports the test models (package ``tests``): the repo root goes on its path.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        procs = [
            subprocess.Popen(
                [sys.executable, str(JOB), str(r), str(world), store, *args],
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    codes: collections.Counter[tuple[bool, int]] = collections.Counter()
    bad = 0
    for i in range(args.launches):
        destroy = i % 2 == 1  # half the launches destroy the process group before exit
        results = launch(args.world, destroy)
        for rank, (rc, err) in enumerate(results):
            codes[(destroy, rc)] += 1
            if rc != 0:
                print(f"launch {i} (destroy={destroy}) rank {rank}: exit {rc}\n{err[-2000:]}", flush=True)
        bad += any(rc != 0 for rc, _ in results)
        if (i + 1) % 10 == 0:
            print(f"{i + 1} launches, {bad} with a non-zero exit; codes {dict(codes)}", flush=True)
    print(f"TOTAL: {args.launches} launches, {bad} with a non-zero exit; (destroy, code) -> ranks: {dict(codes)}")


if __name__ == "__main__":
    main()
