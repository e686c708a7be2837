"""The loop and configs the offload tests share: a TinyLM trained with AdamW over two param groups,
gradient accumulation and clipping, through a zeroray engine."""

from __future__ import annotations

import torch

import zeroray
from tests.models import param_groups

GAS, STEPS, CLIP, LR = 2, 3, 0.5, 1e-2


def offload_config(stage: int, precision: str, offload: dict | None, **extra) -> zeroray.ZeroConfig:
    return zeroray.ZeroConfig(
        stage=stage,
        precision=precision,
        gradient_accumulation_steps=GAS,
        gradient_clipping=CLIP,
        comm={"reduce_bucket_size": 500, "allgather_bucket_size": 700},
        **(offload or {}),
        **extra,
    )


def train_run(model, data, cfg) -> tuple[list[float], dict[str, torch.Tensor], dict[str, int]]:
    engine = zeroray.initialize(model, torch.optim.AdamW(param_groups(model), lr=LR), cfg)
    losses = []
    for x, y in data:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = engine.full_state_dict()
    mem = engine.memory_report()
    engine.close()
    return losses, state, mem


def nvme_offload(path: str, rank: int, **kw) -> dict:
    return {"offload_optimizer": {"device": "nvme", "nvme_path": path, **kw}}
