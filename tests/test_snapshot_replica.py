"""Recovery from replicas (``zeroray.checkpoint.snapshot`` with ``take(..., live=True)``) on real gloo ranks.

Under hybrid sharding (k=2 at world 4: replica groups {0, 1} and {2, 3}, one node each) every shard lives on
two ranks. One node's ranks are lost with their memory; the survivors' copies of their live state rebuild
the whole state, flat at world 2 (a shrink) and hybrid at world 4 (a new node receives its replica), bit for
bit, and the grown group's next losses are the uninterrupted run's. At world 6 (three replica groups, one
lost) survivors that stopped at different steps give the newest step whose copies cover every shard, never a
mix; with none, the report-time snapshots, then storage, and rank 0 says why. A rank that fails inside its
optimizer step offers nothing. Whether the ranks a resize keeps hold every shard (``uncovered``, what decides
a recovery point without a checkpoint) is checked on the mesh columns alone."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch.distributed as dist

from tests.support.checkpoint import assemble, assert_same, make_engine, snapshot
from tests.support.dist import run_ranks
from tests.support.models import batches
from tests.support.recipe import OPT_STEPS, train
from zeroray.checkpoint.snapshot import Choice, SnapshotStore, choose, restore, take, uncovered
from zeroray.engine import Comm, GroupAborted

K = 2
STAGES = (1, 2, 3)
MORE = 2  # steps after the failure


def _summary(choice: Choice | None) -> tuple | None:
    if choice is None:
        return None
    return choice.step, choice.world_size, choice.holders, choice.sources, choice.live


def _lost_node(rank: int, world: int) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for stage in STAGES:
        engine = make_engine(stage, shard_group_size=K)
        data = batches(rank, OPT_STEPS + MORE)
        train(engine, data[:OPT_STEPS])
        live = take(engine, "g", live=True)  # what a survivor keeps when its group fails
        got: dict[str, Any] = {"replicas": live.header.replicas, "before": snapshot(engine),
                               "after": train(engine, data[OPT_STEPS:])}  # the uninterrupted run goes on
        engine.close()
        store = SnapshotStore()
        if rank < K:  # the node of ranks 2 and 3 is lost, and their memory with it
            store.add(live)
        survivors = dist.new_group([0, 1])
        if rank < K:  # shrink to the surviving node: flat over its 2 ranks
            fresh = make_engine(stage, seed=1, process_group=survivors)
            comm = Comm(survivors)
            choice = choose(comm, store)
            got["shrunk_choice"] = _summary(choice)
            restore(fresh, comm, store, choice)
            got["shrunk"] = snapshot(fresh)
            fresh.close()
        fresh = make_engine(stage, seed=1, shard_group_size=K)  # a new node replaces the lost one
        comm = Comm(dist.group.WORLD)
        choice = choose(comm, store)
        got["grown_choice"] = _summary(choice)
        restore(fresh, comm, store, choice)
        got["grown"] = snapshot(fresh)
        got["grown_after"] = train(fresh, data[OPT_STEPS:])
        fresh.close()
        out[stage] = got
    # A failure inside the optimizer step (the shard group's clip all-reduce): the state is no completed step.
    engine = make_engine(1, shard_group_size=K)
    train(engine, batches(rank, 1))
    x, y = batches(rank, 1)[0]
    engine.backward(engine(x, y))
    engine.topology.shard.abort("its node was lost")
    try:
        engine.step()
    except GroupAborted:
        pass
    out["mid_update"] = engine.mid_update
    try:
        take(engine, "g", live=True)
    except RuntimeError as e:
        out["mid_update_error"] = str(e)
    engine.close()
    return out


@pytest.fixture(scope="module")
def lost_node() -> list[dict[Any, Any]]:
    return run_ranks(_lost_node, 4)


@pytest.mark.parametrize("stage", STAGES)
def test_survivors_replicas_rebuild_a_lost_node_exactly(lost_node: list[dict[Any, Any]], stage: int) -> None:
    ranks = [r[stage] for r in lost_node]
    assert [r["replicas"] for r in ranks] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    want = assemble([r["before"] for r in ranks])
    # Shrink: ranks 0 and 1 serve old ranks 2 and 3 from their own copies (the same shards), at step OPT_STEPS.
    assert ranks[0]["shrunk_choice"] == ranks[1]["shrunk_choice"] == (OPT_STEPS, 4, (0, 1, 0, 1), (0, 1, 0, 1), True)
    assert_same(assemble([r["shrunk"] for r in ranks[:K]]), want, f"stage {stage} shrunk to world 2")
    # Grow: the new node's ranks receive their replica from the survivors, and training goes on bit for bit.
    assert {r["grown_choice"] for r in ranks} == {(OPT_STEPS, 4, (0, 1, 0, 1), (0, 1, 0, 1), True)}
    assert_same(assemble([r["grown"] for r in ranks]), want, f"stage {stage} at world 4 again")
    assert [r["grown_after"] for r in ranks] == [r["after"] for r in ranks]


def test_a_rank_that_fails_inside_its_step_offers_nothing(lost_node: list[dict[Any, Any]]) -> None:
    for r in lost_node:
        assert r["mid_update"] is True
        assert "inside an optimizer step or a load" in r["mid_update_error"]


def _permuted_mesh(rank: int, world: int) -> dict[str, Any]:
    """A user's mesh whose shard groups are not consecutive ranks: {0, 2} and {1, 3}, so rank 2 holds shard 1
    and rank 1 shard 0. The replica group {1, 3} is lost; ranks 0 and 2 rebuild the state flat at world 2."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("replicate", "shard"))
    engine = make_engine(3, mesh=mesh)
    train(engine, batches(rank, OPT_STEPS))
    live = take(engine, "g", live=True)
    got: dict[str, Any] = {"replicas": live.header.replicas, "before": snapshot(engine)}
    engine.close()
    survivors = dist.new_group([0, 2])
    if rank in (0, 2):
        store = SnapshotStore()
        store.add(live)
        fresh = make_engine(3, seed=1, process_group=survivors)
        comm = Comm(survivors)
        restore(fresh, comm, store, choose(comm, store))
        got["shrunk"] = snapshot(fresh)
        fresh.close()
    return got


