"""In-memory snapshots (``zeroray.checkpoint.snapshot``) on real gloo ranks: a world of 4 on two simulated
nodes snapshots its state and copies each rank's to a buddy on the other node; a node is lost, and the two
survivors rebuild the whole state, resharded to world 2, from their memory alone, bit for bit. When a shard's
two copies are both lost there is no snapshot to restore. The checkpoint tests' exact state comparison is
the reference."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from tests.support.checkpoint import assemble, assert_same, make_engine, snapshot
from tests.support.dist import run_ranks
from tests.support.models import batches
from tests.support.recipe import OPT_STEPS, train
from zeroray.checkpoint.snapshot import SnapshotStore, buddies, choose, replicate, restore, take
from zeroray.engine import Comm

NODES = [0, 0, 1, 1]  # rank -> node: buddies are ranks 2, 3, 0, 1
STAGES = (0, 1, 3)


def _worker(rank: int, world: int) -> dict[int, Any]:
    out: dict[int, Any] = {}
    for stage in STAGES:
        engine = make_engine(stage)
        data = batches(rank, OPT_STEPS + 1)
        train(engine, data[:OPT_STEPS])
        before = snapshot(engine)
        store = SnapshotStore()
        replicate(Comm(dist.group.WORLD), store, take(engine, f"g{stage}"), NODES)
        train(engine, data[OPT_STEPS:])  # the snapshot is a copy: the live state moves on
        engine.close()
        node_0 = dist.new_group([0, 1])  # node 1 (ranks 2 and 3) is lost
        one_copy_each = dist.new_group([1, 3])  # ranks 0 and 2, and with them both copies of rank 0's shard
        got: dict[str, Any] = {"before": before, "held": sorted(k[2] for k in store.held)}
        if rank in (0, 1):
            fresh = make_engine(stage, seed=1, process_group=node_0)
            comm = Comm(node_0)
            choice = choose(comm, store)
            got["choice"] = (choice.step, choice.world_size, choice.holders)
            restore(fresh, comm, store, choice)
            got["restored"] = snapshot(fresh)
            fresh.close()
        if rank in (1, 3):
            got["without_rank_0"] = choose(Comm(one_copy_each), store)
        out[stage] = got
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[int, Any]]:
    return run_ranks(_worker, 4)


@pytest.mark.parametrize("stage", STAGES)
def test_survivors_of_a_lost_node_rebuild_the_state_from_memory(ranks: list[dict[int, Any]], stage: int) -> None:
    # Each rank holds its own snapshot and its buddy's copy: rank 0 holds 0 and 2's, rank 1 holds 1 and 3's.
    assert [r[stage]["held"] for r in ranks] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    # The survivors agree on step OPT_STEPS of the group of 4; each serves two of its shards.
    assert ranks[0][stage]["choice"] == ranks[1][stage]["choice"] == (OPT_STEPS, 4, (0, 1, 0, 1))
    want = assemble([r[stage]["before"] for r in ranks])
    assert_same(assemble([r[stage]["restored"] for r in ranks[:2]]), want, f"stage {stage} restored at world 2")


def test_no_snapshot_when_both_copies_of_a_shard_are_lost(ranks: list[dict[int, Any]]) -> None:
    assert [ranks[r][0]["without_rank_0"] for r in (1, 3)] == [None, None]


@pytest.mark.parametrize(
    ("nodes", "expected"),
    [
        ([0, 0, 1, 1], [2, 3, 0, 1]),  # a shift that puts every pair on two nodes
        ([0, 1, 2], [1, 2, 0]),
        ([0, 0, 1], [2, 2, 0]),  # no such shift: the next rank on another node
        ([5, 5, 5], [1, 2, 0]),  # one node: the next rank (a lost process is covered)
        ([0, 1], [1, 0]),
    ],
)
def test_buddies_are_on_another_node(nodes: list[int], expected: list[int]) -> None:
    assert buddies(nodes) == expected
