"""Recovery after a lost node on the emulated multi-node cluster: from replicas, from buddy snapshots, from storage.

    sudo python benchmarks/replica_recovery_bench.py [--params 20e6] [--runs 1] [--modes replica buddy storage]

Two network namespaces (tests/support/netcluster.py), each a Ray node with 2 ranks; ZeroTrainer runs ZeRO-3
with ``shard_group_size="auto"`` (a shard group per node, the nodes replicas of each other) on a stack of
512-wide linear layers of about ``--params`` parameters (fp32 AdamW), an elastic group of 2-4 ranks, a
checkpoint every 5 steps. Inside step 8 (after its first micro-batch) the other node is killed with
everything in it; the run shrinks to the surviving node and finishes 12 steps. Modes, all else equal:

- ``replica``: ``FailureConfig(replica_recovery=True)`` (the default), no snapshots;
- ``buddy``: ``replica_recovery=False, snapshot_interval=1`` (a snapshot and its copy on the other node every step);
- ``storage``: ``replica_recovery=False``, no snapshots: the newest checkpoint (step 5).

Measured, per run (one clock: the benchmark, the driver and the ranks share the machine): seconds from the
kill to the controller seeing the failure, to the new group training again (its state loaded: the first
step's own time left out), to its first step done, and to step 8 done (the step the node was lost in: for
storage after redoing 6 and 7); the steps lost; where the new group resumed from; the
new group's start phases (teardown of the old group, rendezvous, engine build, loading the state). Needs
root (network namespaces). Results: benchmarks/results/hybrid/recovery.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tests.support import elastic  # noqa: E402
from tests.support.netcluster import NetCluster, start_ray, unavailable  # noqa: E402

WIDTH, GLOBAL_BATCH, MICRO, STEPS, HOLD_STEP, CHECKPOINT_EVERY = 512, 16, 2, 12, 8, 5
FAST_HEALTH_CHECK = {"RAY_health_check_initial_delay_ms": "0", "RAY_health_check_period_ms": "500",
                     "RAY_health_check_timeout_ms": "1000", "RAY_health_check_failure_threshold": "3"}
MODES = {  # FailureConfig fields
    "replica": {"replica_recovery": True, "snapshot_interval": 0},
    "buddy": {"replica_recovery": False, "snapshot_interval": 1},
    "storage": {"replica_recovery": False, "snapshot_interval": 0},
}


def _model(params: float):
    import torch

    torch.manual_seed(0)
    layers = max(1, round(params / (WIDTH * WIDTH + WIDTH)))
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def _loop(config: dict) -> None:
    import torch

    import zeroray.train as zt

    ctx = zt.get_context()
    model = _model(config["params"])
    engine = zt.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    control = Path(config["control"])
    while engine.global_step < STEPS:
        step = engine.global_step
        for micro in range(engine.gradient_accumulation_steps):
            g = torch.Generator().manual_seed(step * 1000 + ctx.sample_indices(step, micro).start)
            x = torch.randn(MICRO, WIDTH, generator=g)
            engine.backward(engine(x).pow(2).mean())
            engine.step()
            if ctx.get_world_size() == 4 and step + 1 == HOLD_STEP:  # inside the step, until the node is gone
                if ctx.get_world_rank() == 0:
                    (control / "held").write_text("")
                while True:
                    zt.report({"held": step})
                    time.sleep(0.05)
        zt.report({"step": step + 1}, checkpoint=(step + 1) % CHECKPOINT_EVERY == 0)
        if ctx.get_world_rank() == 0:
            with open(control / "steps.jsonl", "a") as f:
                f.write(json.dumps({"step": step + 1, "world": ctx.get_world_size(), "time": time.time()}) + "\n")


def _drive(out: Path, mode: str, params: float) -> None:
    """The driver, inside the head's namespace."""
    import ray

    import zeroray
    from zeroray.train import FailureConfig, RunConfig, ScalingConfig, ZeroTrainer

    ray.init()
    while len([n for n in ray.nodes() if n["Alive"]]) < 2:
        time.sleep(0.2)
    result = ZeroTrainer(
        _loop,
        train_loop_config={"control": str(out / "control"), "params": params},
        zero_config=zeroray.ZeroConfig(stage=3, shard_group_size="auto", train_batch_size=GLOBAL_BATCH,
                                       train_micro_batch_size_per_gpu=MICRO),
        scaling_config=ScalingConfig(num_workers=(2, 4), elastic_resize_monitor_interval_s=1.0),
        run_config=RunConfig(name=f"recovery-{mode}", storage_path=str(out / "runs"), progress_bar=False,
                             failure_config=FailureConfig(max_failures=1, collective_timeout_s=60, **MODES[mode])),
    ).fit()
    (out / "result.json").write_text(json.dumps({
        "attempts": [a.as_dict() for a in result.attempt_history],
        "error": None if result.error is None else str(result.error),
    }, default=str))
    ray.shutdown()


