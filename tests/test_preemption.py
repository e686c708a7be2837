"""Preemption notices on a simulated multi-node cluster (``ray.cluster_utils.Cluster``, three one-CPU nodes):

- a real drain (``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds 60``) of a
  node that holds a rank: the loop sees it with ``zt.get_preemption_info()``, the group takes an in-memory
  snapshot at its next report, moves off the node before the deadline, and loses no step: its losses equal
  an uninterrupted run's bitwise, each step once;
- SIGTERM to a rank's process: a notice with ``sigterm_grace_s`` left; a checkpoint (snapshots off), 0 steps lost,
  losses bitwise equal; only the rank that got it gets a new process;
- a SIGTERM whose grace is too short for any recovery point: crash recovery (the steps since the last
  checkpoint redone) with a warning saying how long the recovery point needed;
- preemptions count apart from failures: every run here has ``max_failures=0``, and
  ``max_preemption_failures=0`` fails the run at the first notice, naming the setting.

As in test_elastic_cluster.py, the cluster lives in a process of its own (``python -m tests.test_preemption host
<dir>``) that also sends the notices, and the driver in another (``... drive <address> <dir>``) runs the fits one
after the other; the pytest process never talks to that cluster's GCS. The loop holds at a chosen step until the
notice reaches it (it waits on ``zt.get_preemption_info()``), so each notice lands at a known step.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import elastic

STEPS, HOLD_AT, CHECKPOINT_EVERY = 10, 5, 4
DRAIN_DEADLINE_S = 60
# tag -> (ScalingConfig.num_workers, FailureConfig kwargs, the steps at which a group holds for a notice)
RUNS = {
    "reference": ((1, 2), {}, []),
    "drain": ((1, 2), {"snapshot_interval": 100}, [HOLD_AT]),  # snapshots on; the only one taken is the notice's
    "sigterm": ((2, 2), {}, [HOLD_AT]),
    # a grace too short for any recovery point, twice, with one preemption allowed (max_failures=3 unused)
    "short": ((2, 2), {"sigterm_grace_s": 0.01, "max_failures": 3, "max_preemption_failures": 1}, [HOLD_AT, 8]),
}
NOTICES = [("drain", HOLD_AT), ("sigterm", HOLD_AT), ("short", HOLD_AT), ("short", 8)]  # in the order they come


def _loop(config):
    import ray

    import zeroray.train as zt

    ctx = zt.get_context()
    control, tag = Path(config["control"]), config["tag"]
    m = elastic.model()
    engine = zt.prepare(m, elastic.optimizer(m))
    # The step this group holds at for a notice: the first not noticed yet (decided before any rank can write one).
    hold = next((s for s in config["holds"] if not (control / f"{tag}-{s}-noticed").exists()), None)
    x, y = elastic.data(STEPS)
    while engine.global_step < STEPS:
        step = engine.global_step
        loss = elastic.train_step(engine, ctx, x, y)
        zt.report({"loss": loss, "step": step + 1}, checkpoint=(step + 1) % CHECKPOINT_EVERY == 0)
        if engine.global_step == hold:
            rank = ctx.get_world_rank()
            where = {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}
            tmp = control / f"{tag}-{hold}-rank-{rank}.tmp"
            tmp.write_text(json.dumps(where))
            tmp.rename(control / f"{tag}-{hold}-rank-{rank}")
            while (info := zt.get_preemption_info()) is None:  # the same answer on every rank, each call
                time.sleep(0.05)
            if rank == 0:
                (control / f"{tag}-{hold}-noticed").write_text(json.dumps(
                    {"deadline_ms": info.deadline_ms, "nodes": info.preempted_node_ids, "ranks": info.preempted_ranks}))


def _drive(address: str, out: Path) -> None:
    """Every run of RUNS in turn on the cluster; each one's attempts, history and error to out/<tag>.json."""
    import ray

    from zeroray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError, ZeroTrainer

    ray.init(address=address)
    for tag, (workers, failure, holds) in RUNS.items():
        failure = {"max_failures": 0, "collective_timeout_s": 30, **failure}
        trainer = ZeroTrainer(
            _loop, train_loop_config={"control": str(out / "control"), "tag": tag, "holds": holds},
            zero_config={"train_batch_size": elastic.GLOBAL_BATCH, "train_micro_batch_size_per_gpu": elastic.MICRO,
                         "zero_optimization": {"stage": 3}},
            scaling_config=ScalingConfig(num_workers=workers),
            run_config=RunConfig(name=tag, storage_path=str(out / "runs"), progress_bar=False,
                                 failure_config=FailureConfig(**failure)))
        error = None
        try:
            result = trainer.fit()
        except TrainingFailedError as e:
            result, error = e.result, str(e)
        (out / f"{tag}.json").write_text(json.dumps({
            "attempts": [a.as_dict() for a in result.attempt_history], "history": result.metrics_history,
            "error": error, "left": elastic.left_behind(tag)}, default=str))
    ray.shutdown()


