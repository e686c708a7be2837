"""Hybrid sharding (MiCS / HSDP): states sharded over groups of k ranks, replicated across the groups.

Against torch DDP with the same recipe, at world 4 (k = 2) and world 6 (k = 2 and 3), stages 1-3, with
FSDP2 HSDP (``fully_shard`` on a 2-D mesh, gloo) run on the same data as the yardstick. The first
step's global gradient norm must equal DDP's to rounding: a wrong scale or a missed replica shows there.
After that the recipe amplifies rounding: AdamW turns summation-order differences in tiny gradient
components into weight differences, so by step 3 any two reduction orders differ by up to ~1e-4 at world
6 (zeroray flat, FSDP2 HSDP and zeroray hybrid alike; gloo sums deterministically, so the numbers repeat).
The weights and losses must stay within 3x the largest distance of HSDP's runs at that world size (or a
rounding floor). Then the
bytes each collective scope moves against the formulas, checkpoints across k and world sizes, and the
errors for bad input.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist

import zeroray
import zeroray.checkpoint as zc
from tests.support.checkpoint import assemble, assert_same, snapshot
from tests.support.dist import run_ranks
from tests.support.models import TinyLM, batches
from tests.support.recipe import (
    FLOOR,
    GAS,
    OPT_STEPS,
    config,
    fsdp2_run,
    loss_distance,
    optimizer,
    reference,
    train,
    weight_distance,
    zero_run,
)
from zeroray.config import ConfigError, ZeroConfig

NORM_RTOL = {"fp32": 1e-5, "bf16": 2e-2}


def _parity(rank: int, world: int, ks: list[int], precisions: list[str]) -> dict:
    data = batches(rank, GAS * OPT_STEPS)
    torch.manual_seed(0)
    init = TinyLM()
    out = {"ref": reference(rank, copy.deepcopy(init), data)}
    for precision in precisions:
        for k in ks:
            out[("hsdp", k, precision)] = fsdp2_run(copy.deepcopy(init), data, precision, k=k)
            for stage in (1, 2, 3):
                out[(stage, k, precision)] = zero_run(copy.deepcopy(init), data, stage, precision, shard_group_size=k)
    return out



@pytest.mark.parametrize(("world", "ks", "precisions"), [(4, [2], ["fp32", "bf16"]), (6, [2, 3], ["fp32"])])
def test_hybrid_matches_ddp_as_closely_as_fsdp2_hsdp(world: int, ks: list[int], precisions: list[str]) -> None:
    results = run_ranks(_parity, world, ks, precisions)
    for precision in precisions:
        hsdp_w = max(weight_distance(r[("hsdp", k, precision)][1], r["ref"][1]) for r in results for k in ks)
        hsdp_l = max(loss_distance(r[("hsdp", k, precision)][0], r["ref"][0]) for r in results for k in ks)
        w_tol, l_tol = 3 * max(hsdp_w, FLOOR[precision]), 3 * max(hsdp_l, FLOOR[precision])
        for rank, res in enumerate(results):
            ref_losses, ref_state, ref_norms = res["ref"]
            for k in ks:
                for stage in (1, 2, 3):
                    losses, state, norms = res[(stage, k, precision)]
                    what = f"rank {rank} stage {stage} k {k} {precision}"
                    torch.testing.assert_close(norms[0], ref_norms[0], rtol=NORM_RTOL[precision], atol=0, msg=what)
                    assert list(state) == list(ref_state), what
                    assert weight_distance(state, ref_state) <= w_tol, (what, weight_distance(state, ref_state), w_tol)
                    assert loss_distance(losses, ref_losses) <= l_tol, (what, loss_distance(losses, ref_losses), l_tol)



def _bytes(rank: int, world: int, k: int, stage: int) -> dict:
    """One optimizer step's bytes by scope, with ranks [0, k) on node a, [k, 2k) on node b..."""
    data = batches(rank, GAS)
    torch.manual_seed(0)
    model = TinyLM()
    nodes = [f"node-{r // k}" for r in range(world)]
    engine = zeroray.initialize(model, optimizer(model), config(stage, "fp32", shard_group_size=k), nodes=nodes)
    train(engine, data)
    # The same run flat on this rank's node alone (a group of its k ranks): what one shard group moves.
    node, _ = dist.new_subgroups(k)
    torch.manual_seed(0)
    alone = TinyLM()
    flat = zeroray.initialize(alone, optimizer(alone), config(stage, "fp32"), process_group=node)
    train(flat, data)
    out = {
        "flat": flat.comm_report(),
        "scoped": engine.comm_report(by_scope=True),
        "kinds": engine.comm_report(),
        "padded": {g.name: (g.padded, g.trainable) for g in engine.groups},
        "memory": engine.memory_report(),
    }
    engine.close()
    flat.close()
    return out


