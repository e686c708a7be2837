"""Faults on a real local Ray cluster: a SIGKILLed rank and a SIGSTOPped (hung) rank are each noticed, the
group restarts from the newest checkpoint, and the attempt history says who failed and how many steps were
redone. Bad elastic input fails before any actor starts, or with a clear error after the placement timeout.

The loop holds at a chosen step (it keeps reporting without training) until the test has released it and
hit a rank, so the fault lands at a known step. Detection bounds here are generous (a busy 2-core
machine); the measured latencies are in benchmarks/elastic_bench.py.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group

import zeroray.train as zt
from tests.support.ray import assert_nothing_left, run_config, wait_for_file
from zeroray.train import FailureConfig, ScalingConfig, TrainingFailedError, ZeroTrainer

STEPS, HOLD_AT, CHECKPOINT_EVERY = 10, 6, 4
HEARTBEAT_TIMEOUT_S = 3.0
DETECTION_BOUND_S = 20.0  # a correctness bound (noticed at all, and not after torch's 30 minutes), not a speed claim


def _held_loop(config):
    ctx = zt.get_context()
    control = Path(config["control"])
    with open(control / f"starts-{ctx.get_world_rank()}", "a") as f:  # one line per group this rank's loop ran in
        f.write(f"{os.getpid()}\n")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    engine = zt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.ones(2, 4)
    while engine.global_step < STEPS:
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        zt.report({"loss": loss.item()}, checkpoint=engine.global_step % CHECKPOINT_EVERY == 0)
        if engine.global_step == HOLD_AT and not (control / "released").exists():
            (control / f"pid-{ctx.get_world_rank()}").write_text(str(os.getpid()))
            while True:  # until the test hits a rank
                zt.report({"held": 1})
                time.sleep(0.05)


# A SIGKILLed rank is also test_trainer_checkpoint's (restart from the last commit); -m slow runs it here.
@pytest.mark.parametrize("sig", [pytest.param(signal.SIGKILL, marks=pytest.mark.slow), signal.SIGSTOP],
                         ids=["sigkill", "sigstop"])
def test_a_killed_or_hung_rank_is_noticed_and_the_group_restarts(ray_cluster, tmp_path, sig):
    import threading

    name = f"fault-{sig.name.lower()}"
    control = tmp_path / "control"
    control.mkdir()
    hit: dict[str, float] = {}

    def hit_rank_1() -> None:
        wait_for_file(control / "pid-1")
        wait_for_file(control / "pid-0")
        (control / "released").write_text("")  # the restarted group does not hold
        hit["time"] = time.time()
        os.kill(int((control / "pid-1").read_text()), sig)

    hitter = threading.Thread(target=hit_rank_1, daemon=True)
    hitter.start()
    result = ZeroTrainer(
        _held_loop, train_loop_config={"control": str(control)},
        zero_config={"zero_optimization": {"stage": 2}},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=run_config(tmp_path, name, failure_config=FailureConfig(
            max_failures=1, collective_timeout_s=30, worker_heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)),
    ).fit()
    hitter.join(timeout=10)
    first, second = result.attempt_history
    assert (first.end, first.rank, first.last_step, first.steps_lost) == ("failure", 1, HOLD_AT, HOLD_AT - 4), first
    assert first.node is not None
    assert (second.start_step, second.last_step, second.end) == (4, STEPS, "finished"), second
    detected = first.ended_at - hit["time"]
    assert 0 < detected < DETECTION_BOUND_S, f"noticed {detected:.1f}s after the {sig.name}"
    if sig == signal.SIGSTOP:
        assert "has not answered for" in first.message and "worker_heartbeat_timeout_s=3" in first.message
        assert detected >= HEARTBEAT_TIMEOUT_S - 0.5  # its last answer came up to a poll interval before the stop
    else:
        assert "actor process died" in first.message
    recorded = json.loads((tmp_path / "runs" / name / "run.json").read_text())["attempt_history"]
    assert [(a["world_size"], a["end"], a["rank"], a["steps_lost"]) for a in recorded] == [
        (2, "failure", 1, HOLD_AT - 4), (2, "finished", None, 0)]
    # Only the rank that was hit gets a new process: rank 0's actor (its process, imports, bundle) is kept; the
    # killed or hung rank's actor is never reused.
    starts = {r: [int(p) for p in (control / f"starts-{r}").read_text().split()] for r in (0, 1)}
    hit_pid = int((control / "pid-1").read_text())
    assert starts[0][0] == starts[0][1] == int((control / "pid-0").read_text()), starts
    assert starts[1][0] == hit_pid and starts[1][1] != hit_pid, starts
    assert (first.kept_ranks, second.kept_ranks) == (0, 1)
    assert {"teardown", "placement", "actors", "rendezvous", "build", "load", "first_step"} <= set(second.phases)
    assert all(v >= 0 for v in second.phases.values()), second.phases
    assert_nothing_left(name, [*starts[0], *starts[1]])


def _report_once():
    zt.report({"x": 1})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_workers": (3, 2)}, r"min \(3\) must be <= max \(2\)"),
        ({"num_workers": (0, 2)}, r"min must be >= 1"),
        ({"num_workers": (1, 2, 3)}, r"an integer or a \(min, max\) pair"),
        ({"num_workers": (1, 2), "elastic_resize_monitor_interval_s": -1}, r"elastic_resize_monitor_interval_s"),
        ({"num_workers": (1, 2), "elastic_batch": "local"}, r"'global' or 'micro'"),
    ],
)
def test_bad_elastic_scaling_configs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ScalingConfig(**kwargs)


def test_a_global_batch_no_feasible_size_keeps_is_refused_before_any_actor_starts():
    # 10 = 4 x accumulation x world has no solution for world 2, 3 or 4.
    with pytest.raises(ValueError, match=r"no world size between min_workers=2 and max_workers=4 keeps the global "
                                         r"batch: train_batch_size=10 must be divisible by "
                                         r"train_micro_batch_size_per_gpu=4 x world size"):
        ZeroTrainer(_report_once, zero_config={"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4},
                    scaling_config=ScalingConfig(num_workers=(2, 4)))
    with pytest.raises(ValueError, match=r"elastic_batch='global'\) keeps train_batch_size constant"):
        ZeroTrainer(_report_once, zero_config={"train_micro_batch_size_per_gpu": 4},
                    scaling_config=ScalingConfig(num_workers=(2, 4)))


def test_fewer_resources_than_min_fail_after_the_placement_timeout(ray_cluster, tmp_path):
    # Something else holds 3 of the cluster's 4 CPUs: min 2 fits the cluster, but not now.
    blocker = placement_group([{"CPU": 3}], name="someone-else-elastic")
    ray.get(blocker.ready(), timeout=60)
    start = time.monotonic()
    try:
        with pytest.raises(TrainingFailedError) as info:
            ZeroTrainer(_report_once, scaling_config=ScalingConfig(num_workers=(2, 3), placement_timeout_s=3),
                        run_config=run_config(tmp_path, "elastic-unplaceable")).fit()
    finally:
        remove_placement_group(blocker)
    message = str(info.value)
    assert message.startswith("zeroray training failed (placement)")
    assert "could not place 2 bundle(s) of {'CPU': 1.0} (one placement group per rank)" in message and "placement_timeout_s=3" in message
    assert time.monotonic() - start < 60
    assert [a.end for a in info.value.result.attempt_history] == ["failure"]
    assert_nothing_left("elastic-unplaceable")


@ray.remote(num_cpus=0)
def _waits_for_a_peer(seconds: float) -> None:
    time.sleep(seconds)  # like a rank's rendezvous waiting for a peer that will never come


@ray.remote(num_cpus=0, max_retries=0)
def _dies() -> None:
    os._exit(1)  # like a rank whose node is lost during setup


def test_a_rank_lost_during_setup_fails_the_start_at_once(ray_cluster):
    from zeroray.train.group.worker_group import WorkerGroup, WorkerGroupStartError

    slow = _waits_for_a_peer.remote(90)
    start = time.monotonic()
    try:
        with pytest.raises(WorkerGroupStartError, match="setup failed on rank 1") as info:
            WorkerGroup("setup-loss")._get([slow, _dies.remote()], "setup")
    finally:
        ray.cancel(slow, force=True)
    assert info.value.rank == 1
    assert time.monotonic() - start < 30  # not after rank 0's wait (90 s here; the collective timeout in a real setup)
