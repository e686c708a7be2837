"""ZeRO++ in the engine: qwZ (int8 parameter gathers, stage 3) and qgZ (quantized gradient reduce-scatter,
stages 2-3), on 4 gloo ranks laid out as 2 "nodes" of 2.

Quantized runs cannot equal the unquantized ones bit for bit, so they are held to what quantization
allows: the reduced gradients of a step within a step of the code of the exact ones, losses close to
the unquantized run's, masters and checkpoints untouched by quantization, the bytes of each link class
equal to the formulas, the same losses run to run, and the fp16 overflow check still seeing an overflow.
"""

from __future__ import annotations

import copy

import pytest
import torch

import zeroray
import zeroray.checkpoint as zc
from tests.support.dist import run_ranks
from tests.support.models import TinyLM, batches
from tests.support.recipe import GAS, OPT_STEPS, config, optimizer, train
from zeroray.config import ConfigError, ZeroConfig
from zeroray.config.load import load_config
from zeroray.engine.quantize import BlockQuantizer

NODES = ["node-0", "node-0", "node-1", "node-1"]
NEAREST = {"weight_rounding": "nearest", "gradient_rounding": "nearest"}  # DeepSpeed's rounding; stochastic is the default


def _grad_shards(engine: zeroray.ZeroEngine, data: list) -> list[torch.Tensor]:
    """The reduced gradient shards of one optimizer step (taken before the step), then the step."""
    for i, (x, y) in enumerate(data[:GAS]):
        engine.backward(engine(x, y))
        if i < GAS - 1:
            engine.step()
    shards = [g.grad_shard.clone() for g in engine.groups if g.trainable]
    engine.step()
    return shards


def _run(rank: int, world: int, cases: list[dict]) -> list[dict]:
    data = batches(rank, GAS * OPT_STEPS)
    torch.manual_seed(0)
    init = TinyLM()
    out = []
    for case in copy.deepcopy(cases):
        stage, precision = case.pop("stage", 3), case.pop("precision", "fp32")
        model = copy.deepcopy(init)
        engine = zeroray.initialize(model, optimizer(model), config(stage, precision, **case), nodes=NODES)
        shards = _grad_shards(engine, data)
        engine.reset_comm_report()
        losses = train(engine, data[GAS:])
        out.append({"shards": shards, "losses": losses, "bytes": engine.comm_report(by_scope=True),
                    "state": engine.full_state_dict(), "norm": engine.last_grad_norm,
                    "cached": engine.memory_report()["quantize_buffers_cached"],
                    "qgz_padded": sum(g.padded for g in engine.groups if g.qgz is not None),
                    "units": [[(g.padded, g.shard_numel) for g in u.groups] for u in engine.scheduler.all_units]
                    if stage == 3 else None})
        engine.close()
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


CASES = [
    {},  # 0: unquantized stage 3
    {"quantize": {**NEAREST, "weights": True}},  # 1: qwZ
    {"quantize": {**NEAREST, "gradients": True, "intra_node_gradients": True}},  # 2: qgZ int8, hierarchical, ZeRO++'s form
    {"quantize": {**NEAREST, "gradients": True, "gradient_bits": 4, "intra_node_gradients": True}},  # 3: qgZ int4
    {"quantize": {**NEAREST, "weights": True, "gradients": True}, "hpz_partition_size": 2},  # 4: full ZeRO++ (CPU: fp32 in node)
    {"stage": 2},  # 5: unquantized stage 2
    {"stage": 2, "quantize": {**NEAREST, "gradients": True}},  # 6: qgZ at stage 2
    {"quantize": {**NEAREST, "weights": True, "gradients": True}, "shard_group_size": 2},  # 7: on top of hybrid
    {"quantize": {**NEAREST, "weights": True, "gradients": True}, "hpz_partition_size": 2},  # 8: case 4 again
    {"quantize": {**NEAREST, "gradients": True, "intra_node_gradients": False}},  # 9: qgZ int8, fp32 inside the node
    {"quantize": {**NEAREST, "weights": True, "exact_backward_weights": True}},  # 10: qwZ, the backward gathering fp32
    {"quantize": {"weights": True, "gradients": True}, "hpz_partition_size": 2},  # 11: case 4, rounded stochastically (the default)
    {"quantize": {"weights": True, "gradients": True}, "hpz_partition_size": 2},  # 12: case 11 again
    {"quantize": {"gradients": True, "gradient_codes": "fp8", "intra_node_gradients": True}},  # 13: qgZ fp8, ZeRO++'s form
    {"quantize": {"gradients": True, "gradient_codes": "fp8", "intra_node_gradients": True}},  # 14: case 13 again
    {"quantize": {"weights": True, "gradients": True}},  # 15: case 11 without hpZ
]


