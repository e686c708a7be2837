"""ZeroTrainer on a real local Ray cluster: real actors, a real gloo group, real failures.

The loops here use plain torch (DDP) so they test the Ray layer alone; the engine's own run under the
trainer is in test_trainer_engine.py. Every test checks that no zeroray actor, placement group or
actor process is left behind, with Ray's state API.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import ray
import torch
import torch.distributed as dist

import zeroray.train as zt
from tests.support.ray import (
    assert_nothing_left,
    interruptible,
    list_actors,
    list_placement_groups,
    run_config,
    zeroray_actors,
)
from zeroray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError, ZeroTrainer
from zeroray.train.driver.run_dir import StorageError
from zeroray.train.group import priority

# ---------------------------------------------------------------------------------------------- helpers



def _ddp_loop(config):
    """Linear regression with DDP; reports the loss and this rank's view of the context."""
    ctx = zt.get_context()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + ctx.get_world_rank())
    w_true = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    infos = [None] * ctx.get_world_size()
    me = (ctx.get_world_rank(), ctx.get_local_rank(), ctx.get_node_rank(), str(ctx.get_device()),
          ctx.get_experiment_name(), os.getpid(), os.environ["RANK"], dist.get_world_size(),
          priority.threads_niceness())
    dist.all_gather_object(infos, me)
    for _step in range(config["steps"]):
        x = torch.randn(16, 4, generator=g)
        loss = ((ddp(x) - x @ w_true) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        zt.report({"loss": loss.item(), "reporter": ctx.get_world_rank(), "infos": infos})


# ---------------------------------------------------------------------------------------------- runs


@pytest.mark.parametrize("workers", [1, 2, pytest.param(3, marks=pytest.mark.slow)])  # 3 ranks: the elastic tests
def test_trainer_runs_on_n_workers(ray_cluster, tmp_path, workers):
    name = f"run-{workers}w"
    steps = 12
    strategy = "SPREAD" if workers == 2 else "PACK"
    result = ZeroTrainer(
        _ddp_loop,
        train_loop_config={"steps": steps},
        scaling_config=ScalingConfig(num_workers=workers, placement_strategy=strategy),
        run_config=run_config(tmp_path, name),
    ).fit()

    # Every report arrived, in order; rank 0's metrics are the ones kept; each rank's stats travel along.
    assert [h["_report"] for h in result.metrics_history] == list(range(1, steps + 1))
    assert all(h["reporter"] == 0 for h in result.metrics_history)
    assert result.metrics["reporter"] == 0 and result.metrics["loss"] == result.metrics_history[-1]["loss"]
    assert result.metrics_history[-1]["loss"] < 0.5 * result.metrics_history[0]["loss"]
    for h in result.metrics_history:
        assert [r["rank"] for r in h["_ranks"]] == list(range(workers))
        assert all(r["memory"]["process_rss"] > 0 for r in h["_ranks"])
    assert all(r["step_time_s"] > 0 for r in result.metrics_history[-1]["_ranks"])
    df = result.metrics_dataframe
    assert len(df) == steps and {f"rank{r}/step_time_s" for r in range(workers)} <= set(df.columns)
    assert result.checkpoint is None and result.error is None

    # The context each rank saw: a proper group of distinct processes, one node, CPU, gloo.
    infos = result.metrics["infos"]
    assert [i[0] for i in infos] == list(range(workers))
    assert [i[1] for i in infos] == list(range(workers))  # one node: local rank == world rank
    assert {i[2] for i in infos} == {0}
    assert {i[3] for i in infos} == {"cpu"} and {i[4] for i in infos} == {name}
    assert [i[6] for i in infos] == [str(r) for r in range(workers)] and {i[7] for i in infos} == {workers}
    # Every thread of every rank trains at normal priority: not Ray's worker niceness 15, nor the start's (priority.py).
    assert [i[8] for i in infos] == [[os.getpriority(os.PRIO_PROCESS, 0)]] * workers
    pids = [i[5] for i in infos]
    assert len(set(pids)) == workers and os.getpid() not in pids

    # The metrics history is on storage.
    assert result.path == str(tmp_path / "runs") + "/" + name
    lines = (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["loss"] for line in lines] == [h["loss"] for h in result.metrics_history]
    assert json.loads((tmp_path / "runs" / name / "run.json").read_text())["status"] == "FINISHED"

    # The dashboard shows who is who: one named actor per rank, one placement group with the strategy.
    assert sorted(a.name for a in zeroray_actors(name)) == [f"zeroray:{name}:rank-{r}" for r in range(workers)]
    pgs = [p for p in ray.util.placement_group_table().values() if p["name"] == f"zeroray:{name}"]
    assert [(p["strategy"], len(p["bundles"])) for p in pgs] == [(strategy, workers)]
    assert_nothing_left(name, pids)


def _failing_loop(config):
    ctx = zt.get_context()
    for step in range(10):
        if ctx.get_world_rank() == config["bad_rank"] and step == 3:
            raise ValueError(f"boom at step {step} on rank {ctx.get_world_rank()}")
        zt.report({"step": step, "pid": os.getpid()})  # the others wait in this barrier


def test_worker_exception_surfaces_with_rank_and_traceback(ray_cluster, tmp_path):
    name = "fails"
    with pytest.raises(TrainingFailedError) as info:
        ZeroTrainer(
            _failing_loop,
            train_loop_config={"bad_rank": 1},
            scaling_config=ScalingConfig(num_workers=2),
            run_config=run_config(tmp_path, name),
        ).fit()
    err = info.value
    # Rank 1 failed first-hand. Rank 0 may also have failed, in the report barrier that rank 1 gave up at
    # once: then it is listed after rank 1, as hurt by a peer's failure.
    assert err.rank == 1 and err.failures[0].rank == 1 and not err.failures[0].secondary
    assert all(f.secondary and f.rank == 0 for f in err.failures[1:]), err.failures
    assert str(err).startswith("zeroray training failed (rank 1)")
    assert "boom at step 3 on rank 1" in str(err)
    assert "_failing_loop" in err.failures[0].traceback and "ValueError" in err.failures[0].traceback
    assert err.result is not None and err.result.error is err
    assert [h["step"] for h in err.result.metrics_history] == [0, 1, 2]
    assert json.loads((tmp_path / "runs" / name / "run.json").read_text())["status"] == "ERRORED"
    assert_nothing_left(name, [err.result.metrics_history[0]["pid"]])


def _dies_once_loop(config):
    """Rank 1's process dies hard in the first attempt only (a marker file remembers)."""
    ctx = zt.get_context()
    for step in range(4):
        zt.report({"step": step, "pid": os.getpid()})
        if step == 1 and ctx.get_world_rank() == 1 and not os.path.exists(config["marker"]):
            open(config["marker"], "w").close()
            os._exit(3)


def test_dead_actor_fails_the_run_or_restarts_the_group(ray_cluster, tmp_path):
    # max_failures=0: the lost actor fails the run, naming the rank.
    marker = str(tmp_path / "died")
    with pytest.raises(TrainingFailedError) as info:
        ZeroTrainer(_dies_once_loop, train_loop_config={"marker": marker},
                    scaling_config=ScalingConfig(num_workers=2),
                    run_config=run_config(tmp_path, "dies")).fit()
    assert info.value.rank == 1 and info.value.failures[0].actor_died
    assert_nothing_left("dies")

    # max_failures=1: the group is torn down, a new one runs the loop again and finishes.
    os.remove(marker)
    result = ZeroTrainer(_dies_once_loop, train_loop_config={"marker": marker},
                         scaling_config=ScalingConfig(num_workers=2),
                         run_config=run_config(tmp_path, "restarts",
                                                failure_config=FailureConfig(max_failures=1))).fit()
    assert result.attempts == 2
    attempts = [h["_attempt"] for h in result.metrics_history]
    assert attempts[-4:] == [2, 2, 2, 2] and attempts.count(1) >= 1
    assert [h["step"] for h in result.metrics_history if h["_attempt"] == 2] == [0, 1, 2, 3]
    pids = {h["pid"] for h in result.metrics_history}
    assert len(pids) == 1  # rank 0's actor is kept across the restart; only rank 1 gets a new process
    assert_nothing_left("restarts", list(pids))


def _shard_loop(config):
    shard = zt.get_dataset_shard("train")
    ids = [int(row["id"]) for row in shard.iter_rows()]
    everyone = [None] * zt.get_context().get_world_size()
    dist.all_gather_object(everyone, ids)
    zt.report({"ids": everyone})


def test_dataset_shards_are_disjoint_and_cover(ray_cluster, tmp_path):
    ds = ray.data.range(60, override_num_blocks=6)
    result = ZeroTrainer(_shard_loop, datasets={"train": ds}, scaling_config=ScalingConfig(num_workers=3),
                         run_config=run_config(tmp_path, "shards")).fit()
    per_rank = [set(ids) for ids in result.metrics["ids"]]
    assert all(len(s) == 20 for s in per_rank)  # equal=True: the same number of rows on every rank
    assert per_rank[0].isdisjoint(per_rank[1]) and per_rank[1].isdisjoint(per_rank[2])
    assert per_rank[0].isdisjoint(per_rank[2])
    assert set().union(*per_rank) == set(range(60))
    assert_nothing_left("shards")


def _mismatched_loop():
    for _ in range(3 if zt.get_context().get_world_rank() == 0 else 2):
        zt.report({"x": 1})


def test_report_count_mismatch_is_an_error_not_a_hang(ray_cluster, tmp_path):
    with pytest.raises(TrainingFailedError, match="same number of times"):
        ZeroTrainer(_mismatched_loop, scaling_config=ScalingConfig(num_workers=2),
                    run_config=run_config(tmp_path, "mismatch")).fit()
    assert_nothing_left("mismatch")


def test_bad_arguments_fail_before_any_actor_starts(ray_cluster, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    lock = threading.Lock()
    cases = [
        (lambda: ZeroTrainer(_ddp_loop, scaling_config=ScalingConfig(num_workers=0)), ValueError, "num_workers"),
        (lambda: ZeroTrainer(42), TypeError, "train_loop_per_worker"),
        (lambda: ZeroTrainer(_ddp_loop, train_loop_config={"steps": 1},
                             run_config=RunConfig(name="bad-storage", storage_path=str(blocker / "runs"))).fit(),
         StorageError, "not reachable or not writable"),
        (lambda: ZeroTrainer(_ddp_loop, train_loop_config={"lock": lock},
                             run_config=RunConfig(name="bad-pickle", storage_path=str(tmp_path))).fit(),
         TypeError, "picklable"),
        (lambda: ZeroTrainer(_ddp_loop, scaling_config=ScalingConfig(num_workers=9),
                             run_config=RunConfig(name="too-big", storage_path=str(tmp_path))).fit(),
         ValueError, "more than the cluster has"),
    ]
    before = {a.actor_id for a in list_actors(limit=10_000)}
    pgs_before = {p.placement_group_id for p in list_placement_groups(limit=10_000)}
    for make, exc, match in cases:
        with pytest.raises(exc, match=match):
            make()
    assert {a.actor_id for a in list_actors(limit=10_000)} == before
    assert {p.placement_group_id for p in list_placement_groups(limit=10_000)} == pgs_before


def _metrics_loop(config):
    """Report, then wait (on rank 0) until Ray's Prometheus endpoint shows this run's gauges of every rank
    (the ranks export independently, so one rank's lines can show up a scrape before the other's)."""
    ctx = zt.get_context()
    zt.report({"loss": 1.25})
    seen = ""
    if ctx.get_world_rank() == 0:
        deadline = time.time() + 30
        while time.time() < deadline:
            text = urllib.request.urlopen(config["url"], timeout=5).read().decode()
            lines = [line for line in text.splitlines() if f'run="{ctx.get_experiment_name()}"' in line]
            ranks = range(ctx.get_world_size())
            if all(any(line.startswith("ray_zeroray_loss") and f'rank="{r}"' in line for line in lines)
                   for r in ranks) and any(line.startswith("ray_zeroray_memory_bytes") for line in lines):
                seen = "\n".join(lines)
                break
            time.sleep(0.5)
    zt.report({"seen": seen})


def test_rank_actors_export_ray_metrics(ray_cluster, tmp_path):
    result = ZeroTrainer(_metrics_loop, train_loop_config={"url": ray_cluster["metrics_url"]},
                         scaling_config=ScalingConfig(num_workers=2),
                         run_config=run_config(tmp_path, "metrics")).fit()
    seen = result.metrics["seen"]
    assert seen, "no ray_zeroray_* metrics for this run on the Prometheus endpoint"
    loss_lines = [line for line in seen.splitlines() if line.startswith("ray_zeroray_loss")]
    assert {('rank="0"' in line, 'rank="1"' in line) for line in loss_lines} >= {(True, False), (False, True)}
    assert all(line.endswith(" 1.25") for line in loss_lines)
    assert 'category="process_rss"' in seen
    assert_nothing_left("metrics")


_CTRL_C_DRIVER = """
import logging, sys, time, ray
import zeroray.train as zt
from zeroray.train import ZeroTrainer, ScalingConfig, RunConfig

def loop():
    i = 0
    while True:
        zt.report({"i": i}); i += 1; time.sleep(0.05)

logging.basicConfig(level=logging.INFO, format="%(message)s")  # the progress lines are INFO logs
ray.init(address=sys.argv[1])
try:
    ZeroTrainer(loop, scaling_config=ScalingConfig(num_workers=2),
                run_config=RunConfig(name="ctrl-c", storage_path=sys.argv[2], progress_bar=True)).fit()
except KeyboardInterrupt:
    print("INTERRUPTED", flush=True)
    sys.stdin.readline()  # stay connected (so Ray's fate-sharing cannot do the cleanup for us)
"""


def test_ctrl_c_in_the_driver_tears_the_group_down(ray_cluster, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(_CTRL_C_DRIVER)
    proc = subprocess.Popen([sys.executable, str(script), ray_cluster["address"], str(tmp_path / "runs")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=interruptible)
    out: list[str] = []
    try:
        # Wait until the loop is reporting (off a terminal, the progress prints "zeroray: step=...").
        for line in proc.stdout:
            out.append(line)
            if line.startswith("zeroray: step="):
                break
        alive = [a for a in zeroray_actors("ctrl-c") if a.state == "ALIVE"]
        assert len(alive) == 2, "".join(out)
        proc.send_signal(signal.SIGINT)
        for line in proc.stdout:
            out.append(line)
            if line.startswith("INTERRUPTED"):
                break
        assert proc.poll() is None, "".join(out)  # the driver is still connected while we look
        assert_nothing_left("ctrl-c", [a.pid for a in alive])
        info = json.loads((tmp_path / "runs" / "ctrl-c" / "run.json").read_text())
        assert info["status"] == "ABORTED" and info["num_reports"] > 0
    finally:  # never leave the driver (and its ranks, holding the cluster's CPUs) behind a failed assert
        try:
            proc.communicate("\n", timeout=30) if proc.poll() is None else None
        except subprocess.TimeoutExpired:
            pass
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
