"""ZeRO++'s block quantizer (zeroray.engine.quantize.BlockQuantizer) on this CPU: throughput, error, cost a step.

    PYTHONPATH=. python benchmarks/quantize_bench.py [--params 25e6] [--numel 8e6] [--reps 5]

1. Throughput: quantize and dequantize GB/s of the input (fp32; bf16 at the default block) for int8, int4
   and fp8 (e4m3) codes at block sizes 64..2048, with one and two torch threads. The input is a (4, numel/4) buffer, as qgZ
   quantizes a gradient buffer's rows for 4 ranks; GB/s counts the full-precision bytes (quantize reads them,
   dequantize writes fp32). Median of ``--reps`` after one warm-up.
2. Error per element, on zeroray's GPT (``--params``, the hybrid/ZeRO++ benchmark's model, seed 0, a few AdamW
   steps on the shipped corpus): mean |x - deq(q(x))| / mean |x| and max |x - deq(q(x))| / max |block| (at
   most 1 / (2 qmax): 0.0039 for int8, 0.071 for int4), on (a) the weights and (b) one step's gradient, each
   unit's flat buffer (a transformer block, or the root's parameters) cut into 4 rows as the engine's shards
   are, and on one weight matrix alone; and (c) qgZ's reduced gradient: the sum over 4 ranks' gradients
   (4 batches) through one quantized exchange, and hierarchically (2 nodes x 2 ranks: quantize, sum a node's
   2, requantize, sum the 2 nodes), against the exact fp32 sum; and the share of Adam's step the
   hierarchical reduced gradient keeps, per element (what qgZ's int codes cost on a block's small gradients).
3. The cost of quantizing a step, apart: the quantize and dequantize calls one rank of the ZeRO++ benchmark
   (2 nodes x 2 ranks, hpZ + qwZ + qgZ) makes in a step, on the model's real unit sizes, timed in one process
   at one thread, without any communication: qwZ quantizes the rank's shard and dequantizes the gathered
   buffer for each unit's forward; qgZ quantizes the unit's gradient buffer (4 rows), dequantizes what the
   node's exchange brings, requantizes the node's partial sums (2 rows) and dequantizes the cross-node
   exchange. Compared with the step times in results/zeropp/results.md where that file exists.

Writes benchmarks/results/zeropp/quantize.md (and prints it). About 3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.gpu_offload_bench import _wall as timed  # noqa: E402  (median seconds after a warm-up)
from zeroray.engine.quantize import BlockQuantizer  # noqa: E402
from zeroray.engine.rounding import Draws  # noqa: E402
from zeroray.engine.scratch import ScratchPool  # noqa: E402
from zeroray.models.gpt import GPT, GPTConfig  # noqa: E402

BLOCKS = (64, 128, 256, 512, 1024, 2048)
FORMATS = {"int8": (8, "int"), "int4": (4, "int"), "fp8": (8, "fp8")}  # name: (bits, codes) of BlockQuantizer
KEPT_DRAWS = 16  # stochastic roundings averaged for "Adam's step kept"
DEFAULT_BLOCK = 256  # ZeroConfig.quantize.block_size's default
WORLD, PER_NODE = 4, 2  # the ZeRO++ benchmark's 2 nodes x 2 ranks
OUT = Path(__file__).resolve().parent / "results" / "zeropp" / "quantize.md"
CORPUS = Path(__file__).resolve().parent.parent / "examples" / "data" / "corpus.txt"
ZPP_RESULTS = OUT.with_name("results.md")
ZPP_MODES = ("zeroray ZeRO++ (hpZ + qwZ + qgZ int8)", "zeroray hpZ (h=2), stage 3")


def throughput(numel: int, reps: int) -> list[tuple[int, str, str, int, str, float, float]]:
    """(threads, dtype, codes, block, rounding, quantize GB/s, dequantize GB/s) of the full-precision input's
    bytes. Stochastic rounding (at the default block) counts drawing its noise (rounding.Draws) into quantize."""
    rows = []
    draws, pool = Draws(), ScratchPool()
    g = torch.Generator().manual_seed(0)
    x32 = torch.randn(WORLD, numel // WORLD, generator=g)
    inputs = {"fp32": x32, "bf16": x32.to(torch.bfloat16)}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for dtype, x in inputs.items():
            for fmt, (bits, codes) in FORMATS.items():
                for block in BLOCKS if dtype == "fp32" else (DEFAULT_BLOCK,):
                    q = BlockQuantizer(bits, block, codes)
                    packed = q.quantize(x)
                    n = x.shape[-1]
                    t_q = timed(lambda q=q, x=x, packed=packed: q.quantize(x, out=packed), reps)
                    t_d = timed(lambda q=q, packed=packed, n=n: q.dequantize(packed, n), reps)
                    gb = x.numel() * x.element_size() / 1e9
                    rows.append((threads, dtype, fmt, block, "nearest", gb / t_q, gb / t_d))
                    if dtype == "fp32" and block == DEFAULT_BLOCK:
                        t_s = timed(lambda q=q, x=x, packed=packed: _stochastic(q, x, draws, pool, packed), reps)
                        rows.append((threads, dtype, fmt, block, "stochastic", gb / t_s, gb / t_d))
                    print(f"threads {threads} {dtype} {fmt} block {block:5d}: quantize {gb / t_q:6.2f} GB/s,"
                          f" dequantize {gb / t_d:6.2f} GB/s", flush=True)
    torch.set_num_threads(1)
    return rows


def _stochastic(q: BlockQuantizer, x: torch.Tensor, draws: Draws, pool: ScratchPool,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``x``'s rows quantized with stochastic rounding (into ``out`` when given), the noise drawn as the engine
    draws it."""
    noise = draws.uniform("bench", q.padded_numel(x), x.device, pool)
    out = q.quantize(x, out=out, noise=noise)
    pool.give(noise)
    return out


