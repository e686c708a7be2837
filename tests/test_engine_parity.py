"""Stages 0-3 against torch DDP with the same optimizer: real processes, gloo on CPU.

AdamW with two param groups, gradient accumulation and clipping, tied and frozen parameters, a
parameter used twice per forward, sizes no world size divides; world sizes 1, 2, 3 and 4.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroray
from tests.dist_harness import run_ranks
from tests.models import TinyLM, batches, param_groups

GAS, OPT_STEPS, CLIP, LR = 2, 3, 0.5, 1e-2


def _reference(rank: int, model: torch.nn.Module, data: list) -> tuple[list[float], dict, list[float]]:
    ddp = DDP(model)
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    losses, norms = [], []
    for i, (x, y) in enumerate(data):
        boundary = (i + 1) % GAS == 0
        ctx = ddp.no_sync() if not boundary else torch.enable_grad()
        with ctx:
            loss = ddp(x, y)
            (loss / GAS).backward()
        losses.append(loss.item())
        if boundary:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            opt.zero_grad()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def _zero(model: torch.nn.Module, data: list, stage: int, precision: str) -> tuple[list[float], dict, list[float]]:
    cfg = zeroray.ZeroConfig(
        stage=stage,
        precision=precision,
        gradient_accumulation_steps=GAS,
        gradient_clipping=CLIP,
        comm={
            "reduce_bucket_size": 500,  # several buckets even on this small model
            "allgather_bucket_size": 700,  # stages 1-2 wait for earlier parameter gathers
        },
    )
    engine = zeroray.initialize(model, torch.optim.AdamW(param_groups(model), lr=LR), cfg)
    losses, norms = [], []
    for x, y in data:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if engine.micro_step % GAS == 0:
            norms.append(engine.last_grad_norm)
    assert engine.global_step == OPT_STEPS
    state = engine.full_state_dict()
    engine.close()
    return losses, state, norms


def _worker(rank: int, world: int, precisions: list[str]) -> dict:
    data = batches(rank, GAS * OPT_STEPS)
    torch.manual_seed(0)
    init = TinyLM()
    out = {"ref": _reference(rank, copy.deepcopy(init), data), "init_frozen": init.frozen.weight.detach().clone()}
    for precision in precisions:
        for stage in range(4):
            out[(stage, precision)] = _zero(copy.deepcopy(init), data, stage, precision)
    return out


def init_frozen(res: dict) -> torch.Tensor:
    return res["init_frozen"]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_stages_match_ddp_fp32(world: int) -> None:
    results = run_ranks(_worker, world, ["fp32"] if world != 2 else ["fp32", "bf16"])
    for rank, res in enumerate(results):
        ref_losses, ref_state, ref_norms = res["ref"]
        for stage in range(4):
            losses, state, norms = res[(stage, "fp32")]
            # Global gradient norms catch errors Adam's scale invariance would hide.
            torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), msg=f"stage {stage} norms")
            # The tolerances of PyTorch's FSDP parity tests (assert_close defaults for fp32).
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=f"stage {stage} rank {rank}")
            assert list(state) == list(ref_state)
            for name in ref_state:
                torch.testing.assert_close(state[name], ref_state[name], msg=f"stage {stage} {name}")
            # The frozen layer did not move; the trained ones did.
            assert torch.equal(state["frozen.weight"], init_frozen(res))
        if world == 2:
            for stage in range(4):
                losses, state, _ = res[(stage, "bf16")]
                torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=3e-2, atol=3e-2)
