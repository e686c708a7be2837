"""A test skipped for a missing tool says which tool in the default ``pytest -q`` output (conftest.py).

pytest runs the Prometheus and Chromium tests in a real subprocess whose PATH holds neither binary;
both skip before the Ray cluster starts, so this costs pytest's start-up only.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_a_skip_for_a_missing_binary_names_it_in_the_default_output(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/test_monitoring_prometheus.py", "tests/test_monitoring_dashboard_browser.py"],
        cwd=REPO, env={**os.environ, "PATH": str(empty)}, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 skipped" in done.stdout, done.stdout
    lines = done.stdout.splitlines()
    for tool in ("prometheus", "chromium"):
        said = [line for line in lines if line.startswith("SKIPPED") and f"no {tool} binary" in line]
        assert len(said) == 1, done.stdout
