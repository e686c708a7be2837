"""How long a rank takes to start on a node that was just added: the part of the chaos benchmark's
scale-up latency that comes before the grow itself.

    python benchmarks/node_start_bench.py [--busy 0,3] [--trials 3]

A ``ray.cluster_utils.Cluster`` (a head without CPUs, one-CPU nodes, as ``elastic_bench.py chaos``)
runs ``--busy`` actors spinning at niceness 0 (the training ranks) on nodes of their own. Then, per
trial, a node is added and a real :class:`~zeroray.train.group.rank_actor.RankActor` is created on it, the
way the worker group creates one; the time from ``add_node`` returning to the actor answering
``node_info`` (its process started, torch, zeroray and its imports ahead done) is the start. Three ways
to set the rank's niceness (Ray starts workers at 15) are compared:

- ``start_ahead``: what zeroray does (``zeroray/train/group/priority.py``): the runtime env starts the worker
  at ``START_NICENESS`` (below 0 where the node allows it) and the rank goes back to 0 after its imports;
- ``runtime_env``: ``runtime_env={"env_vars": {"RAY_worker_niceness": "0"}}``, the start at 0 (zeroray
  before); the worker starts through the node's runtime-env agent in both;
- ``cluster_config``: the cluster started with ``_system_config={"worker_niceness": 0}``, no runtime env.

Results: benchmarks/results/node_start.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from zeroray.train.group.priority import RANK_RUNTIME_ENV  # noqa: E402
from zeroray.train.group.rank_actor import RankActor  # noqa: E402

NICE_0 = {"env_vars": {"RAY_worker_niceness": "0"}}  # a running rank's priority


@ray.remote(num_cpus=1)
class Busy:
    """A training rank's CPU demand: spin until told to stop."""

    def __init__(self) -> None:
        self.stop = False

    def spin(self) -> int:
        x = 0
        while not self.stop:
            for _ in range(100_000):
                x += 1
        return os.nice(0)

    def halt(self) -> None:
        self.stop = True


def run(mode: str, busy: int, trials: int) -> list[dict]:
    config = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
              "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3}
    if mode == "cluster_config":
        config["worker_niceness"] = 0
    cluster = Cluster(initialize_head=True, connect=True,
                      head_node_args={"num_cpus": 0, "include_dashboard": False, "_system_config": config})
    try:
        for i in range(busy):
            cluster.add_node(num_cpus=1, resources={f"busy{i}": 1})
        spinners = [Busy.options(resources={f"busy{i}": 1}, max_concurrency=2, runtime_env=NICE_0).remote()
                    for i in range(busy)]
        spins = [s.spin.remote() for s in spinners]
        time.sleep(3)
        out = []
        for k in range(trials):
            t0 = time.perf_counter()
            node = cluster.add_node(num_cpus=1, resources={f"new{k}": 1})
            t1 = time.perf_counter()
            opts = {"num_cpus": 1, "resources": {f"new{k}": 1}, "max_restarts": 0}
            if mode != "cluster_config":
                opts["runtime_env"] = RANK_RUNTIME_ENV if mode == "start_ahead" else NICE_0
            actor = ray.remote(RankActor).options(**opts).remote("node-start", False)
            info = ray.get(actor.node_info.remote(), timeout=300)
            t2 = time.perf_counter()
            out.append({"add_node_s": round(t1 - t0, 2), "start_s": round(t2 - t1, 2),
                        "start_niceness": info["start_niceness"], "niceness": info["niceness"],
                        "pid": info["pid"]})
            print(mode, busy, out[-1], flush=True)
            ray.kill(actor)
            cluster.remove_node(node)
            time.sleep(2)
        for s in spinners:
            s.halt.remote()
        assert ray.get(spins) == [0] * busy
        return out
    finally:
        ray.shutdown()
        cluster.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--busy", default="0,3", help="spinning actors beside the new node, comma-separated")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--modes", default="start_ahead,runtime_env,cluster_config")
    ap.add_argument("--out-dir", type=Path, default=HERE / "results")
    args = ap.parse_args()
    rows = []
    for busy in [int(b) for b in args.busy.split(",")]:
        for mode in args.modes.split(","):
            trials = run(mode, busy, args.trials)
            starts = [t["start_s"] for t in trials]
            rows.append({"mode": mode, "busy": busy, "trials": trials, "start_median_s": statistics.median(starts),
                         "start_min_s": min(starts), "start_max_s": max(starts),
                         "start_niceness": sorted({t["start_niceness"] for t in trials}),
                         "niceness": sorted({n for t in trials for n in t["niceness"]})})
    machine = f"{platform.node()} ({os.cpu_count()} cores)"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "node_start.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    lines = ["# A rank's start on a node just added (benchmarks/node_start_bench.py)", "",
             f"{machine}; a head without CPUs, one-CPU nodes; `--busy` actors spinning at niceness 0 on "
             f"nodes of their own; {args.trials} trials each. Start: `add_node` returned → the new "
             "`RankActor` answered `node_info`.", "",
             "| busy processes | mode | the start's niceness | start, median (min–max) | the rank's threads' niceness after |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['busy']} | {r['mode']} | {r['start_niceness']} | {r['start_median_s']:.2f} s "
                     f"({r['start_min_s']:.2f}–{r['start_max_s']:.2f}) | {r['niceness']} |")
    (args.out_dir / "node_start.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
