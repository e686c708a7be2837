"""Chaos on the emulated multi-node cluster: SIGKILLs, link cuts and preemption notices against an elastic run.

    sudo python benchmarks/chaos_bench.py [--minutes 10] [--seed 0] [--label TEXT]
    sudo python benchmarks/chaos_bench.py --quick            # development: 2 minutes, an event every 18-24 s

The cluster (tests/support/netcluster.py): a head namespace without CPUs (GCS and the driver) and ``--nodes``
worker namespaces of one CPU each, joined by a bridge, each a Ray node with its own address. ZeroTrainer runs
an elastic ZeRO-2 run (a 0.6M-parameter MLP), ``num_workers=(1, nodes)`` (one rank a node), global batch 24 kept across resizes,
in-memory snapshots every ``--snapshot-interval`` steps (``FailureConfig.snapshot_interval``, buddies on other
nodes), an async checkpoint to storage every ``--checkpoint-every`` steps (all kept), ``max_failures=-1``.

One event every 30-60 s (seeded random spacing; the kinds in a seeded random order, each kind once per block
of four), none in the last 30 s:

- ``kill-rank``: SIGKILL of one rank's process (its node stays up);
- ``kill-node``: SIGKILL of every process in a node holding a rank (Ray's daemons too: a machine that loses
  power); a fresh Ray node starts in it 20-40 s later;
- ``cut``: the node's link set down (its switch port: the cable is cut, the node and its ranks keep running)
  for 15-30 s, then up; once its link is back the harness waits up to ``--settle`` s for what ran in it to
  go, counts the rank processes still alive there (``stale_ranks_after_heal``), kills what is left and starts
  a fresh Ray node in it;
- ``preempt``: a spot preemption notice through Ray's drain API (``GcsClient.drain_node``, what
  ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N`` and autoscaler v2
  call) with a ``--grace`` s deadline; at the deadline the node is removed (every process killed, as the
  cloud reclaims the machine) and a fresh node joins 20-40 s later.

A node-level event needs two worker nodes up (none cut, down or draining) and waits for them. The harness
never looks inside zeroray: it targets processes by the pid files the training loop writes and by namespace,
and measures from what the run reports (``metrics.jsonl``: each step's ``t0``/``t``, loss, world size, a digest
of the weights) and ``run.json``'s attempt history. Then an undisturbed run of the same length on a fresh
cluster (skip with ``--no-baseline``).

Reported (``--out``: benchmarks/results/chaos/chaos.{json,md}):

- goodput: the useful steps' time (each step that survives in the final trajectory, its own compute time
  ``t - t0``) ÷ wall time (first step to the stop), and steps/s against the undisturbed run;
- per event, by kind: steps lost (the steps a group reported and the next group redid), recovery time (from
  the event to the first step of the group that followed it, or to the next step where the group survived),
  the longest stall without a step in that window, and where the new group's state came from;
- checkpoints: ``zeroray ls --verify`` on the run directory, then every committed checkpoint loaded into a
  fresh world-1 engine: it must load, every tensor (weights, Adam's states) must be finite, the manifest must
  name the model's parameters with their shapes and its step, the directory must hold only the manifest's
  rank files, and the weights must be bit for bit a state the run reported for that step (the loop reports
  a digest of its weights at every step): a torn or mixed checkpoint cannot match. Redone steps' losses
  must agree across attempts (same samples in the same steps).

Needs root (network namespaces). The machine's load (1-minute load average) is sampled through the run and
reported with the results.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tests.support.netcluster import (  # noqa: E402
    NetCluster,
    Node,
    RayCluster,
    join_ray,
    python_env,
    start_ray,
    unavailable,
)

KINDS = ("kill-rank", "kill-node", "cut", "preempt")
DIM, WIDTH, SAMPLES, GLOBAL_BATCH, MICRO = 64, 512, 4096, 24, 2
FAST_HEALTH_CHECK = {"RAY_health_check_initial_delay_ms": "0", "RAY_health_check_period_ms": "500",
                     "RAY_health_check_timeout_ms": "1000", "RAY_health_check_failure_threshold": "3"}
RUN = "chaos"

DRAIN = """
import json, sys, time
import ray
from ray.core.generated import autoscaler_pb2, gcs_pb2
address, ip, grace = sys.argv[1], sys.argv[2], float(sys.argv[3])
client = ray._raylet.GcsClient(address=address)
alive = [nid for nid, n in client.get_all_node_info().items()
         if n.state == gcs_pb2.GcsNodeInfo.ALIVE and n.node_manager_address == ip]
if len(alive) != 1:
    sys.exit(f"{len(alive)} alive Ray nodes at {ip}")
