"""An elastic run on a simulated multi-node cluster (``ray.cluster_utils.Cluster``): it grows when a node is
added (a planned resize: 0 steps lost, the old ranks keep their processes), shrinks when a node is removed
without warning (at most the steps since the last checkpoint lost; the survivors keep their processes),
reshards its ZeRO-3 checkpoint across world sizes 2 -> 3 -> 2, and ends with the same parameters and
per-step losses as a fixed-size run on the same global batch and samples. Its data come from a
``zt.DistributedSampler``: every step's global batch, as the ranks took it, is the fixed-size run's, through the
grow, the lost node and the shrink (issue 32's record of sample ids).

With in-memory snapshots (``FailureConfig.snapshot_interval=1``) the same run loses no step to the lost node:
the survivors rebuild the group of 3's state at step 10 from their memory, resharded to 2. Storage plays no
part in it: every checkpoint file is overwritten with zeros before the node goes, so a read of one would fail.

The cluster lives in a process of its own (``python -m tests.test_elastic_cluster host <dir>``), which
adds and removes the nodes and tears the cluster down; the driver runs in another
(``... drive <address> <dir>``) connected to it. The pytest process never talks to that cluster's GCS:
when it hosted the Cluster itself, Ray's GCS client ended the whole pytest process 10-20 minutes after
the teardown ("GCS unavailable for more than 60 s"). The loop holds at chosen steps (it keeps reporting
without training) until the group changes, so each node event lands at a known step, whatever the
machine's speed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support import elastic

STEPS, CHECKPOINT_EVERY = 16, 4
HOLDS = {"2": 5, "3": 10}  # world size -> global step at which that group holds until it is replaced
# Parameters and losses of a resized run against a fixed-size one: the same math, the sums in another order
# (gradients reduced over 2 or 3 ranks and 3 or 4 micro-batches), so equal up to fp32 rounding.
RTOL = 1e-6
# Ray's health check here (conftest: 500 ms x 3, 1 s timeout) plus the controller's wait for the root cause; a
# bound that says "within the health-check window", not a speed claim.
NODE_LOSS_BOUND_S = 20.0


def _elastic_loop(config):
    elastic.run_loop(Path(config["control"]), STEPS, CHECKPOINT_EVERY,
                     lambda world, step: HOLDS.get(str(world)) == step)


def _drive(address: str, out: Path, recovery: str) -> None:
    """The subprocess driver: the elastic fit, then what it recorded and whether anything was left behind."""
    import ray

    from zeroray.train import FailureConfig, RunConfig, ScalingConfig, ZeroTrainer

    ray.init(address=address)
    control = out / "control"
    result = ZeroTrainer(
        _elastic_loop,
        train_loop_config={"control": str(control)},
        zero_config={"train_batch_size": elastic.GLOBAL_BATCH, "train_micro_batch_size_per_gpu": elastic.MICRO,
                     "zero_optimization": {"stage": 3}},
        scaling_config=ScalingConfig(num_workers=(1, 4), elastic_resize_monitor_interval_s=1.0),
        run_config=RunConfig(name="elastic", storage_path=str(out / "runs"), progress_bar=False,
                             failure_config=FailureConfig(max_failures=2, collective_timeout_s=30,
                                                          snapshot_interval=1 if recovery == "memory" else 0)),
    ).fit()
    elastic.write_result(out, result, "elastic")
    ray.shutdown()



def _host(out: Path, recovery: str) -> None:
    """The cluster's own process: a head without CPUs and two one-CPU nodes; the driver in a subprocess; a third
    node added when the group of 2 holds, removed without warning when the group of 3 holds; then teardown.
    Writes out/host.json (the removed node and when) and the driver's output to out/driver.log."""
    control = out / "control"
    with elastic.host_cluster(_system_config=elastic.HEALTH_CHECK_CONFIG) as cluster:
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        with elastic.driver("tests.test_elastic_cluster", cluster.address, out, recovery) as proc:
            elastic.wait_for(control / "held-2-5", proc)  # 2 nodes: a group of 2 (max 4), held at step 5
            third = cluster.add_node(num_cpus=1)  # -> grows to 3 at the next check, from a recovery point at 5
            elastic.wait_for(control / "held-3-10", proc)
            spoiled = elastic.spoil_checkpoints(out / "runs") if recovery == "memory" else []
            removed_at = time.time()
            cluster.remove_node(third, allow_graceful=False)  # a node lost without warning, its rank with it
            (out / "host.json").write_text(json.dumps({"removed": third.node_id, "removed_at": removed_at,
                                                       "spoiled": spoiled}))
            proc.wait(timeout=300)


# Storage recovery (the default) is what the other elastic and trainer tests restart from; across real nodes
# it runs with `-m slow`, out of the default suite to keep that under 20 minutes.
@pytest.mark.parametrize("recovery", [pytest.param("storage", marks=pytest.mark.slow), "memory"])
def test_elastic_run_grows_and_shrinks_with_nodes_and_matches_a_fixed_run(tmp_path, recovery):
    (tmp_path / "control").mkdir()
    removed = elastic.run_host("tests.test_elastic_cluster", tmp_path, recovery, timeout_s=900)
    out = json.loads((tmp_path / "result.json").read_text())
    attempts = out["attempts"]
    summary = elastic.summary(attempts)
    if recovery == "storage":
        assert summary == [
            (2, 0, 5, "resize_up", 0, None),  # planned: a recovery point at step 5, nothing lost
            (3, 5, 10, "failure", 2, "storage"),  # the node died at step 10; the newest checkpoint was step 8
            (2, 8, STEPS, "finished", 0, "storage"),  # shrunk to what was left instead of waiting for the node
        ], attempts
    else:
        assert summary == [
            (2, 0, 5, "resize_up", 0, None),
            (3, 5, 10, "failure", 0, "memory"),  # the kept ranks hold step 5 (as new as the recovery point)
            (2, 10, STEPS, "finished", 0, "memory"),  # step 10, from the two survivors' memory: nothing lost
        ], attempts
        assert len(removed["spoiled"]) >= 4, removed  # checkpoints 4, 5 and 8: their rank files
    assert attempts[1]["node"] == removed["removed"], attempts[1]  # the dead node's rank, not a survivor's error
    # Only new capacity gets new processes: the grow keeps both old ranks, the shrink both survivors.
    assert [a["kept_ranks"] for a in attempts] == [0, 2, 2], attempts
    noticed = attempts[1]["ended_at"] - removed["removed_at"]
    assert 0 < noticed < NODE_LOSS_BOUND_S, f"the lost node was noticed after {noticed:.1f}s"
    assert out["left"] == {"actors": [], "pgs": []}

    # Parity with the fixed-size run: the last loss recorded for each step (steps 9 and 10 ran twice).
    elastic.assert_matches_reference(out["history"], torch.load(tmp_path / "control" / "final.pt"), STEPS, RTOL)
    elastic.assert_same_samples(out["history"])  # zt.DistributedSampler: through the grow, the kill and the shrink


if __name__ == "__main__":
    if sys.argv[1] == "host":
        _host(Path(sys.argv[2]), sys.argv[3])
    else:
        _drive(sys.argv[2], Path(sys.argv[3]), sys.argv[4])
