"""Bad input fails with a message naming the problem, before any communication."""

from __future__ import annotations

import datetime
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroray
from tests.support.dist import run_ranks


def test_stage_out_of_range() -> None:
    with pytest.raises(ValueError, match="stage: must be 0, 1, 2 or 3, got 5"):
        zeroray.ZeroConfig(stage=5)
    with pytest.raises(ValueError, match="zero_optimization.stage"):
        zeroray.load_config({"zero_optimization": {"stage": 5}})


def test_fp16_and_bf16_both_on() -> None:
    with pytest.raises(ValueError, match="'fp16.enabled' and 'bf16.enabled' both set"):
        zeroray.load_config({"fp16": {"enabled": True}, "bf16": {"enabled": True}})


def test_optimizer_over_foreign_parameters() -> None:
    model, other = nn.Linear(4, 4), nn.Linear(4, 4)
    opt = torch.optim.AdamW([*model.parameters(), other.weight])
    with pytest.raises(ValueError, match=r"1 parameter\(s\) that are not parameters of the model"):
        zeroray.initialize(model, opt, zeroray.ZeroConfig(stage=2))


def test_trainable_parameter_missing_from_optimizer() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"parameter '1.weight' requires grad but is in no param group"):
        zeroray.initialize(model, opt, zeroray.ZeroConfig(stage=1))


def test_no_optimizer_anywhere() -> None:
    with pytest.raises(ValueError, match="no optimizer"):
        zeroray.initialize(nn.Linear(2, 2), None, zeroray.ZeroConfig())


def test_optimizer_named_in_config() -> None:
    model = nn.Linear(3, 3)
    engine = zeroray.initialize(model, None, {"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}}})
    assert type(engine.optimizer) is torch.optim.AdamW
    assert engine.optimizer.param_groups[0]["lr"] == 0.01
    assert engine.optimizer.param_groups[0]["weight_decay"] == 0.1


def test_loss_backward_without_engine_is_explained() -> None:
    model = nn.Linear(3, 1)
    engine = zeroray.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), zeroray.ZeroConfig(stage=2))
    with pytest.raises(RuntimeError, match=r"call engine.backward\(loss\)"):
        engine(torch.randn(2, 3)).sum().backward()


def _bad_batch_on_rank0(rank: int, world: int) -> str:
    """Only rank 0 calls initialize: any collective inside it would time out instead of raising."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=20))
    if rank != 0:
        return "idle"
    model = nn.Linear(4, 4)
    cfg = {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
    try:
        zeroray.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg, process_group=group)
    except ValueError as e:
        return str(e)
    return "no error"


def test_batch_sizes_that_do_not_multiply_fail_before_communication() -> None:
    msg = run_ranks(_bad_batch_on_rank0, 2)[0]
    assert "train_batch_size (10) must equal train_micro_batch_size_per_gpu (2) x gradient_accumulation_steps (2) x data-parallel world size (2) = 8" in msg


def test_stepping_the_users_optimizer_is_explained() -> None:
    model = nn.Linear(3, 1)
    opt = torch.optim.AdamW(model.parameters())
    engine = zeroray.initialize(model, opt, zeroray.ZeroConfig(stage=1))
    engine.backward(engine(torch.randn(2, 3)).sum())
    with pytest.raises(RuntimeError, match=r"call engine.step\(\), not optimizer.step\(\)"):
        opt.step()
    engine.step()  # the engine's own optimizer is another instance: the hook is per instance
    assert engine.global_step == 1
    engine.close()
    opt.step()  # close() gives the optimizer back


def test_optimizer_block_ignored_when_an_optimizer_is_passed_warns() -> None:
    model = nn.Linear(3, 3)
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    with pytest.warns(UserWarning, match=r"the config's 'optimizer' block \('AdamW'\) is ignored: .* given an optimizer \(SGD\)") as rec:
        engine = zeroray.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5), cfg)
    assert rec[0].filename == __file__  # points at the caller's initialize line
    assert type(engine.optimizer) is torch.optim.SGD
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zeroray.initialize(nn.Linear(3, 3), None, cfg)
        zeroray.initialize(model := nn.Linear(3, 3), torch.optim.SGD(model.parameters(), lr=0.5), {})


def _warnings_per_rank(rank: int, world: int) -> int:
    model = nn.Linear(3, 3)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        engine = zeroray.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5), {"optimizer": {"type": "AdamW"}})
    engine.close()
    return sum("'optimizer' block" in str(w.message) for w in rec)


def test_the_ignored_optimizer_block_is_said_once_for_all_ranks() -> None:
    assert run_ranks(_warnings_per_rank, 2) == [1, 0]
