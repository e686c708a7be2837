"""A planned resize keeps the rank actors it has: on a real local Ray cluster, an elastic group of 2 (something
else holds the other CPUs) grows to 3 when they are freed, and the 2 old ranks go on in their own processes;
only the third rank is a new one. Each rank's placement group is its own, and none is left behind.

(The restart after a SIGKILLed rank, which keeps the other rank, and the hung rank, which is never reused,
are in test_elastic_faults.py.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import ray
import torch
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

import zeroray.train as zt
from tests.support.ray import assert_nothing_left, run_config, wait_for_file
from zeroray.train import FailureConfig, ScalingConfig, ZeroTrainer

GLOBAL_BATCH, STEPS, GROW_AT = 6, 8, 3  # 6: sizes 1, 2 and 3 all keep the global batch


def _growing_loop(config):
    ctx = zt.get_context()
    control = Path(config["control"])
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    (control / f"start-w{world}-r{rank}").write_text(str(os.getpid()))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    engine = zt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.ones(2, 4)
    while engine.global_step < STEPS:
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        zt.report({"loss": loss.item(), "world": world})
        if world < 3 and engine.global_step >= GROW_AT:
            if rank == 0 and world == 2:
                (control / "held").write_text("")
            while True:  # until a grow stops the loop at a recovery point
                zt.report({"held": 1})
                time.sleep(0.05)


def test_a_planned_grow_keeps_the_old_ranks_processes(ray_cluster, tmp_path):
    import threading

    name = "grow-keeps"
    control = tmp_path / "control"
    control.mkdir()
    blocker = placement_group([{"CPU": 2}], name="someone-else-grow")  # the cluster has 4 CPUs: 2 are free
    ray.get(blocker.ready(), timeout=60)
    pg_names: list[str] = []

    def free_the_cpus() -> None:
        wait_for_file(control / "held")
        pg_names.extend(p["name"] for p in placement_group_table().values() if p["state"] == "CREATED")
        remove_placement_group(blocker)

    freer = threading.Thread(target=free_the_cpus, daemon=True)
    freer.start()
    try:
        result = ZeroTrainer(
            _growing_loop, train_loop_config={"control": str(control)},
            zero_config={"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": 1},
            scaling_config=ScalingConfig(num_workers=(1, 3), elastic_resize_monitor_interval_s=1.0,
                                         placement_timeout_s=60),
            run_config=run_config(tmp_path, name),
        ).fit()
    finally:
        freer.join(timeout=10)
        if freer.is_alive() or not pg_names:
            remove_placement_group(blocker)
    attempts = result.attempt_history
    # 2 -> 3, or 1 -> 2 -> 3 when the first placement retry counted the free CPUs before Ray had freed them all.
    sizes = [a.world_size for a in attempts]
    assert sizes in ([2, 3], [1, 2, 3]), attempts
    assert [a.end for a in attempts] == ["resize_up"] * (len(sizes) - 1) + ["finished"], attempts
    assert all(a.steps_lost == 0 for a in attempts), attempts
    assert [a.kept_ranks for a in attempts] == [0, *sizes[:-1]], attempts  # every old rank went on
    # The added rank was started while the smaller group still trained (its placement, process and imports).
    assert all("prestart" in a.phases for a in attempts[1:]), attempts

    pid = {p.name: int(p.read_text()) for p in control.glob("start-*")}
    groups = [{pid[f"start-w{w}-r{r}"] for r in range(w)} for w in sizes]
    for smaller, bigger in zip(groups, groups[1:]):
        assert smaller < bigger, pid  # the old ranks' processes serve the bigger group; one process is new
    new = groups[-1]

    # Each rank had a placement group of its own (one bundle), named after the run.
    ours = [n for n in pg_names if n.startswith(f"zeroray:{name}:slot-")]
    assert len(ours) == 2 and not any(n == f"zeroray:{name}" for n in pg_names), pg_names
    assert_nothing_left(name, sorted(new))
    left = [p["name"] for p in placement_group_table().values()
            if p["name"].startswith(f"zeroray:{name}") and p["state"] != "REMOVED"]
    assert left == []


def test_release_stops_rank_0s_commit_from_waiting_for_a_dead_peer(tmp_path):
    """Rank 0's async save in flight waits for every rank's marker; a peer that died never writes one. Release
    (a survivor kept for the next group) writes the missing ranks' error markers, so the commit fails at once,
    uncommitted, instead of holding the rank for the commit timeout."""
    import threading

    import torch

    from zeroray.checkpoint.commit import await_markers
    from zeroray.checkpoint.manifest import CheckpointError, part_file
    from zeroray.checkpoint.writer import SaveHandle
    from zeroray.storage import open_url
    from zeroray.train.config import CheckpointConfig
    from zeroray.train.group.rank_actor import _join_upload
    from zeroray.train.run_spec import RankInfo, RunSpec
    from zeroray.train.worker.context import Session, TrainContext

    run = tmp_path / "run"
    ckpt = run / "checkpoint_10"
    ckpt.mkdir(parents=True)
    fs, path = open_url(str(ckpt), None)
    handle = SaveHandle(str(ckpt))

    def commit() -> None:  # what rank 0's upload thread does last
        try:
            await_markers(fs, path, str(ckpt), 2, timeout=600)
        except CheckpointError as e:
            handle.error = e

    handle._thread = threading.Thread(target=commit, daemon=True)
    handle._thread.start()
    spec = RunSpec(name="run", run_url=str(run), storage_path=str(tmp_path), storage_options=None, train_fn=print,
                   train_loop_config=None, pass_config=False, zero_config=None, use_gpu=False,
                   placement_strategy="PACK", placement_timeout_s=None, collective_timeout_s=60, snapshot_interval=0,
                   checkpoint_config=CheckpointConfig(), samples_per_step=None, progress_bar=False)
    context = TrainContext(RankInfo(0, 2, 0, 2, 0), "run", str(tmp_path), torch.device("cpu"), str(run))
    session = Session(context, spec, {}, report_comm=None)
    session.checkpoint_saver, session.last_saved_step = handle, 10

    start = time.monotonic()
    assert _join_upload(session, timeout_s=30.0)
    assert time.monotonic() - start < 30.0
    assert "the group ended" in str(handle.error)
    assert {p.name for p in ckpt.iterdir()} == {part_file(0), part_file(1)}  # error markers; no manifest


def _dying_loop(config):
    """Four ranks of a ZeRO-2 model with small buckets; in the first group rank 1 dies in the middle of a
    backward, with every rank's bucket reductions in flight (tests/jobs/peer_loss_job.py, on Ray)."""
    from tests.support.jobs import die_mid_backward
    from tests.support.models import TinyLM, batches, param_groups
    from tests.support.recipe import train

    ctx = zt.get_context()
    control = Path(config["control"])
    rank = ctx.get_world_rank()
    with open(control / f"starts-{rank}", "a") as f:
        f.write(f"{os.getpid()}\n")
    torch.manual_seed(0)
    model = TinyLM(d=64, n_layer=6)
    engine = zt.prepare(model, torch.optim.AdamW(param_groups(model)))
    if rank == 1 and not (control / "died").exists():
        die_mid_backward(model, engine, str(control / "died"))
    train(engine, batches(rank, 4), on_step=lambda _: zt.report({"step": engine.global_step}))


