"""One fit() at a time per run: two real drivers with the same run name, one refused while the other
runs; a lease left by a driver killed with SIGKILL is taken over once its heartbeat is stale; two takers
racing behind a slow S3 store (a proxy that holds the lease's PUTs) get one lease; nothing is left behind."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import zeroray.train as zt
from tests.support.ray import assert_nothing_left, zeroray_actors
from tests.support.s3 import SlowProxy
from zeroray.train import RunConfig, ScalingConfig, ZeroTrainer
from zeroray.train.driver.lease import RunLease, exclusive
from zeroray.train.driver.run_dir import RunStorage
from zeroray.train.errors import RunLeaseError

_DRIVER = """
import sys, time, ray
import zeroray.train as zt
from zeroray.train import RunConfig, ScalingConfig, ZeroTrainer

def loop(config):
    i = 0
    while True:
        zt.report({"i": i, "driver": "first"}); i += 1; time.sleep(0.05)

ray.init(address=sys.argv[1])
ZeroTrainer(loop, train_loop_config={}, scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(name="leased", storage_path=sys.argv[2], progress_bar=False,
                                 lease_timeout_s=float(sys.argv[3]))).fit()
"""


def _wait_for(check, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _take_over(run_dir: Path, intruder: dict) -> None:
    """Another driver's takeover, written as a lease writer must (lease.py): under the lease's lock, so no
    heartbeat can be between its check of the owner and its write."""
    with exclusive(str(run_dir / "lease.json.lock")):
        (run_dir / "lease.json.tmp").write_text(json.dumps(intruder))
        os.replace(run_dir / "lease.json.tmp", run_dir / "lease.json")


def _second_loop():
    zt.report({"driver": "second"})


def test_a_second_fit_of_a_running_run_refuses_and_a_dead_drivers_lease_is_taken_over(
    ray_cluster, tmp_path, caplog
):
    runs = tmp_path / "runs"
    run_dir = runs / "leased"
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    lease_timeout_s = 4.0
    first = subprocess.Popen([sys.executable, str(script), ray_cluster["address"], str(runs), str(lease_timeout_s)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # The first driver runs: its lease is there and its ranks report (metrics.jsonl has lines).
        metrics = run_dir / "metrics.jsonl"
        _wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, "the first fit's reports")
        lease = json.loads((run_dir / "lease.json").read_text())
        first_actors = {a.actor_id for a in zeroray_actors("leased") if a.state == "ALIVE"}
        assert len(first_actors) == 2

        # A second fit with the same name refuses before any actor starts; the first goes on.
        second = RunConfig(name="leased", storage_path=str(runs), progress_bar=False, lease_timeout_s=lease_timeout_s)
        with pytest.raises(RunLeaseError, match=r"run 'leased' is running \(since .* UTC, owner "):
            ZeroTrainer(_second_loop, scaling_config=ScalingConfig(num_workers=2), run_config=second).fit()
        assert {a.actor_id for a in zeroray_actors("leased") if a.state != "DEAD"} == first_actors
        lines_then = metrics.read_text().count("\n")
        _wait_for(lambda: metrics.read_text().count("\n") > lines_then, "the first fit to go on reporting")
        assert json.loads((run_dir / "lease.json").read_text())["owner"] == lease["owner"]

        # The first driver dies hard: Ray removes its actors, its lease stays with a heartbeat that ages.
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        assert_nothing_left("leased", timeout_s=60)
        stale = json.loads((run_dir / "lease.json").read_text())
        _wait_for(lambda: time.time() - stale["heartbeat"] > lease_timeout_s, "the lease to go stale", 30)

        with caplog.at_level(logging.WARNING, logger="zeroray.train.driver.lease"):
            result = ZeroTrainer(_second_loop, scaling_config=ScalingConfig(num_workers=2), run_config=second).fit()
        assert f"taking over run 'leased' from {lease['owner']}" in caplog.text
        assert result.metrics == {"driver": "second"}
        # The history of both fits is in the file, the second appended after the first's lines.
        entries = [json.loads(line) for line in metrics.read_text().splitlines()]
        drivers = [e["driver"] for e in entries]
        assert drivers[-1] == "second" and set(drivers[:-1]) == {"first"}
        assert not (run_dir / "lease.json").exists()  # released at the end of the fit
        assert_nothing_left("leased")
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(timeout=30)


def test_a_fresh_lease_file_refuses_and_an_unreadable_one_counts_as_stale(ray_cluster, tmp_path, caplog):
    run_dir = Path(tmp_path) / "runs" / "held"
    run_dir.mkdir(parents=True)
    now = time.time()
    (run_dir / "lease.json").write_text(json.dumps({"owner": "elsewhere:1:abc", "started_at": now - 30,
                                                    "heartbeat": now}))
    rc = RunConfig(name="held", storage_path=str(tmp_path / "runs"), progress_bar=False)
    with pytest.raises(RunLeaseError, match=r"run 'held' is running .* owner elsewhere:1:abc, last heartbeat"):
        ZeroTrainer(_second_loop, run_config=rc).fit()
    (run_dir / "lease.json").write_text('{"owner": "torn')  # a writer died mid-write
    with caplog.at_level(logging.WARNING, logger="zeroray.train.driver.lease"):
        assert ZeroTrainer(_second_loop, run_config=rc).fit().metrics == {"driver": "second"}
    assert "taking over run 'held' from unknown" in caplog.text
    # The lease is gone, and its lock file with it; the epoch fence (and its lock) stays with the run.
    assert sorted(os.listdir(run_dir)) == ["epoch.json", "epoch.json.lock", "metrics.jsonl", "run.json"]
    assert_nothing_left("held")


@pytest.mark.parametrize("where", ["local", "s3"])
def test_lease_and_history_on_local_disk_and_object_storage(s3, tmp_path, where, caplog):
    storage_path, options = (str(tmp_path), None) if where == "local" else (s3["bucket"] + f"/{tmp_path.name}",
                                                                           s3["options"])
    storage = RunStorage(storage_path, "run", options)
    storage.validate(processes=3)
    first = RunLease(storage, timeout_s=60)
    first.acquire()
    try:
        with pytest.raises(RunLeaseError, match=rf"run 'run' is running .* owner {first.owner}"):
            RunLease(RunStorage(storage_path, "run", options), timeout_s=60).acquire()
        assert storage.open_history() == 0
        storage.append_history([{"a": 1}])
        storage.append_history([{"a": 2}])
    finally:
        first.release()
    assert not storage.fs.exists(storage.path("lease.json"))

    # A lease whose heartbeat is older than the timeout is taken over, with a warning.
    again = RunStorage(storage_path, "run", options)
    stale = {"owner": "dead-driver", "started_at": 0.0, "heartbeat": 0.0}
    again.fs.pipe_file(again.path("lease.json"), json.dumps(stale).encode())
    second = RunLease(again, timeout_s=60)
    with caplog.at_level(logging.WARNING, logger="zeroray.train.driver.lease"):
        second.acquire()
    try:
        assert "taking over run 'run' from dead-driver" in caplog.text
        assert json.loads(again.fs.cat_file(again.path("lease.json")))["owner"] == second.owner
        assert again.open_history() == 2
        again.append_history([{"a": 3}])
        assert [json.loads(line)["a"] for line in again.fs.cat_file(again.path("metrics.jsonl")).splitlines()] == [
            1, 2, 3]
    finally:
        second.release()


def test_a_takeover_between_a_heartbeats_check_and_its_write_is_never_overwritten(tmp_path):
    """A heartbeat reads the lease, checks the owner, then writes. Another driver's takeover landing in
    between was overwritten, and the run that had lost the lease went on (the trainer test below hung
    now and then). Under the lease's lock it cannot land there: over 30 takeovers of a lease beating
    every 2.5 ms, each is noticed and none overwritten. Without the lock it failed: a takeover overwritten, never noticed."""
    for trial in range(30):
        storage = RunStorage(str(tmp_path), f"run{trial}")
        storage.validate(processes=1)
        lease = RunLease(storage, timeout_s=0.01)
        lease.acquire()
        try:
            time.sleep(0.003 * (trial % 7))  # land at a different point of the heartbeat's cycle each time
            intruder = {"owner": f"other:{trial}", "started_at": time.time(), "heartbeat": time.time()}
            path = Path(storage.dir) / "lease.json"
            _take_over(path.parent, intruder)
            _wait_for(lambda lease=lease: lease.lost is not None, "the heartbeat to notice the takeover", 10)
            assert json.loads(path.read_text())["owner"] == f"other:{trial}", trial
        finally:
            lease.release()
        assert json.loads(path.read_text())["owner"] == f"other:{trial}"  # release leaves another's lease


@pytest.mark.parametrize("held", ["none", "stale"])
def test_two_takers_racing_behind_slow_puts_get_one_lease(s3, held, caplog):
    """Two fits of one run start while the store is slow to take PUTs of the lease (2 s for the first, 4 s
    for the second): the second reads the lease while the first's PUT is still on its way. Both took it
    (a write, then a read-back of their own write, each before the other's landed), both ran, and the
    first later blamed its own "late heartbeat". Now the store decides (S3 If-None-Match, or If-Match the
    stale lease's ETag): the first takes the lease, the second refuses naming it."""
    run = f"{s3['bucket']}/race-{held}"
    is_lease_put = lambda method, path: method == "PUT" and path.endswith("/lease.json")  # noqa: E731
    with SlowProxy(s3["options"]["endpoint_url"], is_lease_put, delays_s=[2.0, 4.0]).running() as proxy:
        options = {**s3["options"], "endpoint_url": proxy.url}
        storages = [RunStorage(run, "run", options) for _ in range(2)]
        storages[0].validate(processes=1)
        if held == "stale":  # a dead driver's lease, written straight to the store
            stale = {"owner": "dead-driver", "started_at": 0.0, "heartbeat": 0.0}
            RunStorage(run, "run", s3["options"]).fs.pipe_file(storages[0].path("lease.json"), json.dumps(stale).encode())
        leases = [RunLease(s, timeout_s=60) for s in storages]
        outcome: dict[int, RunLeaseError | None] = {}

        def take(i: int) -> None:
            try:
                leases[i].acquire()
                outcome[i] = None
            except RunLeaseError as e:
                outcome[i] = e

        takers = [threading.Thread(target=take, args=(i,)) for i in range(2)]
        with caplog.at_level(logging.WARNING, logger="zeroray.train.driver.lease"):
            takers[0].start()
            assert proxy.arrived(1, 30), "the first taker's PUT"  # on its way, held by the slow store
            takers[1].start()
            for t in takers:
                t.join(60)
        try:
            assert sorted(outcome) == [0, 1]
            winners = [i for i in (0, 1) if outcome[i] is None]
            assert winners == [0], outcome
            owner = leases[0].owner
            assert "run 'run' is running (since " in str(outcome[1]) and f"owner {owner}, " in str(outcome[1])
            lease = json.loads(RunStorage(run, "run", s3["options"]).fs.cat_file(storages[0].path("lease.json")))
            assert lease["owner"] == owner
        finally:
            for i, lease in enumerate(leases):
                if outcome.get(i) is None:
                    lease.release()


def test_a_released_lease_leaves_nothing_behind(tmp_path):
    """The lease and its lock file go at the end of a fit: an empty ``lease.json.lock`` stayed."""
    storage = RunStorage(str(tmp_path), "run")
    storage.validate(processes=1)
    for _ in range(2):  # and the next fit of the run takes it again as new
        lease = RunLease(storage, timeout_s=60)
        lease.acquire()
        assert sorted(os.listdir(storage.dir)) == ["lease.json", "lease.json.lock"]
        lease.release()
        assert os.listdir(storage.dir) == []


def _reports_forever():
    i = 0
    while True:
        zt.report({"i": i})
        i += 1
        time.sleep(0.05)


def test_a_run_that_loses_its_lease_stops(ray_cluster, tmp_path):
    """Another driver took the lease over (this one's heartbeat was late): the run ends, says so, and
    leaves the other's lease alone."""
    run_dir = tmp_path / "runs" / "usurped"
    intruder = {"owner": "other-driver:1:xyz", "started_at": time.time(), "heartbeat": time.time()}

    def take_over() -> None:
        # Without the lock this write was overwritten now and then, and the run went on forever.
        _wait_for(lambda: (run_dir / "metrics.jsonl").exists(), "the run's first report")
        _take_over(run_dir, intruder)

    thread = threading.Thread(target=take_over)
    thread.start()
    try:
        with pytest.raises(zt.TrainingFailedError, match=r"lost the lease of run 'usurped' to other-driver:1:xyz"):
            ZeroTrainer(_reports_forever, scaling_config=ScalingConfig(num_workers=2),
                        run_config=RunConfig(name="usurped", storage_path=str(tmp_path / "runs"), progress_bar=False,
                                             lease_timeout_s=2.0)).fit()
    finally:
        thread.join()
    assert json.loads((run_dir / "lease.json").read_text())["owner"] == intruder["owner"]
    assert json.loads((run_dir / "run.json").read_text())["status"] == "ERRORED"
    assert_nothing_left("usurped")
