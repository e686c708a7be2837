"""Helpers shared by the checkpoint tests: a small engine (the recipe's variant without accumulation) and
exact state snapshots (weights, every rank's optimizer pieces, scalars, buffers) to compare across a
save and a load. The tests train it with tests.support.recipe's ``train``."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

import zeroray
from tests.support.models import TinyLM
from tests.support.recipe import CLIP, optimizer
from zeroray.engine import ZeroEngine, layout


def make_engine(stage: int, seed: int = 0, device: str | torch.device = "cpu", process_group: Any = None,
                shard_group_size: int | None = None, mesh: Any = None, **model_kw: Any) -> ZeroEngine:
    """TinyLM on ``device`` with the recipe's AdamW over two param groups and clipping, no accumulation, and
    a StepLR schedule, on ``process_group`` (default: WORLD), hybrid over ``shard_group_size`` ranks or the
    2-D ``mesh`` if given."""
    torch.manual_seed(seed)
    model = TinyLM(**model_kw).to(device)
    cfg = zeroray.ZeroConfig(stage=stage, comm={"reduce_bucket_size": 500}, gradient_clipping=CLIP,
                             shard_group_size=shard_group_size)
    return zeroray.initialize(
        model,
        optimizer(model),
        cfg,
        process_group=process_group,
        mesh=mesh,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9),
    )


def snapshot(engine: ZeroEngine) -> dict[str, Any]:
    """Collective: weights, this rank's pieces of every optimizer state, scalars and buffers."""
    opt: dict[tuple[str, str], list] = defaultdict(list)
    for gs in engine.shard_state():
        for p in layout.pieces(gs.slots, gs.lo, gs.hi):
            for k, t in gs.tensors.items():
                if k != "weight":
                    opt[(p.name, k)].append((p.t_lo, p.t_hi, t[p.f_lo - gs.lo : p.f_hi - gs.lo].clone()))
    meta = engine.state_meta()
    return {
        "weights": engine.full_state_dict(),
        "opt": dict(opt),
        "meta": {k: meta[k] for k in ("global_step", "optimizer_scalars", "lr_scheduler", "loss_scaler")},
        "buffers": {n: b.clone() for n, b in engine.module.named_buffers()},
    }


def assemble(snaps: list[dict[str, Any]]) -> dict[str, Any]:
    """One full state from every rank's snapshot (optimizer pieces put together)."""
    weights = snaps[0]["weights"]
    opt: dict[tuple[str, str], torch.Tensor] = {}
    for s in snaps:
        for (name, key), pieces in s["opt"].items():
            flat = opt.setdefault((name, key), torch.full((weights[name].numel(),), float("nan")))
            for lo, hi, t in pieces:
                flat[lo:hi] = t
    return {**snaps[0], "opt": opt}


def assert_same(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    """Exact equality: a checkpoint round trip must not change a bit."""
    assert got["meta"] == want["meta"], what
    for part in ("weights", "opt", "buffers"):
        assert got[part].keys() == want[part].keys(), (what, part)
        for k in want[part]:
            assert torch.equal(got[part][k], want[part][k]), (what, part, k)
