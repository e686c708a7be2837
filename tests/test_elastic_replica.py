"""Resizes under recovery from replicas, on a simulated multi-node cluster (``ray.cluster_utils.Cluster``, nodes of
two CPUs): an elastic ZeRO-3 run with ``shard_group_size="auto"`` (one shard group of 2 per node, the nodes
replicas of each other) grows when a node joins, shrinks when one is drained and again when one is lost, and
writes and reads no checkpoint for any of them:

- **A grow** (2 nodes, 4 ranks -> 3 nodes, 6 ranks), a planned resize: its recovery point at step 5 is the
  ranks' live state (every rank stays, so every shard has a copy), not a checkpoint, and the new node's ranks
  receive their shards from the old ones' memory (``recovered_from == "replica"``, 0 steps lost).
- **A drain** of the third node (a preemption notice, ``ray drain-node``) at step 10: the ranks that stay, one
  replica group per node left, hold every shard, so that is the recovery point (kind "replica"), and the group of
  4 resumes at step 10 from them.
- **A node lost** without warning at step 13: the survivors' live copies cover every shard, as in
  tests/test_netcluster_replica.py; the group of 2 (one node: flat) resumes at step 13 from them.

Storage plays no part: every checkpoint file is overwritten with zeros before each node event (a read of one
would fail its checksum), and storage ends with the checkpoints of steps 4, 8, 12 and 16 only (none at 5, 10 or
13). The per-step losses and final weights are a single-process reference run's, up to fp32 rounding (world
sizes 2, 4 and 6 sum the same gradients in another order). As in tests/test_elastic_cluster.py, the cluster lives in a process of
its own (``python -m tests.test_elastic_replica host <dir>``) and the driver in another; the loop holds at the
chosen steps until the group changes, so each node event lands at a known step.

"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import torch

from tests.support import elastic

STEPS, CHECKPOINT_EVERY = 16, 4
HOLDS = (5, 10, 13)  # the group that trains these steps holds after them until it is replaced: grow, drain, loss
RTOL = 1e-6

def _loop(config):
    # A group resumed at a hold step trains the next one before it looks.
    elastic.run_loop(Path(config["control"]), STEPS, CHECKPOINT_EVERY, lambda world, step: step in HOLDS)


def _drive(address: str, out: Path) -> None:
    """The subprocess driver: the elastic fit, then what it recorded and whether anything was left behind."""
    import ray

    import zeroray
    from zeroray.train import FailureConfig, RunConfig, ScalingConfig, ZeroTrainer

    ray.init(address=address)
    result = ZeroTrainer(
        _loop,
        train_loop_config={"control": str(out / "control")},
        zero_config=zeroray.ZeroConfig(stage=3, shard_group_size="auto", train_batch_size=elastic.GLOBAL_BATCH,
                                       train_micro_batch_size_per_gpu=elastic.MICRO),
        scaling_config=ScalingConfig(num_workers=(2, 6), elastic_resize_monitor_interval_s=1.0),
        run_config=RunConfig(name="replicagrow", storage_path=str(out / "runs"), progress_bar=False,
                             failure_config=FailureConfig(max_failures=1, collective_timeout_s=30)),
    ).fit()
    elastic.write_result(out, result, "replicagrow")
    ray.shutdown()


def _host(out: Path) -> None:
    """The cluster's own process: a head without CPUs and two two-CPU nodes; the driver in a subprocess; a third
    node added when the group of 4 holds at step 5, drained when the group of 6 holds at step 10, the first node
    removed without warning when the group of 4 holds at step 13 (the checkpoints spoiled before each); then
    teardown. The driver's output goes to out/driver.log."""
    control, runs = out / "control", out / "runs"
    with elastic.host_cluster(_system_config=elastic.HEALTH_CHECK_CONFIG) as cluster:
        first = cluster.add_node(num_cpus=2)
        cluster.add_node(num_cpus=2)
        with elastic.driver("tests.test_elastic_replica", cluster.address, out) as proc:
            elastic.wait_for(control / "held-4-5", proc)
            spoiled = elastic.spoil_checkpoints(runs)
            third = cluster.add_node(num_cpus=2)  # -> grows to 6 at the next check, from the replicas at step 5
            elastic.wait_for(control / "held-6-10", proc)
            spoiled += elastic.spoil_checkpoints(runs)
            subprocess.run([str(Path(sys.executable).parent / "ray"), "drain-node", "--address", cluster.address,
                            "--node-id", third.node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION",
                            "--reason-message", "spot reclaim (test)", "--deadline-remaining-seconds", "60"],
                           check=True, capture_output=True, timeout=60)
            elastic.wait_for(control / "held-4-13", proc)
            spoiled += elastic.spoil_checkpoints(runs)
            cluster.remove_node(first, allow_graceful=False)  # its two ranks lost with it
            (out / "host.json").write_text(json.dumps({"drained": third.node_id, "removed": first.node_id,
                                                       "spoiled": spoiled}))
            proc.wait(timeout=300)


