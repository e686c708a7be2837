"""Cases drawn from DeepSpeed's ``tests/unit/runtime/zero/`` and PyTorch's FSDP tests, each against
the behaviour of plain PyTorch or DDP: fp32 buffers under bf16, masters from the built values,
parameters without a gradient left alone, a parameter unfrozen after set-up, ranks that run different
units, and units that are containers."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroray
from tests.support.dist import run_ranks
from zeroray.engine.gather_check import UnitMismatchError


class Rotary(nn.Module):
    """A Llama-style rotary embedding: an fp32 ``inv_freq`` buffer whose precision sets the angles."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)))
        self.proj = nn.Linear(d, d)

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        angles = pos[:, None].float() * self.inv_freq[None, :]
        return self.proj(torch.cat([angles.cos(), angles.sin()], -1).to(self.proj.weight.dtype))


@pytest.mark.parametrize("stage", [0, 3])
def test_bf16_keeps_floating_buffers_in_their_dtype_unless_buffer_dtype_says_otherwise(stage: int) -> None:
    # DeepSpeed's test_buffer_preserved_by_default; FSDP2's MixedPrecisionPolicy never casts buffers.
    model = Rotary()
    want = model.inv_freq.clone()
    engine = zeroray.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"bf16": {"enabled": True},
                                "zero_optimization": {"stage": stage}})
    assert model.inv_freq.dtype == torch.float32 and torch.equal(model.inv_freq, want)
    assert engine(torch.tensor([4096.0])).dtype == torch.bfloat16
    engine.close()

    model = Rotary()
    engine = zeroray.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {
        "bf16": {"enabled": True}, "data_types": {"buffer_dtype": "bf16"}, "zero_optimization": {"stage": stage}})
    assert model.inv_freq.dtype == torch.bfloat16 and torch.equal(model.inv_freq, want.bfloat16())
    engine.close()


def _masters(rank: int, world: int, swap: str) -> dict:
    out = {}
    for stage, offload in [(0, None), (1, None), (2, "cpu"), (3, None), (3, "cpu"), (3, "nvme")]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))
        built = {n: p.detach().clone() for n, p in model.named_parameters()}
        cfg = {"bf16": {"enabled": True}, "zero_optimization": {"stage": stage}}
        if offload:
            cfg["zero_optimization"]["offload_optimizer"] = {"device": offload, "nvme_path": swap}
        engine = zeroray.initialize(model, torch.optim.SGD(model.parameters(), lr=0.0), cfg)
        out[(stage, offload)] = (built, engine.full_state_dict())
        engine.close()
    return out


def test_bf16_masters_start_from_the_fp32_values_the_model_was_built_with(tmp_path) -> None:
    # FSDP2 keeps the fp32 values as its masters (test_fully_shard_mixed_precision); the low 16 bits
    # of every weight must survive set-up at every stage, with the masters in memory or in swap files.
    for res in run_ranks(_masters, 2, str(tmp_path)):
        for key, (built, state) in res.items():
            for name, value in built.items():
                assert torch.equal(state[name], value), (key, name)
                assert not torch.equal(value, value.bfloat16().float())  # the case has bits to lose


