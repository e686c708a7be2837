"""Elastic runs under faults: detection latency, and a chaos schedule on a simulated multi-node cluster.

    python benchmarks/elastic_bench.py detect [--workers 2] [--kills 20] [--hangs 3] [--heartbeat-timeout 30]
    python benchmarks/elastic_bench.py chaos [--minutes 10] [--kill-every 60] [--down-for 30] [--interval 1]
                                             [--snapshot-interval 1]

**detect**: how soon the driver notices a SIGKILLed rank, and a SIGSTOPped (hung) one.

A ZeroTrainer run (stage 2, a small model, a step every ~20 ms, a checkpoint every 20 steps) on an
embedded local Ray cluster; a thread in this driver waits for each new group to train for 1-2 s (a
random phase), then sends SIGKILL (``--kills`` times), then SIGSTOP (``--hangs`` times) to rank 1's
process. For each fault:

- detection: from the signal to the moment the controller ended the attempt (``Attempt.ended_at``:
  the failure was seen and its root cause collected);
- restart: from the signal to the next group running again (``Attempt.started_at`` of the next one:
  placement, actors, rendezvous; then the loop loads the checkpoint);
- steps lost: ``Attempt.steps_lost``.

A hang is noticed by the driver's watchdog (``FailureConfig.worker_heartbeat_timeout_s``, default 30 s)
or by the peers' collective timeout, whichever comes first. Results: benchmarks/results/elastic.{json,md}.

**chaos**: an elastic run (``num_workers=(1, 4)``, ZeRO-2, global batch 24, a checkpoint every 10 steps,
async) on a ``ray.cluster_utils.Cluster`` of 4 one-CPU nodes (and a head without CPUs, Ray's health
check at 500 ms x 3); every ``--kill-every`` s a node holding a rank is removed without warning and
a new one added ``--down-for`` s later. Reported:

- goodput: the run's final step ÷ the steps a fault-free run would have made over the same time at the
  sizes available (each size's fault-free rate: the median step time of that size's steady reports);
- recovery: from a node's removal to the first report of the next group, p50 / p95;
- steps lost per failure, and where each recovery came from: the survivors' in-memory snapshots
  (``--snapshot-interval``, ``FailureConfig.snapshot_interval``; default 1) or, with 0 (the storage-only,
  Ray-Train-like baseline) or when a shard's two copies are gone, the newest committed checkpoint;
- scale-up latency: from a node's addition to the first report at the larger size;
- where a restart's and a grow's time goes: the median of each start-up phase (``Attempt.phases``:
  teardown, placement, actors, rendezvous, build, load, first step) and how many ranks each attempt kept
  from the one before (``Attempt.kept_ranks``: no new process, imports or placement for them).

Results: benchmarks/results/elastic_chaos.{json,md,png} (``--out`` to name them otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from zeroray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, ZeroTrainer  # noqa: E402


def _loop(config):
    import torch
    import torch.distributed as dist

    import zeroray.train as zt

    ctx = zt.get_context()
    model = torch.nn.Linear(16, 1)
    engine = zt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    control = Path(config["control"])
    (control / f"rank{ctx.get_world_rank()}-{os.getpid()}").write_text("")
    x = torch.ones(4, 16)
    while True:
        stop = torch.tensor([float((control / "stop").exists())])
        dist.broadcast(stop, 0)  # rank 0 decides, so every rank reports the same number of times
        if stop.item():
            return
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        zt.report({"loss": loss.item()}, checkpoint=engine.global_step % 20 == 0)
        time.sleep(0.02)


def _faults(control: Path, signals: list[signal.Signals], hits: list[tuple[str, float]], errors: list[str]) -> None:
    """Hit rank 1 of each new group once; then tell the last group to stop."""
    seen: set[str] = set()

    def next_group(timeout_s: float = 300.0) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            new = [p for p in control.glob("rank1-*") if p.name not in seen]
            if new:
                seen.add(new[0].name)
                return int(new[0].name.split("-")[1])
            time.sleep(0.05)
        raise TimeoutError("no new group")

    try:
        for sig in signals:
            pid = next_group()
            time.sleep(1.0 + random.random())  # training by now; a random phase within its steps
            hits.append((sig.name, time.time()))
            os.kill(pid, sig)
        next_group()
    except Exception as e:  # the run's own error is what matters; say this one too
        errors.append(f"{type(e).__name__}: {e}")
    finally:
        (control / "stop").write_text("")


def _stats(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=float)
    return {"n": int(a.size), "p50": float(np.percentile(a, 50)), "p95": float(np.percentile(a, 95)),
            "max": float(a.max())} if a.size else {"n": 0}


def detect(args: argparse.Namespace) -> None:
    import ray

    ray.init(num_cpus=max(args.workers, 2) + 1, include_dashboard=False)
    signals = [signal.SIGKILL] * args.kills + [signal.SIGSTOP] * args.hangs
    hits: list[tuple[str, float]] = []
    errors: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        control = Path(tmp) / "control"
        control.mkdir()
        thread = threading.Thread(target=_faults, args=(control, signals, hits, errors), daemon=True)
        thread.start()
        result = ZeroTrainer(
            _loop, train_loop_config={"control": str(control)}, zero_config={"zero_optimization": {"stage": 2}},
            scaling_config=ScalingConfig(num_workers=args.workers),
            run_config=RunConfig(name="elastic-bench", storage_path=str(Path(tmp) / "runs"), progress_bar=False,
                                 failure_config=FailureConfig(max_failures=-1,
                                                              worker_heartbeat_timeout_s=args.heartbeat_timeout)),
        ).fit()
        thread.join(timeout=60)
    ray.shutdown()
    attempts = result.attempt_history
    rows = []
    for i, (sig, t) in enumerate(hits):
        ended, following = attempts[i], attempts[i + 1]
        rows.append({"signal": sig, "detect_s": ended.ended_at - t, "restart_s": following.started_at - t,
                     "steps_lost": ended.steps_lost, "end": ended.end, "rank": ended.rank})
    out = {
        "machine": f"{platform.node()} ({os.cpu_count()} cores)",
        "workers": args.workers, "heartbeat_timeout_s": args.heartbeat_timeout, "errors": errors,
        "sigkill": {k: _stats([r[k] for r in rows if r["signal"] == "SIGKILL"]) for k in ("detect_s", "restart_s")},
        "sigstop": {k: _stats([r[k] for r in rows if r["signal"] == "SIGSTOP"]) for k in ("detect_s", "restart_s")},
        "steps_lost": _stats([r["steps_lost"] for r in rows]),
        "rows": rows,
    }
    Path(args.out + ".json").write_text(json.dumps(out, indent=1))
    lines = [
        "# Failure detection (benchmarks/elastic_bench.py)", "",
        f"{out['machine']}; world {args.workers}, gloo, embedded Ray; a step every ~20 ms, a checkpoint every 20; "
        f"FailureConfig.worker_heartbeat_timeout_s={args.heartbeat_timeout:g}. Times from the signal (seconds).", "",
        "| fault | n | detection p50 | detection p95 | detection max | group running again p50 | p95 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("sigkill", "sigstop"):
        d, r = out[name]["detect_s"], out[name]["restart_s"]
        if d["n"]:
            lines.append(f"| {name.upper()} rank 1 | {d['n']} | {d['p50']:.2f} | {d['p95']:.2f} | {d['max']:.2f} | "
                         f"{r['p50']:.2f} | {r['p95']:.2f} |")
    lost = out["steps_lost"]
    if lost["n"]:
        lines += ["", f"Steps lost per failure (checkpoint every 20 steps): p50 {lost['p50']:.0f}, max {lost['max']:.0f}."]
    if errors:
        lines += ["", "Errors: " + "; ".join(errors)]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


# ---------------------------------------------------------------------------------------------------- chaos
GLOBAL_BATCH, MICRO = 24, 2


def _chaos_loop(config):
    import torch
    import torch.distributed as dist

    import zeroray.train as zt

    ctx = zt.get_context()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    engine = zt.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    control = Path(config["control"])
    g = torch.Generator().manual_seed(1)
    data = torch.randn(4096, 256, generator=g)
    while True:
        stop = torch.tensor([float((control / "stop").exists())])
        dist.broadcast(stop, 0)  # rank 0 decides, so every rank reports the same number of times
        if stop.item():
            return
        step = engine.global_step
        for micro in range(engine.gradient_accumulation_steps):
            idx = [i % len(data) for i in ctx.sample_indices(step, micro)]
            x = data[idx]
            loss = (engine(x) - x).pow(2).mean()
            engine.backward(loss)
            engine.step()
        zt.report({"loss": loss.item(), "t": time.time(), "world": ctx.get_world_size()},
                  checkpoint=engine.global_step % 10 == 0)


def _chaos_schedule(cluster, control: Path, args: argparse.Namespace, events: list[tuple[str, float, int]]) -> None:
    """Every kill_every s remove a node holding a rank (without warning); add one back down_for s later."""
    from ray._private import state

    start = time.monotonic()
    end = start + args.minutes * 60
    k = 1
    try:
        while start + k * args.kill_every + args.down_for <= end:
            time.sleep(max(start + k * args.kill_every - time.monotonic(), 0))
            busy = {a["Address"]["NodeID"] for a in state.actors(actor_state_name="ALIVE").values()
                    if "zeroray:" in (a.get("Name") or "")}
            victims = [n for n in cluster.worker_nodes if n.node_id in busy] or list(cluster.worker_nodes)
            victim = random.choice(victims)
            cluster.remove_node(victim, allow_graceful=False)
            events.append(("kill", time.time(), len(cluster.worker_nodes)))
            time.sleep(max(start + k * args.kill_every + args.down_for - time.monotonic(), 0))
            cluster.add_node(num_cpus=1)
            events.append(("add", time.time(), len(cluster.worker_nodes)))
            k += 1
        time.sleep(max(end - time.monotonic(), 0))
    finally:
        (control / "stop").write_text("")


def chaos(args: argparse.Namespace) -> None:
    import ray
    from ray.cluster_utils import Cluster

    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")])
    health = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500, "health_check_timeout_ms": 1000,
              "health_check_failure_threshold": 3}
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 0, "include_dashboard": False, "_system_config": health})
    for _ in range(args.nodes):
        cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)
    events: list[tuple[str, float, int]] = []
    outcome: dict[str, object] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            control = Path(tmp) / "control"
            control.mkdir()
            trainer = ZeroTrainer(
                _chaos_loop, train_loop_config={"control": str(control)},
                zero_config={"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": MICRO,
                             "zero_optimization": {"stage": 2}},
                scaling_config=ScalingConfig(num_workers=(1, args.nodes),
                                             elastic_resize_monitor_interval_s=args.interval),
                run_config=RunConfig(name="chaos", storage_path=str(Path(tmp) / "runs"), progress_bar=False,
                                     checkpoint_config=CheckpointConfig(async_save=True, num_to_keep=2),
                                     failure_config=FailureConfig(max_failures=-1,
                                                                  snapshot_interval=args.snapshot_interval)),
            )

            def fit() -> None:
                try:
                    outcome["result"] = trainer.fit()
                except BaseException as e:  # reported below
                    outcome["error"] = e
                    (control / "stop").write_text("")

            runner = threading.Thread(target=fit, daemon=True)  # nodes are added from the main thread (signals)
            t_start = time.time()
            runner.start()
            _chaos_schedule(cluster, control, args, events)
            runner.join()
            t_end = time.time()
    finally:
        ray.shutdown()
        for node in list(cluster.worker_nodes):
            cluster.remove_node(node, allow_graceful=False)
        cluster.remove_node(cluster.head_node, allow_graceful=False)
    if "error" in outcome:
        raise outcome["error"]
    result = outcome["result"]
    _chaos_report(args, result, events, t_start, t_end)


def _chaos_report(args, result, events, t_start: float, t_end: float) -> None:
    rows = [h for h in result.metrics_history if "t" in h]
    by_world: dict[int, list[float]] = {}
    seen_first: set[int] = set()
    for h in rows:  # steady reports: not the first of each attempt (its step time spans the restart)
        if h["_attempt"] in seen_first and h["_step_time_s"]:
            by_world.setdefault(h["world"], []).append(h["_step_time_s"])
        seen_first.add(h["_attempt"])
    rate = {w: 1.0 / float(np.median(v)) for w, v in by_world.items()}
    # Nodes available over time -> the fault-free steps over the same time.
    timeline = [(t_start, args.nodes)] + [(t, n) for _, t, n in events] + [(t_end, None)]
    ideal = 0.0
    for (t0, n), (t1, _) in zip(timeline, timeline[1:]):
        size = min(n, args.nodes)
        r = rate.get(size) or (rate[max(rate)] * size / max(rate) if rate else 0.0)
        ideal += (t1 - t0) * r
    useful = max(h["_global_step"] for h in rows) if rows else 0
    recovery, scale_up = [], []
    for kind, t, _ in events:
        after = [h for h in rows if h["t"] > t]
        if not after:
            continue
        before = [h for h in rows if h["t"] <= t]
        if kind == "kill":
            attempt = before[-1]["_attempt"] if before else 0
            nxt = next((h for h in after if h["_attempt"] != attempt), None)
            if nxt:
                recovery.append(nxt["t"] - t)
        else:
            world = before[-1]["world"] if before else 0
            nxt = next((h for h in after if h["world"] > world), None)
            if nxt:
                scale_up.append(nxt["t"] - t)
    failures = [a for a in result.attempt_history if a.end == "failure"]
    recovered = [nxt.recovered_from for a, nxt in zip(result.attempt_history, result.attempt_history[1:])
                 if a.end == "failure"]
    snapshot_bytes = max((r["memory"].get("snapshots", 0) for h in rows for r in h["_ranks"]), default=0)
    phases = _phase_table(result.attempt_history)
    out = {
        "machine": f"{platform.node()} ({os.cpu_count()} cores)",
        "minutes": args.minutes, "kill_every_s": args.kill_every, "down_for_s": args.down_for,
        "resize_check_interval_s": args.interval, "nodes": args.nodes, "snapshot_interval": args.snapshot_interval,
        "recovered_from": {k: recovered.count(k) for k in sorted(set(recovered), key=str)},
        "snapshot_host_bytes_max": snapshot_bytes,
        "useful_steps": useful, "fault_free_steps": ideal, "goodput": useful / ideal if ideal else None,
        "fault_free_steps_per_s": rate, "recovery_s": _stats(recovery), "scale_up_s": _stats(scale_up),
        "steps_lost": _stats([a.steps_lost for a in failures if a.steps_lost is not None]),
        "phases": phases, "attempts": [a.as_dict() for a in result.attempt_history], "events": events,
        "series": [(h["t"] - t_start, h["world"], h["_global_step"]) for h in rows], "t_start": t_start,
    }
    Path(args.out + ".json").write_text(json.dumps(out, indent=1, default=str))
    rec, up, lost = out["recovery_s"], out["scale_up_s"], out["steps_lost"]
    lines = [
        "# Chaos: an elastic run losing and regaining nodes (benchmarks/elastic_bench.py chaos)", "",
        f"{out['machine']}; {args.nodes} simulated one-CPU nodes (ray.cluster_utils.Cluster, health check 500 ms x 3), "
        f"num_workers=(1, {args.nodes}), ZeRO-2, global batch {GLOBAL_BATCH}, async checkpoint every 10 steps; "
        f"{args.minutes:g} min, a node holding a rank removed every {args.kill_every:g} s and a new one added "
        f"{args.down_for:g} s later; resize check every {args.interval:g} s. "
        + (f"In-memory snapshots every {args.snapshot_interval} step(s) (`FailureConfig.snapshot_interval`), copied "
           f"to a buddy rank on another node; recoveries: {out['recovered_from']} (memory: from the survivors' "
           f"snapshots, storage: the newest committed checkpoint); snapshots held in host memory, most on one rank: "
           f"{snapshot_bytes / 1e6:.1f} MB." if args.snapshot_interval else
           "No in-memory snapshots (storage-only, the Ray-Train-like baseline): recovery reads the newest committed "
           "checkpoint."), "",
        "| metric | value | goal |", "|---|---|---|",
        f"| goodput (useful steps ÷ fault-free steps at the sizes available) | "
        f"{out['goodput'] * 100:.0f}% ({useful} of {ideal:.0f}) | ≥ 90% |" if out["goodput"] else "| goodput | n/a | |",
    ]
    if rec["n"]:
        lines.append(f"| recovery, node removed → first report after ({rec['n']}) | p50 {rec['p50']:.1f} s, "
                     f"p95 {rec['p95']:.1f} s | p95 ≤ 10 s |")
    if lost["n"]:
        lines.append(f"| steps lost per failure ({lost['n']}) | p50 {lost['p50']:.0f}, max {lost['max']:.0f} | ≤ 1 with "
                     f"in-memory snapshots |")
    if up["n"]:
        lines.append(f"| scale-up, node added → first report at the larger size ({up['n']}) | p50 {up['p50']:.1f} s, "
                     f"p95 {up['p95']:.1f} s | ≤ 5 s |")
    lines += ["", "Fault-free steps/s by world size (steady reports of this run): "
              + ", ".join(f"{w}: {r:.2f}" for w, r in sorted(rate.items()))]
    if phases:
        names = [p for p in PHASES if any(p in row for row in phases.values())]
        lines += ["", "Where a new attempt's start goes (median seconds by phase, `Attempt.phases`; kept: ranks whose "
                  "actor came from the attempt before; prestart: a grow's new ranks started while the old group "
                  "trained):", "",
                  "| attempt after | n | kept / world | " + " | ".join(names) + " | sum (training stopped) |",
                  "|---|---|---|" + "---|" * len(names) + "---|"]
        for why, row in phases.items():
            lines.append(f"| {why} | {row['n']} | {row['kept']:.1f} / {row['world']:.1f} | "
                         + " | ".join(f"{row[p]:.2f}" if p in row else "" for p in names)
                         + f" | {sum(row.get(p, 0.0) for p in names if p != 'prestart'):.2f} |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    chaos_plot(out, Path(args.out + ".png"))
    print("\n".join(lines))


def chaos_plot(result: dict, png: Path, window_s: float = 5.0) -> None:
    """World size and throughput over the run (``series``: seconds, world, global step of each report), with
    each node removal and addition marked: where the time of a recovery and of a grow goes, at a glance."""
    from matplotlib.figure import Figure

    series = np.array(result["series"], dtype=float)
    t, world, step = series[:, 0], series[:, 1], series[:, 2]
    # Steps/s over the last window_s seconds at each report: 0 while no group trains.
    grid = np.arange(0.0, t[-1] + 1.0, 1.0)
    reached = np.maximum.accumulate(np.interp(grid, t, step, left=0.0))
    rate = (reached - np.interp(grid - window_s, grid, reached, left=0.0)) / window_s
    t0 = result["t_start"]
    fig = Figure(figsize=(9.0, 4.5), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.plot(grid, rate, color="tab:blue", label=f"steps/s (last {window_s:g} s)")
    ax.set(xlabel="seconds since the start", ylabel="optimizer steps/s", ylim=(0, None))
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.step(t, world, where="post", color="tab:orange", label="world size (reports)")
    ax2.set(ylabel="ranks", ylim=(0, max(world.max(), result["nodes"]) + 0.5))
    for kind, when, _ in result["events"]:
        ax.axvline(when - t0, color="tab:red" if kind == "kill" else "tab:green", alpha=0.6, lw=1)
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="lower left")
    goodput = result.get("goodput")
    ax.set_title(f"chaos: a node removed every {result['kill_every_s']:g} s (red), re-added {result['down_for_s']:g} s "
                 f"later (green)" + (f"; goodput {goodput * 100:.0f}%" if goodput else ""))
    fig.savefig(png)


PHASES = ("prestart", "teardown", "placement", "actors", "rendezvous", "build", "load", "first_step")


def _phase_table(attempts: list) -> dict[str, dict[str, float]]:
    """Median start-up phases of the attempts that followed a failure, and of those that followed a grow."""
    groups: dict[str, list] = {}
    for before, after in zip(attempts, attempts[1:]):
        if before.end in ("failure", "resize_up") and getattr(after, "phases", None):
            groups.setdefault(before.end, []).append(after)
    table = {}
    for why, group in groups.items():
        row: dict[str, float] = {"n": len(group), "kept": float(np.median([a.kept_ranks for a in group])),
                                 "world": float(np.median([a.world_size for a in group]))}
        for p in PHASES:
            values = [a.phases[p] for a in group if p in a.phases]
            if values:
                row[p] = float(np.median(values))
        table[why] = row
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("detect")
    d.add_argument("--workers", type=int, default=2)
    d.add_argument("--kills", type=int, default=20)
    d.add_argument("--hangs", type=int, default=3)
    d.add_argument("--heartbeat-timeout", type=float, default=30.0)
    d.add_argument("--out", default=str(HERE / "results" / "elastic"))
    c = sub.add_parser("chaos")
    c.add_argument("--minutes", type=float, default=10.0)
    c.add_argument("--kill-every", type=float, default=60.0)
    c.add_argument("--down-for", type=float, default=30.0)
    c.add_argument("--interval", type=float, default=1.0)
    c.add_argument("--nodes", type=int, default=4)
    c.add_argument("--snapshot-interval", type=int, default=1, help="FailureConfig.snapshot_interval (0: storage only)")
    c.add_argument("--out", default=str(HERE / "results" / "elastic_chaos"))
    p = sub.add_parser("plot", help="the PNG of a chaos result (chaos writes it too)")
    p.add_argument("json", help="a chaos result, e.g. benchmarks/results/elastic_chaos.json")
    args = ap.parse_args()
    if args.cmd == "detect":
        detect(args)
    elif args.cmd == "chaos":
        chaos(args)
    else:
        chaos_plot(json.loads(Path(args.json).read_text()), Path(args.json).with_suffix(".png"))


if __name__ == "__main__":
    main()
