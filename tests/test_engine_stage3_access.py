"""Stage 3: touching parameters outside forward/backward never crashes (issue #8).

The touching cases run in a spawned process (one for all of them, each case on a model and engine
of its own: a process each cost a fork, a process group and the module's import fifteen times): a
SIGSEGV there fails the tests instead of killing pytest. Every torch call that would read or write a
freed parameter raises an error naming it and the way out (``engine.gathered_parameters()``),
metadata works, ``print`` describes the shard, and state_dict, load_state_dict, a parameter used
outside its unit and a second initialize get errors of their own.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import math

import pytest
import torch
from torch import nn

import zeroray
from tests.support.dist import run_ranks
from tests.support.models import TinyLM, batches
from tests.support.recipe import optimizer, train


def _engine(stage: int = 3, model: nn.Module | None = None, **cfg) -> tuple[nn.Module, zeroray.ZeroEngine]:
    torch.manual_seed(0)
    model = model if model is not None else TinyLM()
    engine = zeroray.initialize(model, optimizer(model), zeroray.ZeroConfig(stage=stage, **cfg))
    return model, engine


def _touch(rank: int, world: int, case: str) -> str:
    model, engine = _engine()
    train(engine, batches(rank, 2))
    p = model.h[0].fc.weight
    try:
        if case == "sum":
            return f"value {float(p.sum())}"
        if case == "print":
            return f"printed {p}"
        if case == "clone":
            c = p.detach().clone()
            return f"clone {tuple(c.shape)} {float(c.sum())}"
        if case == "copy_":
            with torch.no_grad():
                p.copy_(torch.ones(p.shape))
            return "copied"
        if case == "data":
            return f"value {float(p.data.sum())}"
        if case == "ema":
            ema = torch.zeros(p.shape)
            ema.mul_(0.9).add_(p, alpha=0.1)
            return "ema"
        if case == "deepcopy":
            copy.deepcopy(model)
            return "copied"
        if case == "metadata":
            return f"metadata {tuple(p.shape)} {p.numel()} {p.dtype} {p.requires_grad} {p.grad} {p.dim()}"
        if case == "inside_gathered":
            with engine.gathered_parameters([p]):
                inside = float(p.sum())
            return f"inside {inside == float(engine.full_state_dict()['h.0.fc.weight'].sum())}"
        if case == "closed":
            engine.close()
            return f"closed {type(p) is nn.Parameter} {float(p.sum()) == float(p.detach().clone().sum())}"
        if case == "clip_grad_norm_":
            return f"norm {float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))}"
        if case == "state_dict":
            model.state_dict()
            return "no error"
        if case == "torch.save":
            buf = io.BytesIO()
            torch.save(model.state_dict(), buf)
            return "no error"
        if case == "initialize_again":
            zeroray.initialize(model, torch.optim.AdamW(model.parameters()), zeroray.ZeroConfig(stage=3))
            return "no error"
        if case == "load_state_dict":
            model.load_state_dict(engine.full_state_dict())
            return "no error"
    except RuntimeError as e:
        return f"error {e}"
    raise AssertionError(case)


TOUCHES = [
    ("sum", "error zeroray stage 3: parameter 'h.0.fc.weight' of unit 'h.0' is sharded across ranks and not gathered now, so sum() cannot use it. On every rank, use it inside `with engine.gathered_parameters([p]):`"),
    ("print", "printed Parameter(zeroray stage-3 shard of 'h.0.fc.weight' in unit 'h.0', not gathered: shape=(40, 13)"),
    ("clone", "error zeroray stage 3: parameter 'h.0.fc.weight' of unit 'h.0' is sharded across ranks and not gathered now, so detach() cannot use it"),
    ("copy_", "error zeroray stage 3: parameter 'h.0.fc.weight' of unit 'h.0' is sharded across ranks and not gathered now, so copy_() cannot use it"),
    ("data", "error zeroray stage 3: parameter 'h.0.fc.weight' of unit 'h.0' is sharded across ranks and not gathered now, so .data cannot use it"),
    ("ema", "error zeroray stage 3: parameter 'h.0.fc.weight' of unit 'h.0' is sharded across ranks and not gathered now, so add_() cannot use it"),
    ("deepcopy", "error zeroray stage 3: parameter 'wpe' of unit 'root' is sharded across ranks and not gathered now, so .data"),
    ("metadata", "metadata (40, 13) 520 torch.float32 True None 2"),
    ("inside_gathered", "inside True"),
    ("closed", "closed True True"),
    ("clip_grad_norm_", "norm 0.0"),  # zeroray keeps no .grad on parameters; engine.last_grad_norm
    ("state_dict", "error zeroray stage 3: 'wpe' is sharded across ranks, so module.state_dict()"),
    ("torch.save", "error zeroray stage 3: 'wpe' is sharded across ranks, so module.state_dict()"),
    ("load_state_dict", "error zeroray stage 3: 'wpe' is sharded across ranks, so load_state_dict()"),
    ("initialize_again", "error this TinyLM (or a module in it) is already held by a ZeroEngine; call engine.close() first"),
]


def _touch_each(rank: int, world: int, cases: list[str]) -> dict[str, str]:
    return {case: _touch(rank, world, case) for case in cases}


@pytest.fixture(scope="module")
def touched() -> dict[str, str]:
    """Every case of TOUCHES, one after the other in one spawned process: what each case gave."""
    (got,) = run_ranks(_touch_each, 1, [case for case, _ in TOUCHES])
    return got


@pytest.mark.parametrize("case, expect", TOUCHES)
def test_touching_a_freed_parameter_does_not_crash(touched: dict[str, str], case: str, expect: str) -> None:
    assert touched[case].startswith(expect), touched[case]


def _state_dict_inside_gathered(rank: int, world: int) -> dict:
    model, engine = _engine()
    train(engine, batches(rank, 2))
    full = engine.full_state_dict()
    with engine.gathered_parameters():
        sd = model.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)  # the file loads: real values, not views of freed memory
    buf.seek(0)
    loaded = torch.load(buf)
    return {"full": full, "loaded": {k: v for k, v in loaded.items() if k in full}, "keys": sorted(loaded)}


def test_state_dict_inside_gathered_parameters_holds_the_full_weights() -> None:
    for r in run_ranks(_state_dict_inside_gathered, 2):
        assert set(r["loaded"]) == set(r["full"])
        for k, v in r["full"].items():
            torch.testing.assert_close(r["loaded"][k], v, rtol=0, atol=0)


def _gathered_modifier(rank: int, world: int, stage: int, precision: str) -> dict:
    model, engine = _engine(stage, precision=precision)
    train(engine, batches(rank, 2))
    before = engine.full_state_dict()
    fc = model.h[1].fc
    with engine.gathered_parameters([fc.weight, fc.bias], modifier_rank=1):
        seen = fc.weight.detach().float().clone()
        with torch.no_grad():
            fc.weight.fill_(0.5 + rank)  # only rank 1's write counts
            fc.bias.zero_()
    after = engine.full_state_dict()
    with engine.gathered_parameters():
        everything = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    train(engine, batches(rank, 1))  # training goes on from the new values
    return {"before": before, "seen": seen, "after": after, "everything": everything, "trained": engine.full_state_dict()}


def _gathered_modifier_each(rank: int, world: int, stage: int, precisions: list[str]) -> dict[str, dict]:
    return {precision: _gathered_modifier(rank, world, stage, precision) for precision in precisions}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gathered_parameters_with_modifier_rank_reaches_every_shard_and_master(stage: int) -> None:
    by_rank = run_ranks(_gathered_modifier_each, 2, stage, ["fp32", "bf16"])  # one group for both precisions
    for precision in ("fp32", "bf16"):
        results = [r[precision] for r in by_rank]
        for r in results:
            dtype = torch.float32 if precision == "fp32" else torch.bfloat16  # the compute copy's values
            torch.testing.assert_close(r["seen"], r["before"]["h.1.fc.weight"].to(dtype).float(), rtol=0, atol=0)
            assert torch.all(r["after"]["h.1.fc.weight"] == 1.5) and torch.all(r["after"]["h.1.fc.bias"] == 0)
            for name, value in r["before"].items():
                if not name.startswith("h.1.fc."):
                    torch.testing.assert_close(r["after"][name], value, rtol=0, atol=0)
                # The compute copy is the master's cast (bf16 masters keep their own fp32 bits).
                torch.testing.assert_close(r["everything"][name], r["after"][name].to(dtype).float(), rtol=0, atol=0)
            assert not torch.equal(r["trained"]["h.1.fc.weight"], r["after"]["h.1.fc.weight"])
        for name in results[0]["trained"]:  # ranks agree
            torch.testing.assert_close(results[0]["trained"][name], results[1]["trained"][name], rtol=0, atol=0)


def _close_and_again(rank: int, world: int) -> dict:
    model, engine = _engine()
    train(engine, batches(rank, 2))
    full = engine.full_state_dict()
    engine.close()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    sd = model.state_dict()  # hooks are gone: plain module again
    engine2 = zeroray.initialize(model, optimizer(model), zeroray.ZeroConfig(stage=3))
    again = engine2.full_state_dict()
    train(engine2, batches(rank, 2))
    return {"full": full, "params": params, "sd": sorted(sd), "again": again, "loss": float(engine2(*batches(rank, 1)[0]))}


def test_close_puts_full_weights_back_and_the_model_can_be_wrapped_again() -> None:
    for r in run_ranks(_close_and_again, 2):
        for name, value in r["full"].items():
            torch.testing.assert_close(r["params"][name], value, rtol=0, atol=0)
            torch.testing.assert_close(r["again"][name], value, rtol=0, atol=0)
        assert "wte.weight" in r["sd"]
        assert math.isfinite(r["loss"])


@dataclasses.dataclass
class BlockOut:
    hidden: torch.Tensor
    aux: float


class DataclassBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> BlockOut:
        return BlockOut(torch.tanh(self.fc(x)), 1.0)


class DataclassNet(nn.Module):
    def __init__(self, d: int = 8, n: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(DataclassBlock(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x).hidden
        return x.pow(2).mean()


def _dataclass_outputs(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    init = DataclassNet()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    out = {}
    for stage in (0, 3):
        model = copy.deepcopy(init)
        engine = zeroray.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5), zeroray.ZeroConfig(stage=stage))
        losses = []
        for _ in range(3):
            loss = engine(x)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        out[stage] = (losses, engine.full_state_dict())
    return out


def test_units_returning_dataclasses_train_like_stage_0() -> None:
    for r in run_ranks(_dataclass_outputs, 2):
        torch.testing.assert_close(torch.tensor(r[3][0]), torch.tensor(r[0][0]))
        for name, value in r[0][1].items():
            torch.testing.assert_close(r[3][1][name], value)


class ReachesIntoAUnit(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.tanh(b(x))
        x = x @ self.blocks[0].weight  # blocks.0's weight, used outside blocks.0's forward
        return self.out(x).mean()


def _cross_unit(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = ReachesIntoAUnit()
    engine = zeroray.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), zeroray.ZeroConfig(stage=3))
    try:
        engine.backward(engine(torch.randn(2, 8)))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_unit_parameter_used_by_another_module_is_named() -> None:
    msg = run_ranks(_cross_unit, 2)[0]
    assert "parameter 'blocks.0.weight' of unit 'blocks.0' was used by matmul() outside that unit's forward" in msg
    assert "ZeroConfig(units=" in msg