class Branchy(nn.Module):
    """Two heads: ``b`` runs only where ``use_b`` (an unused output, as in DeepSpeed's
    unused-parameter tests); ``c`` runs only on rank 0 (used somewhere, so stepped everywhere)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.c = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, use_b: bool, use_c: bool) -> torch.Tensor:
        y = torch.tanh(self.a(x))
        if use_b:
            y = self.b(y)
        if use_c:
            y = y + self.c(y)
        return (y * y).mean()


def _schedule(rank: int, c_on_rank0_only: bool = True) -> list[tuple[torch.Tensor, bool, bool]]:
    g = torch.Generator().manual_seed(rank)
    # b: unused at steps 0-1 on every rank (its first real update must be scaled as a first step), used later.
    return [(torch.randn(4, 6, generator=g), step >= 2, rank == 0 or not c_on_rank0_only) for step in range(4)]


def _unused(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    init = Branchy()
    out = {}
    # Stage 3 gathers c as a unit: every rank must run it (see the unit-mismatch test below).
    for stages, c_on_rank0_only in (((0, 1, 2), True), ((3,), False)):
        data = _schedule(rank, c_on_rank0_only)
        ref = copy.deepcopy(init)
        ddp = DDP(ref, find_unused_parameters=True)
        opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.5)
        for x, use_b, use_c in data:
            ddp(x, use_b, use_c).backward()
            opt.step()
            opt.zero_grad()
        for stage in stages:
            model = copy.deepcopy(init)
            engine = zeroray.initialize(model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.5),
                                        zeroray.ZeroConfig(stage=stage))
            for x, use_b, use_c in data:
                engine.backward(engine(x, use_b, use_c))
                engine.step()
            out[stage] = (engine.full_state_dict(), engine.state_meta()["param_steps"],
                          {n: p.detach().clone() for n, p in ref.named_parameters()})
            engine.close()
    return out


def test_parameters_without_a_gradient_are_not_stepped_as_under_ddp_with_find_unused_parameters() -> None:
    for res in run_ranks(_unused, 2):
        for stage in range(4):
            state, steps, ref = res[stage]
            for name, want in ref.items():
                torch.testing.assert_close(state[name], want, msg=f"stage {stage} {name}")
            assert steps == {"b.weight": 2, "b.bias": 2}, stage  # a and c: 4 steps (c on rank 0 only at stages 0-2)


def _frozen_late(rank: int, world: int) -> dict:
    out = {}
    for stage in range(4):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        engine = zeroray.initialize(model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5),
                                    zeroray.ZeroConfig(stage=stage))
        before = engine.full_state_dict()
        model[1].requires_grad_(False)  # after set-up: no gradient from now on, as in torch
        for _ in range(2):
            engine.backward(engine(torch.randn(2, 4)).sum())
            engine.step()
        out[stage] = (before, engine.full_state_dict())
        engine.close()
    return out


def test_a_parameter_frozen_after_initialize_stays_where_it_was() -> None:
    # AdamW's decoupled decay would move a parameter stepped with a zero gradient.
    for res in run_ranks(_frozen_late, 2):
        for stage in range(4):
            before, after = res[stage]
            assert torch.equal(after["1.weight"], before["1.weight"]) and torch.equal(after["1.bias"], before["1.bias"])
            assert not torch.equal(after["0.weight"], before["0.weight"])


@pytest.mark.parametrize("stage", [0, 3])
def test_unfreezing_a_parameter_frozen_at_initialize_is_an_error_naming_it(stage: int) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].requires_grad_(False)
    engine = zeroray.initialize(model, torch.optim.SGD([model[0].weight, model[0].bias], lr=0.1),
                                zeroray.ZeroConfig(stage=stage))
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    model[1].weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"parameter '1\.weight' was frozen .* when the engine was built"):
        engine.backward(engine(torch.randn(2, 4)).sum())
    engine.close()


class ChooseModuleByRank(nn.Module):
    """DeepSpeed's ChooseModuleByRankModel: rank r runs ``linears[r % 2]``."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank
        self.linears = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linears[self.rank % 2](x).sum()


def _by_rank(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = ChooseModuleByRank(rank)
    engine = zeroray.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), zeroray.ZeroConfig(stage=3))
    try:
        for _ in range(2):
            engine.backward(engine(torch.randn(2, 8)))
            engine.step()
    except UnitMismatchError as e:
        return str(e)
    finally:
        engine.abort("test")
        engine.close()
    return "no error"


def test_ranks_that_run_different_units_fail_on_every_rank_naming_the_units_and_ranks() -> None:
    for msg in run_ranks(_by_rank, 2):
        assert "rank 0 'linears.0/pg0'" in msg and "rank 1 'linears.1/pg0'" in msg, msg
        assert "one unit (config units=[...])" in msg


