"""The numerical reference the engine's parity tests share: torch DDP with AdamW over two param groups,
gradient accumulation and clipping, and the same loop through a zeroray engine."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroray
from tests.models import param_groups
from zeroray.config import PrecisionPolicy

GAS, OPT_STEPS, CLIP, LR = 2, 3, 0.5, 1e-2


def reference(rank: int, model: torch.nn.Module, data: list) -> tuple[list[float], dict, list[float]]:
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


def zero_run(
    model: torch.nn.Module, data: list, stage: int, precision: str | PrecisionPolicy, **config: Any
) -> tuple[list[float], dict, list[float]]:
    cfg = zeroray.ZeroConfig(
        **config,
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
