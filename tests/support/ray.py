"""Helpers shared by the tests that run ZeroTrainer on the real local Ray cluster (conftest's ray_cluster)."""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from pathlib import Path

import psutil
from ray.util import state

from zeroray.train import RunConfig


def interruptible() -> None:
    """``preexec_fn`` of a subprocess a test sends Ctrl-C (SIGINT) to: a shell that starts the tests in the
    background makes them ignore SIGINT, and a child inherits that, so its Ctrl-C would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_config(tmp_path, name: str, **kw) -> RunConfig:
    """A run under ``tmp_path/runs`` without a progress display."""
    return RunConfig(name=name, storage_path=str(tmp_path / "runs"), progress_bar=False, **kw)


def list_actors(**kw) -> list:
    """The state API on this process's cluster: without an address it looks for one, and fails when
    several Ray clusters run on the machine."""
    return state.list_actors(address=_dashboard(), **kw)


def list_placement_groups(**kw) -> list:
    return state.list_placement_groups(address=_dashboard(), **kw)


def _dashboard() -> str:
    from ray._private.worker import get_dashboard_url

    return f"http://{get_dashboard_url()}"


def zeroray_actors(run: str) -> list:
    return [a for a in list_actors(limit=10_000) if (a.name or "").startswith(f"zeroray:{run}:")]


def zeroray_pgs(run: str) -> list:
    """The run's placement groups: one per group (fixed size) or one per rank slot (elastic, ``zeroray:<run>:slot-<i>``)."""
    return [p for p in list_placement_groups(limit=10_000) if p.name == f"zeroray:{run}" or p.name.startswith(f"zeroray:{run}:")]


def assert_nothing_left(run: str, pids: Sequence[int] = (), timeout_s: float = 15.0) -> None:
    """Every actor of the run DEAD, its placement group REMOVED, its actor processes gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        actors = [(a.name, a.state) for a in zeroray_actors(run) if a.state != "DEAD"]
        pgs = [(p.name, p.state) for p in zeroray_pgs(run) if p.state != "REMOVED"]
        procs = [p for p in pids if _running(p)]
        if not actors and not pgs and not procs:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"left behind: actors {actors}, placement groups {pgs}, processes {procs}")
        time.sleep(0.2)


def _running(pid: int) -> bool:
    """The process exists and is not a zombie; it may exit between any two psutil calls."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_for_file(path: Path, timeout_s: float = 120.0) -> None:
    """Until a rank's loop writes ``path`` (a marker of where it is), within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"no {path.name} after {timeout_s:.0f}s"
        time.sleep(0.05)
