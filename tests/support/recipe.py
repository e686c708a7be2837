"""The training recipe the engine tests share, and the one loop every test runs an engine through.

The recipe: a model from tests.support.models under AdamW over two param groups at ``LR``
(``optimizer``), gradients accumulated over ``GAS`` micro-batches and clipped to ``CLIP``, with small
communication buckets (``config``); ``OPT_STEPS`` optimizer steps. ``reference`` runs it through
torch DDP, the numerical reference of the parity and offload tests; ``zero_run`` through a zeroray
engine. The checkpoint tests' variant (tests.support.checkpoint) has the same ``LR`` and ``CLIP``
and no accumulation, and saves after ``OPT_STEPS`` steps.

``train`` is the loop: forward, loss, backward, step, one micro-batch at a time (the engine
accumulates and steps the optimizer at each boundary).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroray
from tests.support.models import param_groups
from zeroray.config import PrecisionPolicy

GAS, OPT_STEPS, CLIP, LR = 2, 3, 0.5, 1e-2
COMM = {
    "reduce_bucket_size": 500,  # several buckets even on this small model
    "allgather_bucket_size": 700,  # stages 1-2 wait for earlier parameter gathers
}


def optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model), lr=LR)


def config(stage: int, precision: str | PrecisionPolicy, **extra: Any) -> zeroray.ZeroConfig:
    """The recipe's engine config at ``stage`` and ``precision``; ``extra``: more ZeroConfig fields (offload...)."""
    return zeroray.ZeroConfig(
        **extra,
        stage=stage,
        precision=precision,
        gradient_accumulation_steps=GAS,
        gradient_clipping=CLIP,
        comm=dict(COMM),
    )


def train(
    engine: Any,
    batches: Iterable[tuple[Any, Any]],
    loss: Callable[[Any, Any, Any], torch.Tensor] | None = None,
    on_step: Callable[[float], None] | None = None,
) -> list[float]:
    """For each micro-batch ``(x, y)`` of ``batches``: forward, backward and ``engine.step()``. Returns every
    micro-batch's loss.

    ``loss(engine, x, y)`` is the loss where the model does not return it alone (default ``engine(x, y)``,
    as TinyLM does; ``gpt_loss`` for zeroray's GPT); ``on_step(loss)`` runs after each micro-batch's step."""
    losses = []
    for x, y in batches:
        value = engine(x, y) if loss is None else loss(engine, x, y)
        engine.backward(value)
        engine.step()
        losses.append(value.item())
        if on_step is not None:
            on_step(losses[-1])
    return losses


def gpt_loss(engine: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss of zeroray's GPT, which returns (logits, loss)."""
    return engine(x, y)[1]


def gpt_batches(vocab_size: int, steps: int, seed: int = 1, batch: int = 2, seq: int = 8) -> list[tuple]:
    """``steps`` batches of random tokens (``batch`` sequences of ``seq``, from ``seed``) for zeroray's GPT:
    inputs and the next tokens."""
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(vocab_size, (batch, seq + 1), generator=g) for _ in range(steps)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def train_gpt(engine: Any, vocab_size: int, steps: int, seed: int = 1) -> list[float]:
    """``steps`` optimizer steps of an engine wrapping zeroray's GPT, on random tokens (2 sequences
    of 8, from ``seed``): the losses."""
    return train(engine, gpt_batches(vocab_size, steps, seed), loss=gpt_loss)


def reference(rank: int, model: torch.nn.Module, data: list) -> tuple[list[float], dict, list[float]]:
    """The recipe through torch DDP: the losses, the final parameters and the global gradient norm of
    every optimizer step."""
    ddp = DDP(model)
    opt = optimizer(model)
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
    model: torch.nn.Module, data: list, stage: int, precision: str | PrecisionPolicy, **extra: Any
) -> tuple[list[float], dict, list[float]]:
    """The recipe through a zeroray engine: the losses, the final (full) weights and the global gradient
    norm of every optimizer step."""
    engine = zeroray.initialize(model, optimizer(model), config(stage, precision, **extra))
    norms: list[float] = []

    def at_boundary(_: float) -> None:
        if engine.micro_step % GAS == 0:
            norms.append(engine.last_grad_norm)

    losses = train(engine, data, on_step=at_boundary)
    assert engine.global_step == OPT_STEPS
    state = engine.full_state_dict()
    engine.close()
    return losses, state, norms


def fsdp2_run(
    model: torch.nn.Module, data: list, precision: str, k: int | None = None, compile_blocks: bool = False
) -> tuple[list[float], dict]:
    """The recipe through FSDP2, the yardstick of the parity tests: each block of ``model.h`` and the root
    ``fully_shard``-ed, over all ranks, or HSDP on a (world/k, k) mesh; ``compile_blocks``: each block
    compiled first (torchtitan's per-block compile). The losses and the final (full) weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // k, k), mesh_dim_names=("replicate", "shard")) if k else None
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    for blk in model.h:
        if compile_blocks:
            blk.compile()
        fully_shard(blk, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = optimizer(model)
    losses = []
    for i, (x, y) in enumerate(data):
        boundary = (i + 1) % GAS == 0
        model.set_requires_gradient_sync(boundary)
        loss = model(x, y)
        (loss / GAS).backward()
        losses.append(loss.item())
        if boundary:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], CLIP)
            opt.step()
            opt.zero_grad()
    return losses, {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


# Rounding floor of the parity tests' distances: below it, distances are noise of the summation order.
FLOOR = {"fp32": 2e-6, "bf16": 2e-2}


def weight_distance(state: dict, ref: dict) -> float:
    """The largest elementwise difference between two full state dicts, over ``ref``'s names."""
    return max(float((state[n].float() - ref[n].float()).abs().max()) for n in ref)


def loss_distance(losses: list[float], ref: list[float]) -> float:
    return max(abs(a - b) for a, b in zip(losses, ref, strict=True))
