"""ZeRO++'s quantizer and quantized collectives (qwZ's int8 gather, qgZ's all-to-all reduce-scatter).

The kernels are checked against their definition (codes, scales, packing, the error bound, non-finite
blocks); the collectives, on 4 gloo ranks, against the same quantizer applied by hand to every rank's
input, bit for bit: one level, and hierarchical over 2 "nodes" of 2 ranks, whose bytes by link class
equal the formulas.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support.dist import run_ranks
from zeroray.config import CommConfig
from zeroray.engine.quantize import BlockQuantizer, QuantizeKernels
from zeroray.engine.quantized_comm import QuantizedGather, QuantizedReduceScatter
from zeroray.engine.rounding import Draws
from zeroray.engine.scratch import ScratchPool
from zeroray.engine.topology import Topology, _node_runs


def _padded_blocks(x: torch.Tensor, q: BlockQuantizer) -> torch.Tensor:
    out = torch.zeros(x.shape[0], q.blocks(x.shape[1]) * q.block)
    out[:, : x.shape[1]] = x.float()
    return out.view(x.shape[0], -1, q.block)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n", [7, 256, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_element_is_within_half_a_step_of_its_value(bits: int, n: int, dtype: torch.dtype) -> None:
    q = BlockQuantizer(bits, 64)
    x = (torch.randn(3, n, generator=torch.Generator().manual_seed(n)) * torch.logspace(-3, 2, n)).to(dtype)
    packed = q.quantize(x)
    assert packed.dtype == torch.uint8 and packed.shape == (3, q.row_bytes(n))
    assert q.row_bytes(n) == q.blocks(n) * (64 * bits // 8 + 4)
    y = q.dequantize(packed, n)
    assert y.dtype == torch.float32 and y.shape == (3, n)
    blocks = _padded_blocks(x, q)
    step = blocks.abs().amax(-1, keepdim=True) / q.qmax
    err = (blocks - _padded_blocks(y, q)).abs()
    assert bool((err <= step / 2 * (1 + 1e-6)).all())
    assert float(err.max()) > 0  # it does quantize


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_whole_blocks_quantize_as_the_padded_path_does(bits: int, dtype: torch.dtype) -> None:
    """Rows of whole blocks are read where they lie (no padded copy); one value more takes the padded path.
    The full blocks' codes and scales are bit for bit the same, also for strided rows, inf, nan and -0.0."""
    q = BlockQuantizer(bits, 64)
    x = torch.randn(3, 4 * 64 + 1, generator=torch.Generator().manual_seed(bits)) * 30
    x[0, 5], x[1, 70], x[2, 130] = float("inf"), float("-inf"), float("nan")
    x[1, :64] = -0.0  # a block of negative zeros scales +0.0
    x = x.to(dtype)
    whole, padded = q.quantize(x[:, :256]), q.quantize(x)
    cb = q.code_bytes(256)
    assert torch.equal(whole[:, :cb], padded[:, :cb])
    scales, more = whole[:, cb:].view(torch.float32), padded[:, q.code_bytes(257):].view(torch.float32)[:, :4]
    assert torch.equal(scales.isnan(), more.isnan()) and torch.equal(scales.nan_to_num(), more.nan_to_num())
    assert not scales[1, 0].signbit() and scales[1, 0] == 0
    strided = torch.cat([x[:, :256], x[:, :256]], dim=1)[:, ::2]  # every other value: a strided (3, 256) view
    a, b = q.quantize(strided), q.quantize(strided.contiguous())
    assert torch.equal(a[:, :cb], b[:, :cb])
    # A strided row is copied to fp32 first: a nan scale may then carry another nan payload (fp16), still nan.
    sa, sb = a[:, cb:].view(torch.float32), b[:, cb:].view(torch.float32)
    assert torch.equal(sa.isnan(), sb.isnan()) and torch.equal(sa.nan_to_num(), sb.nan_to_num())


def test_codes_scales_and_nibble_order() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5, 0.0, 2.0, -1.0, 0.25, 1.5]])
    q8 = BlockQuantizer(8, 8).quantize(x)
    assert q8[0, :8].view(torch.int8).tolist() == [64, -127, 32, 0, 127, -64, 16, 95]  # round half to even
    assert q8[0, 8:].view(torch.float32).item() == pytest.approx(2.0 / 127)
    q4 = BlockQuantizer(4, 8).quantize(x)
    codes = [int(c) - 8 for b in q4[0, :4].tolist() for c in (b & 15, b >> 4)]  # the first value in the low nibble
    assert codes == [3, -7, 2, 0, 7, -3, 1, 5]  # 1.0 x (1 / (2/7)) is just below 3.5 in fp32
    assert q4[0, 4:].view(torch.float32).item() == pytest.approx(2.0 / 7)


