"""tests/support/dist.run_ranks, the harness under most multi-rank tests: a wait that is interrupted (a test's
timeout raises in the main thread) must not leave its rank processes running beside the rest of the suite."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import pytest

from tests.support.dist import run_ranks


class _Interrupted(Exception):
    pass


def _block_forever(rank: int, world: int, marks: str) -> None:
    """Announces this rank's pid (atomically: written, then renamed), then waits for a wake-up that never comes."""
    tmp = Path(marks) / f".{rank}"
    tmp.write_text(str(os.getpid()))
    tmp.rename(Path(marks) / f"rank{rank}")
    threading.Event().wait()


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its parent (the fork server) has yet to reap."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_interrupted_wait_kills_the_ranks(tmp_path: Path) -> None:
    world = 2
    returned = threading.Event()

    def waiting() -> bool:  # the main thread blocks in the ranks' join (not still starting them)
        frame = sys._current_frames().get(threading.main_thread().ident)
        while frame is not None and not (frame.f_code.co_name == "join" and frame.f_code.co_filename.endswith("spawn.py")):
            frame = frame.f_back
        return frame is not None

    def watch() -> None:  # interrupts the main thread's wait once every rank runs and run_ranks waits on them
        while not (all((tmp_path / f"rank{r}").exists() for r in range(world)) and waiting()):
            if returned.wait(0.05):  # run_ranks returned or failed first
                return
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)

    def interrupt(signum: int, frame: object) -> None:
        raise _Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupt)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with pytest.raises(_Interrupted):
            run_ranks(_block_forever, world, str(tmp_path))
    finally:
        returned.set()
        watcher.join()
        signal.signal(signal.SIGUSR1, previous)
    pids = [int((tmp_path / f"rank{r}").read_text()) for r in range(world)]
    assert all(_gone(pid) for pid in pids), f"rank processes {pids} outlived the interrupted run_ranks"