@pytest.fixture(scope="module")
def runs() -> list[list[dict]]:
    return run_ranks(_run, 4, CASES)


def test_reduced_gradients_are_within_the_code_of_the_exact_ones(runs: list[list[dict]]) -> None:
    for rank in runs:
        base, base2 = rank[0]["shards"], rank[5]["shards"]
        for i, bound in ((1, 0.05), (2, 0.02), (3, 0.3), (4, 0.05), (11, 0.1), (13, 0.05)):
            for got, want in zip(rank[i]["shards"], base, strict=True):
                assert _rel(got, want) < bound, (i, _rel(got, want))
        assert max(_rel(g, w) for g, w in zip(rank[2]["shards"], base)) > 0  # it did quantize
        for got, want in zip(rank[6]["shards"], base2, strict=True):
            assert _rel(got, want) < 0.02
        # fp32 inside the node: one rounding, not two, so nearer the exact shards than case 2, yet quantized.
        mixed = [_rel(g, w) for g, w in zip(rank[9]["shards"], base, strict=True)]
        assert 0 < max(mixed) < 0.02 and sum(mixed) < sum(_rel(g, w) for g, w in zip(rank[2]["shards"], base))


def test_losses_stay_close_to_the_unquantized_run_and_repeat_exactly(runs: list[list[dict]]) -> None:
    for rank in runs:
        base = rank[0]["losses"]
        for i in (1, 2, 3, 4, 7, 9, 10, 11, 13):
            assert max(abs(a - b) / b for a, b in zip(rank[i]["losses"], base)) < 0.02, i
        for i, again in ((4, 8), (11, 12), (13, 14)):  # a fixed seed: the same losses run to run, stochastic rounding's too
            assert rank[i]["losses"] == rank[again]["losses"], i
            assert rank[i]["state"].keys() == rank[again]["state"].keys()
            for name, t in rank[i]["state"].items():
                assert torch.equal(t, rank[again]["state"][name]), (i, name)
        # hpZ changes where the backward gathers from, not what: full ZeRO++ trains as qwZ + qgZ do, draws included.
        # (Checked in the CPU default form, fp32 inside the node; hpZ touches only the weights' gathers.)
        assert rank[11]["losses"] == rank[15]["losses"]
        assert rank[11]["bytes"] != rank[15]["bytes"]
        assert rank[11]["losses"] != rank[4]["losses"]  # it rounds otherwise ...
        assert rank[11]["bytes"] == rank[4]["bytes"]  # ... and moves the same bytes
        # fp8 codes: other values than int8's, the same bytes under their own name
        assert rank[13]["losses"] != rank[2]["losses"]
        assert rank[13]["bytes"] == {k.replace("int8", "fp8"): v for k, v in rank[2]["bytes"].items()}


def test_quantized_collectives_keep_their_buffers_for_the_next_step(runs: list[list[dict]]) -> None:
    """Between steps the quantized collectives' temporaries wait in their pool (reused, not freed: fresh
    pages cost more than quantizing on CPU); an unquantized run has none."""
    for rank in runs:
        assert rank[0]["cached"] == rank[5]["cached"] == 0
        assert all(rank[i]["cached"] > 0 for i in (1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 13))