deadline_ms = int((time.time() + grace) * 1000)
accepted, why = client.drain_node(alive[0].hex(), autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                  "chaos_bench: spot preemption", deadline_ms)
print(json.dumps({"node_id": alive[0].hex(), "accepted": accepted, "message": why, "deadline": deadline_ms / 1000}))
"""


# ------------------------------------------------------------------------------------------ the training run
def _model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH),
                               torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(),
                               torch.nn.Linear(WIDTH, DIM))


def _optimizer(model: Any) -> Any:
    import torch

    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def _zero_config() -> Any:
    import zeroray

    return zeroray.ZeroConfig(stage=2, train_batch_size=GLOBAL_BATCH, train_micro_batch_size_per_gpu=MICRO)


def weights_digest(named: Iterable[tuple[str, Any]]) -> str:
    """A digest of the weights' bytes, in the model's parameter order: equal iff every bit is."""
    h = hashlib.blake2b(digest_size=16)
    for name, p in named:
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _loop(config: dict) -> None:
    """Train until the harness writes ``stop`` (rank 0 decides, so every rank reports as often). Each step
    reports its compute start and end (``t0``, ``t``), the global loss, the world size and (rank 0, stage 2:
    every rank holds the whole weights) a digest of the weights after it."""
    import torch
    import torch.distributed as dist

    import zeroray.train as zt

    ctx = zt.get_context()
    model = _model()
    engine = zt.prepare(model, _optimizer(model))
    control, rank = Path(config["control"]), ctx.get_world_rank()
    _atomic_write(control / "pids" / str(os.getpid()),
                  json.dumps({"rank": rank, "world": ctx.get_world_size(), "t": time.time()}))
    data = torch.randn(SAMPLES, DIM, generator=torch.Generator().manual_seed(1))
    target = torch.sin(data.roll(1, dims=1) * 2.0)
    while True:
        stop = torch.tensor([float((control / "stop").exists())])
        dist.broadcast(stop, 0)
        if stop.item():
            return
        step, t0, total = engine.global_step, time.time(), torch.zeros(())
        for micro in range(engine.gradient_accumulation_steps):
            idx = [i % SAMPLES for i in ctx.sample_indices(step, micro)]
            loss = ((engine(data[idx]) - target[idx]) ** 2).mean()
            engine.backward(loss)
            engine.step()
            total += loss.detach() * len(idx)
        dist.all_reduce(total)
        metrics = {"loss": total.item() / GLOBAL_BATCH, "t0": t0, "t": time.time(), "world": ctx.get_world_size()}
        if rank == 0:
            metrics["weights"] = weights_digest(engine.module.named_parameters())
        zt.report(metrics, checkpoint=engine.global_step % config["checkpoint_every"] == 0)
        if rank == 0 and not (control / "first_step").exists():
            _atomic_write(control / "first_step", str(metrics["t"]))


def _drive(out: Path, cfg: dict) -> None:
    """The driver, inside the head's namespace: the elastic fit, and how it ended."""
    import ray

    from zeroray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, ZeroTrainer

    ray.init()
    deadline = time.monotonic() + 120
    while len([n for n in ray.nodes() if n["Alive"]]) < cfg["nodes"] + 1:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the cluster has not {cfg['nodes'] + 1} nodes: {ray.nodes()}")
        time.sleep(0.2)
    error = None
    try:
        result = ZeroTrainer(
            _loop,
            train_loop_config={"control": str(out / "control"), "checkpoint_every": cfg["checkpoint_every"]},
            zero_config=_zero_config(),
            scaling_config=ScalingConfig(num_workers=(1, cfg["nodes"]),
                                         elastic_resize_monitor_interval_s=cfg["resize_interval"]),
            run_config=RunConfig(
                name=RUN, storage_path=str(out / "runs"), progress_bar=False,
                checkpoint_config=CheckpointConfig(async_save=True),
                failure_config=FailureConfig(max_failures=-1, snapshot_interval=cfg["snapshot_interval"],
                                             collective_timeout_s=cfg["collective_timeout"])),
        ).fit()
        error = None if result.error is None else f"{type(result.error).__name__}: {result.error}"
    except Exception as e:  # reported by the harness
        error = f"{type(e).__name__}: {e}"
    _atomic_write(out / "result.json", json.dumps({"error": error}))
    ray.shutdown()


# ------------------------------------------------------------------------------------------------- the harness
def head_script(cluster: RayCluster, code: str, argv: list[str]) -> dict[str, Any]:
    """Run Python ``code`` inside the head's namespace (where the GCS is reachable); its last line, as JSON."""
    done = cluster.net.run(cluster.nodes[0], [sys.executable, "-c", code, *argv], env=cluster.env, timeout_s=60)
    return json.loads(done.stdout.strip().splitlines()[-1])