def test_a_grow_a_drain_and_a_lost_node_resume_from_the_replicas_with_no_checkpoint(tmp_path):
    (tmp_path / "control").mkdir()
    host_out = elastic.run_host("tests.test_elastic_replica", tmp_path)
    driver_log = (tmp_path / "driver.log").read_text()
    out = json.loads((tmp_path / "result.json").read_text())
    attempts = out["attempts"]
    summary = elastic.summary(attempts)
    assert summary == [
        (4, 0, 5, "resize_up", 0, None),  # the grow's recovery point at step 5: the live replicas
        (6, 5, 10, "preempted", 0, "replica"),  # the new node's ranks got their shards from the old ranks' memory
        (4, 10, 13, "failure", 0, "replica"),  # the drained node's shards, from the ranks that stay
        (2, 13, STEPS, "finished", 0, "replica"),  # the lost node's shards, from the survivors' live state
    ], attempts
    assert attempts[0]["message"] == ("resized from 4 to 6 workers; recovery point at step 5: the live replicas of "
                                      "the ranks that stay (no checkpoint)"), attempts[0]["message"]
    assert "the live replicas of ranks 0-3 hold every shard; no checkpoint written" in driver_log
    assert attempts[1]["node"] == host_out["drained"], attempts[1]
    assert re.match(r"rank\(s\) \[4, 5\] preempted: replica at step 10 in \d+\.\d\ds \(\d+\.\ds left to the deadline; a "
                    r"replica needs about \d+\.\d\ds \(kept in memory\)", attempts[1]["message"]), attempts[1]["message"]
    assert "preemption: the live replicas of the ranks that stay (no checkpoint) at step 10" in driver_log
    assert attempts[2]["node"] == host_out["removed"], attempts[2]
    assert [a["kept_ranks"] for a in attempts] == [0, 4, 4, 2], attempts  # new processes only on the new node
    # No checkpoint was written for these recovery points, and none read: the spoiled ones would have failed their
    # checksums.
    assert len(host_out["spoiled"]) >= 3 * 2, host_out  # checkpoint 4's files; 4's and 8's; 4's, 8's and 12's
    checkpoints = sorted(int(p.name.split("_")[1]) for p in (tmp_path / "runs" / "replicagrow").glob("checkpoint_*"))
    assert checkpoints == [4, 8, 12, 16], checkpoints
    assert out["left"] == {"actors": [], "pgs": []}

    elastic.assert_matches_reference(out["history"], torch.load(tmp_path / "control" / "final.pt"), STEPS, RTOL)
    elastic.assert_same_samples(out["history"])  # zt.DistributedSampler: through the grow, the kill and the shrink


if __name__ == "__main__":
    if sys.argv[1] == "host":
        _host(Path(sys.argv[2]))
    else:
        _drive(sys.argv[2], Path(sys.argv[3]))
