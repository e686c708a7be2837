"""How a run fails on a real local Ray cluster: storage the ranks cannot share, ranks out of step in their
collectives, a group that cannot be placed, a full disk. Each must end with a clear error, soon, with
nothing left behind and the run's files telling the truth."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import placement_group, remove_placement_group

import zeroray.train as zt
from tests.support.ray import assert_nothing_left, list_actors, list_placement_groups, run_config
from zeroray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError, ZeroTrainer
from zeroray.train.driver.run_dir import StorageError

TIMEOUT_S = 5.0  # the collective timeout the out-of-step tests set
BOUND_S = 120.0  # far below torch's 30 minutes, far above startup on a busy machine


def _checkpointing_loop():
    model = torch.nn.Linear(2, 1)
    engine = zt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    zt.report({"x": 1}, checkpoint=True)
    return engine


def test_process_local_storage_is_refused_before_any_actor_starts(ray_cluster, tmp_path):
    # memory:// lives inside one process: each rank would wait forever for the others' shards.
    before = {a.actor_id for a in list_actors(limit=10_000)}
    pgs_before = {p.placement_group_id for p in list_placement_groups(limit=10_000)}
    with pytest.raises(StorageError, match=r"'memory://zeroray-shared' is process-local storage"):
        ZeroTrainer(_checkpointing_loop, scaling_config=ScalingConfig(num_workers=2),
                    run_config=RunConfig(name="mem", storage_path="memory://zeroray-shared")).fit()
    assert {a.actor_id for a in list_actors(limit=10_000)} == before
    assert {p.placement_group_id for p in list_placement_groups(limit=10_000)} == pgs_before


def _reports_on_rank0_only():
    """Rank 0 reports after every step; rank 1 never does and goes on to the next step's all-reduce."""
    for _step in range(3):
        t = torch.ones(4)
        dist.all_reduce(t)
        if zt.get_context().get_world_rank() == 0:
            zt.report({"sum": t.sum().item()})


def _full_state_dict_on_rank0_only():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    engine = zt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loss = engine(torch.ones(2, 4)).sum()
    engine.backward(loss)
    engine.step()
    zt.report({"loss": loss.item()})
    if zt.get_context().get_world_rank() == 0:
        engine.full_state_dict()  # a collective: rank 1 is not there, it waits in the next report
    zt.report({"loss": loss.item()})


@pytest.mark.parametrize(
    ("loop", "places"),
    [
        (_reports_on_rank0_only, ["rank 0 waiting in zt.report call 1 (0 completed)",
                                  "rank 1 outside zt.report (in the loop's own code or collectives) after 0 report(s)"]),
        (_full_state_dict_on_rank0_only, ["rank 0 outside zt.report (in the loop's own code or collectives) after 1 "
                                          "report(s)", "rank 1 waiting in zt.report call 2 (1 completed)"]),
    ],
    ids=["report-on-rank-0-only", "full-state-dict-on-rank-0-only"],
)
def test_ranks_out_of_step_fail_with_the_ranks_and_report_counts(ray_cluster, tmp_path, loop, places):
    name = f"out-of-step-{loop.__name__.strip('_')}".replace("_", "-")
    start = time.monotonic()
    with pytest.raises(TrainingFailedError) as info:
        ZeroTrainer(loop, zero_config={"zero_optimization": {"stage": 3}},
                    scaling_config=ScalingConfig(num_workers=2),
                    run_config=run_config(tmp_path, name,
                                          failure_config=FailureConfig(collective_timeout_s=TIMEOUT_S))).fit()
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert elapsed < BOUND_S, f"the error took {elapsed:.0f}s: {message}"
    assert "ranks out of step: a collective timed out (the ranks reported different numbers of times)" in message
    for place in places:
        assert place in message
    assert "engine.full_state_dict()" in message and "collective_timeout_s" in message
    # Both ranks' failures are in: the first to time out, and the other's own timeout or its collective failing
    # because the first went away.
    failures = info.value.failures
    assert {f.rank for f in failures} == {0, 1}, message
    assert any(f.timed_out for f in failures) and all(f.secondary for f in failures), message
    assert json.loads((tmp_path / "runs" / name / "run.json").read_text())["status"] == "ERRORED"
    assert_nothing_left(name)


def _steady_loop():
    zt.report({"x": 1})