def test_bytes_by_link_class_equal_the_formulas(runs: list[list[dict]]) -> None:
    """Two optimizer steps of GAS micro-steps, 2 nodes x 2 ranks, fp32. qwZ: each forward gathers every unit
    in int8 (N rows of row_bytes(S)), and the backward gathers each unit but the root (gathered throughout) in
    int8 again; with exact_backward_weights in fp32. qgZ: every micro-step reduces each trainable group through
    the node (N rows) and across nodes (N/m = 2 rows)."""
    micro = GAS * (OPT_STEPS - 1)
    q8 = BlockQuantizer(8, 256)
    r0 = runs[0]
    root, *units = r0[0]["units"]  # the root unit stays gathered from its forward to the end of backward
    fp32_backward = micro * sum(padded * 4 for u in units for padded, _ in u)
    int8_forward = micro * sum(4 * q8.row_bytes(s) for u in (root, *units) for _, s in u)
    int8_backward = micro * sum(4 * q8.row_bytes(s) for u in units for _, s in u)
    qwz = r0[1]["bytes"]
    assert qwz["inter_node:all_gather_int8"] == int8_forward + int8_backward
    assert qwz.get("inter_node:all_gather", 0) == 0
    exact_backward = r0[10]["bytes"]
    assert exact_backward["inter_node:all_gather_int8"] == int8_forward
    assert exact_backward["inter_node:all_gather"] == fp32_backward
    assert r0[0]["bytes"]["inter_node:all_gather"] == 2 * fp32_backward + micro * sum(p * 4 for p, _ in root)
    qgz = r0[2]["bytes"]
    assert qgz["intra_node:all_to_all_int8"] == 2 * qgz["inter_node:all_to_all_int8"]
    mixed = r0[9]["bytes"]  # the same int8 rows across nodes; inside the node every group's fp32 buffer
    assert mixed["inter_node:all_to_all_int8"] == qgz["inter_node:all_to_all_int8"]
    assert mixed["intra_node:all_to_all"] == micro * 4 * r0[9]["qgz_padded"] > 0
    assert "intra_node:all_to_all_int8" not in mixed
    assert "inter_node:reduce_scatter" not in qgz and "inter_node:all_reduce" not in {
        k for k, v in qgz.items() if v > 1000
    }
    full = r0[4]["bytes"]  # hpZ + qwZ + qgZ: only the int8 forward gathers and a quarter of the int8 gradients cross
    # intra_node_gradients left to the device: on CPU the node's stage moves fp32, as case 9's does
    assert full["intra_node:all_to_all"] > 0 and "intra_node:all_to_all_int8" not in full
    flat = r0[0]["bytes"]
    inter = sum(v for k, v in full.items() if k.startswith("inter_node:"))
    assert inter < 0.3 * sum(v for k, v in flat.items() if k.startswith("inter_node:"))


def test_checkpoints_and_masters_are_untouched_by_quantization(runs: list[list[dict]]) -> None:
    """full_state_dict gathers in full precision: the quantized runs' weights are the masters', and they moved."""
    for rank in runs:
        for i in (1, 4, 10):
            state = rank[i]["state"]
            assert all(t.dtype == torch.float32 for t in state.values())
            assert any(not torch.equal(state[n], rank[0]["state"][n]) for n in state)
        assert all(torch.equal(a, b) for a, b in zip(runs[0][4]["state"].values(), rank[4]["state"].values()))