class MultiBlock(nn.Module):
    """DeepSpeed's MultiBlockFrozenModel shape: a ModuleList of ModuleLists, the inner lists' forward never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleList([nn.Linear(5, 5), nn.Linear(5, 5)]) for _ in range(2))
        self.blocks[0][1].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for pair in self.blocks:
            for layer in pair:
                x = torch.tanh(layer(x))
        return x.pow(2).mean()


def _multiblock(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    init = MultiBlock()
    g = torch.Generator().manual_seed(rank)
    data = [torch.randn(3, 5, generator=g) for _ in range(3)]
    ref = copy.deepcopy(init)
    ddp = DDP(ref)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=0.05)
    for x in data:
        ddp(x).backward()
        opt.step()
        opt.zero_grad()
    model = copy.deepcopy(init)
    engine = zeroray.initialize(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05),
                                zeroray.ZeroConfig(stage=3))
    for x in data:
        engine.backward(engine(x))
        engine.step()
    out = {"units": [n for n, _ in engine.units], "state": engine.full_state_dict(),
           "ref": {n: p.detach().clone() for n, p in ref.named_parameters()}}
    engine.close()
    return out


def test_stage3_units_descend_into_containers_whose_forward_never_runs() -> None:
    for res in run_ranks(_multiblock, 2):
        assert res["units"] == ["blocks.0.0", "blocks.0.1", "blocks.1.0", "blocks.1.1"]
        for name, want in res["ref"].items():
            torch.testing.assert_close(res["state"][name], want, msg=name)


def _resume_uneven(rank: int, world: int) -> dict:
    """Steps where ``b`` got no gradient, a save (shard state and JSON meta), a load into a new
    engine, more steps: as if never interrupted."""
    torch.manual_seed(0)
    init = Branchy()
    data = _schedule(rank, False) + _schedule(rank + 10, False)[2:]
    out = {}
    for stage in (1, 3):
        cfg = zeroray.ZeroConfig(stage=stage)
        make = lambda m: torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.5)  # noqa: E731
        whole = copy.deepcopy(init)
        engine = zeroray.initialize(whole, make(whole), cfg)
        for x, use_b, use_c in data:
            engine.backward(engine(x, use_b, use_c))
            engine.step()
        out[("whole", stage)] = engine.full_state_dict()
        engine.close()
        first = copy.deepcopy(init)
        engine = zeroray.initialize(first, make(first), cfg)
        for x, use_b, use_c in data[:2]:  # b unused in both: it never stepped before the save
            engine.backward(engine(x, use_b, use_c))
            engine.step()
        shards = {s.name: {k: t.clone() for k, t in s.tensors.items()} for s in engine.shard_state()}
        meta = json.loads(json.dumps(engine.state_meta()))
        engine.close()
        second = copy.deepcopy(init)
        engine = zeroray.initialize(second, make(second), cfg)
        engine.load_shard_state(shards, meta)
        for x, use_b, use_c in data[2:]:
            engine.backward(engine(x, use_b, use_c))
            engine.step()
        out[("resumed", stage)] = engine.full_state_dict()
        engine.close()
    return out


def test_a_checkpoint_keeps_the_step_count_of_a_parameter_that_missed_steps() -> None:
    for res in run_ranks(_resume_uneven, 2):
        for stage in (1, 3):
            for name, want in res[("whole", stage)].items():
                assert torch.equal(res[("resumed", stage)][name], want), (stage, name)


def test_bad_param_steps_in_a_checkpoint_fail_before_anything_changes() -> None:
    torch.manual_seed(0)
    model = Branchy()
    model.c.requires_grad_(False)  # a frozen group: written first by a load
    engine = zeroray.initialize(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]),
                                zeroray.ZeroConfig(stage=1))
    before = engine.full_state_dict()
    shards = {s.name: {k: torch.zeros_like(t) for k, t in s.tensors.items()} for s in engine.shard_state()}
    for bad in ({"b.weight": "2"}, {"b.weight": -1}, ["b.weight"]):
        with pytest.raises(ValueError, match="param_steps must map parameter names to step counts >= 0"):
            engine.load_shard_state(shards, {**engine.state_meta(), "param_steps": bad})
        after = engine.full_state_dict()
        assert all(torch.equal(after[n], t) for n, t in before.items())
    engine.close()
