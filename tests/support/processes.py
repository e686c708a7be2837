"""Ending a helper process a test started (Prometheus, Chromium): politely first, then for sure."""

from __future__ import annotations

import subprocess


def stop(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