def corpus_batches(vocab: int, batch: int, seq: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of the shipped corpus's bytes as tokens (random windows, seed 0)."""
    data = torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8).long() % vocab
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        starts = torch.randint(len(data) - seq - 1, (batch,), generator=g)
        window = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
        out.append((window[:, :-1], window[:, 1:]))
    return out


def unit_params(model: GPT) -> list[list[torch.nn.Parameter]]:
    """The model's parameters by stage-3 unit, as the engine groups them: each transformer block, then the rest
    (the root: embeddings, final norm; the tied head counted once)."""
    blocks = [list(b.parameters()) for b in model.transformer.h]
    in_blocks = {id(p) for ps in blocks for p in ps}
    root = [p for p in model.parameters() if id(p) not in in_blocks]
    return [*blocks, root]


def flat_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors concatenated and padded to a multiple of WORLD, as WORLD rows (the ranks' shards)."""
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    pad = -len(flat) % WORLD
    return torch.cat([flat, flat.new_zeros(pad)]).view(WORLD, -1)


def errors(q: BlockQuantizer, rows: torch.Tensor) -> tuple[float, float]:
    """(mean |x - deq| / mean |x|, max over elements of |x - deq| / max |x| of the element's block)."""
    n = rows.shape[-1]
    err = (q.dequantize(q.quantize(rows), n) - rows).abs()
    pad = -n % q.block
    blocks = torch.nn.functional.pad(rows.abs(), (0, pad)).view(rows.shape[0], -1, q.block)
    block_max = blocks.amax(-1, keepdim=True).expand_as(blocks).reshape(rows.shape[0], -1)[:, :n]
    mask = block_max > 0
    return (err.mean() / rows.abs().mean()).item(), (err[mask] / block_max[mask]).max().item()


def hierarchical_sum(qd: Callable[[torch.Tensor], torch.Tensor], grads: list[torch.Tensor]) -> torch.Tensor:
    """qgZ's hierarchical sum over WORLD ranks' rows, each quantization done by ``qd`` (quantize, dequantize):
    inside each node, then across, the node's partial sums requantized."""
    partials = [sum(qd(grads[j * PER_NODE + i]) for i in range(PER_NODE)) for j in range(WORLD // PER_NODE)]
    return sum(qd(p) for p in partials)


def reduced_error(q: BlockQuantizer, grads: list[torch.Tensor], hierarchical: bool) -> float:
    """mean |sum - qgZ's sum| / mean |sum| over WORLD ranks' gradient rows (each ``grads[r]`` is (WORLD, S))."""
    exact = torch.stack(grads).sum(0)
    n = exact.shape[-1]

    def qd(x: torch.Tensor) -> torch.Tensor:
        return q.dequantize(q.quantize(x), n).view_as(x)

    got = hierarchical_sum(qd, grads) if hierarchical else sum(qd(g) for g in grads)
    return ((got - exact).abs().mean() / exact.abs().mean()).item()


def adam_step_kept(q: BlockQuantizer, grads: list[torch.Tensor]) -> float:
    """The mean over the elements of the hierarchical reduced gradient (2 nodes x 2 ranks) of E[q] sign(g) /
    sqrt(E[q^2]): Adam's step on each element relative to the exact gradient's, the codes rounded
    stochastically (the default; KEPT_DRAWS draws)."""
    exact = torch.stack(grads).sum(0)
    n, draws, pool = exact.shape[-1], Draws(), ScratchPool()

    def qd(x: torch.Tensor) -> torch.Tensor:
        return q.dequantize(_stochastic(q, x, draws, pool), n).view_as(x)

    m1, m2 = torch.zeros_like(exact), torch.zeros_like(exact)
    for _ in range(KEPT_DRAWS):
        got = hierarchical_sum(qd, grads)
        m1 += got / KEPT_DRAWS
        m2 += got * got / KEPT_DRAWS
        draws.micro_batch += 1
    nz = exact != 0
    return float((m1[nz] * exact[nz].sign() / m2[nz].sqrt().clamp_min(1e-30)).mean())


def model_errors(params: float, steps: int) -> tuple[list[str], dict[str, object]]:
    """The error tables' lines, and the unit sizes (elements, padded to WORLD) for the cost part."""
    torch.manual_seed(0)
    cfg = GPTConfig.for_params(params)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = corpus_batches(cfg.vocab_size, 4, 128, steps + WORLD)
    for x, y in batches[:steps]:
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
    units = unit_params(model)
    weights = [flat_rows(ps) for ps in units]
    rank_grads = []  # per rank: each unit's gradient rows
    for x, y in batches[steps:]:
        model(x, y)[1].backward()
        rank_grads.append([flat_rows([p.grad for p in ps]) for ps in units])
        opt.zero_grad()
    matrix_name = "transformer.h.0.mlp.c_fc.weight"
    matrix = dict(model.named_parameters())[matrix_name]
    lines = [
        f"Model: zeroray GPT {model.num_params() / 1e6:.1f}M parameters (n_layer {cfg.n_layer}, n_embd {cfg.n_embd}),"
        f" seed 0, {steps} AdamW steps (lr 1e-3) on the shipped corpus; gradient: rank 0's next batch (4 x 128"
        f" tokens); reduced gradient: {WORLD} ranks' batches.",
        "",
        "| codes | block | weights: mean rel. err | weights: max err / block max | one weight matrix: mean rel. err"
        " | gradient: mean rel. err | gradient: max err / block max | reduced gradient, one level | reduced gradient,"
        " hierarchical (2 x 2) | Adam's step kept |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("errors:", flush=True)
    for fmt, (bits, codes) in FORMATS.items():
        for block in BLOCKS:
            q = BlockQuantizer(bits, block, codes)
            w = [errors(q, r) for r in weights]
            g = [errors(q, r) for r in rank_grads[0]]
            sizes = [r.numel() for r in weights]
            total = sum(sizes)
            # unit means weighted by each unit's mean |x| x size = the mean over the whole model
            w_abs = [r.abs().mean().item() * s for r, s in zip(weights, sizes, strict=True)]
            g_abs = [r.abs().mean().item() * s for r, s in zip(rank_grads[0], sizes, strict=True)]
            w_mean = sum(e[0] * a for e, a in zip(w, w_abs, strict=True)) / sum(w_abs)
            g_mean = sum(e[0] * a for e, a in zip(g, g_abs, strict=True)) / sum(g_abs)
            mat = errors(q, matrix.detach().view(1, -1))[0]
            red = [sum(reduced_error(q, [rank_grads[r][u] for r in range(WORLD)], h) * s
                       for u, s in enumerate(sizes)) / total for h in (False, True)]
            kept = sum(adam_step_kept(q, [rank_grads[r][u] for r in range(WORLD)]) * s
                       for u, s in enumerate(sizes)) / total if block == DEFAULT_BLOCK else None
            lines.append(f"| {fmt} | {block} | {w_mean:.4f} | {max(e[1] for e in w):.4f} | {mat:.4f} | {g_mean:.4f}"
                         f" | {max(e[1] for e in g):.4f} | {red[0]:.4f} | {red[1]:.4f} | "
                         + (f"{kept:.3f} |" if kept is not None else " |"))
            print(lines[-1], flush=True)
    lines += [
        "",
        f"*weights* / *gradient*: every unit's flat buffer in {WORLD} rows (the shards), the mean error weighted over"
        " the whole model (= total |error| / total |x|), the max over every element. *one weight matrix*:"
        f" `{matrix_name}` alone, one row. *reduced gradient*: the mean relative error of the sum over {WORLD} ranks"
        " after qgZ's quantized exchange(s), size-weighted over units; the hierarchical form quantizes twice (the"
        " node's partial sum is requantized), as in ZeRO++. *Adam's step kept* (default block): per element of the"
        " hierarchical reduced gradient, E[q] sign(g) / sqrt(E[q^2]) over the quantizer's errors, averaged over the"
        " elements, Adam's step on an element relative to its exact one when its moments track q (m -> E[q],"
        f" v -> E[q^2]); the codes rounded stochastically, the default ({KEPT_DRAWS} draws). A mean"
        " weighted by |g| would hide it: Adam gives every element the same step size, so the small gradients of a"
        " block, whose int codes are mostly 0 with a rare +-1, count as much as the large ones.",
    ]
    return lines, {"units": [r.numel() for r in weights], "n_params": model.num_params()}


def step_cost(units: list[int], fmt: str, block: int, reps: int, stochastic: bool = False) -> tuple[float, float, float]:
    """Seconds of one rank's quantize and dequantize calls in one ZeRO++ step (2 nodes x 2 ranks), one thread:
    (qwZ, qgZ in ``fmt``, full-precision bytes touched); ``stochastic``: every quantization rounded
    stochastically, its noise drawn as the engine draws it."""
    torch.set_num_threads(1)
    qw, qg = BlockQuantizer(8, block), BlockQuantizer(FORMATS[fmt][0], block, FORMATS[fmt][1])
    g = torch.Generator().manual_seed(0)
    bufs = [torch.randn(n, generator=g) for n in units]
    nodes = WORLD // PER_NODE
    draws, pool = Draws(), ScratchPool()

    def quantize(q: BlockQuantizer, x: torch.Tensor) -> torch.Tensor:
        return _stochastic(q, x, draws, pool) if stochastic else q.quantize(x)

    def qwz() -> None:
        for full in bufs:
            s = full.numel() // WORLD
            packed = quantize(qw, full[:s].view(1, s))
            recv = packed.expand(WORLD, -1).contiguous()
            full.view(WORLD, s).copy_(qw.dequantize(recv, s))

    def qgz() -> None:
        for full in bufs:
            s = full.numel() // WORLD
            send = quantize(qg, full.view(nodes, PER_NODE, s).transpose(0, 1))  # the node's exchange
            partial = qg.dequantize(send, s).reshape(PER_NODE, nodes, s).sum(0)
            send2 = quantize(qg, partial)  # the cross-node exchange
            qg.dequantize(send2, s).reshape(nodes, s).sum(0)

    touched = sum(units) * 4 * (1 / WORLD + 1) + sum(units) * 4 * (1 + 1 + 2 / PER_NODE)
    return timed(qwz, reps), timed(qgz, reps), touched


def step_times() -> dict[tuple[str, str, str], float]:
    """{(nodes x ranks, link, mode name): step s} from results/zeropp/results.md's first table, if any."""
    out: dict[tuple[str, str, str], float] = {}
    if not ZPP_RESULTS.exists():
        return out
    for line in ZPP_RESULTS.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[2] in ZPP_MODES:
            try:
                out[(cells[0], cells[1], cells[2])] = float(cells[3])
            except ValueError:
                continue
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=25e6)
    parser.add_argument("--numel", type=float, default=8e6, help="elements of the throughput input")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--train-steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    t0 = time.monotonic()
    load0 = os.getloadavg()[0]
    tp = throughput(int(args.numel), args.reps)
    err_lines, info = model_errors(args.params, args.train_steps)
    costs = {(fmt, rounding): step_cost(info["units"], fmt, DEFAULT_BLOCK, args.reps, rounding == "stochastic")
             for fmt in FORMATS for rounding in ("nearest", "stochastic")}
    lines = [
        "# ZeRO++'s block quantizer on CPU: throughput, error, cost a step",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- machine: {os.cpu_count()} cores CPU ({platform.processor() or platform.machine()}), torch"
        f" {torch.__version__}; shared with other jobs, so times are noisy",
        f"- command: `PYTHONPATH=. python benchmarks/quantize_bench.py {' '.join(sys.argv[1:])}`",
        f"- total wall time {time.monotonic() - t0:.0f} s; 1-minute load average {load0:.1f} at the start,"
        f" {os.getloadavg()[0]:.1f} at the end (above 2, other jobs share the 2 cores and the GB/s are a floor)",
        "",
        "## Throughput",
        "",
        f"GB/s of the full-precision input (a ({WORLD}, {int(args.numel) // WORLD}) tensor, {args.numel / 1e6:.0f}M"
        f" elements); median of {args.reps} after a warm-up; `quantize(x, out=...)` into a preallocated buffer,"
        " `dequantize` allocating its fp32 output. Block = values per fp32 scale.",
        "",
        "Rounding `stochastic` (quantize.weight_rounding / gradient_rounding) includes drawing the noise from a"
        " seeded generator (zeroray.engine.rounding.Draws); dequantizing is the same either way.",
        "",
        "| threads | input | codes | block | rounding | quantize GB/s | dequantize GB/s |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {t} | {d} | {c} | {blk} | {r} | {gq:.2f} | {gd:.2f} |" for t, d, c, blk, r, gq, gd in tp]
    lines += ["", "## Error per element", "", *err_lines, "", "## The cost of quantizing, a step", ""]
    n_params = info["n_params"]
    lines += [
        f"One rank's quantize + dequantize calls in one ZeRO++ step of the benchmark's model ({n_params / 1e6:.1f}M"
        f" parameters, {len(info['units'])} units, {WORLD} ranks on {WORLD // PER_NODE} nodes, block {DEFAULT_BLOCK}),"
        " one thread, no communication (what results/zeropp/results.md's ZeRO++ rows add to hpZ's step besides the"
        " smaller transfers):",
        "",
        "| qgZ codes | rounding | qwZ (forward gathers) s | qgZ (hierarchical reduce-scatter) s | total s | fp32 GB touched |",
        "|---|---|---|---|---|---|",
    ]
    for (fmt, rounding), (tw, tg, touched) in costs.items():
        lines.append(f"| {fmt} | {rounding} | {tw:.3f} | {tg:.3f} | {tw + tg:.3f} | {touched / 1e9:.2f} |")
    steps = step_times()
    if steps:
        total8 = sum(costs["int8", "nearest"][:2])
        lines += ["", "Against the step times of results/zeropp/results.md (2 nodes x 2 ranks; there 4 ranks share"
                  " 2 cores, so a rank's quantizing takes about twice the one-thread time above):", "",
                  "| link | mode | step s | quantizing (int8, 1 thread) / step | x2 (half a core a rank) / step |",
                  "|---|---|---|---|---|"]
        for (case, link, mode), s in steps.items():
            if case == f"{WORLD // PER_NODE}x{PER_NODE}":
                lines.append(f"| {link} | {mode} | {s:.3f} | {total8 / s:.2f} | {2 * total8 / s:.2f} |")
    md = "\n".join(lines) + "\n"
    print("\n" + md)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(md)


if __name__ == "__main__":
    main()
