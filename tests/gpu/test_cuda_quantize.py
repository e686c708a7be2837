"""ZeRO++'s quantizer on CUDA, where the engine runs it compiled into fused kernels (QuantizeKernels): the
compiled ops against the eager ones, and qwZ/qgZ in the engine at world 1 on NCCL against unquantized."""

from __future__ import annotations

import copy

import pytest
import torch

import zeroray
from tests.support.dist import run_ranks
from tests.support.models import TinyLM, batches
from tests.support.recipe import GAS, OPT_STEPS, config, optimizer, train
from zeroray.engine.quantize import BlockQuantizer, QuantizeKernels
from zeroray.engine.rounding import Draws
from zeroray.engine.scratch import ScratchPool


@pytest.mark.parametrize("bits", [8, 4])
def test_compiled_kernels_match_the_eager_ops_within_a_step(bits: int) -> None:
    q = BlockQuantizer(bits, 256)
    eager, compiled = QuantizeKernels(q, compiled=False), QuantizeKernels(q, compiled=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows in (torch.randn(1, 100_003, device="cuda", generator=g).bfloat16(),  # qwZ: a shard
                 torch.randn(4, 2, 3, 5_000, device="cuda", generator=g).transpose(0, 1)):  # qgZ: strided rows
        n = rows.shape[-1]
        a, b = eager.quantize(rows), compiled.quantize(rows)
        assert a.shape == b.shape and a.dtype == b.dtype == torch.uint8
        cb = q.code_bytes(n)
        scales_a, scales_b = a[:, cb:].view(torch.float32), b[:, cb:].view(torch.float32)
        torch.testing.assert_close(scales_b, scales_a, rtol=1e-6, atol=0)
        da, db = eager.dequantize(a, n), compiled.dequantize(b, n)
        step = scales_a.repeat_interleave(q.block, dim=1)[:, :n]
        assert bool(((da - db).abs() <= step * 1.0001).all()), "codes differ by more than one step"
        assert (a[:, :cb] != b[:, :cb]).float().mean().item() < 1e-3  # only values at a half-step tie
        torch.testing.assert_close(compiled.dequantize(a, n), da, rtol=0, atol=0)  # same codes, same values


def test_compiled_fp8_codes_match_the_eager_ones() -> None:
    """qgZ's fp8 codes compiled: the same codes but at a rounding tie, each value within 1/16 of itself."""
    q = BlockQuantizer(8, 256, "fp8")
    eager, compiled = QuantizeKernels(q, compiled=False), QuantizeKernels(q, compiled=True)
    rows = torch.randn(4, 2, 3, 5_000, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    rows = rows.transpose(0, 1)
    n = rows.shape[-1]
    a, b = eager.quantize(rows), compiled.quantize(rows)
    assert (a != b).float().mean().item() < 1e-3
    values = compiled.dequantize(b, n)
    assert torch.equal(compiled.dequantize(a, n), eager.dequantize(a, n))
    flat = rows.reshape(-1, n)
    scale = b[:, q.code_bytes(n):].view(torch.float32).repeat_interleave(q.block, dim=1)[:, :n]
    assert bool(((values - flat).abs() <= torch.maximum(flat.abs() / 16, scale * 2**-10) * 1.0001).all())


def _engine_runs(rank: int, world: int) -> dict:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    data = [(x.to(dev), y.to(dev)) for x, y in batches(rank, GAS * OPT_STEPS)]
    torch.manual_seed(0)
    init = TinyLM().to(dev)
    out = {}
    sr = {"weights": True, "gradients": True, "weight_rounding": "stochastic", "gradient_rounding": "stochastic"}
    for name, quantize in (("base", {}), ("qwz", {"weights": True}), ("both", {"weights": True, "gradients": True}),
                           ("both_again", {"weights": True, "gradients": True}), ("sr", sr), ("sr_again", sr),
                           ("fp8", {"gradients": True, "gradient_codes": "fp8"})):
        model = copy.deepcopy(init)
        engine = zeroray.initialize(model, optimizer(model), config(3, "bf16", quantize=quantize))
        out[name] = train(engine, data)
        out[name + "_compiled"] = engine.groups[0].qwz is not None and engine.groups[0].qwz.quantizer.quantize is not (
            engine.groups[0].qwz.quantizer.quantizer.quantize)
        engine.close()
    return out


def test_engine_quantized_on_cuda_tracks_unquantized_and_repeats_bitwise() -> None:
    (res,) = run_ranks(_engine_runs, 1, backend="nccl")
    assert res["qwz_compiled"] and res["both_compiled"]
    for name in ("qwz", "both", "sr", "fp8"):
        for got, want in zip(res[name], res["base"]):
            assert abs(got - want) <= 0.02 * abs(want), (name, res[name], res["base"])
    assert res["both"] == res["both_again"] and res["sr"] == res["sr_again"] and res["sr"] != res["both"]


def test_compiled_stochastic_rounding_stays_within_a_step() -> None:
    """The compiled quantizer rounds with the draws' noise on CUDA: every value within one step of its code."""
    q = BlockQuantizer(8, 256)
    compiled, pool = QuantizeKernels(q, compiled=True), ScratchPool()
    rows = torch.randn(1, 100_003, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    noise = Draws().uniform("0/h.0", q.padded_numel(rows), rows.device, pool)
    codes = compiled.quantize(rows, noise)
    values = compiled.dequantize(codes, rows.shape[-1])
    step = codes[:, q.code_bytes(rows.shape[-1]):].view(torch.float32).repeat_interleave(q.block, dim=1)[:, : rows.shape[-1]]
    assert bool(((values - rows).abs() <= step * 1.0001).all())
    assert not torch.equal(codes, compiled.quantize(rows))  # not the nearest codes