def test_a_block_with_inf_or_nan_dequantizes_non_finite_and_leaves_the_others_exact() -> None:
    """What keeps the fp16 overflow check working after a quantized reduction."""
    q = BlockQuantizer(8, 64)
    x = torch.randn(1, 256)
    x[0, 3], x[0, 200] = float("inf"), float("nan")
    y = q.dequantize(q.quantize(x), 256).view(4, 64)
    assert not torch.isfinite(y[0]).any() and not torch.isfinite(y[3]).any()
    ref = q.dequantize(q.quantize(x.view(4, 64)[1:3].reshape(1, -1)), 128).view(2, 64)
    assert torch.equal(y[1:3], ref)
    zeros = q.dequantize(q.quantize(torch.zeros(2, 100)), 100)
    assert torch.equal(zeros, torch.zeros(2, 100))


def test_same_input_same_bytes_and_strided_input_as_contiguous() -> None:
    q = BlockQuantizer(4, 32)
    x = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    assert torch.equal(q.quantize(x), q.quantize(x.clone()))
    t = torch.randn(50, 6).t()  # not contiguous
    assert torch.equal(q.quantize(t), q.quantize(t.contiguous()))


def test_bad_quantizer_settings() -> None:
    with pytest.raises(ValueError, match="bits must be 4 or 8, got 3"):
        BlockQuantizer(3, 64)
    with pytest.raises(ValueError, match="block must be a power of two >= 8, got 100"):
        BlockQuantizer(8, 100)
    with pytest.raises(ValueError, match="codes must be 'int' or 'fp8', got 'e5m2'"):
        BlockQuantizer(8, 64, "e5m2")
    with pytest.raises(ValueError, match="fp8 codes have 8 bits, got bits=4"):
        BlockQuantizer(4, 64, "fp8")