class Injector:
    """Runs the events of one chaos run on the cluster, at their planned offsets from the first step.

    Everything is timed on this machine's one clock (``time.time()``, which the ranks' reports use too).
    Deferred actions (a heal, the reclaim at a preemption's deadline, a node coming back) sit in a heap and
    run between events."""

    def __init__(self, cluster: RayCluster, workers: list[Node], control: Path, args: argparse.Namespace,
                 rng: random.Random) -> None:
        self.cluster, self.net, self.workers, self.control, self.args, self.rng = \
            cluster, cluster.net, workers, control, args, rng
        self.state = {n.index: "up" for n in workers}  # up, down, cut, draining
        self.events: list[dict[str, Any]] = []
        self.joins: list[dict[str, Any]] = []
        self.load: list[tuple[float, float]] = []
        self._actions: list[tuple[float, int, Callable[[], None]]] = []
        self._threads: list[threading.Thread] = []
        self._seq = 0

    # -- what the cluster holds now
    def _rank_pids(self) -> set[int]:
        pids = set()
        for f in (self.control / "pids").glob("[0-9]*"):
            pid = int(f.name)
            try:
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    pids.add(pid)
            except (FileNotFoundError, IndexError):
                pass
        return pids

    def _ranks_by_node(self) -> dict[int, list[int]]:
        """The live rank processes of each worker node that is up."""
        pids = self._rank_pids()
        return {n.index: sorted(pids & set(self.net.pids(n))) for n in self.workers if self.state[n.index] == "up"}

    def _up(self) -> list[Node]:
        return [n for n in self.workers if self.state[n.index] == "up"]

    def _at(self, when: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._actions, (when, self._seq, fn))

    def _run_due(self) -> None:
        while self._actions and self._actions[0][0] <= time.time():
            heapq.heappop(self._actions)[2]()

    def _wait(self, ready: Callable[[], Any], timeout_s: float) -> Any:
        """Until ``ready()`` is truthy (deferred actions run meanwhile); its last value."""
        deadline = time.time() + timeout_s
        while not (value := ready()) and time.time() < deadline:
            self._run_due()
            time.sleep(0.2)
        return value

    # -- events
    def _pick_node(self) -> Node | None:
        """A worker node holding a rank (any up node if none does for 20 s), once two are up."""
        if not self._wait(lambda: len(self._up()) >= 2, 120):
            return None
        busy = self._wait(lambda: [i for i, pids in self._ranks_by_node().items() if pids], 20)
        candidates = [n for n in self._up() if n.index in (busy or [])] or self._up()
        return self.rng.choice(candidates)

    def inject(self, kind: str) -> dict[str, Any]:
        event: dict[str, Any] = {"kind": kind, "planned": time.time()}
        if kind == "kill-rank":
            ranks = self._wait(lambda: [(i, p) for i, pids in self._ranks_by_node().items() for p in pids], 60)
            if not ranks:
                return {**event, "skipped": "no live rank on a node that is up"}
            index, pid = self.rng.choice(sorted(ranks))
            rank = json.loads((self.control / "pids" / str(pid)).read_text())["rank"]
            event.update(node=index, pid=pid, rank=rank, t=time.time())
            os.kill(pid, signal.SIGKILL)
            return event
        node = self._pick_node()
        if node is None:
            return {**event, "skipped": "fewer than two worker nodes up for 120 s"}
        event["node"] = node.index
        if kind == "kill-node":
            event["t"] = time.time()
            self.net.kill(node)
            self.state[node.index] = "down"
            self._rejoin_later(node, event)
        elif kind == "cut":
            event["t"] = time.time()
            self.net.partition(node)
            self.state[node.index] = "cut"
            event["heal_at"] = event["t"] + self.rng.uniform(*self.args.cut_for)
            self._at(event["heal_at"], lambda: self._heal(node, event))
        else:  # preempt
            self.state[node.index] = "draining"
            done = head_script(self.cluster, DRAIN, [self.cluster.address, node.ip, str(self.args.grace)])
            event.update(t=done["deadline"] - self.args.grace, deadline=done["deadline"], accepted=done["accepted"],
                         message=done["message"])
            self._at(done["deadline"], lambda: self._reclaim(node, event))
        return event

    def _heal(self, node: Node, event: dict[str, Any]) -> None:
        self.net.heal(node)
        event["healed"] = time.time()
        self._background(lambda: self._settle_and_rejoin(node, event))

    def _settle_and_rejoin(self, node: Node, event: dict[str, Any]) -> None:
        """The stale ranks: are they still alive on the node ``--settle`` s after its link is back?"""
        deadline = event["healed"] + self.args.settle
        while (stale := self._rank_pids() & set(self.net.pids(node))) and time.time() < deadline:
            time.sleep(0.2)
        event["stale_ranks_after_heal"] = len(stale)
        event["stale_ranks_gone_s"] = None if stale else time.time() - event["healed"]
        self._rejoin(node, event)

    def _background(self, fn: Callable[[], None]) -> None:
        """Slow work (``ray start`` takes seconds, more on a loaded machine) off the event schedule."""
        thread = threading.Thread(target=fn, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _reclaim(self, node: Node, event: dict[str, Any]) -> None:
        event["reclaimed"] = time.time()
        self.net.kill(node)
        self.state[node.index] = "down"
        self._rejoin_later(node, event)

    def _rejoin_later(self, node: Node, event: dict[str, Any]) -> None:
        self._at(time.time() + self.rng.uniform(*self.args.down_for),
                 lambda: self._background(lambda: self._rejoin(node, event)))

    def _rejoin(self, node: Node, event: dict[str, Any]) -> None:
        """A fresh Ray node in the namespace (what is left there is killed first; ``join_ray`` tries a start
        that missed Ray's startup window again)."""
        self.net.kill(node)
        t = time.time()
        join_ray(self.cluster, node, num_cpus=1, object_store_mb=self.args.object_store_mb)
        self.state[node.index] = "up"
        self.joins.append({"node": node.index, "t": t, "joined": time.time(), "after": event["kind"]})

    def run(self, plan: list[tuple[float, str]], t_begin: float, t_end: float, driver: subprocess.Popen) -> None:
        """The events of ``plan`` (offset s, kind) from ``t_begin``; then, at ``t_end``, heal what is cut and
        tell the run to stop."""
        todo = list(plan)
        next_load = 0.0
        try:
            while time.time() < t_end and driver.poll() is None:
                now = time.time()
                if now >= next_load:
                    self.load.append((now - t_begin, os.getloadavg()[0]))
                    next_load = now + 5.0
                self._run_due()
                if todo and now >= t_begin + todo[0][0]:
                    offset, kind = todo.pop(0)
                    event = self.inject(kind)
                    event["offset"] = offset
                    event["late_s"] = event.get("t", now) - (t_begin + offset)
                    self.events.append(event)
                    print(f"[chaos] {now - t_begin:6.1f}s {kind}: {json.dumps(event)}", flush=True)
                time.sleep(0.1)
        finally:
            for n in self.workers:
                if self.state[n.index] == "cut":
                    self.net.heal(n)
            _atomic_write(self.control / "stop", str(time.time()))

    def join(self) -> None:
        """Wait for the nodes still starting (the cluster's teardown must not race a ``ray start``)."""
        for thread in self._threads:
            thread.join()


def plan_events(rng: random.Random, seconds: float, spacing: tuple[float, float], kinds: tuple[str, ...],
                quiet_end: float) -> list[tuple[float, str]]:
    """(offset s, kind) of each event: seeded spacing, kinds in shuffled blocks of each kind once."""
    plan, t, block = [], 0.0, []
    while True:
        t += rng.uniform(*spacing)
        if t > seconds - quiet_end:
            return plan
        if not block:
            block = list(kinds)
            rng.shuffle(block)
        plan.append((round(t, 1), block.pop()))


def one_run(args: argparse.Namespace, scratch: Path, plan: list[tuple[float, str]], seed: int) -> dict[str, Any]:
    """A fresh cluster, the driver, the events of ``plan``, the driver's end; what the harness saw."""
    out = scratch
    (out / "control" / "pids").mkdir(parents=True)
    cfg = {"nodes": args.nodes, "checkpoint_every": args.checkpoint_every, "snapshot_interval": args.snapshot_interval,
           "collective_timeout": args.collective_timeout, "resize_interval": args.resize_interval}
    with NetCluster(args.nodes + 1) as net:
        head, workers = net.nodes[0], net.nodes[1:]
        cluster = start_ray(net, [head], num_cpus=0, object_store_mb=args.object_store_mb, env=FAST_HEALTH_CHECK)
        for node in workers:
            join_ray(cluster, node, num_cpus=1, object_store_mb=args.object_store_mb)
        injector = Injector(cluster, list(workers), out / "control", args, random.Random(seed))
        with open(out / "driver.log", "w") as log:
            driver = net.popen(head, [sys.executable, str(Path(__file__).resolve()), "drive", str(out), json.dumps(cfg)],
                               env={**cluster.env, "RAY_ADDRESS": cluster.address}, stdout=log,
                               stderr=subprocess.STDOUT)
            first = out / "control" / "first_step"
            deadline = time.time() + 300
            while not first.exists():
                if driver.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"no first step (driver {driver.poll()}): "
                                       + (out / "driver.log").read_text(errors="replace")[-4000:])
                time.sleep(0.1)
            t_begin = float(first.read_text())
            t_end = t_begin + args.minutes * 60
            injector.run(plan, t_begin, t_end, driver)
            t_stop = time.time()
            try:
                driver.wait(timeout=args.finish_timeout)
            except subprocess.TimeoutExpired:
                driver.kill()
                driver.wait()
            injector.join()
    result = json.loads((out / "result.json").read_text()) if (out / "result.json").exists() else {
        "error": f"the driver ended ({driver.returncode}) without a result: "
                 + (out / "driver.log").read_text(errors="replace")[-4000:]}
    return {"t_begin": t_begin, "t_end": t_stop, "events": injector.events, "joins": injector.joins,
            "load": injector.load, "error": result["error"], "run_dir": str(out / "runs" / RUN)}


