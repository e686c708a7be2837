"""hpZ (ZeRO++ hierarchical partitioning, stage 3): after a unit's forward each rank keeps 1/h of its
gathered parameters, and the unit's backward gathers them from the h ranks of its node.

The copy holds exactly the gathered values, so a run with hpZ equals the same run without it bit for
bit (alone, and on top of hybrid sharding); its backward gathers move to the secondary group, inside
the node; its memory shows in ``memory_report()`` and ``zeroray estimate``; bad values fail first.
"""

from __future__ import annotations

import copy

import pytest
import torch

import zeroray
from tests.support.dist import run_ranks
from tests.support.models import TinyLM, batches
from tests.support.recipe import GAS, OPT_STEPS, config, optimizer, train, zero_run
from zeroray.config import ConfigError, ZeroConfig
from zeroray.estimate import estimate


def _runs(rank: int, world: int, cases: list[dict]) -> list[tuple]:
    data = batches(rank, GAS * OPT_STEPS)
    torch.manual_seed(0)
    init = TinyLM()
    return [zero_run(copy.deepcopy(init), data, 3, c.pop("precision"), **c) for c in copy.deepcopy(cases)]


@pytest.fixture(scope="module")
def flat_and_hpz() -> list[list[tuple]]:
    """Flat stage 3 and hpZ over 2, in fp32 then in bf16, on one group of 4: per rank, the four runs in that order."""
    cases = [{"precision": p, **hpz} for p in ("fp32", "bf16") for hpz in ({}, {"hpz_partition_size": 2})]
    return run_ranks(_runs, 4, cases)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_hpz_equals_flat_stage_3_bit_for_bit(flat_and_hpz: list[list[tuple]], precision: str) -> None:
    first = 0 if precision == "fp32" else 2
    for flat, hpz in (runs[first:first + 2] for runs in flat_and_hpz):
        assert flat[0] == hpz[0]  # losses
        assert flat[2] == hpz[2]  # gradient norms
        for name in flat[1]:
            assert torch.equal(flat[1][name], hpz[1][name]), name


def test_hpz_on_top_of_hybrid_sharding_equals_hybrid_alone() -> None:
    """World 8: shard groups of 4 (two "nodes"), hpZ over 2 inside each."""
    cases = [{"precision": "fp32", "shard_group_size": 4}, {"precision": "fp32", "shard_group_size": 4, "hpz_partition_size": 2}]
    for hybrid, both in run_ranks(_runs, 8, cases):
        assert hybrid[0] == both[0]
        for name in hybrid[1]:
            assert torch.equal(hybrid[1][name], both[1][name]), name


def _scoped(rank: int, world: int, hpz: int | None) -> dict:
    torch.manual_seed(0)
    model = TinyLM()
    nodes = ["node-0", "node-0", "node-1", "node-1"]
    engine = zeroray.initialize(model, optimizer(model), config(3, "bf16", hpz_partition_size=hpz), nodes=nodes)
    train(engine, batches(rank, GAS))
    out = {"scoped": engine.comm_report(by_scope=True), "memory": engine.memory_report(),
           "secondary": [(g.padded, g.full.element_size()) for g in engine.groups],
           "unit_numel": sum(g.padded for u in engine.scheduler.units for g in u.groups)}
    engine.close()
    return out


def _refused(rank: int, world: int, cfg: ZeroConfig) -> str:
    model = TinyLM()
    try:
        zeroray.initialize(model, optimizer(model), cfg)
    except ValueError as e:
        return str(e)
    return "no error"


def _world_4(rank: int, world: int) -> dict:
    """The runs of world 4 that need no other world: flat and hpZ on two nodes, then an hpZ that does not divide
    the shard group (refused before any collective work)."""
    return {"flat": _scoped(rank, world, None), "hpz": _scoped(rank, world, 2),
            "refused": _refused(rank, world, ZeroConfig(stage=3, hpz_partition_size=3))}


@pytest.fixture(scope="module")
def world_4() -> list[dict]:
    """:func:`_world_4` on one group of 4 processes (one spawn, not one per run)."""
    return run_ranks(_world_4, 4)


def test_backward_gathers_stay_inside_the_node_and_the_copy_is_counted(world_4: list[dict]) -> None:
    """Flat stage 3 on 2 nodes x 2 ranks: every gather spans the nodes. With hpZ over the 2 ranks of a
    node, the units' backward gathers (all their bytes of one pass per micro-step) move inside the node;
    the total stays the same. The copy is 1/h of each group in bf16, in memory_report and the estimate."""
    flat, hpz = world_4[0]["flat"], world_4[0]["hpz"]
    gathered = flat["scoped"]["inter_node:all_gather"]
    assert "intra_node:all_gather" not in flat["scoped"]
    backward = GAS * flat["unit_numel"] * 2  # bf16: one backward gather of every unit per micro-step
    assert hpz["scoped"]["intra_node:all_gather"] == backward
    assert hpz["scoped"]["inter_node:all_gather"] + backward == gathered
    assert flat["memory"]["params_secondary"] == 0
    want = sum(padded // 2 * size for padded, size in hpz["secondary"])
    assert hpz["memory"]["params_secondary"] == want
    assert hpz["memory"]["total"] == flat["memory"]["total"] + want
    psi = sum(p for p, _ in hpz["secondary"])
    est = estimate(psi, 4, 3, "bf16", hpz_partition_size=2)
    assert est["params_secondary"] == pytest.approx(want, rel=0.02)


def test_hpz_that_does_not_divide_the_shard_group_fails_before_any_work(world_4: list[dict]) -> None:
    for err in (r["refused"] for r in world_4):
        assert "hpz_partition_size 3 does not divide the shard group size 4" in err, err


def test_bad_hpz_config() -> None:
    from zeroray.config.load import load_config

    with pytest.raises(ConfigError, match="hpZ keeps a secondary copy of stage 3's sharded parameters; it needs stage 3"):
        ZeroConfig(stage=2, hpz_partition_size=2)
    with pytest.raises(ConfigError, match="must be a positive integer"):
        ZeroConfig(stage=3, hpz_partition_size=0)
    assert load_config({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}}).hpz_partition_size == 8
    assert load_config({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 1}}).hpz_partition_size is None
    with pytest.raises(ValueError, match="needs stage 3"):
        load_config({"zero_optimization": {"stage": 1, "zero_hpz_partition_size": 8}})
    with pytest.raises(ValueError, match="hpz_partition_size 3 does not divide the shard group size 8"):
        estimate(1e9, 8, 3, hpz_partition_size=3)