def test_a_group_that_cannot_be_placed_says_what_could_not_be_placed(ray_cluster, tmp_path):
    # Something else holds 3 of the cluster's 4 CPUs: 2 workers fit the cluster, but not now.
    blocker = placement_group([{"CPU": 3}], name="someone-else")
    ray.get(blocker.ready(), timeout=60)
    try:
        with pytest.raises(TrainingFailedError) as info:
            ZeroTrainer(_steady_loop, scaling_config=ScalingConfig(num_workers=2, placement_timeout_s=2),
                        run_config=run_config(tmp_path, "unplaceable")).fit()
    finally:
        remove_placement_group(blocker)
    message = str(info.value)
    assert "rank -1" not in message and info.value.rank is None
    assert message.startswith("zeroray training failed (placement)")
    assert "could not place 2 bundle(s) of {'CPU': 1.0} (PACK) for the worker group" in message
    assert "placement_timeout_s=2" in message
    run_info = json.loads((tmp_path / "runs" / "unplaceable" / "run.json").read_text())
    assert run_info["status"] == "ERRORED" and "could not place" in run_info["error"]
    assert_nothing_left("unplaceable")


def _rank0_slow_to_answer_when_rank1_fails(config):
    """Rank 0 queues report 1 and then answers no poll for a second (a C call that holds the GIL, as a busy
    machine may delay an actor); meanwhile rank 1 fails: the driver learns of the failure before rank 0 hands
    over its report."""
    zt.report({"step": 1})
    marker = Path(config["marker"])
    if zt.get_context().get_world_rank() == 0:
        marker.write_text("report 1 queued")
        ctypes.PyDLL(None).usleep(1_000_000)  # PyDLL: the call keeps the GIL
        return
    deadline = time.monotonic() + BOUND_S
    while not marker.exists():
        assert time.monotonic() < deadline, "rank 0 never queued report 1"
        time.sleep(0.01)
    raise RuntimeError("rank 1 fails after report 1")


def _rank0_dies_after_report_1(config):
    """Report 1 is queued on every rank; rank 0's process ends before any poll takes it."""
    zt.report({"step": 1, "rank": zt.get_context().get_world_rank()})
    if zt.get_context().get_world_rank() == 0:
        os._exit(1)
    zt.report({"step": 2, "rank": 1})  # waits for rank 0, and fails once its connection closes


@pytest.mark.parametrize(("loop", "rank", "message"), [
    (_rank0_slow_to_answer_when_rank1_fails, 1, "rank 1 fails after report 1"),
    (_rank0_dies_after_report_1, 0, "the rank's actor process died"),
], ids=["rank-0-slow-to-answer", "rank-0-dead"])
def test_reports_queued_before_a_failure_reach_the_history(ray_cluster, tmp_path, loop, rank, message):
    """Rank 0's report 1 reaches the history though the failure is found first: from rank 0 once it answers,
    or, when rank 0 is dead, from rank 1, which queued the same report (rank 0's metrics)."""
    name = f"late-report-{rank}"
    with pytest.raises(TrainingFailedError) as info:
        ZeroTrainer(loop, train_loop_config={"marker": str(tmp_path / "queued")},
                    scaling_config=ScalingConfig(num_workers=2),
                    run_config=run_config(tmp_path, name, failure_config=FailureConfig(max_failures=0))).fit()
    assert info.value.rank == rank and message in str(info.value)
    history = info.value.result.metrics_history
    assert [h["step"] for h in history] == [1] and history[0].get("rank", 0) == 0, history
    assert info.value.result.attempt_history[-1].last_step is None  # no engine: no global step
    assert_nothing_left(name)


_FULL_DISK_DRIVER = """
import resource, signal, sys
import ray
import zeroray.train as zt
from zeroray.train import RunConfig, ScalingConfig, TrainingFailedError, ZeroTrainer

def loop():
    for i in range(40):
        zt.report({"i": i, "pad": "x" * 1000})
    raise ValueError("the loop failed after 40 reports")

ray.init(address=sys.argv[1])
# From here on no file this process writes may grow past 16 KiB: a disk that fills up mid-run.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))
try:
    ZeroTrainer(loop, run_config=RunConfig(name="full-disk", storage_path=sys.argv[2], progress_bar=False)).fit()
except TrainingFailedError as e:
    print("FAILED", e.rank, flush=True)
"""


def test_a_full_disk_leaves_whole_lines_and_run_json_says_errored(ray_cluster, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(_FULL_DISK_DRIVER)
    done = subprocess.run([sys.executable, str(script), ray_cluster["address"], str(tmp_path / "runs")],
                          capture_output=True, text=True, timeout=300)
    assert "FAILED 0" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = tmp_path / "runs" / "full-disk"
    raw = (run_dir / "metrics.jsonl").read_bytes()
    assert raw.endswith(b"\n") and 0 < len(raw) <= 16384
    entries = [json.loads(line) for line in raw.decode().splitlines()]  # every line whole
    assert [e["i"] for e in entries] == list(range(len(entries))) and len(entries) < 40
    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "ERRORED" and "the loop failed after 40 reports" in info["error"]
    assert "File too large" in info["metrics_error"]
    assert not (run_dir / "lease.json").exists()
    assert_nothing_left("full-disk")