def test_a_permuted_mesh_is_rebuilt_from_the_ranks_that_hold_each_shard() -> None:
    ranks = run_ranks(_permuted_mesh, 4)
    assert [r["replicas"] for r in ranks] == [(0, 1), (0, 1), (2, 3), (2, 3)]  # the mesh's columns
    want = assemble([r["before"] for r in ranks])
    assert_same(assemble([ranks[0]["shrunk"], ranks[2]["shrunk"]]), want, "permuted mesh shrunk to world 2")


# Which step each survivor (ranks 0-3 of 6; ranks 4 and 5 are lost) stopped at: 0 = step t, 1 = step t+1;
# "reports": the ranks also hold their own report-time snapshot of step t-1 (snapshot_interval).
SCENARIOS = {
    "t+1 covered": ({0: 1, 1: 1, 2: 0, 3: 0}, False),
    "t+1 not covered": ({0: 1, 1: 0, 2: 0, 3: 0}, False),
    "no step covered, reports": ({0: 1, 1: 0, 2: 1, 3: 0}, True),
    "no step covered": ({0: 1, 1: 0, 2: 1, 3: 0}, False),
}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _mixed_steps(rank: int, world: int) -> dict[str, Any]:
    engine = make_engine(3, shard_group_size=K)
    data = batches(rank, OPT_STEPS + 1)
    train(engine, data[: OPT_STEPS - 1])
    report = take(engine, "g")
    states = [snapshot(engine)]
    lives = []
    for i in range(OPT_STEPS - 1, OPT_STEPS + 1):
        train(engine, data[i : i + 1])
        lives.append(take(engine, "g", live=True))
        states.append(snapshot(engine))
    engine.close()
    survivors = dist.new_group([0, 1, 2, 3])
    out: dict[str, Any] = {"states": states}
    lines = _Lines()
    logging.getLogger("zeroray.checkpoint.snapshot").addHandler(lines)
    for name, (steps, reports) in SCENARIOS.items():
        if rank >= 4:
            continue
        store = SnapshotStore()
        store.add(lives[steps[rank]])
        if reports:
            store.add(report)
        fresh = make_engine(3, seed=1, process_group=survivors)
        comm = Comm(survivors)
        del lines.lines[:]
        choice = choose(comm, store)
        out[name] = {"choice": _summary(choice), "log": list(lines.lines)}
        if choice is not None:
            restore(fresh, comm, store, choice)
            out[name]["restored"] = snapshot(fresh)
        fresh.close()
    return out


@pytest.fixture(scope="module")
def mixed() -> list[dict[str, Any]]:
    return run_ranks(_mixed_steps, 6)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_survivors_at_different_steps_give_the_newest_covered_step(mixed: list[dict[str, Any]], name: str) -> None:
    t = OPT_STEPS
    full = [assemble([r["states"][i] for r in mixed]) for i in range(3)]  # steps t-1, t, t+1
    step, live, warned = {
        "t+1 covered": (t + 1, True, None),
        "t+1 not covered": (t, True, (t + 1, [1, 3, 5], f"step {t} in memory")),
        "no step covered, reports": (t - 1, False, (t + 1, [1, 3, 5], f"step {t - 1} in memory")),
        "no step covered": (None, None, (t + 1, [1, 3, 5], "storage")),
    }[name]
    got = [mixed[r][name] for r in range(4)]
    assert len({g["choice"] for g in got}) == 1, got
    choice = got[0]["choice"]
    if step is None:
        assert choice is None
    else:
        assert (choice[0], choice[4]) == (step, live), choice
        assert_same(assemble([g["restored"] for g in got]), full[step - (t - 1)], name)
    assert [g["log"] for g in got[1:]] == [[], [], []]  # rank 0 alone says it
    if warned is None:
        assert got[0]["log"] == []
    else:
        at, lacking, instead = warned
        assert any(f"no recovery from replicas at step {at}" in line and str(lacking) in line and instead in line
                   for line in got[0]["log"]), got[0]["log"]


# The mesh columns (Topology.replica_ranks) at world 6: k=2 (replica groups {0, 1}, {2, 3}, {4, 5}) and k=3.
COLUMNS_K2 = [(0, 2, 4), (1, 3, 5)] * 3
COLUMNS_K3 = [(0, 3), (1, 4), (2, 5)] * 2


@pytest.mark.parametrize(("columns", "holders", "expected"), [
    (COLUMNS_K2, range(6), []),  # a grow: every rank stays
    (COLUMNS_K2, range(4), []),  # a shrink to 4: two replica groups stay
    (COLUMNS_K2, range(2), []),  # a shrink to 2: one replica group is a whole copy
    (COLUMNS_K2, [0], [1, 3, 5]),  # a shrink to 1: the other place's shards have no copy
    (COLUMNS_K2, [0, 2, 4], [1, 3, 5]),  # one place of every replica group (a node of each, k across nodes)
    (COLUMNS_K3, range(2), [2, 5]),  # a shrink to 2 at k=3: the third place of each group is lost
    (COLUMNS_K3, [3, 4, 5], []),
    (COLUMNS_K2, [], list(range(6))),
])
def test_the_ranks_that_stay_cover_every_shard_or_name_what_they_lack(columns, holders, expected) -> None:
    assert uncovered(columns, holders) == expected