def _one(mode: str, params: float, scratch: Path) -> dict:
    out = scratch / mode
    (out / "control").mkdir(parents=True)
    with NetCluster(2) as net:
        cluster = start_ray(net, num_cpus=2, object_store_mb=200, env=FAST_HEALTH_CHECK)
        killed_at = elastic.drive_and_kill(cluster, [sys.executable, str(Path(__file__).resolve()), "drive", str(out),
                                                     mode, str(params)], out / "driver.log", out / "control" / "held",
                                           timeout_s=600)
    result = json.loads((out / "result.json").read_text())
    if result["error"]:
        raise RuntimeError(f"{mode}: {result['error']}")
    lost, resumed = result["attempts"]
    steps = [json.loads(line) for line in (out / "control" / "steps.jsonl").read_text().splitlines()]
    after = [s for s in steps if s["world"] == 2]
    return {
        "mode": mode, "steps_lost": lost["steps_lost"], "recovered_from": resumed["recovered_from"],
        "resumed_at": resumed["start_step"],
        "noticed_s": lost["ended_at"] - killed_at,
        "training_again_s": after[0]["time"] - killed_at - resumed["phases"]["first_step"],
        "first_step_s": after[0]["time"] - killed_at,
        "back_at_lost_step_s": next(s["time"] for s in after if s["step"] == HOLD_STEP) - killed_at,
        "step_s": statistics.median(b["time"] - a["time"] for a, b in zip(after, after[1:])),
        "phases": resumed["phases"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=20e6)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--out", default=str(HERE / "results" / "hybrid" / "recovery"))
    args = ap.parse_args()
    why = unavailable()
    if why:
        sys.exit(f"no emulated cluster here: {why}")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for mode in args.modes:
                runs.append(_one(mode, args.params, Path(tmp, f"{i}")))
                print(json.dumps(runs[-1]), flush=True)
    params = sum(p.numel() for p in _model(args.params).parameters())
    load = os.getloadavg()
    out = {"machine": f"{platform.node()} ({os.cpu_count()} cores, load {load[0]:.1f} at the end)", "params": params,
           "state_bytes_per_rank": params * 12 // 2, "runs": runs}  # fp32 weight + Adam's 2 states, over k=2
    Path(args.out + ".json").write_text(json.dumps(out, indent=1))
    lines = [
        "# Recovery after a lost node (benchmarks/replica_recovery_bench.py)", "",
        f"{out['machine']}; 2 emulated nodes x 2 ranks (network namespaces, unshaped links), ZeRO-3 with "
        f"`shard_group_size=\"auto\"` (k=2), {params / 1e6:.0f}M parameters (fp32 AdamW: "
        f"{out['state_bytes_per_rank'] / 1e6:.0f} MB of shard state per rank), an elastic group of 2-4, a checkpoint "
        f"every {CHECKPOINT_EVERY} steps. One node is killed inside step {HOLD_STEP}; the run shrinks to the other "
        "node. Seconds from the kill; a step of the shrunk group takes "
        f"{statistics.median(r['step_s'] for r in runs):.1f} s here (median).", "",
        "| recovery | resumed from | steps lost | failure noticed | training again | first step done | step "
        f"{HOLD_STEP} done | teardown | rendezvous | build | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        p = r["phases"]
        lines.append(
            f"| {r['mode']} | {r['recovered_from']} @ {r['resumed_at']} | {r['steps_lost']} | {r['noticed_s']:.2f} | "
            f"{r['training_again_s']:.2f} | {r['first_step_s']:.2f} | {r['back_at_lost_step_s']:.2f} | {p.get('teardown', 0):.2f} | "
            f"{p.get('rendezvous', 0):.2f} | {p.get('build', 0):.2f} | {p.get('load', 0):.2f} |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "drive":
        _drive(Path(sys.argv[2]), sys.argv[3], float(sys.argv[4]))
    else:
        main()
