"""What the tests of runs that lose or gain nodes share: a small regression trained on a fixed global batch,
one optimizer step over this rank's samples of it (``sample_indices``, so any world size sees the same samples
in the same steps), the single-process reference such a run must match, and the test process's side of a run
(spoiling checkpoints so that a read of one fails, waiting for a control file, what Ray still holds)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

GLOBAL_BATCH, MICRO = 24, 2
REPO_ROOT = Path(__file__).resolve().parent.parent.parent
# Ray's node health check, tightened (host_cluster's _system_config): a node lost without warning is declared dead
# after about 3 x 500 ms.
HEALTH_CHECK_CONFIG = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                       "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3}


def data(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps * GLOBAL_BATCH, 8, generator=g)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def optimizer(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=1e-2)


def train_step(engine: Any, ctx: Any, x: torch.Tensor, y: torch.Tensor,
               after_micro: Callable[[int], None] | None = None, batches: Iterator[Any] | None = None) -> float:
    """One optimizer step (``engine.global_step``) over this rank's micro-batches of the global batch; the
    global batch's mean loss (all-reduced). ``after_micro(micro)`` runs after each micro-batch's step.
    ``batches``: the micro-batches' sample indices (a DataLoader over a ``zt.DistributedSampler``), else
    ``ctx.sample_indices``."""
    import torch.distributed as dist

    step, total = engine.global_step, torch.zeros(())
    for micro in range(engine.gradient_accumulation_steps):
        idx = [int(i) for i in next(batches)] if batches is not None else list(ctx.sample_indices(step, micro))
        loss = ((engine(x[idx]) - y[idx]) ** 2).mean()
        engine.backward(loss)
        engine.step()
        total += loss.detach() * len(idx)
        if after_micro is not None:
            after_micro(micro)
    dist.all_reduce(total)
    return total.item() / GLOBAL_BATCH


def run_loop(control: Path, steps: int, checkpoint_every: int, holds: Callable[[int, int], bool]) -> None:
    """The elastic tests' loop: train ``steps`` steps on the samples a ``zt.DistributedSampler`` (in order, one
    epoch) hands out, a checkpoint every ``checkpoint_every``; each report says the step's global batch as the
    ranks took it (``samples``, ranks in order). Where ``holds(world, step)``, rank 0 writes
    ``held-<world>-<step>`` into ``control`` and the group keeps reporting until a recovery point (a grow's, a
    drain's) stops the loop or a lost node fails it; at the end rank 0 saves the full weights as ``final.pt``."""
    import torch.distributed as dist

    import zeroray.train as zt

    ctx = zt.get_context()
    x, y = data(steps)
    sampler = zt.DistributedSampler(list(range(len(x))), shuffle=False)  # made before zt.prepare: it resumes it
    m = model()
    engine = zt.prepare(m, optimizer(m))
    batches = iter(torch.utils.data.DataLoader(list(range(len(x))), batch_size=MICRO, sampler=sampler))
    while engine.global_step < steps:
        step, taken = engine.global_step, []
        loss = train_step(engine, ctx, x, y, batches=_recorded(batches, taken))
        everyone: list[Any] = [None] * ctx.get_world_size()
        dist.all_gather_object(everyone, taken)
        zt.report({"loss": loss, "step": step + 1, "world": ctx.get_world_size(), "samples": sum(everyone, [])},
                  checkpoint=(step + 1) % checkpoint_every == 0)
        if holds(ctx.get_world_size(), engine.global_step):
            if ctx.get_world_rank() == 0:
                (control / f"held-{ctx.get_world_size()}-{engine.global_step}").write_text("")
            while True:
                zt.report({"held": engine.global_step})
                time.sleep(0.05)
    state = engine.full_state_dict()
    if ctx.get_world_rank() == 0:
        torch.save(state, control / "final.pt")


def write_result(out: Path, result: Any, run: str) -> None:
    """A subprocess driver's record for the test process: ``out/result.json`` with the attempts, the metrics
    history and what Ray still holds of ``run``."""
    (out / "result.json").write_text(json.dumps({
        "attempts": [a.as_dict() for a in result.attempt_history],
        "history": result.metrics_history,
        "left": left_behind(run),
    }, default=str))


def _recorded(batches: Iterator[Any], into: list[int]) -> Iterator[Any]:
    """``batches``, each one's indices appended to ``into`` as it is taken."""
    for batch in batches:
        into.extend(int(i) for i in batch)
        yield batch


def assert_same_samples(history: list[dict[str, Any]]) -> None:
    """Every step's global batch, in every report of it (the steps redone after a failure too), is the one a
    fixed-size run takes: step s (1-based) is samples ``[(s-1)B, sB)``, whatever the world size."""
    records = [h for h in history if "samples" in h]
    assert records
    for h in records:
        s = h["step"] - 1
        assert h["samples"] == list(range(s * GLOBAL_BATCH, (s + 1) * GLOBAL_BATCH)), (h["step"], h["world"], h["samples"])


@contextlib.contextmanager
def driver(module: str, address: str, out: Path, *args: str) -> Iterator[subprocess.Popen]:
    """A host's driver subprocess, ``python -m <module> drive <address> <out> *args``, its output in
    ``out/driver.log``; killed on the way out if it still runs."""
    with open(out / "driver.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", module, "drive", address, str(out), *args], cwd=REPO_ROOT,
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def run_host(module: str, out: Path, *args: str, done: str = "result.json", timeout_s: float = 600.0) -> dict[str, Any]:
    """Run ``python -m <module> host <out> *args``, the test's cluster in a process of its own, and assert it ended
    well with ``out/<done>`` written (else say what the host and the driver printed); returns its ``host.json``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    host = subprocess.run([sys.executable, "-m", module, "host", str(out), *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    log = out / "driver.log"
    driver_log = log.read_text() if log.exists() else ""
    assert host.returncode == 0 and (out / done).exists(), (
        f"host exited {host.returncode}:\n{host.stdout[-3000:]}{host.stderr[-3000:]}\ndriver:\n{driver_log[-6000:]}")
    return json.loads((out / "host.json").read_text())


def summary(attempts: list[dict[str, Any]]) -> list[tuple]:
    """Each attempt as (world size, start step, last step, end, steps lost, recovered from)."""
    return [(a["world_size"], a["start_step"], a["last_step"], a["end"], a["steps_lost"], a["recovered_from"])
            for a in attempts]


def reference(steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The run without failures or resizes: one process, the whole global batch per step (what DDP at any
    size computes)."""
    m = model()
    opt = optimizer(m)
    x, y = data(steps)
    losses = []
    for step in range(steps):
        sl = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        loss = ((m(x[sl]) - y[sl]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in m.named_parameters()}, losses


def assert_matches_reference(history: list[dict[str, Any]], final: dict[str, torch.Tensor], steps: int,
                             rtol: float) -> None:
    """The last loss recorded for each step (a step redone after a failure counts once) and the final weights
    against :func:`reference`, up to ``rtol`` (other world sizes sum the same gradients in another order)."""
    losses = {e["step"]: e["loss"] for e in history if "loss" in e}
    ref_params, ref_losses = reference(steps)
    assert sorted(losses) == list(range(1, steps + 1))
    torch.testing.assert_close(torch.tensor([losses[s] for s in range(1, steps + 1)]), torch.tensor(ref_losses),
                               rtol=rtol, atol=0)
    flat = torch.cat([final[k].flatten() for k in ref_params])
    ref = torch.cat([v.flatten() for v in ref_params.values()])
    rel = ((flat - ref).norm() / ref.norm()).item()
    assert rel <= rtol, f"global relative error {rel:.2e} > {rtol}"


def spoil_checkpoints(runs: Path) -> list[str]:
    """Overwrite every file of every run's checkpoints but its manifest with zeros (same sizes, so a listing
    still finds them valid; reading any byte range fails its checksum). Returns the spoiled files."""
    spoiled = []
    for f in sorted(runs.glob("*/checkpoint_*/*")):
        if f.name != "manifest.json":
            f.write_bytes(bytes(f.stat().st_size))
            spoiled.append(str(f))
    return spoiled


def wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 240.0) -> None:
    """Until the loop writes ``path``; fails early if the driver ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the driver exited ({proc.returncode}) before {path.name}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {path.name} after {timeout_s:.0f}s")
        time.sleep(0.1)


def left_behind(run: str, timeout_s: float = 30.0) -> dict[str, list[str]]:
    """In a driver after ``fit()``: the run's named actors and placement groups Ray still holds (waits up to
    ``timeout_s`` for them to go)."""
    import ray
    from ray.util.placement_group import placement_group_table

    deadline = time.monotonic() + timeout_s
    while True:
        actors = [a for a in ray.util.list_named_actors(all_namespaces=True) if f"zeroray:{run}:" in str(a)]
        pgs = [p for p in placement_group_table().values()
               if p["name"].startswith(f"zeroray:{run}") and p["state"] != "REMOVED"]
        if (not actors and not pgs) or time.monotonic() > deadline:
            return {"actors": [str(a) for a in actors], "pgs": [p["name"] for p in pgs]}
        time.sleep(0.2)


@contextlib.contextmanager
def host_cluster(**head_args: Any) -> Iterator[Any]:
    """In the test's host process: a ``ray.cluster_utils.Cluster`` whose head has no CPUs (plus ``head_args``),
    not connected and not written as this machine's Ray address, so no other ``ray.init()`` joins it; torn down
    after, every node removed at once. A start that missed Ray's fixed 30 s raylet window on a swamped machine
    is tried again, twice."""
    import ray._private.utils
    from ray.cluster_utils import Cluster

    ray._private.utils.write_ray_address = lambda *a, **k: None
    for attempt in range(3):
        try:
            cluster = Cluster(initialize_head=True, connect=False,
                              head_node_args={"num_cpus": 0, "include_dashboard": False, **head_args})
            break
        except Exception as e:
            if "timed out during startup" not in str(e) or attempt == 2:
                raise
    try:
        yield cluster
    finally:
        for node in list(cluster.worker_nodes):
            cluster.remove_node(node, allow_graceful=False)
        cluster.remove_node(cluster.head_node, allow_graceful=False)


def drive_and_kill(cluster: Any, argv: list[str], log: Path, held: Path, timeout_s: float,
                   before_kill: Callable[[], None] | None = None) -> float:
    """On an emulated cluster (tests/support/netcluster.py ``RayCluster``): run the driver ``argv`` inside the head's
    namespace (its output to ``log``); once the loop writes ``held``, run ``before_kill`` and kill the other node
    with everything in it; wait for the driver to end. Returns when the node was killed (``time.time()``)."""
    net, (head, other) = cluster.net, cluster.nodes
    with open(log, "w") as out:
        driver = net.popen(head, argv, env={**cluster.env, "RAY_ADDRESS": cluster.address}, stdout=out,
                           stderr=subprocess.STDOUT)
        try:
            wait_for(held, driver, timeout_s=timeout_s)
            if before_kill is not None:
                before_kill()
            killed_at = time.time()
            net.kill(other)
            driver.wait(timeout=timeout_s)
        finally:
            if driver.poll() is None:
                driver.kill()
                driver.wait()
    return killed_at