def _bytes_each(rank: int, world: int, k: int, stages: list[int]) -> dict[int, dict]:
    return {stage: _bytes(rank, world, k, stage) for stage in stages}


@pytest.fixture(scope="module")
def bytes_by_stage() -> list[dict[int, dict]]:
    """:func:`_bytes` at world 4, k = 2, for stages 1-3 one after the other in one group (each stage's engines
    count their own bytes): per rank, by stage."""
    return run_ranks(_bytes_each, 4, 2, [1, 2, 3])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bytes_by_scope_follow_the_formulas(bytes_by_stage: list[dict[int, dict]], stage: int) -> None:
    """World 4, k = 2 on two nodes: only the all-reduce of each gradient shard over its 2 replicas crosses
    nodes: 2 x (Ψ/k) x 4 bytes per reduction (once per step at stage 1, per micro-step at 2-3). Inside a
    node each shard group moves exactly what the same run flat over that node's k ranks moves."""
    k = 2
    res = [r[stage] for r in bytes_by_stage]
    psi_trainable = sum(p for p, t in res[0]["padded"].values() if t)
    reductions = 1 if stage == 1 else GAS
    for r in res:
        scoped = r["scoped"]
        assert sum(scoped.values()) == sum(r["kinds"].values())
        inter = sum(v for key, v in scoped.items() if key.startswith("inter_node:"))
        assert set(scoped) - {f"intra_node:{kind}" for kind in r["kinds"]} == {"inter_node:all_reduce"}
        want = reductions * 2 * (psi_trainable // k) * 4
        assert abs(inter - want) <= 0.02 * want, (inter, want)
        intra = {key.removeprefix("intra_node:"): v for key, v in scoped.items() if key.startswith("intra_node:")}
        assert intra == r["flat"], (intra, r["flat"])
        if stage < 3:  # gradients all-reduced on gloo (2Ψ), the step's new weights gathered (Ψ), the norm's sum
            assert sum(intra.values()) == reductions * 2 * psi_trainable * 4 + psi_trainable * 4 + 2 * 4


def _memory(rank: int, world: int, k: int) -> dict:
    torch.manual_seed(0)
    model = TinyLM()
    engine = zeroray.initialize(model, optimizer(model), ZeroConfig(stage=3, shard_group_size=k))
    report = engine.memory_report()
    engine.close()
    return report


def test_memory_follows_the_shard_group_not_the_world() -> None:
    """At stage 3 a rank holds 1/k of the states (not 1/N): world 4 at k = 2 holds what world 2 flat does."""
    hybrid = run_ranks(_memory, 4, 2)
    flat = run_ranks(_memory, 2, None)
    for key in ("params", "grads", "optimizer"):
        assert hybrid[0][key] == flat[0][key], key
        assert hybrid[3][key] == flat[1][key], key


def _save(rank: int, world: int, url: str, stage: int, k: int | None, steps: int) -> dict:
    torch.manual_seed(0)
    model = TinyLM()
    engine = zeroray.initialize(model, optimizer(model), config(stage, "fp32", shard_group_size=k))
    train(engine, batches(rank, GAS * steps))
    zc.save(engine, url)
    state = snapshot(engine)
    engine.close()
    return state


def _load_and_save(rank: int, world: int, src: str, dst: str, stage: int, k: int | None) -> dict:
    torch.manual_seed(1)  # other initial weights: the load must replace all of them
    model = TinyLM()
    engine = zeroray.initialize(model, optimizer(model), config(stage, "fp32", shard_group_size=k))
    zc.load(engine, src)
    state = snapshot(engine)
    zc.save(engine, dst)
    engine.close()
    return state


def test_checkpoints_go_hybrid_to_flat_to_hybrid_at_another_k(tmp_path) -> None:
    """Saved at world 4, k = 2 (each shard written once, by one replica group); loaded flat at world 2 and
    saved again; loaded at world 6, k = 3 and saved again: every save holds the same tensors."""
    a, b, c = (str(tmp_path / n) for n in ("hybrid4", "flat2", "hybrid6"))
    saved = assemble(run_ranks(_save, 4, a, 3, 2, OPT_STEPS))
    assert saved["meta"]["global_step"] == OPT_STEPS
    assert_same(assemble(run_ranks(_load_and_save, 2, a, b, 2, None)), saved, "hybrid k=2 -> flat world 2")
    assert_same(assemble(run_ranks(_load_and_save, 6, b, c, 3, 3)), saved, "flat -> hybrid world 6, k=3")
    again = assemble(run_ranks(_load_and_save, 4, c, str(tmp_path / "again"), 1, 2))
    assert_same(again, saved, "hybrid k=3 -> hybrid world 4, k=2 at stage 1")


def _refused(rank: int, world: int, kwargs: dict) -> str:
    model = TinyLM()
    try:
        zeroray.initialize(model, optimizer(model), **kwargs)
    except (ValueError, ConfigError) as e:
        return str(e)
    return "no error"


BAD_HYBRID = [
    ({"config": ZeroConfig(stage=2, shard_group_size=4)}, "shard_group_size 4 does not divide the world size 6"),
    ({"config": ZeroConfig(stage=2, shard_group_size="auto")}, "shard_group_size 'auto' needs each rank's node"),
    ({"config": ZeroConfig(stage=2), "nodes": ["a", "b"]}, "nodes names 2 ranks' nodes, but the process group has 6"),
]


def _refused_each(rank: int, world: int, cases: list[dict]) -> list[str]:
    return [_refused(rank, world, kwargs) for kwargs in cases]


@pytest.fixture(scope="module")
def refusals() -> list[list[str]]:
    """Every case of BAD_HYBRID, one after the other in one group of 6 (a refusal does no collective work, so
    the next case meets an untouched group): per rank, each case's error."""
    return run_ranks(_refused_each, 6, [kwargs for kwargs, _ in BAD_HYBRID])


@pytest.mark.parametrize("case", range(len(BAD_HYBRID)), ids=[message for _, message in BAD_HYBRID])
def test_bad_hybrid_input_fails_before_any_work(refusals: list[list[str]], case: int) -> None:
    message = BAD_HYBRID[case][1]
    for errors in refusals:
        assert message in errors[case], errors[case]


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"zero_optimization": {"stage": 0, "mics_shard_size": 2}}, "hybrid sharding applies to stages 1-3"),
        ({"zero_optimization": {"stage": 3, "mics_shard_size": 2, "mics_hierarchical_params_gather": True}},
         "gathers need no hierarchy"),
        ({"zero_optimization": {"stage": 3, "mics_shard_size": 0.5}}, "must be a positive integer"),
    ],
)
def test_bad_deepspeed_mics_keys(cfg: dict, message: str) -> None:
    from zeroray.config.load import load_config

    with pytest.raises(ValueError, match=message):
        load_config(cfg)