def _host(out: Path) -> None:
    """A head without CPUs and three one-CPU nodes; the driver in a subprocess; the notices when each run holds."""
    control, sent = out / "control", {}
    with elastic.host_cluster() as cluster:
        for _ in range(3):
            cluster.add_node(num_cpus=1)
        with elastic.driver("tests.test_preemption", cluster.address, out) as proc:
            for tag, step in NOTICES:
                elastic.wait_for(control / f"{tag}-{step}-rank-1", proc)
                rank1 = json.loads((control / f"{tag}-{step}-rank-1").read_text())
                if tag == "drain":  # Ray's own API, as the autoscaler (v2) calls it on a spot notice
                    sent[tag] = {"at": time.time(), "node": rank1["node"]}
                    subprocess.run([str(Path(sys.executable).parent / "ray"), "drain-node", "--address",
                                    cluster.address, "--node-id", rank1["node"], "--reason",
                                    "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot reclaim (test)",
                                    "--deadline-remaining-seconds", str(DRAIN_DEADLINE_S)], check=True,
                                   capture_output=True, timeout=60)
                else:
                    sent[f"{tag}-{step}"] = {"at": time.time(), "pid": rank1["pid"]}
                    os.kill(rank1["pid"], signal.SIGTERM)
            (out / "host.json").write_text(json.dumps(sent))
            proc.wait(timeout=400)


def _losses(run: dict) -> list[tuple[int, float]]:
    return [(e["step"], e["loss"]) for e in run["history"] if "loss" in e]


def test_preemption_notices_lose_no_step_and_count_apart(tmp_path):
    (tmp_path / "control").mkdir()
    sent = elastic.run_host("tests.test_preemption", tmp_path, done="short.json")
    driver_log = (tmp_path / "driver.log").read_text()
    runs = {tag: json.loads((tmp_path / f"{tag}.json").read_text()) for tag in RUNS}
    reference = _losses(runs["reference"])
    assert [s for s, _ in reference] == list(range(1, STEPS + 1))
    for tag, run in runs.items():
        assert run["left"] == {"actors": [], "pgs": []}, (tag, run["left"])

    # A drain with a generous deadline: seen in the loop, an in-memory snapshot at the next report, a group of 2
    # on the nodes that stay (one rank kept, one new on the third node), 0 steps lost, bitwise the same losses.
    drain = runs["drain"]
    noticed = json.loads((tmp_path / "control" / f"drain-{HOLD_AT}-noticed").read_text())
    assert noticed["nodes"] == [sent["drain"]["node"]] and noticed["ranks"] == [1], noticed
    deadline_s = noticed["deadline_ms"] / 1000
    assert abs(deadline_s - (sent["drain"]["at"] + DRAIN_DEADLINE_S)) < 10, (noticed, sent)
    assert elastic.summary(drain["attempts"]) == [(2, 0, HOLD_AT + 1, "preempted", 0, None),
                               (2, HOLD_AT + 1, STEPS, "finished", 0, "memory")], drain["attempts"]
    first = drain["attempts"][0]
    assert first["node"] == sent["drain"]["node"] and first["ended_at"] < deadline_s, first
    assert first["message"].startswith(f"rank(s) [1] preempted: snapshot at step {HOLD_AT + 1}"), first["message"]
    assert drain["attempts"][1]["kept_ranks"] == 1
    assert _losses(drain) == reference  # every step once, in order, bitwise

    # SIGTERM to a rank with the default grace: a checkpoint (snapshots off), 0 steps lost, bitwise the same.
    sigterm = runs["sigterm"]
    assert elastic.summary(sigterm["attempts"]) == [(2, 0, HOLD_AT + 1, "preempted", 0, None),
                                 (2, HOLD_AT + 1, STEPS, "finished", 0, "storage")], sigterm["attempts"]
    assert f"checkpoint at step {HOLD_AT + 1}" in sigterm["attempts"][0]["message"]
    assert sigterm["attempts"][1]["kept_ranks"] == 1  # rank 0 kept; the SIGTERMed process is not reused
    assert _losses(sigterm) == reference
    assert "got SIGTERM: handled as a preemption notice with 30s of grace" in driver_log

    # A grace too short for any recovery point: none is taken, with the warning, and the next group resumes from
    # checkpoint 4 as after a crash (steps 5 and 6 redone, to the same bits). Preemptions count apart: the second
    # notice is one more than max_preemption_failures=1 and ends the run, with max_failures=3 unused.
    short = runs["short"]
    assert elastic.summary(short["attempts"]) == [(2, 0, HOLD_AT + 1, "preempted", HOLD_AT + 1 - 4, None),
                               (2, 4, 9, "preempted", None, "storage")], short["attempts"]
    assert short["attempts"][0]["message"].startswith(f"rank(s) [1] preempted: no recovery point at step {HOLD_AT + 1}")
    assert "the deadline is too short for a recovery point at step 6" in driver_log
    assert re.search(r"the recovery point needed about \d+\.\d\ds", driver_log)
    assert "preempted 2 time(s), more than FailureConfig.max_preemption_failures=1" in short["error"], short["error"]
    assert all(reference[step - 1] == (step, loss) for step, loss in _losses(short)), _losses(short)


