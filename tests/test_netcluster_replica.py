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
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support.netcluster import NetCluster, start_ray, unavailable

GLOBAL_BATCH, MICRO, STEPS, CHECKPOINT_AT = 24, 2, 8, 2
HOLD_STEP = 5  # the group of 4 holds inside this step (1-based), after its first micro-batch
RTOL = 1e-6  # another world size sums the same gradients in another order
FAST_HEALTH_CHECK = {"RAY_health_check_initial_delay_ms": "0", "RAY_health_check_period_ms": "500",
                     "RAY_health_check_timeout_ms": "1000", "RAY_health_check_failure_threshold": "3"}


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * GLOBAL_BATCH, 8, generator=g)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _loop(config: dict) -> None:
    import torch.distributed as dist

    import zeroray.train as zt

    ctx = zt.get_context()
    model = _model()
    engine = zt.prepare(model, _optimizer(model))
    x, y = _data()
    control = Path(config["control"])
    while engine.global_step < STEPS:
        step = engine.global_step
        total = torch.zeros(())
        for micro in range(engine.gradient_accumulation_steps):
            idx = list(ctx.sample_indices(step, micro))
            loss = ((engine(x[idx]) - y[idx]) ** 2).mean()
            engine.backward(loss)
            engine.step()
            total += loss.detach() * len(idx)
            if ctx.get_world_size() == 4 and step + 1 == HOLD_STEP:  # inside the step: until the node is gone
                if ctx.get_world_rank() == 0:
                    (control / "held").write_text(json.dumps({"micro_step": engine.micro_step}))
                while True:
                    zt.report({"held": step})
                    time.sleep(0.05)
        dist.all_reduce(total)
        zt.report({"loss": total.item() / GLOBAL_BATCH, "step": step + 1, "world": ctx.get_world_size()},
                  checkpoint=step + 1 == CHECKPOINT_AT)
    state = engine.full_state_dict()
    if ctx.get_world_rank() == 0:
        torch.save(state, control / "final.pt")


def _drive(out: Path) -> None:
    """The driver, inside the head's namespace: the elastic fit, what it recorded, and what is left behind."""
    import ray
    from ray.util.placement_group import placement_group_table

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
        zero_config=zeroray.ZeroConfig(stage=3, shard_group_size="auto", train_batch_size=GLOBAL_BATCH,
                                       train_micro_batch_size_per_gpu=MICRO),
        scaling_config=ScalingConfig(num_workers=(2, 4), elastic_resize_monitor_interval_s=1.0),
        run_config=RunConfig(name="replica", storage_path=str(out / "runs"), progress_bar=False,
                             failure_config=FailureConfig(max_failures=1, collective_timeout_s=30)),
    ).fit()
    deadline = time.monotonic() + 30
    while True:
        actors = [a for a in ray.util.list_named_actors(all_namespaces=True) if "zeroray:replica:" in str(a)]
        pgs = [p for p in placement_group_table().values()
               if p["name"].startswith("zeroray:replica") and p["state"] != "REMOVED"]
        if (not actors and not pgs) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    (out / "result.json").write_text(json.dumps({
        "attempts": [a.as_dict() for a in result.attempt_history],
        "history": result.metrics_history,
        "error": None if result.error is None else str(result.error),
        "left": {"actors": [str(a) for a in actors], "pgs": [p["name"] for p in pgs]},
    }, default=str))
    ray.shutdown()


def _reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    """The run without a failure: one process, the whole global batch per step (what DDP at any size computes)."""
    model = _model()
    opt = _optimizer(model)
    x, y = _data()
    losses = []
    for step in range(STEPS):
        sl = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        loss = ((model(x[sl]) - y[sl]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.named_parameters()}, losses


def _spoil_checkpoints(runs: Path) -> list[str]:
    """Every checkpoint file but the manifests, overwritten with zeros of the same size (a read fails)."""
    spoiled = []
    for f in sorted(runs.glob("replica/checkpoint_*/*")):
        if f.name != "manifest.json":
            f.write_bytes(bytes(f.stat().st_size))
            spoiled.append(str(f))
    return spoiled


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the driver exited ({proc.returncode}) before {path.name}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {path.name} after {timeout_s:.0f}s")
        time.sleep(0.1)


@pytest.fixture(autouse=True)
def _needs_namespaces() -> None:
    why = unavailable()
    if why:
        pytest.skip(f"no emulated cluster here: {why}")


@pytest.mark.timeout(600)
def test_a_lost_node_is_recovered_from_its_replicas(tmp_path: Path) -> None:
    control = tmp_path / "control"
    control.mkdir()
    with NetCluster(2) as net:
        head, other = net.nodes
        cluster = start_ray(net, num_cpus=2, env=FAST_HEALTH_CHECK)
        with open(tmp_path / "driver.log", "w") as log:
            driver = net.popen(head, [sys.executable, "-m", "tests.test_netcluster_replica", "drive", str(tmp_path)],
                               env={**cluster.env, "RAY_ADDRESS": cluster.address}, stdout=log,
                               stderr=subprocess.STDOUT)
            try:
                _wait_for(control / "held", driver, timeout_s=300)
                spoiled = _spoil_checkpoints(tmp_path / "runs")
                net.kill(other)
                driver.wait(timeout=300)
            finally:
                if driver.poll() is None:
                    driver.kill()
                    driver.wait()
    log_text = (tmp_path / "driver.log").read_text(errors="replace")
    assert (tmp_path / "result.json").exists(), log_text[-6000:]
    out = json.loads((tmp_path / "result.json").read_text())
    assert out["error"] is None, log_text[-6000:]
    assert spoiled, "the step-2 checkpoint was not written"
    assert json.loads((control / "held").read_text())["micro_step"] % 3 == 1  # inside step 5 (3 micro-batches)
    attempts = out["attempts"]
    summary = [(a["world_size"], a["start_step"], a["last_step"], a["end"], a["steps_lost"], a["recovered_from"])
               for a in attempts]
    assert summary == [
        (4, 0, HOLD_STEP - 1, "failure", 0, None),  # the node died inside step 5: step 4 was complete
        (2, HOLD_STEP - 1, STEPS, "finished", 0, "replica"),  # step 4 from the surviving replicas' memory
    ], attempts
    assert out["left"] == {"actors": [], "pgs": []}

    losses = {e["step"]: e["loss"] for e in out["history"] if "loss" in e}
    ref_params, ref_losses = _reference()
    assert sorted(losses) == list(range(1, STEPS + 1))
    torch.testing.assert_close(torch.tensor([losses[s] for s in range(1, STEPS + 1)]), torch.tensor(ref_losses),
                               rtol=RTOL, atol=0)
    final = torch.load(control / "final.pt")
    flat = torch.cat([final[k].flatten() for k in ref_params])
    ref = torch.cat([v.flatten() for v in ref_params.values()])
    assert ((flat - ref).norm() / ref.norm()).item() <= RTOL


if __name__ == "__main__":
    _drive(Path(sys.argv[2]))