def test_deepspeed_mics_shard_size_maps_to_shard_group_size() -> None:
    from zeroray.config.load import load_config

    assert load_config({"zero_optimization": {"stage": 3, "mics_shard_size": 8}}).shard_group_size == 8
    assert load_config({"zero_optimization": {"stage": 3, "mics_shard_size": -1}}).shard_group_size is None
    assert load_config({"zero_optimization": {"stage": 1, "mics_shard_size": "auto"}}).shard_group_size == "auto"


def _mesh(rank: int, world: int) -> dict:
    """A DeviceMesh given instead of shard_group_size: the same groups, the same result."""
    from torch.distributed.device_mesh import init_device_mesh

    data = batches(rank, GAS * OPT_STEPS)
    torch.manual_seed(0)
    init = TinyLM()
    out = {}
    for how in ("k", "mesh"):
        model = copy.deepcopy(init)
        if how == "k":
            engine = zeroray.initialize(model, optimizer(model), config(3, "fp32", shard_group_size=2))
        else:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            engine = zeroray.initialize(model, optimizer(model), config(3, "fp32"), mesh=mesh)
        out[how] = (train(engine, data), engine.full_state_dict(), engine.topology.shard_size)
        engine.close()
    with contextlib.suppress(ValueError):
        bad = init_device_mesh("cpu", (4,), mesh_dim_names=("shard",))
        model = copy.deepcopy(init)
        zeroray.initialize(model, optimizer(model), config(3, "fp32"), mesh=bad)
        out["bad"] = "accepted"
    return out


def test_a_device_mesh_gives_the_same_run_as_shard_group_size() -> None:
    for res in run_ranks(_mesh, 4):
        assert "bad" not in res
        (la, sa, ka), (lb, sb, kb) = res["k"], res["mesh"]
        assert la == lb and ka == kb == 2
        for name in sa:
            assert torch.equal(sa[name], sb[name]), name


def test_auto_is_the_ranks_per_node_and_unequal_nodes_are_named() -> None:
    """ZeroTrainer's "auto" (zeroray.train.worker.preparation); the run on two Ray nodes is in
    test_netcluster_hybrid.py."""
    from zeroray.train.worker.preparation import ranks_per_node

    assert ranks_per_node(["node-0"] * 4 + ["node-1"] * 4) == 4
    with pytest.raises(ValueError, match=r"the ranks per node are: node-0 2, node-1 1; give an integer"):
        ranks_per_node(["node-0", "node-0", "node-1"])