def test_a_peer_dying_mid_backward_keeps_every_survivor(ray_cluster, tmp_path):
    """The survivors of a rank that died with collectives in flight are all kept for the restart. Before
    the rank actors gave their group up at once (engine.abort, and torch's default-argument modules imported
    before the group), one survivor stayed blocked on a live peer until the collective timeout, was not
    released in time and got a new process."""
    control = tmp_path / "control"
    control.mkdir()
    name = "peer-dies"
    result = ZeroTrainer(
        _dying_loop, train_loop_config={"control": str(control)},
        zero_config={"zero_optimization": {"stage": 2, "reduce_bucket_size": 2000}},
        scaling_config=ScalingConfig(num_workers=4),
        run_config=run_config(tmp_path, name, failure_config=FailureConfig(max_failures=1, collective_timeout_s=120)),
    ).fit()
    first, second = result.attempt_history
    assert (first.end, first.rank, second.end) == ("failure", 1, "finished"), (first, second)
    starts = {r: [int(p) for p in (control / f"starts-{r}").read_text().split()] for r in range(4)}
    assert second.kept_ranks == 3, (second, starts)
    first_pids, second_pids = {ps[0] for ps in starts.values()}, {ps[1] for ps in starts.values()}
    survivors = first_pids - {starts[1][0]}
    assert survivors <= second_pids and starts[1][0] not in second_pids, starts  # ranks may be renumbered
    assert_nothing_left(name, [p for ps in starts.values() for p in ps])


