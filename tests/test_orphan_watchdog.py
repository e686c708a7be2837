"""The rank watchdog (``RankActor._watchdog``) on the real local Ray cluster, outside the partition test: two
rank actors, each the one rank of its own group with a tiny orphan timeout, their loops running. The test plays
the driver for one of them only. The one it stops calling ends its own process with ORPHAN_EXIT_CODE, no sooner
than the orphan timeout and within a bound, and says why on its stderr; the one it keeps polling keeps running
for longer than that timeout, and its loop ends normally when told to. The exit status is read from the kernel's
process events (tests/support/exits.py) where the test may listen to them (root); elsewhere the rest is checked."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import psutil
import pytest
import ray

from tests.support.exits import ExitWatch, exit_watch
from zeroray.train.config import CheckpointConfig
from zeroray.train.group.priority import RANK_RUNTIME_ENV
from zeroray.train.group.rank_actor import ORPHAN_EXIT_CODE, RankActor
from zeroray.train.run_spec import RankInfo, RunSpec

ORPHAN_S = 2.0  # the groups' orphan timeout (worker_heartbeat_timeout_s + collective_timeout_s in a real run)
BOUND_S = ORPHAN_S + 20.0  # the watchdog wakes every 0.5 s; the rest is slack for a busy 2-core machine
POLL_S = 0.1  # what the driver does: ten polls a second


def _loop(config: dict) -> None:
    """Runs until the test writes the stop file (only the polled rank is ever told)."""
    stop = Path(config["stop"])
    while not stop.exists():
        time.sleep(0.05)


def _spec(tmp_path: Path, name: str) -> RunSpec:
    return RunSpec(
        name=name, run_url=str(tmp_path / "runs" / name), storage_path=str(tmp_path / "runs"),
        storage_options=None, train_fn=_loop, train_loop_config={"stop": str(tmp_path / f"stop-{name}")},
        pass_config=True, zero_config=None, use_gpu=False, placement_strategy="PACK", placement_timeout_s=None,
        collective_timeout_s=30.0, snapshot_interval=0, checkpoint_config=CheckpointConfig(), samples_per_step=None,
        progress_bar=False,
    )


def _start_rank(tmp_path: Path, name: str) -> tuple[ray.actor.ActorHandle, int]:
    """A RankActor as the worker group makes it (at the ranks' start priority: at Ray's worker niceness, 15, a
    busy machine starves its start for a minute), set up as rank 0 of a group of one, its loop started."""
    actor = ray.remote(RankActor).options(num_cpus=0, max_restarts=0, runtime_env=RANK_RUNTIME_ENV).remote(name, False)
    pid = ray.get(actor.node_info.remote(), timeout=120)["pid"]  # node_info does not count as the driver's call
    addr, port = ray.get(actor.rendezvous_address.remote(), timeout=60)
    info = RankInfo(world_rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0)
    ray.get(actor.setup.remote(addr, port, info, _spec(tmp_path, name), {}, orphan_timeout_s=ORPHAN_S), timeout=120)
    return actor, pid


def _wait_exit(exits: ExitWatch | None, pid: int, timeout_s: float) -> tuple[bool, int | None]:
    """Up to ``timeout_s`` for ``pid`` to end: whether it has, and its exit status where ``exits`` listens."""
    if exits is not None:
        status = exits.wait(pid, timeout_s)
        if status is None and not psutil.pid_exists(pid):  # gone: its exit event is on its way
            status = exits.wait(pid, 5.0)
        return status is not None or not psutil.pid_exists(pid), status
    with contextlib.suppress(psutil.NoSuchProcess, psutil.TimeoutExpired):
        psutil.Process(pid).wait(timeout=timeout_s)  # the raylet reaps it: no status for a non-child
    return not psutil.pid_exists(pid), None


def _stderr_of(pid: int) -> str:
    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    return "".join(f.read_text(errors="replace") for f in logs.glob(f"worker-*-{pid}.err"))


@pytest.mark.timeout(180)
def test_a_rank_the_driver_stops_calling_ends_its_process_and_a_polled_one_does_not(ray_cluster, tmp_path):
    polled, polled_pid = _start_rank(tmp_path, "watchdog-polled")
    orphan, orphan_pid = _start_rank(tmp_path, "watchdog-orphan")
    with exit_watch() as exits:  # the orphan's pid is alive: its next exit is this process's
        ray.get(polled.start.remote(), timeout=60)
        started = time.monotonic()  # before the orphan's start: its last call from the driver is after this
        ray.get(orphan.start.remote(), timeout=60)
        gone = False
        while not gone:  # play the driver for one rank only, until the other rank's process is gone
            answer = ray.get(polled.poll.remote(), timeout=30)
            assert not answer.done and answer.failure is None, answer
            assert time.monotonic() - started < BOUND_S, f"the orphaned rank still runs after {BOUND_S:g}s"
            gone, status = _wait_exit(exits, orphan_pid, POLL_S)
    assert time.monotonic() - started >= ORPHAN_S  # never before the orphan timeout
    assert exits is None or status == ORPHAN_EXIT_CODE, status

    with pytest.raises(ray.exceptions.ActorDiedError, match="The actor died unexpectedly"):
        ray.get(orphan.poll.remote(), timeout=60)
    deadline = time.monotonic() + 30  # Ray's log monitor writes the line it read from the process's stderr
    while "has not heard from the driver" not in _stderr_of(orphan_pid):
        assert time.monotonic() < deadline, _stderr_of(orphan_pid)[-2000:]
        time.sleep(0.1)
    line = next(ln for ln in _stderr_of(orphan_pid).splitlines() if "has not heard from the driver" in ln)
    assert line.startswith(f"zeroray: rank 0 (pid {orphan_pid}) has not heard from the driver for "), line
    assert line.endswith(f"(> worker_heartbeat_timeout_s + collective_timeout_s = {ORPHAN_S:g}s): it is cut off, "
                         "stopping its process"), line

    # The polled rank outlives another whole orphan timeout of polling, then ends its loop when told to.
    until = time.monotonic() + ORPHAN_S + 1.0
    while time.monotonic() < until:
        answer = ray.get(polled.poll.remote(), timeout=30)
        assert not answer.done and answer.failure is None, answer
        time.sleep(POLL_S)  # the driver's poll period, not a synchronisation
    (tmp_path / "stop-watchdog-polled").write_text("")
    while not (answer := ray.get(polled.poll.remote(), timeout=30)).done:
        time.sleep(POLL_S)
    assert answer.failure is None and psutil.pid_exists(polled_pid)
    assert ray.get(polled.release.remote(30.0), timeout=60) is None
    ray.kill(polled)
