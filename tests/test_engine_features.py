"""Engine behaviours beyond parity: units, optimizer forms, silence off the accumulation boundary,
fp16 overflow agreement, stage-3 evaluation."""

from __future__ import annotations

import copy

import torch
from torch import nn

import zeroray
from tests.support.dist import run_ranks
from tests.support.models import Block, TinyLM, batches, param_groups
from tests.support.recipe import train


def test_units_default_to_modulelist_blocks_and_can_be_named() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    engine = zeroray.initialize(model, torch.optim.AdamW(param_groups(model)), zeroray.ZeroConfig(stage=3))
    names = [g.name for g in engine.groups]
    assert names[:3] == ["root/pg0", "root/pg1", "root/frozen"]  # tied wte/head, gate, frozen, ...
    assert {n.split("/")[0] for n in names[3:]} == {"h.0", "h.1", "h.2"}
    # Tied weight: one slot in the root unit, named as model.named_parameters() names it.
    assert sum(slot.name == "wte.weight" for g in engine.groups for slot in g.slots) == 1

    model = TinyLM()
    engine = zeroray.initialize(model, torch.optim.AdamW(param_groups(model)), {"zero_optimization": {"stage": 3, "zeroray_units": ["Block", "gate"]}})
    assert {g.name.split("/")[0] for g in engine.groups} == {"root", "h.0", "h.1", "h.2", "gate"}
    assert all(isinstance(m, (Block, nn.Linear)) for _, m in engine.units)


def test_optimizer_forms_keep_groups_and_hyperparameters() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    engine = zeroray.initialize(model, torch.optim.AdamW(param_groups(model, 0.3), lr=0.02, betas=(0.8, 0.9)), zeroray.ZeroConfig(stage=2))
    groups = engine.optimizer.param_groups
    assert type(engine.optimizer) is torch.optim.AdamW and len(groups) == 2
    assert [g["weight_decay"] for g in groups] == [0.3, 0.0]
    assert all(g["lr"] == 0.02 and tuple(g["betas"]) == (0.8, 0.9) for g in groups)

    model = TinyLM()
    engine = zeroray.initialize(model, lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9), zeroray.ZeroConfig(stage=1))
    assert type(engine.optimizer) is torch.optim.SGD and engine.optimizer.param_groups[0]["momentum"] == 0.9


def test_scheduler_from_config_steps_at_boundaries() -> None:
    model = nn.Linear(4, 4)
    cfg = {
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1.0, "warmup_num_steps": 4, "warmup_type": "linear"}},
    }
    engine = zeroray.initialize(model, None, cfg)
    lrs = []
    for _ in range(6):
        engine.backward(engine(torch.randn(2, 4)).sum())
        engine.step()
        lrs.append(engine.optimizer.param_groups[0]["lr"])
    assert engine.global_step == 3
    # The LR moves only when the optimizer steps (micro-steps 2, 4, 6), and it warms up.
    assert lrs[1] == lrs[2] and lrs[3] == lrs[4]
    assert lrs[1] < lrs[3] < lrs[5]


def _silent_off_boundary(rank: int, world: int) -> dict:
    out = {}
    data = batches(rank, 4)
    for stage in range(4):
        torch.manual_seed(0)
        model = TinyLM()
        engine = zeroray.initialize(model, torch.optim.AdamW(param_groups(model)), zeroray.ZeroConfig(stage=stage, gradient_accumulation_steps=2))
        sizes = []
        for x, y in data:
            engine.backward(engine(x, y))
            engine.step()
            sizes.append(sum(engine.comm_report().values()))
            engine.reset_comm_report()
        out[stage] = sizes
    return out


def test_no_communication_off_the_boundary_where_the_stage_allows() -> None:
    res = run_ranks(_silent_off_boundary, 2)[0]
    for stage in (0, 1):
        assert res[stage][0] == 0 and res[stage][2] == 0, res[stage]
        assert res[stage][1] > 0 and res[stage][3] > 0
    assert res[2][0] > 0  # stage 2 keeps only a gradient shard: it must reduce every micro-step
    assert res[3][0] > 0


def _fp16_overflow(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    ref = copy.deepcopy(model)
    cfg = {"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}, "zero_optimization": {"stage": 2}}
    engine = zeroray.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    scales, steps = [], []
    x = torch.randn(4, 8, dtype=torch.float16)
    for i in range(3):
        loss = engine(x).float().mean()
        if i == 1 and rank == 1:
            loss = loss * float("inf")  # only one rank overflows
        engine.backward(loss)
        engine.step()
        scales.append(engine.loss_scaler.scale)
        steps.append(engine.skipped_steps)
    return {"scales": scales, "skipped": steps, "moved": engine.full_state_dict(), "init": {n: p.detach().float() for n, p in ref.named_parameters()}}


def test_fp16_overflow_on_one_rank_skips_the_step_on_all() -> None:
    r0, r1 = run_ranks(_fp16_overflow, 2)
    for r in (r0, r1):
        assert r["scales"] == [256.0, 128.0, 128.0]
        assert r["skipped"] == [0, 1, 1]
    for name in r0["moved"]:
        torch.testing.assert_close(r0["moved"][name], r1["moved"][name], rtol=0, atol=0)
        assert not torch.equal(r0["moved"][name], r0["init"][name])  # the clean steps did update


def _stage3_eval(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = TinyLM()
    ref = copy.deepcopy(model)
    engine = zeroray.initialize(model, torch.optim.AdamW(param_groups(model)), zeroray.ZeroConfig(stage=3))
    x, y = batches(rank, 1)[0]
    with torch.no_grad():
        got = engine(x, y)
        again = engine(x, y)
    return {"got": got, "again": again, "ref": ref(x, y).detach(), "freed": [g.full.untyped_storage().size() for g in engine.groups]}


def test_stage3_eval_under_no_grad_gathers_and_frees() -> None:
    for r in run_ranks(_stage3_eval, 2):
        torch.testing.assert_close(r["got"], r["ref"])
        assert torch.equal(r["got"], r["again"])
        assert r["freed"] == [0] * len(r["freed"])  # nothing stays gathered after forward


def _cast_runs(rank: int, world: int, cast_run: int | None) -> dict:
    torch.manual_seed(0)
    model = TinyLM()
    engine = zeroray.initialize(model, torch.optim.AdamW(param_groups(model), lr=1e-2),
                                zeroray.ZeroConfig(stage=3, precision="bf16", gradient_clipping=0.5))
    steps: list[int] = []
    if cast_run is not None:
        engine.optim.cast_run = cast_run
        inner = engine.optim.optimizer
        inner.register_step_post_hook(lambda opt, args, kwargs: steps.append(1))
    losses = train(engine, batches(rank, 4))
    return {"losses": losses, "state": engine.full_state_dict(), "calls": len(steps),
            "pieces": len(engine.optim.sub_groups[0].pieces), "lazy": engine.optim.grads().lazy}


def test_bf16_gradients_cast_in_runs_give_the_same_bits() -> None:
    """16-bit gradient shards are cast to fp32 a run of pieces at a time (not a whole sub-group: 4 GB at
    DeepSpeed's default sub_group_size); stepping the sub-group in runs changes no bit."""
    whole = run_ranks(_cast_runs, 2, None)
    split = run_ranks(_cast_runs, 2, 1)  # every piece its own run
    for w, s in zip(whole, split):
        assert s["lazy"] and s["calls"] == 4 * s["pieces"]  # one optimizer call per piece per step
        assert w["losses"] == s["losses"]
        for name, t in w["state"].items():
            assert torch.equal(t, s["state"][name]), name