def test_a_rank_whose_loop_does_not_end_says_where_it_waits():
    """Release gives up on a loop that does not end; the reason (logged by the driver) names the frames the
    loop thread waits in, so a survivor that is not kept says why."""
    import threading

    from zeroray.train.group.rank_actor import RankActor

    blocked, entered = threading.Event(), threading.Event()

    def waits_in_a_collective_that_never_returns() -> None:
        entered.set()
        blocked.wait()

    actor = RankActor("run", use_gpu=False)
    actor.thread = threading.Thread(target=waits_in_a_collective_that_never_returns, daemon=True)
    actor.thread.start()
    assert entered.wait(10)
    try:
        why = actor.release(timeout_s=0.05)
    finally:
        blocked.set()
        actor.thread.join(10)
    assert why.startswith("its loop was still running after 0.05s (in the loop; at threading.py:"), why
    assert re.search(r"< test_elastic_reuse\.py:\d+ waits_in_a_collective_that_never_returns <", why), why


def _imported(_actor, names: list[str]) -> dict[str, bool]:
    import sys

    import torch.distributed as dist

    return {**{n: n in sys.modules for n in names}, "group": dist.is_initialized()}


def test_a_new_rank_imports_ahead_of_its_first_group(ray_cluster):
    """A new rank's process imports, while it is created, what its first rendezvous and engine build would
    otherwise import with every rank waiting (a grow's spare does it while the old group trains), and joins no
    group doing so."""
    from zeroray.engine.comm import _WORLD_DEFAULT_MODULES
    from zeroray.train.group.priority import RANK_RUNTIME_ENV
    from zeroray.train.group.rank_actor import RankActor

    # Started as the worker group starts a rank: without its runtime env the process runs at Ray's worker
    # niceness (15), and beside busy processes its imports took over the 120 s below.
    actor = ray.remote(RankActor).options(num_cpus=1, runtime_env=RANK_RUNTIME_ENV).remote("import-ahead", False)
    try:
        names = [*_WORLD_DEFAULT_MODULES, "torch._dynamo", "zeroray.train.worker.metrics"]
        found = ray.get(actor.__ray_call__.remote(_imported, names), timeout=120)
        assert found == {**{n: True for n in names}, "group": False}, found
    finally:
        ray.kill(actor)


def test_a_new_rank_starts_ahead_of_running_work_then_trains_at_normal_priority(ray_cluster):
    """A rank's start (its process and imports) runs below the raylet's niceness where the node allows it, ahead
    of the ranks already training there; then every thread of it goes back to the raylet's niceness."""
    from zeroray.train.group.priority import RANK_RUNTIME_ENV, START_NICENESS
    from zeroray.train.group.rank_actor import RankActor

    base = os.getpriority(os.PRIO_PROCESS, 0)  # the local raylet's: it was started by this process
    allowed = subprocess.run([sys.executable, "-c", f"import os; os.nice({START_NICENESS})"],
                             capture_output=True).returncode == 0
    actor = ray.remote(RankActor).options(num_cpus=1, runtime_env=RANK_RUNTIME_ENV).remote("priority", False)
    try:
        info = ray.get(actor.node_info.remote(), timeout=120)
        assert info["start_niceness"] == (max(-20, base + START_NICENESS) if allowed else base), (info, allowed)
        assert info["niceness"] == [base], info
    finally:
        ray.kill(actor)