def _params(m: torch.nn.Module) -> dict:
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def _weights_used(rank: int, exact_backward: bool, rounding: str = "nearest") -> dict:
    """qwZ at the first step: the weights a unit's forward and backward compute with, and what
    gathered_parameters (full precision) gives."""
    torch.manual_seed(0)
    model = TinyLM()
    blk = model.h[0]
    exact = _params(blk)
    quantize = {"weights": True, "exact_backward_weights": exact_backward, "weight_rounding": rounding}
    engine = zeroray.initialize(model, optimizer(model), config(3, "fp32", quantize=quantize))
    seen, back = {}, {}

    def on_output(m: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.register_hook(lambda g: back.update(_params(m)))

    # Hooks registered after the engine's run after them: the pre-hook once the unit is gathered for its
    # forward, the output's gradient hook once it is gathered again for its backward.
    hooks = [blk.register_forward_pre_hook(lambda m, a: seen.update(_params(m))), blk.register_forward_hook(on_output)]
    x, y = batches(rank, 1)[0]
    engine.backward(engine(x, y))
    for h in hooks:
        h.remove()
    with engine.gathered_parameters():
        after = _params(blk)
    engine.close()
    return {"seen": seen, "back": back, "exact": exact, "after": after}


def _forward_weights(rank: int, world: int) -> list[dict]:
    """By default, with exact_backward_weights, and rounded stochastically."""
    return [_weights_used(rank, False), _weights_used(rank, True), _weights_used(rank, False, "stochastic")]


def test_forward_and_backward_compute_with_the_same_dequantized_weights_and_the_shards_stay_exact() -> None:
    res = run_ranks(_forward_weights, 2)
    for r, r_exact_backward, r_stochastic in res:
        # A block of 256 values may span several parameters of the unit: half a step of the largest is the bound.
        half_step = max(float(w.abs().max()) for w in r["exact"].values()) / 254 * (1 + 1e-6)
        for name, w in r["exact"].items():
            # rounded stochastically: within a step, the backward on the forward's weights, every rank alike
            s = r_stochastic["seen"][name]
            assert float((s - w).abs().max()) <= 2 * half_step, name
            assert torch.equal(r_stochastic["back"][name], s), name
            assert torch.equal(s, res[0][2]["seen"][name]), name
            assert torch.equal(r["after"][name], w), name  # no step yet: the shards are the exact values
            assert torch.equal(r["seen"][name], res[0][0]["seen"][name])  # every rank computes with the same weights
            assert float((r["seen"][name] - w).abs().max()) <= half_step, name
            assert torch.equal(r["back"][name], r["seen"][name]), name  # the backward: the forward's weights
            # exact_backward_weights: the same forward, and a backward on the full-precision weights
            assert torch.equal(r_exact_backward["seen"][name], r["seen"][name]), name
            assert torch.equal(r_exact_backward["back"][name], w), name
        assert any(not torch.equal(r["seen"][n], w) for n, w in r["exact"].items())
        assert any(not torch.equal(r_stochastic["seen"][n], r["seen"][n]) for n in r["exact"])


def _resume(rank: int, world: int, url: str) -> tuple[list[float], list[float]]:
    """Stochastic rounding: the losses after a checkpoint, run on, and in a fresh engine loaded from it."""
    data = batches(rank, GAS * (OPT_STEPS + 1))
    cfg = config(3, "fp32", quantize={"weights": True, "gradients": True})  # rounded stochastically
    losses = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = TinyLM()
        engine = zeroray.initialize(model, optimizer(model), cfg, nodes=NODES)
        if seed == 0:
            train(engine, data[: GAS * OPT_STEPS])
            zc.save(engine, url)
        else:
            zc.load(engine, url)
        losses.append(train(engine, data[GAS * OPT_STEPS :]))
        engine.close()
    return losses[0], losses[1]


def test_stochastic_rounding_resumes_with_the_draws_of_an_uninterrupted_run(tmp_path) -> None:
    """The draws follow the micro-step the checkpoint saves: a resumed run rounds as the uninterrupted one."""
    for ran_on, resumed in run_ranks(_resume, 4, str(tmp_path / "ckpt")):
        assert ran_on == resumed


def _fp16_overflow(rank: int, world: int) -> list[list[int]]:
    out = []
    for quantize in ({"gradients": True, "gradient_bits": 4}, {}):
        torch.manual_seed(0)
        model = TinyLM()
        cfg = config(3, "fp16", quantize=quantize, loss_scaling={"initial_scale_power": 8})
        engine = zeroray.initialize(model, optimizer(model), cfg, nodes=NODES)
        x, y = batches(rank, 1)[0]
        skipped = []
        for i in range(2 * GAS):
            loss = engine(x, y)
            if i == 1 and rank == 3:
                loss = loss * float("inf")  # one rank's gradients overflow
            engine.backward(loss)
            engine.step()
            skipped.append(engine.skipped_steps)
        engine.close()
        out.append(skipped)
    return out


def test_an_overflow_survives_quantization_and_skips_the_step_on_all_ranks() -> None:
    for quantized, plain in run_ranks(_fp16_overflow, 4):
        assert quantized == plain == [0, 1, 1, 1]


def test_bad_quantize_settings_fail_before_any_work() -> None:
    with pytest.raises(ConfigError, match="qwZ quantizes stage 3's parameter gathers; it needs stage 3, got stage 2"):
        ZeroConfig(stage=2, quantize={"weights": True})
    with pytest.raises(ConfigError, match="qgZ quantizes the reduce-scatter of sharded gradients; it needs stage 2 or 3"):
        ZeroConfig(stage=1, quantize={"gradients": True})
    with pytest.raises(ConfigError, match="quantize.block_size: must be a power of two from 8 to 65536"):
        ZeroConfig(stage=3, quantize={"weights": True, "block_size": 100})
    with pytest.raises(ConfigError, match="quantize.gradient_bits: must be 4 or 8, got 2"):
        ZeroConfig(stage=3, quantize={"gradients": True, "gradient_bits": 2})
    with pytest.raises(ConfigError, match="quantize.weights: must be true or false"):
        ZeroConfig(stage=3, quantize={"weights": "yes"})
    with pytest.raises(ConfigError, match=r"quantize.intra_node_gradients: must be true or false or None \(automatic\), got 'no'"):
        ZeroConfig(stage=3, quantize={"gradients": True, "intra_node_gradients": "no"})
    with pytest.raises(ConfigError, match="quantize.exact_backward_weights: must be true or false, got 1"):
        ZeroConfig(stage=3, quantize={"weights": True, "exact_backward_weights": 1})
    with pytest.raises(ConfigError, match="quantize.weight_rounding: must be 'nearest' or 'stochastic', got 'up'"):
        ZeroConfig(stage=3, quantize={"weights": True, "weight_rounding": "up"})
    with pytest.raises(ConfigError, match="quantize.gradient_rounding: must be 'nearest' or 'stochastic', got True"):
        ZeroConfig(stage=3, quantize={"gradients": True, "gradient_rounding": True})
    with pytest.raises(ConfigError, match="quantize.gradient_codes: must be 'int' or 'fp8', got 'e5m2'"):
        ZeroConfig(stage=3, quantize={"gradients": True, "gradient_codes": "e5m2"})
    with pytest.raises(ConfigError, match="quantize.gradient_bits: fp8 gradient codes have 8 bits, got 4"):
        ZeroConfig(stage=3, quantize={"gradients": True, "gradient_codes": "fp8", "gradient_bits": 4})
    fp8 = load_config({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True,
                                             "zeroray_quantize_gradient_codes": "fp8"}}).quantize
    assert fp8.gradient_codes == "fp8" and fp8.gradient_rounding == "stochastic"
    cfg = load_config({"zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True,
                                             "zeroray_quantize_gradient_bits": 4,
                                             "zeroray_quantize_intra_node_gradients": False,
                                             "zeroray_quantize_exact_backward_weights": True,
                                             "zeroray_quantize_weight_rounding": "stochastic",
                                             "zeroray_quantize_gradient_rounding": "stochastic"}})
    assert (cfg.quantize.weights, cfg.quantize.gradients, cfg.quantize.gradient_bits) == (True, True, 4)
    assert cfg.quantize.intra_node_gradients is False and cfg.quantize.exact_backward_weights is True
    assert cfg.quantize.weight_rounding == cfg.quantize.gradient_rounding == "stochastic"
    with pytest.raises(ValueError, match="DeepSpeed config key 'zero_optimization.zero_quantized_gradients': qgZ"):
        load_config({"zero_optimization": {"stage": 1, "zero_quantized_gradients": True}})
