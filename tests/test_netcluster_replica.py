"""Recovery from replicas under ZeroTrainer on a real multi-node Ray cluster: two network namespaces
(tests/support/netcluster.py), each a Ray node with its own address and two ranks, ZeRO-3 with
``shard_group_size="auto"`` (one shard group per node, the two nodes replicas of each other).

The group of 4 stops inside step 5 (the first micro-batch's gradients reduced, over the link too) and one
node is killed with everything in it (``net.kill``: Ray's daemons and the two ranks). The survivors keep their
live state of step 4; the elastic run shrinks to the surviving node and rebuilds the whole state from it, flat
at world 2: ``recovered_from == "replica"``, 0 steps lost. Storage plays no part: every checkpoint file is
zeros before the node goes (a read would fail its checksum), and the step-2 checkpoint is older anyway. The
per-step losses and final weights are a single-process reference run's (same global batch and samples;
the sums in another order, so up to fp32 rounding), and nothing is left behind.

The driver runs inside the head's namespace (``python -m tests.test_netcluster_replica drive <dir>``); the
test process watches its control files and kills the other node. Needs root (network namespaces): skipped,
naming why, elsewhere.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support import elastic
from tests.support.netcluster import NetCluster, start_ray

pytestmark = pytest.mark.usefixtures("needs_namespaces")

STEPS, CHECKPOINT_AT = 8, 2
HOLD_STEP = 5  # the group of 4 holds inside this step (1-based), after its first micro-batch
RTOL = 1e-6  # another world size sums the same gradients in another order
FAST_HEALTH_CHECK = {"RAY_health_check_initial_delay_ms": "0", "RAY_health_check_period_ms": "500",
                     "RAY_health_check_timeout_ms": "1000", "RAY_health_check_failure_threshold": "3"}


def _loop(config: dict) -> None:
    import zeroray.train as zt

    ctx = zt.get_context()
    m = elastic.model()
    engine = zt.prepare(m, elastic.optimizer(m))
    x, y = elastic.data(STEPS)
    control = Path(config["control"])

    def hold_inside_step_5(micro: int) -> None:  # the first micro-batch's gradients reduced: until the node is gone
        if micro == 0 and ctx.get_world_size() == 4 and engine.global_step + 1 == HOLD_STEP:
            if ctx.get_world_rank() == 0:
                (control / "held").write_text(json.dumps({"micro_step": engine.micro_step}))
            while True:
                zt.report({"held": engine.global_step})
                time.sleep(0.05)

    while engine.global_step < STEPS:
        step = engine.global_step
        loss = elastic.train_step(engine, ctx, x, y, after_micro=hold_inside_step_5)
        zt.report({"loss": loss, "step": step + 1, "world": ctx.get_world_size()}, checkpoint=step + 1 == CHECKPOINT_AT)
    state = engine.full_state_dict()
    if ctx.get_world_rank() == 0:
        torch.save(state, control / "final.pt")


def _drive(out: Path) -> None:
    """The driver, inside the head's namespace: the elastic fit, what it recorded, and what is left behind."""
    import ray

    import zeroray
    from zeroray.train import FailureConfig, RunConfig, ScalingConfig, ZeroTrainer

    ray.init()
    deadline = time.monotonic() + 60
    while len([n for n in ray.nodes() if n["Alive"]]) < 2:
        assert time.monotonic() < deadline, ray.nodes()
        time.sleep(0.2)
    result = ZeroTrainer(
        _loop,
        train_loop_config={"control": str(out / "control")},
        zero_config=zeroray.ZeroConfig(stage=3, shard_group_size="auto", train_batch_size=elastic.GLOBAL_BATCH,
                                       train_micro_batch_size_per_gpu=elastic.MICRO),
        scaling_config=ScalingConfig(num_workers=(2, 4), elastic_resize_monitor_interval_s=1.0),
        run_config=RunConfig(name="replica", storage_path=str(out / "runs"), progress_bar=False,
                             failure_config=FailureConfig(max_failures=1, collective_timeout_s=30)),
    ).fit()
    (out / "result.json").write_text(json.dumps({
        "attempts": [a.as_dict() for a in result.attempt_history],
        "history": result.metrics_history,
        "error": None if result.error is None else str(result.error),
        "left": elastic.left_behind("replica"),
    }, default=str))
    ray.shutdown()


@pytest.mark.timeout(600)
def test_a_lost_node_is_recovered_from_its_replicas(tmp_path: Path) -> None:
    control = tmp_path / "control"
    control.mkdir()
    spoiled: list[str] = []
    with NetCluster(2) as net:
        cluster = start_ray(net, num_cpus=2, env=FAST_HEALTH_CHECK)
        elastic.drive_and_kill(cluster, [sys.executable, "-m", "tests.test_netcluster_replica", "drive", str(tmp_path)],
                               tmp_path / "driver.log", control / "held", timeout_s=300,
                               before_kill=lambda: spoiled.extend(elastic.spoil_checkpoints(tmp_path / "runs")))
    log_text = (tmp_path / "driver.log").read_text(errors="replace")
    assert (tmp_path / "result.json").exists(), log_text[-6000:]
    out = json.loads((tmp_path / "result.json").read_text())
    assert out["error"] is None, log_text[-6000:]
    assert spoiled, "the step-2 checkpoint was not written"
    assert json.loads((control / "held").read_text())["micro_step"] % 3 == 1  # inside step 5 (3 micro-batches)
    attempts = out["attempts"]
    summary = elastic.summary(attempts)
    assert summary == [
        (4, 0, HOLD_STEP - 1, "failure", 0, None),  # the node died inside step 5: step 4 was complete
        (2, HOLD_STEP - 1, STEPS, "finished", 0, "replica"),  # step 4 from the surviving replicas' memory
    ], attempts
    assert out["left"] == {"actors": [], "pgs": []}

    elastic.assert_matches_reference(out["history"], torch.load(control / "final.pt"), STEPS, RTOL)


if __name__ == "__main__":
    _drive(Path(sys.argv[2]))