def test_recovery_point_choice_fits_the_deadline():
    from zeroray.train.worker.preemption import MARGIN_S, SAFETY_FACTOR, choose

    needed = {"snapshot": 0.5, "checkpoint": 4.0}
    assert choose(None, needed) == "snapshot"
    assert choose(60.0, needed) == "snapshot"
    assert choose(60.0, {"checkpoint": 4.0}) == "checkpoint"  # snapshots off
    assert choose(0.5 * SAFETY_FACTOR + MARGIN_S - 0.01, needed) == "none"
    assert choose(4.0 * SAFETY_FACTOR + MARGIN_S, {"checkpoint": 4.0}) == "checkpoint"
    assert choose(-1.0, {"snapshot": 0.0, "checkpoint": 0.0}) == "none"  # the deadline passed


def test_notices_merge_like_ray_train_v2():
    from zeroray.train import PreemptionInfo
    from zeroray.train.preemption import merge

    a = PreemptionInfo(2_000, {"n1": [0, 1]})
    b = PreemptionInfo(1_000, {"n2": [3], "n1": [2]})
    assert merge(None, None) is None
    m = merge(a, None, b)
    assert (m.deadline_ms, m.preempted_node_to_ranks) == (1_000, {"n1": [0, 1, 2], "n2": [3]})
    assert (m.preempted_node_ids, m.preempted_ranks) == (["n1", "n2"], [0, 1, 2, 3])
    assert merge(PreemptionInfo(None, {"n": [0]})).deadline_ms is None


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_preemption_failures": -2}, r"max_preemption_failures must be an integer >= 0, or -1 for unlimited"),
    ({"max_preemption_failures": 1.5}, r"max_preemption_failures must be an integer"),
    ({"sigterm_grace_s": 0}, r"FailureConfig.sigterm_grace_s must be a number of seconds > 0, got 0"),
    ({"sigterm_grace_s": "30"}, r"FailureConfig.sigterm_grace_s must be a number of seconds > 0"),
])
def test_bad_preemption_settings_are_refused(kwargs, message):
    from zeroray.train import FailureConfig

    with pytest.raises(ValueError, match=message):
        FailureConfig(**kwargs)


if __name__ == "__main__":
    if sys.argv[1] == "host":
        _host(Path(sys.argv[2]))
    else:
        _drive(sys.argv[2], Path(sys.argv[3]))
