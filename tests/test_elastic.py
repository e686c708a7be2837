"""The elastic arithmetic, without Ray: which world sizes a batch rule allows, the batch sizes each gets,
the ranks' sample indices (the same samples in the same steps at any size), how many bundles nodes hold,
and how a group's batch sizes reach each form of config."""

from __future__ import annotations

import json

import pytest
import torch

from zeroray.config import ZeroConfig
from zeroray.config.load import load_config
from zeroray.train.config import ScalingConfig
from zeroray.train.driver.scaling_policy import ElasticScalingPolicy, fitting_workers
from zeroray.train.run_spec import RankInfo
from zeroray.train.sizing import BatchPlan, BatchSizes
from zeroray.train.worker.context import TrainContext, with_batch


def _plan(zero: dict, **scaling) -> BatchPlan:
    return BatchPlan.from_config(load_config(zero, defer=True), ScalingConfig(**scaling))


def test_global_batch_rule_recomputes_accumulation_at_exact_sizes_only():
    plan = _plan({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2}, num_workers=(1, 5))
    sizes = {w: plan.for_world(w) for w in range(1, 6) if plan.feasible(w)}
    assert sizes == {1: BatchSizes(24, 2, 12), 2: BatchSizes(24, 2, 6), 3: BatchSizes(24, 2, 4), 4: BatchSizes(24, 2, 3)}
    assert not plan.feasible(5) and plan.samples_per_step == 24
    policy = ElasticScalingPolicy(ScalingConfig(num_workers=(1, 5)), plan)
    assert [policy.largest_feasible(n) for n in (0, 1, 4, 5, 9)] == [None, 1, 4, 4, 4]  # DeepSpeed-elasticity style


def test_global_batch_rule_without_micro_keeps_accumulation_and_recomputes_micro():
    plan = _plan({"train_batch_size": 12, "gradient_accumulation_steps": 2}, num_workers=(1, 4))
    assert [plan.for_world(w) for w in (1, 2, 3)] == [BatchSizes(12, 6, 2), BatchSizes(12, 3, 2), BatchSizes(12, 2, 2)]
    assert not plan.feasible(4)


def test_micro_rule_keeps_micro_and_accumulation_and_lets_the_global_batch_follow():
    plan = _plan({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, num_workers=(1, 3),
                 elastic_batch="micro")
    assert [plan.for_world(w) for w in (1, 3)] == [BatchSizes(6, 2, 3), BatchSizes(18, 2, 3)]
    assert plan.samples_per_step is None


def test_fixed_size_or_no_batch_sizes_leave_the_config_as_given():
    assert _plan({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2}, num_workers=2).for_world(2) is None
    assert _plan({}, num_workers=(1, 3)).for_world(3) is None


def test_an_integer_shard_group_size_keeps_whole_shard_groups_across_resizes():
    plan = _plan({"zero_optimization": {"stage": 3, "mics_shard_size": 2}}, num_workers=(1, 6))
    assert [w for w in range(1, 7) if plan.feasible(w)] == [2, 4, 6]
    assert plan.for_world(4) is None  # no batch sizes given: the config as it is
    policy = ElasticScalingPolicy(ScalingConfig(num_workers=(1, 6)), plan)
    assert [policy.largest_feasible(n) for n in (1, 3, 5, 9)] == [None, 2, 4, 6]
    both = _plan({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2, "zero_optimization":
                  {"stage": 3, "mics_shard_size": 2, "zero_hpz_partition_size": 3}}, num_workers=(1, 6))
    assert [w for w in range(1, 7) if both.feasible(w)] == [6] and both.for_world(6) == BatchSizes(24, 2, 2)
    assert _plan({"zero_optimization": {"stage": 3, "mics_shard_size": "auto"}}, num_workers=(1, 3)).feasible(3)
    with pytest.raises(ValueError, match=r"no world size between min_workers=3 and max_workers=3 is a multiple of "
                                         r"shard_group_size / hpz_partition_size \(2\)"):
        _plan({"zero_optimization": {"stage": 2, "mics_shard_size": 2}}, num_workers=(3, 3))


def test_sample_indices_cover_the_same_global_batch_at_every_world_size():
    sizes = BatchPlan("global", 24, 2, None)
    for step in (0, 7):
        seen = {}
        for world in (1, 2, 3, 4):
            batch = sizes.for_world(world)
            indices = []
            for rank in range(world):
                ctx = TrainContext(RankInfo(rank, world, rank, world, 0), "r", "/tmp", torch.device("cpu"), batch=batch)
                for micro in range(batch.gradient_accumulation_steps):
                    indices.extend(ctx.sample_indices(step, micro))
            seen[world] = sorted(indices)
            assert len(indices) == len(set(indices))
        assert all(v == list(range(step * 24, (step + 1) * 24)) for v in seen.values()), seen


def test_sample_indices_need_batch_sizes():
    ctx = TrainContext(RankInfo(0, 1, 0, 1, 0), "r", "/tmp", torch.device("cpu"))
    with pytest.raises(RuntimeError, match="needs the batch sizes: set train_batch_size"):
        ctx.sample_indices(0)


def test_fitting_workers_counts_whole_bundles_per_node():
    nodes = {"a": {"CPU": 3.0, "GPU": 1.0}, "b": {"CPU": 1.5}, "c": {"CPU": 4.0, "GPU": 2.0}}
    assert fitting_workers(nodes, {"CPU": 1.0}) == 3 + 1 + 4
    assert fitting_workers(nodes, {"CPU": 2.0, "GPU": 1.0}) == 1 + 0 + 2


def test_a_groups_batch_sizes_reach_every_form_of_config(tmp_path):
    sizes = BatchSizes(24, 2, 4)
    expected = {"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}
    ds = {"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 6,
          "zero_optimization": {"stage": 3}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    for given in (ds, str(path), ZeroConfig(stage=3, train_batch_size=24, train_micro_batch_size_per_gpu=2), None):
        cfg = load_config(with_batch(given, sizes))
        got = {k: getattr(cfg, k) for k in expected}
        assert got == expected, given
        assert cfg.resolve_batch(3).gradient_accumulation_steps == 4
    assert with_batch(ds, None) is ds
