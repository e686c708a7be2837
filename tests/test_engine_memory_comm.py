"""memory_report() against the ZeRO paper's per-rank formulas, comm_report() against its volumes.

Psi parameters, N ranks, K optimizer bytes per parameter: stage 0 (2+2+K)Psi, stage 1 4Psi+K Psi/N,
stage 2 2Psi+(2+K)Psi/N, stage 3 (2+2+K)Psi/N with 2-byte params and grads and K=12 in mixed
precision; 4-byte params and grads and K=8 in fp32. Communication per step: 2Psi elements for
stages 0-2, 3Psi for stage 3 (on the reduce-scatter/all-gather path).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroray
from tests.support.dist import run_ranks


class Stack(nn.Module):
    """A stack of blocks (the stage-3 units) and a tiny root; sizes no world size divides."""

    def __init__(self, d: int = 127, n: int = 6):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d + 1), nn.GELU(), nn.Linear(2 * d + 1, d)) for _ in range(n))
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return (x * self.scale).pow(2).mean()


def formula(stage: int, psi: int, n: int, precision: str) -> dict[str, float]:
    pb, k = (4, 8) if precision == "fp32" else (2, 12)
    if stage == 0:
        return {"params": pb * psi, "grads": pb * psi, "optimizer": k * psi}
    if stage == 1:
        return {"params": pb * psi, "grads": pb * psi, "optimizer": k * psi / n}
    if stage == 2:
        return {"params": pb * psi, "grads": pb * psi / n, "optimizer": k * psi / n}
    return {"params": pb * psi / n, "grads": pb * psi / n, "optimizer": k * psi / n}


def _worker(rank: int, world: int) -> dict:
    out = {}
    for precision in ("fp32", "bf16"):
        for stage in range(4):
            torch.manual_seed(0)
            model = Stack()
            dtype = torch.float32 if precision == "fp32" else torch.bfloat16
            engine = zeroray.initialize(
                model,
                torch.optim.AdamW(model.parameters(), lr=1e-3),
                zeroray.ZeroConfig(stage=stage, precision=precision, comm={"reduce_scatter": True, "all_gather_by_broadcast": False}),
            )
            x = torch.randn(4, 127, dtype=dtype)
            engine.backward(engine(x))
            engine.step()  # optimizer states exist from here on
            engine.reset_comm_report()
            engine.backward(engine(x))
            engine.step()
            out[(stage, precision)] = (engine.memory_report(), engine.comm_report())
            engine.close()
    # The gloo defaults (all-reduce, gather by broadcast) count what really moves.
    torch.manual_seed(0)
    model = Stack()
    engine = zeroray.initialize(model, torch.optim.AdamW(model.parameters()), zeroray.ZeroConfig(stage=2))
    x = torch.randn(4, 127)
    engine.backward(engine(x))
    engine.step()
    out["gloo_default"] = engine.comm_report()
    out["psi"] = sum(p.numel() for p in Stack().parameters())
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_memory_and_comm_match_the_paper(world: int) -> None:
    results = run_ranks(_worker, world)
    psi = results[0]["psi"]
    for rank, res in enumerate(results):
        for precision in ("fp32", "bf16"):
            for stage in range(4):
                mem, comm = res[(stage, precision)]
                want = formula(stage, psi, world, precision)
                for key, value in want.items():
                    assert mem[key] == pytest.approx(value, rel=0.05), (stage, precision, key, rank)
                pb = 4 if precision == "fp32" else 2
                moved = sum(comm.values())
                elements = (3 if stage == 3 else 2) * psi
                assert moved == pytest.approx(elements * pb, rel=0.02), (stage, precision, comm)
                if stage == 0:
                    assert set(comm) == {"all_reduce"}
                elif stage in (1, 2):
                    assert comm["reduce_scatter"] == pytest.approx(psi * pb, rel=0.02)
                    assert comm["all_gather"] == pytest.approx(psi * pb, rel=0.02)
                else:
                    assert comm["all_gather"] == pytest.approx(2 * psi * pb, rel=0.02)
                    assert comm["reduce_scatter"] == pytest.approx(psi * pb, rel=0.02)
        gloo = res["gloo_default"]
        assert set(gloo) == {"all_reduce", "all_gather"}
        assert gloo["all_reduce"] == pytest.approx(2 * psi * 4, rel=0.02)  # counted twice its size
        assert gloo["all_gather"] == pytest.approx(psi * 4, rel=0.02)


def test_fp32_reduction_under_bf16_counts_fp32_grads_as_the_estimate_does() -> None:
    from zeroray.config import PrecisionPolicy
    from zeroray.estimate import estimate

    for stage in range(4):
        torch.manual_seed(0)
        model = Stack()
        policy = PrecisionPolicy("bf16", reduce_dtype="fp32")
        engine = zeroray.initialize(model, torch.optim.AdamW(model.parameters()), zeroray.ZeroConfig(stage=stage, precision=policy))
        engine.backward(engine(torch.randn(4, 127, dtype=torch.bfloat16)).float())
        engine.step()
        psi = sum(p.numel() for p in Stack().parameters())
        want = estimate(psi, 1, stage, "bf16", reduce_dtype="fp32")
        mem = engine.memory_report()
        assert mem["grads"] == pytest.approx(want["grads"], rel=0.05) and want["grads"] == 4 * psi
        assert mem["params"] == pytest.approx(want["params"], rel=0.05)
        engine.close()