@pytest.mark.parametrize("n", [7, 256, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_codes_keep_each_element_within_a_sixteenth_of_itself(n: int, dtype: torch.dtype) -> None:
    """e4m3 codes of value / scale (scale = the block's largest / 448): each element within 1/16 of itself, or
    within 2**-10 scale below e4m3's normal range, so the block's small elements keep their size, where int8
    gives the small ones a large error relative to themselves (what shrinks Adam's step on them)."""
    q, q8 = BlockQuantizer(8, 64, "fp8"), BlockQuantizer(8, 64)
    x = (torch.randn(3, n, generator=torch.Generator().manual_seed(n)) * torch.logspace(-3, 2, n)).to(dtype)
    packed = q.quantize(x)
    assert packed.shape == (3, q.row_bytes(n)) and q.row_bytes(n) == q8.row_bytes(n)
    blocks = _padded_blocks(x, q)
    scale = blocks.abs().amax(-1, keepdim=True) / 448
    want = (blocks * scale.reciprocal()).to(torch.float8_e4m3fn).view(torch.uint8).view(3, -1)
    assert torch.equal(packed[:, : q.code_bytes(n)], want)  # the float8 conversion's codes ...
    assert torch.equal(packed[:, q.code_bytes(n) :].view(torch.float32), scale.view(3, -1))  # ... and the scales
    y = _padded_blocks(q.dequantize(packed, n), q)
    err = (y - blocks).abs()
    assert bool((err <= torch.maximum(blocks.abs() / 16, scale * 2**-10) * (1 + 1e-6)).all())
    small = (blocks != 0) & (blocks.abs() < scale * 448 / 100)  # under a hundredth of their block's largest
    y8 = _padded_blocks(q8.dequantize(q8.quantize(x), n), q)
    rel, rel8 = (err / blocks.abs())[small], ((y8 - blocks).abs() / blocks.abs())[small]
    assert float(rel.mean()) < 0.05 < float(rel8.mean()), (float(rel.mean()), float(rel8.mean()))


def test_fp8_stochastic_rounding_is_unbiased_and_within_one_code() -> None:
    """Noise rounds each fp8 code to one of the two e4m3 values around value / scale, up with a probability
    equal to the fraction: over many draws the mean is the value, where rounding to nearest keeps its error."""
    q = BlockQuantizer(8, 64, "fp8")
    x = torch.randn(2, 300, generator=torch.Generator().manual_seed(5)) * torch.logspace(-2, 0, 300)
    nearest = q.dequantize(q.quantize(x), 300)
    noise, pool, total, draws = Draws(), ScratchPool(), torch.zeros(2, 300), 2000
    for _ in range(draws):
        u = noise.uniform("0/h.0/grad", q.padded_numel(x), torch.device("cpu"), pool)
        y = q.dequantize(q.quantize(x, noise=u), 300)
        pool.give(u)
        noise.micro_batch += 1
        assert bool(((y - x).abs() <= x.abs() / 8 * (1 + 1e-6)).all())  # one e4m3 step: 1/8 of the value at most
        total += y
    bias, rtn = float((total / draws - x).abs().mean()), float((nearest - x).abs().mean())
    assert bias < rtn / 5, (bias, rtn)
    down = q.dequantize(q.quantize(x, noise=torch.zeros(q.padded_numel(x))), 300)
    up = q.dequantize(q.quantize(x, noise=torch.full((q.padded_numel(x),), 1 - 2**-24)), 300)
    tol = 1 + 1e-6  # x * (1 / scale) * scale is x within an ulp or two
    assert bool((down.abs() <= x.abs() * tol).all()) and bool((up.abs() * tol >= x.abs()).all())  # toward / away from 0
    assert not torch.equal(down, up)
    # each block's largest value, 448 codes' worth (a hair above after x * inv), never rounds up past e4m3's 448
    assert bool(torch.isfinite(up).all())
    assert bool((_padded_blocks(up, q).abs().amax(-1) <= _padded_blocks(x, q).abs().amax(-1) * (1 + 1e-6)).all())


def test_an_fp8_block_with_inf_or_nan_dequantizes_non_finite_and_leaves_the_others_exact() -> None:
    q = BlockQuantizer(8, 64, "fp8")
    x = torch.randn(1, 256)
    x[0, 3], x[0, 200] = float("inf"), float("nan")
    y = q.dequantize(q.quantize(x), 256).view(4, 64)
    assert not torch.isfinite(y[0]).any() and not torch.isfinite(y[3]).any()
    assert torch.equal(y[1:3], q.dequantize(q.quantize(x.view(4, 64)[1:3].reshape(1, -1)), 128).view(2, 64))
    assert torch.equal(q.dequantize(q.quantize(torch.zeros(2, 100)), 100), torch.zeros(2, 100))


def test_node_runs_finds_equal_node_major_layouts_only() -> None:
    ranks = [0, 1, 2, 3]
    assert _node_runs([ranks], ranks, ["a", "a", "b", "b"]) == 2
    assert _node_runs([[0, 1, 2, 3, 4, 5]], list(range(6)), ["a", "a", "b", "b", "c", "c"]) == 2
    assert _node_runs([ranks], ranks, ["a", "b", "a", "b"]) is None  # not node-major
    assert _node_runs([ranks], ranks, ["a", "a", "a", "b"]) is None  # unequal counts
    assert _node_runs([ranks], ranks, ["a", "a", "a", "a"]) is None  # one node: one level is inside it
    assert _node_runs([ranks], ranks, ["a", "b", "c", "d"]) is None  # one rank a node: one level crosses


# ---------------------------------------------------------------------------------------------- collectives
N, S, BLOCK = 4, 300, 64  # S is not a multiple of BLOCK: the last block of each row is padded


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(N * S, generator=g) * (1 + rank), torch.randn(S, generator=g)


def _expected(bits: int, hierarchical: bool, quantize_node: bool = True, codes: str = "int") -> tuple[torch.Tensor, ...]:
    """Every rank's reduced shard, by the quantizer applied by hand to every rank's input."""
    q = BlockQuantizer(bits, BLOCK, codes)
    full = [_inputs(r)[0].view(N, S) for r in range(N)]

    def qd(x: torch.Tensor) -> torch.Tensor:
        return q.dequantize(q.quantize(x), x.shape[-1])

    if not hierarchical:
        return tuple(sum(qd(full[src][r : r + 1]) for src in range(N))[0] for r in range(N))
    out = []
    for r in range(N):  # 2 nodes of 2 ranks
        # After its node's all-to-all, the rank of node jj at r's place holds that node's sum of row r ...
        node = qd if quantize_node else (lambda x: x)  # fp32 inside the node: its exact sum is quantized once
        partial = [sum(node(full[jj * 2 + p][r : r + 1]) for p in range(2)) for jj in range(2)]
        out.append(sum(qd(x) for x in partial)[0])  # ... requantized, and summed across the nodes by rank r
    return tuple(out)


def _collectives(rank: int, world: int, bits: int, codes: str) -> dict:
    nodes = ["a", "a", "b", "b"]
    topo = Topology.build(dist.group.WORLD, CommConfig(), nodes=nodes, node_levels=True)
    full, shard = _inputs(rank)
    out = {}
    for name, rs in (("one", QuantizedReduceScatter(bits, BLOCK, topo.shard, codes=codes)),
                     ("two", QuantizedReduceScatter(bits, BLOCK, topo.shard, topo.node, topo.cross, codes=codes)),
                     ("mixed", QuantizedReduceScatter(bits, BLOCK, topo.shard, topo.node, topo.cross,
                                                      quantize_node=False, codes=codes))):
        topo.reset()
        reduced = torch.empty(S)
        rs.reduce_scatter(reduced, full.clone(), "g").wait()
        out[name] = (reduced, topo.report(by_scope=True))
    topo.reset()
    gathered = torch.empty(N * S, dtype=torch.bfloat16)
    QuantizedGather(BLOCK).all_gather(topo.shard, gathered, shard.to(torch.bfloat16), "g").wait()
    out["gather"] = (gathered, topo.report(by_scope=True))
    out["exact"] = torch.stack([_inputs(r)[0].view(N, S)[rank] for r in range(N)]).sum(0)
    topo.close()
    return out


@pytest.mark.parametrize(("bits", "codes"), [(4, "int"), (8, "int"), (8, "fp8")])
def test_quantized_reduce_scatter_and_gather_equal_the_quantizer_by_hand(bits: int, codes: str) -> None:
    res = run_ranks(_collectives, N, bits, codes)
    q, q8 = BlockQuantizer(bits, BLOCK, codes), BlockQuantizer(8, BLOCK)
    row, kind = q.row_bytes(S), "all_to_all_fp8" if codes == "fp8" else f"all_to_all_int{bits}"
    one, two = _expected(bits, False, codes=codes), _expected(bits, True, codes=codes)
    mixed = _expected(bits, True, quantize_node=False, codes=codes)
    for rank, r in enumerate(res):
        assert torch.equal(r["one"][0], one[rank])
        assert torch.equal(r["two"][0], two[rank])
        assert torch.equal(r["mixed"][0], mixed[rank])
        # One rounding instead of two: the fp32 stage inside the node leaves the smaller error.
        error = {k: float((r[k][0] - r["exact"]).norm()) for k in ("two", "mixed")}
        assert error["mixed"] < error["two"], error
        # Accuracy against the exact sum: relative to the largest input block a step of the code.
        rel = float((r["two"][0] - r["exact"]).norm() / r["exact"].norm())
        assert rel < {(8, "int"): 0.02, (8, "fp8"): 0.05, (4, "int"): 0.3}[bits, codes], rel
        # One level: the whole buffer through one all-to-all spanning the nodes.
        assert r["one"][1] == {f"inter_node:{kind}": N * row}
        # Two levels: the whole buffer inside the node, then one row per node across (N/m = 2 rows).
        assert r["two"][1] == {f"intra_node:{kind}": N * row, f"inter_node:{kind}": 2 * row}
        # fp32 inside the node: the whole buffer in fp32 there, the same quantized rows across.
        assert r["mixed"][1] == {"intra_node:all_to_all": N * S * 4, f"inter_node:{kind}": 2 * row}
        want = torch.cat([q8.dequantize(q8.quantize(_inputs(s)[1].to(torch.bfloat16).view(1, S)), S)[0] for s in range(N)])
        assert torch.equal(r["gather"][0], want.to(torch.bfloat16))  # every rank, its own shard too
        assert r["gather"][1] == {"inter_node:all_gather_int8": N * q8.row_bytes(S)}


@pytest.mark.parametrize("bits", [4, 8])
def test_stochastic_rounding_is_unbiased_and_within_one_step(bits: int) -> None:
    """Rounded with uniform noise, each code is the one below or above value / scale, and over many draws
    the mean of the dequantized values is the value itself, where rounding to nearest keeps its error."""
    q = BlockQuantizer(bits, 64)
    x = torch.randn(2, 300, generator=torch.Generator().manual_seed(3)) * 0.02
    blocks = _padded_blocks(x, q)
    step = blocks.abs().amax(-1, keepdim=True) / q.qmax
    nearest = q.dequantize(q.quantize(x), 300)
    noise, pool, total, draws = Draws(), ScratchPool(), torch.zeros(2, 300), 4000
    for _ in range(draws):  # the engine's noise, fresh each micro-batch
        u = noise.uniform("0/h.0", q.padded_numel(x), torch.device("cpu"), pool)
        y = q.dequantize(q.quantize(x, noise=u), 300)
        pool.give(u)
        noise.micro_batch += 1
        assert bool(((_padded_blocks(y, q) - blocks).abs() <= step * (1 + 1e-6)).all())
        total += y
    bias, rtn = float((total / draws - x).abs().mean()), float((nearest - x).abs().mean())
    assert bias < rtn / 5, (bias, rtn)
    # noise 0 rounds down, noise just below 1 rounds up: the codes bracket value / scale
    down = q.dequantize(q.quantize(x, noise=torch.zeros(2, q.blocks(300) * 64)), 300)
    up = q.dequantize(q.quantize(x, noise=torch.full((2, q.blocks(300) * 64), 1 - 2**-24)), 300)
    assert bool((down <= x).all()) and bool((up >= x).all()) and not torch.equal(down, up)


def test_draws_are_uniform_on_256_levels() -> None:
    """Every byte of the random words is used, so each level (k + 0.5) / 256 comes up alike, and the mean is
    1/2 (a draw that left the words' sign bit at 0 would give 0.469)."""
    u = Draws().uniform("0/h.0", 1 << 18, torch.device("cpu"), ScratchPool()).view(-1)
    levels = u * 256 - 0.5
    assert torch.equal(levels, levels.round())
    counts = torch.bincount(levels.long(), minlength=256)
    assert counts.numel() == 256 and int(counts.min()) > 0.8 * 1024 and int(counts.max()) < 1.2 * 1024
    for byte in range(8):  # each byte of the words, on its own
        assert abs(float(u.view(-1, 8)[:, byte].mean()) - 0.5) < 0.01


def test_draws_are_a_function_of_the_key_and_the_micro_batch() -> None:
    draws, pool, cpu = Draws(), ScratchPool(), torch.device("cpu")
    a = draws.uniform("0/h.0", 512, cpu, pool).clone()
    assert a.shape == (1, 512) and float(a.min()) >= 0 and float(a.max()) < 1
    assert torch.equal(draws.uniform("0/h.0", 512, cpu, pool), a)  # the backward's gather: the forward's draws
    assert not torch.equal(draws.uniform("1/h.0", 512, cpu, pool), a)  # another rank
    assert not torch.equal(draws.uniform("0/h.1", 512, cpu, pool), a)  # another group
    draws.micro_batch += 1
    assert not torch.equal(draws.uniform("0/h.0", 512, cpu, pool), a)  # the next micro-batch


def test_scratch_pool_hands_back_the_memory_it_was_given() -> None:
    pool = ScratchPool()
    a = pool.take((4, 8), torch.float32, torch.device("cpu"))
    assert a.shape == (4, 8) and a.dtype == torch.float32 and a.is_contiguous()
    ptr = a.data_ptr()
    pool.give(a)
    assert pool.cached_bytes() == 128
    b = pool.take((128,), torch.uint8, torch.device("cpu"))  # the same byte size, any shape and dtype
    assert b.data_ptr() == ptr and pool.cached_bytes() == 0
    c = pool.take((4, 8), torch.float32, torch.device("cpu"))  # in use: a new buffer
    assert c.data_ptr() != ptr
    pool.give(b, c)
    assert pool.cached_bytes() == 256
    pool.clear()
    assert pool.cached_bytes() == 0


def test_pooled_kernels_equal_the_quantizer_and_reuse_buffers() -> None:
    """QuantizeKernels on CPU: the same bytes and values as the plain quantizer, into pooled buffers."""
    q = BlockQuantizer(8, 64)
    kernels = QuantizeKernels(q, compiled=False)
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(0))
    rows = torch.randn(2, 3, 200, generator=torch.Generator().manual_seed(1)).transpose(0, 1)  # strided rows
    for t in (x, rows):
        codes = kernels.quantize(t)
        assert torch.equal(codes, q.quantize(t))
        values = kernels.dequantize(codes, 200)
        assert torch.equal(values, q.dequantize(q.quantize(t), 200))
        into = torch.empty(codes.shape[0], 200, dtype=torch.bfloat16)
        assert torch.equal(kernels.dequantize(codes, 200, out=into), q.dequantize(codes, 200).to(torch.bfloat16))
        ptrs = {codes.data_ptr(), values.data_ptr()}
        kernels.release(codes, values)
        assert {kernels.quantize(t).data_ptr(), kernels.dequantize(codes, 200).data_ptr()} == ptrs