# ------------------------------------------------------------------------------------------------ measurement
def _stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"n": len(values), "median": statistics.median(values), "mean": statistics.fmean(values),
            "max": max(values), "total": sum(values)}


def read_run(run_dir: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The run's step reports (in time order) and run.json's attempt history, as the run directory holds them."""
    from zeroray.monitoring.run_history import HistoryReader

    history = HistoryReader(run_dir).read()
    entries = sorted((e for e in history.entries if "t" in e), key=lambda e: e["t"])
    return entries, list(history.info.get("attempt_history") or [])


def measure(run: dict[str, Any], entries: list[dict[str, Any]], attempts: list[dict[str, Any]]) -> dict[str, Any]:
    """Goodput, and per event its steps lost, recovery time and stall (see the module docstring)."""
    t_begin, t_end = run["t_begin"], run["t_end"]
    window = [e for e in entries if t_begin <= e["t"] <= t_end]
    first, final = window[0]["_global_step"], max(e["_global_step"] for e in window)
    survivor: dict[int, dict[str, Any]] = {}
    for e in window:  # the last version of each step is the one the final trajectory kept
        survivor[e["_global_step"]] = e
    useful_s = sum(survivor[s]["t"] - survivor[s]["t0"] for s in range(first + 1, final + 1) if s in survivor)
    wall = t_end - t_begin
    out: dict[str, Any] = {
        "wall_s": wall, "first_step": first, "final_step": final, "useful_steps": final - first,
        "steps_computed": len(window) - 1, "steps_per_s": (final - first) / wall, "useful_time_s": useful_s,
        "goodput": useful_s / wall, "worlds": sorted({e["world"] for e in window}),
    }
    by_index = {a["index"]: a for a in attempts}
    events = [e for e in run["events"] if "t" in e]
    boundaries = []
    for prev, nxt in zip(entries, entries[1:]):
        if prev["_attempt"] == nxt["_attempt"]:
            continue
        ended = [by_index[i] for i in range(prev["_attempt"], nxt["_attempt"]) if i in by_index]
        ends = [a.get("end") for a in ended]
        grow = all(end == "resize_up" for end in ends) if ends else nxt["world"] > prev["world"]
        when = next((a["ended_at"] for a in ended if a.get("end") != "resize_up" and a.get("ended_at")), nxt["t"])
        cause = max((e for e in events if e["t"] <= when), key=lambda e: e["t"], default=None)
        boundaries.append({
            "t_last": prev["t"], "t_first": nxt["t"], "from_step": prev["_global_step"],
            "resumed_at": nxt["_global_step"] - 1, "lost": max(prev["_global_step"] - (nxt["_global_step"] - 1), 0),
            "world": [prev["world"], nxt["world"]], "ends": ends, "grow": grow,
            "recovered_from": by_index.get(nxt["_attempt"], {}).get("recovered_from"),
            "event": None if grow or cause is None else events.index(cause),
        })
    out["boundaries"] = boundaries
    for i, ev in enumerate(events):
        mine = [b for b in boundaries if b["event"] == i]
        if mine:
            done = mine[-1]["t_first"]
        else:
            done = next((e["t"] for e in entries if e["t"] > ev["t"]), None)
        ev["restarts"] = len(mine)
        ev["steps_lost"] = sum(b["lost"] for b in mine)
        ev["recovered_from"] = [b["recovered_from"] for b in mine]
        ev["recovery_s"] = None if done is None else done - ev["t"]
        times = [ev["t"]] + [e["t"] for e in entries if ev["t"] < e["t"] <= (done or t_end)] + ([] if done else [t_end])
        ev["stall_s"] = max(b - a for a, b in zip(times, times[1:]))  # without a recovery: at least this
        prev_done = events[i - 1].get("recovered_at") if i else None
        ev["overlapped"] = bool(prev_done and prev_done > ev["t"])
        ev["recovered_at"] = done
    out["by_kind"] = {}
    for kind in KINDS:
        evs = [e for e in events if e["kind"] == kind]
        if evs:
            out["by_kind"][kind] = {
                "events": len(evs), "restarts": sum(e["restarts"] for e in evs),
                "steps_lost": _stats([e["steps_lost"] for e in evs]),
                "recovery_s": _stats([e["recovery_s"] for e in evs if e["recovery_s"] is not None]),
                "stall_s": _stats([e["stall_s"] for e in evs]),
                "not_recovered": sum(e["recovery_s"] is None for e in evs),
                "recovered_from": sorted({str(r) for e in evs for r in e["recovered_from"]}),
            }
    grows = [b for b in boundaries if b["grow"]]
    joins = run["joins"]
    out["grows"] = {"n": len(grows), "after_join_s": _stats([
        b["t_first"] - max(j["joined"] for j in joins if j["joined"] <= b["t_first"])
        for b in grows if any(j["joined"] <= b["t_first"] for j in joins)])}
    losses: dict[int, list[float]] = {}
    for e in entries:
        losses.setdefault(e["_global_step"], []).append(e["loss"])
    redone = {s: v for s, v in losses.items() if len(v) > 1}
    out["redone_steps"] = len(redone)
    out["redone_loss_max_rel_diff"] = max((abs(max(v) - min(v)) / abs(min(v)) for v in redone.values()), default=0.0)
    return out


# ----------------------------------------------------------------------------------------------- verification
_LS_ROW = re.compile(r"^(\d+)\s+(yes|no|broken)\s")


def verify(run_dir: str, entries: list[dict[str, Any]]) -> dict[str, Any]:
    """``zeroray ls --verify`` of the run, then every committed checkpoint loaded and checked (module docstring)."""
    import torch
    import torch.distributed as dist

    import zeroray
    from zeroray.checkpoint import list_checkpoints, load

    ls = subprocess.run([sys.executable, "-m", "zeroray.cli", "ls", "--verify", run_dir], capture_output=True,
                        text=True, env=python_env(), timeout=600)
    rows = [line for line in ls.stdout.splitlines() if _LS_ROW.match(line)]
    out: dict[str, Any] = {
        "ls_exit": ls.returncode, "ls_rows": len(rows), "ls_ok": sum(" ok " in r for r in rows),
        "ls_bad": [r for r in rows if "BAD" in r or " broken " in r] + ([ls.stderr.strip()] if ls.stderr.strip() else []),
        "ls_uncommitted": sum(_LS_ROW.match(r).group(2) == "no" for r in rows),
    }
    reported: dict[int, set[str]] = {}
    for e in entries:
        if "weights" in e:
            reported.setdefault(e["_global_step"], set()).add(e["weights"])
    names = [(n, list(p.shape)) for n, p in _model().named_parameters()]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    checked, problems = [], []
    try:
        for info in (c for c in list_checkpoints(run_dir) if c.committed):
            row: dict[str, Any] = {"step": info.step, "world": info.world_size}
            try:
                model = _model()
                engine = zeroray.initialize(model, _optimizer(model), _zero_config())
                manifest = load(engine, info.url)
                where = Path(run_dir) / Path(info.url).name
                files = sorted(p.name for p in where.iterdir() if p.name != "manifest.json")
                stray = sorted(set(files) - {f.path for f in manifest.files})
                slots = [(s.name, list(s.shape)) for g in manifest.groups for s in g.slots]
                finite = all(bool(torch.isfinite(t).all()) for gs in engine.shard_state() for t in gs.tensors.values())
                state = engine.full_state_dict()
                digest = weights_digest((n, state[n]) for n, _ in names)
                row.update(
                    loads=True, finite=finite, step_matches=manifest.meta.get("global_step") == info.step,
                    names_match=sorted(slots) == sorted(names), stray_files=stray,
                    weights=("reported" if digest in reported.get(info.step, ()) else
                             "unreported step" if info.step not in reported else "MISMATCH"))
                engine.close()
            except Exception as e:  # a checkpoint that does not load is what this looks for
                row.update(loads=False, error=f"{type(e).__name__}: {e}")
            bad = (not row["loads"] or not row["finite"] or not row["step_matches"] or not row["names_match"]
                   or row["weights"] == "MISMATCH")
            if bad or row.get("stray_files"):
                problems.append(row)
            row["ok"] = not bad
            checked.append(row)
    finally:
        dist.destroy_process_group()
    out.update(committed=len(checked), loaded_ok=sum(r["ok"] for r in checked),
               matched_reported=sum(r.get("weights") == "reported" for r in checked),
               corrupt_or_mixed=sum(not r["ok"] for r in checked) + len([r for r in out["ls_bad"]]),
               stray=sum(bool(r.get("stray_files")) for r in checked), problems=problems, checkpoints=checked)
    return out


# ------------------------------------------------------------------------------------------------------ report
def _fmt(stats: dict[str, float] | None, key: str = "median", digits: int = 1) -> str:
    return "–" if not stats else f"{stats[key]:.{digits}f}"


def write_report(out: dict[str, Any], path: Path) -> None:
    """The markdown next to the JSON."""
    c, b, a = out["chaos"], out.get("baseline"), out["args"]
    m, v = c["measure"], c["verify"]
    load = [x for _, x in c["load"]]
    lines = [
        f"# Chaos on the emulated cluster (benchmarks/chaos_bench.py) — {out['label']}", "",
        f"{out['machine']}; commit {out['commit']}. {a['nodes']} worker nodes of one CPU (network namespaces, "
        f"unshaped links; Ray health check 500 ms x 3) and a head without CPUs; elastic ZeRO-2, "
        f"num_workers=(1, {a['nodes']}), global batch {GLOBAL_BATCH}, snapshots every {a['snapshot_interval']} "
        f"steps, an async checkpoint every {a['checkpoint_every']} steps, collective timeout "
        f"{a['collective_timeout']:g} s, max_failures=-1. {a['minutes']:g} minutes, seed {a['seed']}, an event "
        f"every {a['spacing'][0]:g}-{a['spacing'][1]:g} s; preemption deadline {a['grace']:g} s, cuts of "
        f"{a['cut_for'][0]:g}-{a['cut_for'][1]:g} s, nodes back {a['down_for'][0]:g}-{a['down_for'][1]:g} s "
        f"after they went. Machine load (1-min load average, sampled every 5 s): median "
        f"{statistics.median(load):.1f}, max {max(load):.1f} over the chaos run"
        + (f", median {statistics.median(x for _, x in b['load']):.1f} over the undisturbed one" if b else "")
        + f", on {os.cpu_count()} cores.", "",
    ]
    if c["error"]:
        lines += [f"**The run failed:** {c['error']}", ""]
    lines += ["| | chaos | undisturbed |", "|---|---|---|"]
    bm = b["measure"] if b else None
    lines += [
        f"| wall time (first step to stop) | {m['wall_s']:.0f} s | " + (f"{bm['wall_s']:.0f} s |" if bm else "– |"),
        f"| useful steps | {m['useful_steps']} (of {m['steps_computed']} computed) | "
        + (f"{bm['useful_steps']} |" if bm else "– |"),
        f"| steps/s | {m['steps_per_s']:.2f} | " + (f"{bm['steps_per_s']:.2f} |" if bm else "– |"),
        f"| goodput (useful steps' time ÷ wall time) | {m['goodput'] * 100:.1f}% | "
        + (f"{bm['goodput'] * 100:.1f}% |" if bm else "– |"),
        f"| world sizes seen | {m['worlds']} | " + (f"{bm['worlds']} |" if bm else "– |"),
    ]
    if bm:
        lines += ["", f"Steps/s against the undisturbed run: **{m['steps_per_s'] / bm['steps_per_s'] * 100:.1f}%**."]
    lines += ["", "By kind (steps lost: the steps a group reported that the next group redid; recovery: from the event "
              "to the first step after it; stall: the longest time without a step in that window; seconds):", "",
              "| kind | events | restarts | steps lost (total / max) | recovery median / max | stall median / max | "
              "no step after it before the stop | recovered from |", "|---|---|---|---|---|---|---|---|"]
    for kind, k in m["by_kind"].items():
        lost = k["steps_lost"]
        lines.append(f"| {kind} | {k['events']} | {k['restarts']} | {lost['total']:.0f} / {lost['max']:.0f} | "
                     f"{_fmt(k['recovery_s'])} / {_fmt(k['recovery_s'], 'max')} | {_fmt(k['stall_s'])} / "
                     f"{_fmt(k['stall_s'], 'max')} | {k['not_recovered']} | {', '.join(k['recovered_from']) or '–'} |")
    g = m["grows"]
    lines += ["", f"Grows back after a node rejoined: {g['n']} (first step at the larger size "
              f"{_fmt(g['after_join_s'])} s after the node joined, median). Redone steps: {m['redone_steps']}, their "
              f"losses agree to {m['redone_loss_max_rel_diff']:.1e} (relative)."]
    cuts = [e for e in c["events"] if e["kind"] == "cut" and "healed" in e]
    if cuts:
        lines += ["", "Link cuts: rank processes still alive on the node after its link came back (after "
                  f"{a['settle']:g} s; then killed by the harness): "
                  + ", ".join(str(e.get("stale_ranks_after_heal")) for e in cuts) + "."]
    lines += ["", "Events:", "", "| # | at (s) | kind | node | steps lost | recovery (s) | stall (s) | from | note |",
              "|---|---|---|---|---|---|---|---|---|"]
    for i, e in enumerate(c["events"]):
        if "t" not in e:
            lines.append(f"| {i} | {e['offset']:.0f} | {e['kind']} | | | | | | skipped: {e['skipped']} |")
            continue
        note = []
        if e.get("rank") is not None:
            note.append(f"rank {e['rank']}")
        if e["kind"] == "preempt":
            note.append(f"notice {'accepted' if e.get('accepted') else 'REFUSED'}")
        if e.get("overlapped"):
            note.append("during the previous recovery")
        if e.get("late_s", 0) > 2:
            note.append(f"{e['late_s']:.0f} s after its planned time")
        if e.get("recovery_s") is None:
            note.append("no step after it before the stop")
        rec = "–" if e.get("recovery_s") is None else f"{e['recovery_s']:.1f}"
        lines.append(f"| {i} | {e['t'] - c['t_begin']:.0f} | {e['kind']} | {e.get('node', '')} | {e['steps_lost']} | "
                     f"{rec} | {e.get('stall_s', 0):.1f} | {', '.join(map(str, e['recovered_from'])) or '–'} | "
                     f"{'; '.join(note)} |")
    lines += ["", "Checkpoints:", "",
              f"- `zeroray ls --verify`: exit {v['ls_exit']}, {v['ls_ok']} committed ok, {len(v['ls_bad'])} bad or "
              f"broken, {v['ls_uncommitted']} uncommitted (saves cut off before their commit; never loaded).",
              f"- loaded: {v['loaded_ok']} of {v['committed']} committed checkpoints load into a world-1 engine with "
              f"finite tensors, the manifest's names, shapes and step; {v['matched_reported']} hold bit for bit the "
              f"weights the run reported for their step (the rest: steps whose report never reached the driver).",
              f"- **corrupt, mixed or torn: {v['corrupt_or_mixed']}**; directories with files the manifest does not "
              f"name: {v['stray']}."]
    for p in v["problems"]:
        lines.append(f"  - step {p['step']}: {json.dumps({k: p[k] for k in p if k != 'step'})}")
    if b:
        bv = b["verify"]
        lines.append(f"- the undisturbed run: `zeroray ls --verify` exit {bv['ls_exit']}, {bv['loaded_ok']} of "
                     f"{bv['committed']} committed checkpoints load and check, {bv['matched_reported']} match the "
                     f"reported weights; corrupt, mixed or torn: {bv['corrupt_or_mixed']}.")
    if b and b["error"]:
        lines.append(f"- the undisturbed run failed: {b['error']}")
    path.write_text("\n".join(lines) + "\n")


def _commit() -> str:
    done = subprocess.run(["git", "-C", str(HERE.parent), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--quick", action="store_true", help="2 minutes, an event every 18-24 s (each kind once), "
                    "last 15 s quiet, shorter cuts and downtimes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nodes", type=int, default=3, help="worker nodes, one rank each")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    ap.add_argument("--spacing", type=float, nargs=2, default=(30.0, 60.0), help="seconds between events")
    ap.add_argument("--grace", type=float, default=20.0, help="a preemption's deadline, seconds after its notice")
    ap.add_argument("--cut-for", type=float, nargs=2, default=(15.0, 30.0), help="seconds a link stays down")
    ap.add_argument("--down-for", type=float, nargs=2, default=(20.0, 40.0),
                    help="seconds until a killed or reclaimed node comes back")
    ap.add_argument("--settle", type=float, default=15.0, help="seconds a healed node's processes get to go")
    ap.add_argument("--snapshot-interval", type=int, default=5)
    ap.add_argument("--checkpoint-every", type=int, default=50)
    ap.add_argument("--collective-timeout", type=float, default=30.0)
    ap.add_argument("--resize-interval", type=float, default=2.0)
    ap.add_argument("--object-store-mb", type=int, default=100)
    ap.add_argument("--finish-timeout", type=float, default=240.0)
    ap.add_argument("--no-baseline", action="store_true", help="skip the undisturbed run")
    ap.add_argument("--label", default="", help="what this run measures, e.g. which branches are merged")
    ap.add_argument("--out", default=str(HERE / "results" / "chaos" / "chaos"))
    ap.add_argument("--keep", help="keep the runs' directories under this folder")
    args = ap.parse_args()
    quiet_end = 30.0
    if args.quick:
        args.minutes, args.spacing, quiet_end = 2.0, (18.0, 24.0), 15.0
        args.cut_for, args.down_for = (10.0, 15.0), (15.0, 20.0)
    if args.nodes < 2:
        sys.exit("--nodes must be >= 2: a node-level event needs another node to go on")
    why = unavailable()
    if why:
        sys.exit(f"no emulated cluster here: {why}")
    rng = random.Random(args.seed)
    plan = plan_events(rng, args.minutes * 60, tuple(args.spacing), tuple(args.kinds), quiet_end)
    print(f"[chaos] plan: {plan}", flush=True)
    scratch = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="chaos-"))
    result: dict[str, Any] = {
        "label": args.label or "unlabelled", "commit": _commit(),
        "machine": f"{platform.node()} ({os.cpu_count()} cores)", "plan": plan,
        "args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()},
    }
    try:
        for name, events in [("chaos", plan)] + ([] if args.no_baseline else [("baseline", [])]):
            run = one_run(args, scratch / name, events, args.seed + 1)
            entries, attempts = read_run(run["run_dir"])
            run["measure"] = measure(run, entries, attempts)
            run["verify"] = verify(run["run_dir"], entries)
            run["attempts"] = attempts
            result[name] = run
            print(f"[chaos] {name}: {json.dumps(run['measure'], default=str)[:2000]}", flush=True)
    finally:
        if not args.keep:
            subprocess.run(["rm", "-rf", str(scratch)], check=False)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(result, indent=1, default=str))
    write_report(result, Path(f"{out}.md"))
    print(Path(f"{out}.md").read_text())


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "drive":
        _drive(Path(sys.argv[2]), json.loads(sys.argv[3]))
    elif len(sys.argv) > 1 and sys.argv[1] == "report":  # the markdown again, from a result's JSON
        write_report(json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[2]).with_suffix(".md"))
    else:
        main()
