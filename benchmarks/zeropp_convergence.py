"""ZeRO++ convergence study (issue 33): do quantized weight gathers (qwZ) and quantized gradient
reductions (qgZ) train the main example's GPT as well as full precision?

    sudo PYTHONPATH=. python benchmarks/zeropp_convergence.py [--steps 400] [--modes all] [--plot-only]

The model and recipe are examples/train_gpt.py's defaults, imported from it: the byte-level GPT (4 layers,
256 wide, 4 heads, context 128, ~3.2M parameters) on examples/data/corpus.txt (the last tenth held out),
micro-batch 8 per rank, AdamW (lr 3e-3, betas (0.9, 0.95), weight decay 0.1), linear warm-up over
steps // 15 steps then cosine decay to a tenth, gradient clipping at 1.0, fp32 (the example's default
precision: it passes no ``precision`` to ZeroConfig). World 4 on the emulated cluster
(tests/support/netcluster.py): 2 network-namespace nodes x 2 gloo ranks, unshaped links, ranks 2r and
2r+1 on node r, the nodes passed to ``zeroray.initialize`` so qgZ is hierarchical (inside the node, then
across). ZeRO stage 3 for every mode.

Data: every mode sees the same windows in the same steps, chosen by global sample index as the example's
elastic path did when this study was first run (``windows_at`` below; the example now reads a Parquet file of
windows through Ray Data, and the study keeps the placement its recorded runs used): step s, rank r trains on samples [s*32 + 8r, s*32 + 8r + 8). Weights:
``torch.manual_seed(1337)`` before the model is built, as in the example. The logged loss of a step is the
mean over the 4 ranks of their micro-batch losses (the global batch's loss).

All modes run side by side in the same 4 rank processes (one engine per mode; one step of each mode a
round, the order rotated every round, a barrier before each mode's step, so a shared machine's load falls
on all modes alike and the process start-up is paid once). The modes are independent: each has its own
model, optimizer, engine and process groups. Per mode and step: the loss and the slowest rank's step
seconds (forward, backward, optimizer step). ``--separate`` runs each mode in its own job instead.

Errors of the quantized collectives, on the run's own tensors, at the steps in ``--measure-steps``:

- weights: after the optimizer step, every floating group's shard is gathered exactly (fp32 all-gather)
  and through qwZ's int8 block gather (``QuantizedGather``, block sizes 64, 256 and 2048), on the same
  shards: the relative error per element ``mean|q - w| / mean|w|``, for one transformer block's group
  (``transformer.h.1``), per tensor inside it, and over all groups;
- gradients: in the qgZ modes, each group's unreduced gradient buffer (what the engine hands its
  ``QuantizedReduceScatter``) is copied during backward; after the step the copies are reduced exactly (an
  fp32 all-reduce of the same buffer, this rank's part kept) and through the quantized all-to-all, with the
  mode's own object (hierarchical, its bits) and with int8/int4, hierarchical/one-level objects on the same
  buffers: ``mean|q - exact| / mean|exact|`` over this rank's shard, summed over ranks.

Writes benchmarks/results/zeropp/convergence.{json,md,png} (or in ``--out``); convergence_notes.md there (the findings, by
hand) is appended to the md. Runs of other jobs are added with ``--merge`` (a mode run alone with
``--no-baseline``, or the control ``--modes "baseline perturbed 1e-6"``); a job stopped early is reported
from its dumps with ``--from-partial``; ``--plot-only`` redraws the md and png from the json. ``--seed N``
starts every mode from other initial weights and names its runs "<mode> (seed N)"; merged in, they give the
report's "Across seeds" section (each mode's mean over its seeds against the baseline's, with standard errors)
and convergence_seeds.png: one seed's curves drift apart by more than the goal's 1% at this batch, so the
goal is judged on the means, with their standard errors: met, missed, or not resolved by the seeds run. Needs
root (network namespaces).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from tests.support.netcluster import NetCluster, run_ranks, unavailable  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "zeropp"
RANKS_PER_NODE = 2
NODES = 2
BLOCK_SIZE = 256  # the quantization block (values per fp32 scale) of every quantized mode
# examples/train_gpt.py's defaults (its argparse defaults; the recipe functions are imported from it)
EXAMPLE = {"batch": 8, "block": 128, "n_layer": 4, "n_embd": 256, "n_head": 4, "lr": 3e-3, "grad_clip": 1.0}
# Every mode recorded before stochastic rounding became the default (2026-11-28) is pinned to rounding to nearest.
NEAREST = {"weight_rounding": "nearest", "gradient_rounding": "nearest"}
# The modes with qwZ recorded before its backward gathers were quantized too (the default since) are pinned to
# exact_backward_weights, so each name keeps the form its runs used; "(int8 backward)" names the form that became
# the default then.
MODES: dict[str, dict[str, Any]] = {
    "baseline": {},
    "qwZ": {**NEAREST, "weights": True, "exact_backward_weights": True},
    "qwZ (int8 backward)": {**NEAREST, "weights": True},
    "qwZ+qgZ int8 (int8 backward)": {**NEAREST, "weights": True, "gradients": True, "gradient_bits": 8, "intra_node_gradients": True},
    # qgZ in ZeRO++'s own form, quantized inside the node too (two roundings; the default on CUDA, and the form
    # the recorded runs used): the CPU default's fp32 stage inside the node rounds once, so it errs less
    "qgZ int8": {**NEAREST, "gradients": True, "gradient_bits": 8, "intra_node_gradients": True},
    "qgZ int4": {**NEAREST, "gradients": True, "gradient_bits": 4, "intra_node_gradients": True},
    "qwZ+qgZ int8": {**NEAREST, "weights": True, "exact_backward_weights": True, "gradients": True, "gradient_bits": 8, "intra_node_gradients": True},
    "qwZ+qgZ int4": {**NEAREST, "weights": True, "exact_backward_weights": True, "gradients": True, "gradient_bits": 4, "intra_node_gradients": True},
    "qwZ+qgZ int8 (repeat)": {**NEAREST, "weights": True, "exact_backward_weights": True, "gradients": True, "gradient_bits": 8, "intra_node_gradients": True},
    # the CPU default (intra_node_gradients None = False on CPU): fp32 inside the node, the node's sum rounded once
    "qgZ int8 (fp32 in node)": {**NEAREST, "gradients": True, "gradient_bits": 8, "intra_node_gradients": False},
    "qwZ+qgZ int8 (fp32 in node)": {**NEAREST, "weights": True, "exact_backward_weights": True, "gradients": True, "gradient_bits": 8, "intra_node_gradients": False},
    # full ZeRO++ (the benchmark's): hpZ keeps the forward's dequantized weights for the backward inside the node, so
    # backward computes with the weights forward used (as qwZ's default form does without hpZ)
    "hpZ+qwZ+qgZ int8": {**NEAREST, "_hpz": RANKS_PER_NODE, "weights": True, "gradients": True, "gradient_bits": 8,
                         "intra_node_gradients": True},
    # stochastic rounding of qwZ's codes (quantize.weight_rounding), and of qgZ's too (gradient_rounding): "SR both"
    # is the default since 2026-11-28
    "qwZ (int8 backward) SR": {"weights": True, "weight_rounding": "stochastic"},
    "qwZ+qgZ int8 (int8 backward) SR": {"weights": True, "gradients": True, "gradient_bits": 8, "intra_node_gradients": True,
                                        "weight_rounding": "stochastic", "gradient_rounding": "nearest"},
    "qwZ+qgZ int8 (int8 backward) SR both": {"weights": True, "gradients": True, "gradient_bits": 8,
                                             "intra_node_gradients": True, "weight_rounding": "stochastic",
                                             "gradient_rounding": "stochastic"},
    "qgZ int8 SR": {"gradients": True, "gradient_bits": 8, "intra_node_gradients": True},  # (rounding: the default)
    # The "SR" runs above drew fp32 noise; since 2026-11-28 the draws are 8-bit (zeroray.engine.rounding), as here.
    # qgZ's fp8 (e4m3) codes keep each gradient's size relative to itself: int8's error on a block's small
    # gradients shrinks Adam's step there (the qgZ lag)
    "qwZ SR (8-bit noise)": {"weights": True, "weight_rounding": "stochastic"},
    "qwZ+qgZ int8 SR (8-bit noise)": {"weights": True, "gradients": True, "gradient_bits": 8, "intra_node_gradients": True},
    "qgZ fp8": {"gradients": True, "gradient_codes": "fp8", "intra_node_gradients": True, "gradient_rounding": "nearest"},
    "qwZ+qgZ fp8": {"weights": True, "weight_rounding": "stochastic", "gradients": True, "gradient_codes": "fp8",
                    "intra_node_gradients": True, "gradient_rounding": "nearest"},
    # fp8 codes rounded stochastically too (the rounding's default)
    "qgZ fp8 SR": {"gradients": True, "gradient_codes": "fp8", "intra_node_gradients": True},
    "qwZ+qgZ fp8 SR": {"weights": True, "gradients": True, "gradient_codes": "fp8", "intra_node_gradients": True},
    # qwZ's weights with 4x the scales (0.6% error per element at block 64 against 0.7% at 256)
    "qwZ block 64": {**NEAREST, "weights": True, "exact_backward_weights": True, "block_size": 64},
    # qwZ's default form (stochastic rounding, 8-bit draws) with 4x the scales
    "qwZ SR block 64 (8-bit noise)": {"weights": True, "weight_rounding": "stochastic", "block_size": 64},
    # A control, not a ZeRO++ mode: the baseline with every initial weight scaled by (1 + 1e-6 x N(0, 1)) (about
    # 8 fp32 ulps), to show how far a run drifts from the baseline from a perturbation far below any quantizer's
    # (the chaotic spread of this recipe's curves); run with --modes, not in "all".
    "baseline perturbed 1e-6": {"_perturb": 1e-6},
}
DEFAULT_MODES = [n for n in MODES if "_perturb" not in MODES[n]]
WEIGHT_BLOCKS = (64, 256, 2048)
PROBE_GROUP = "transformer.h.1"  # the block whose gathered weight is reported on its own (group "<unit>/pg0")
SMOOTH = 20  # trailing moving-average window of the smoothed curves
LAST = 20  # the final loss: mean of the last LAST steps
SEED = 1337  # examples/train_gpt.py's seed of the initial weights


# --------------------------------------------------------------------------------------------- ranks


def _rel(err: Any, ref: Any) -> tuple[float, float]:
    """(sum |err|, sum |ref|): summed over ranks and divided at the end = mean|err| / mean|ref|."""
    return float(err.abs().sum()), float(ref.abs().sum())


def _weight_errors(engine: Any) -> dict[str, Any]:
    """The int8 block gather of every floating group's shard against the exact gather (same shards); the
    gathered values are the same on every rank, so rank 0's numbers are the run's."""
    import torch

    from zeroray.engine.quantized_comm import QuantizedGather

    out: dict[str, Any] = {}
    for block in WEIGHT_BLOCKS:
        qwz = QuantizedGather(block)
        total = [0.0, 0.0]
        per_group: dict[str, Any] = {}
        for g in engine.groups:
            if not g.shard.is_floating_point():
                continue
            exact = torch.empty(g.padded, dtype=g.shard.dtype)
            quant = torch.empty(g.padded, dtype=g.shard.dtype)
            g.comm.all_gather(exact, g.shard, async_op=True).wait()
            qwz.all_gather(g.comm, quant, g.shard, g.name).wait()
            err = (quant - exact)[: g.numel]
            ref = exact[: g.numel]
            e, r = _rel(err, ref)
            total[0] += e
            total[1] += r
            if g.name.split("/")[0] == PROBE_GROUP:
                per_group["group"] = e / r
                per_group["numel"] = g.numel
                per_group["max_abs_err"] = float(err.abs().max())
                per_group["mean_abs_w"] = r / g.numel
                per_group["tensors"] = {
                    s.name: float((err[s.offset:s.end]).abs().mean() / ref[s.offset:s.end].abs().mean())
                    for s in g.slots}
        out[str(block)] = {"all_groups": total[0] / total[1], PROBE_GROUP: per_group}
    return out


class GradTap:
    """Copies of the unreduced gradient buffers a qgZ engine reduces in a step (wrapping its shared
    ``QuantizedReduceScatter``), reduced afterwards exactly and through quantized all-to-alls."""

    def __init__(self, engine: Any):
        self.qgz = next(g.qgz for g in engine.groups if g.qgz is not None)
        self.armed = False
        self.buffers: list[Any] = []
        original = self.qgz.reduce_scatter

        def tapped(out: Any, full: Any, key: str) -> Any:
            if self.armed:
                self.buffers.append((out.numel(), full.detach().clone(), key))
            return original(out, full, key)

        self.qgz.reduce_scatter = tapped
        self.original = original

    def measure(self) -> dict[str, Any]:
        """Per reducer variant: (sum |q - exact|, sum |exact|) over this rank's parts of every buffer, and of
        the largest buffer alone (a transformer block's)."""
        import torch
        import torch.distributed as dist

        from zeroray.engine.quantized_comm import QuantizedReduceScatter

        q = self.qgz
        variants = {"own": None}
        for bits in (8, 4):
            variants[f"int{bits} hierarchical"] = QuantizedReduceScatter(bits, BLOCK_SIZE, q.comm, q.node, q.cross)
            variants[f"int{bits} one-level"] = QuantizedReduceScatter(bits, BLOCK_SIZE, q.comm)
        sums = {name: {"all": [0.0, 0.0], "largest": [0.0, 0.0]} for name in variants}
        largest = max(range(len(self.buffers)), key=lambda i: self.buffers[i][0])
        rank = q.comm.rank
        for i, (s, full, group) in enumerate(self.buffers):
            exact = full.to(torch.float32).clone()
            dist.all_reduce(exact, group=q.comm.group)
            exact = exact.view(q.comm.world_size, s)[rank]
            for name, red in variants.items():
                out = torch.empty(s, dtype=full.dtype)
                (self.original if red is None else red.reduce_scatter)(out, full.clone(), group).wait()
                e, r = _rel(out.float() - exact, exact)
                for key in ("all",) + (("largest",) if i == largest else ()):
                    sums[name][key][0] += e
                    sums[name][key][1] += r
        largest_numel = self.buffers[largest][0] * q.comm.world_size
        self.buffers = []
        return {"sums": sums, "largest_numel": largest_numel}


def _build(rank: int, world: int, name: str, batch: int, seed: int) -> dict[str, Any]:
    import torch
    from train_gpt import adamw, gpt_config

    import zeroray
    from zeroray.models.gpt import GPT

    cfg = {k: EXAMPLE[k] for k in ("block", "n_layer", "n_embd", "n_head")}
    torch.manual_seed(seed)  # as the example (1337): the same initial weights on every rank and in every mode
    model = GPT(gpt_config(cfg))
    perturb = MODES[name].get("_perturb")
    if perturb:
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + perturb * torch.randn(p.shape, generator=gen))
    quant = {"block_size": BLOCK_SIZE, **{k: v for k, v in MODES[name].items() if not k.startswith("_")}}
    config = zeroray.ZeroConfig(stage=3, gradient_clipping=EXAMPLE["grad_clip"],
                                train_micro_batch_size_per_gpu=batch, quantize=quant,
                                hpz_partition_size=MODES[name].get("_hpz"))
    nodes = [f"n{r // RANKS_PER_NODE}" for r in range(world)]
    engine = zeroray.initialize(model, adamw(model, EXAMPLE["lr"]), config, nodes=nodes)
    tap = GradTap(engine) if MODES[name].get("gradients") else None
    hier = None if tap is None else tap.qgz.hierarchical
    return {"engine": engine, "tap": tap, "losses": [], "times": [], "errors": {}, "hierarchical": hier,
            "params": model.num_params()}


def _keep(run: dict[str, Any]) -> dict[str, Any]:
    return {k: run[k] for k in ("losses", "times", "errors", "hierarchical", "params")}


def _dump_partial(progress: str, rank: int, runs: dict[str, Any], names: list[str], setup_s: float) -> None:
    path = Path(f"{progress}.rank{rank}.json")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**{n: {**_keep(runs[n]), "val": float("nan")} for n in names}, "_setup_s": setup_s}))
    tmp.replace(path)


def windows_at(data: Any, indices: range, block: int) -> tuple[Any, Any]:
    """The windows of global sample indices: sample i always starts at the same place (Knuth's multiplicative
    hash), whatever the world size; inputs and next-byte targets."""
    import torch

    starts = [(i * 2654435761) % (len(data) - block - 1) for i in indices]
    x = torch.stack([data[s : s + block] for s in starts])
    y = torch.stack([data[s + 1 : s + 1 + block] for s in starts])
    return x.long(), y.long()


def _validate(engine: Any, val_data: Any, rank: int, world: int, block: int) -> float:
    """This rank's mean loss over 4 fixed batches of 8 held-out windows (the same in every mode)."""
    import torch

    engine.eval()
    vals = []
    with torch.no_grad():
        for i in range(4):
            vb = EXAMPLE["batch"]  # 8 windows a batch, whatever the training micro-batch
            first = (i * world + rank) * vb
            xv, yv = windows_at(val_data, range(first, first + vb), block)
            vals.append(engine(xv, yv)[1].item())
    engine.train()
    return sum(vals) / len(vals)


def train(rank: int, world: int, names: list[str], steps: int, measure_steps: list[int], batch: int,
          seed: int, progress: str | None = None) -> dict[str, Any]:
    """Every mode in ``names`` on this rank, side by side: returns per mode its per-step local losses and
    step seconds, the error measurements and the final validation loss. Rank 0 appends a line per round
    to ``progress`` (a file), if given, and every rank writes what it has so far to ``<progress>.rank<r>.json``
    every 10 steps (``--from-partial`` reports from them)."""
    import torch
    import torch.distributed as dist
    from train_gpt import DATA, lr_at

    start = time.perf_counter()
    data = torch.frombuffer(bytearray(DATA.read_bytes()), dtype=torch.uint8)
    n_val = len(data) // 10
    train_data, val_data = data[:-n_val], data[-n_val:]
    block = EXAMPLE["block"]
    schedule = {"warmup": max(1, steps // 15), "steps": steps, "lr": EXAMPLE["lr"]}
    runs = {}
    for name in names:
        runs[name] = _build(rank, world, name, batch, seed)
        dist.barrier()
    setup_s = time.perf_counter() - start
    log = open(progress, "a") if progress and rank == 0 else None  # noqa: SIM115 - open for the whole run
    if log:
        print(f"setup {setup_s:.1f} s", file=log, flush=True)
    for step in range(steps):
        lr = lr_at(step, schedule)
        first = step * batch * world + rank * batch
        x, y = windows_at(train_data, range(first, first + batch), block)
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            run = runs[name]
            engine, tap = run["engine"], run["tap"]
            for group in engine.optimizer.param_groups:
                group["lr"] = lr
            measuring = step in measure_steps
            if tap is not None:
                tap.armed = measuring
            dist.barrier()
            t0 = time.perf_counter()
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            run["times"].append(time.perf_counter() - t0)
            run["losses"].append(loss.item())
            if measuring:
                errs = {"weights": _weight_errors(engine)}
                if tap is not None:
                    tap.armed = False
                    errs["gradients"] = tap.measure()
                run["errors"][str(step)] = errs
        if progress and (step % 10 == 9 or step == steps - 1):
            _dump_partial(progress, rank, runs, names, setup_s)
        if log:
            print(f"step {step} {time.perf_counter() - start:.1f} s: "
                  + " ".join(f"{runs[n]['times'][-1]:.2f}" for n in names), file=log, flush=True)
    # validation: 4 fixed batches of 8 windows a rank from the held-out tenth, the same for every mode
    results = {}
    for name in names:
        run = runs[name]
        engine = run["engine"]
        results[name] = _keep(run)
        results[name]["val"] = _validate(engine, val_data, rank, world, block)
        qwz = [g for g in engine.groups if g.qwz is not None]
        if qwz:  # the same weights through exact gathers: what qwZ's forward noise costs, apart from training
            saved = [g.qwz for g in qwz]
            for g in qwz:
                g.qwz = None
            results[name]["val_exact"] = _validate(engine, val_data, rank, world, block)
            for g, q in zip(qwz, saved):
                g.qwz = q
        engine.close()
        dist.barrier()
    results["_setup_s"] = setup_s
    return results


# --------------------------------------------------------------------------------------------- driver


def run_job(names: list[str], steps: int, measure_steps: list[int], batch: int, seed: int, timeout_s: float,
            progress: str | None) -> list[dict[str, Any]]:
    with NetCluster(NODES) as net:
        placement = [net.nodes[r // RANKS_PER_NODE] for r in range(NODES * RANKS_PER_NODE)]
        return run_ranks(net, placement, train, names, steps, measure_steps, batch, seed, progress,
                         timeout_s=timeout_s)


def merge(per_rank: list[dict[str, Any]], names: list[str], wall_s: float) -> dict[str, Any]:
    """Per mode: global loss per step (mean over ranks), slowest-rank step seconds, errors summed over ranks."""
    out = {}
    for name in names:
        rows = [r[name] for r in per_rank]
        losses = [sum(v) / len(v) for v in zip(*(r["losses"] for r in rows))]
        times = [max(v) for v in zip(*(r["times"] for r in rows))]
        errors: dict[str, Any] = {}
        for step, err0 in rows[0]["errors"].items():
            e = {"weights": err0["weights"]}
            if "gradients" in err0:
                grads = {}
                for variant in err0["gradients"]["sums"]:
                    grads[variant] = {}
                    for key in ("all", "largest"):
                        num = sum(r["errors"][step]["gradients"]["sums"][variant][key][0] for r in rows)
                        den = sum(r["errors"][step]["gradients"]["sums"][variant][key][1] for r in rows)
                        grads[variant][key] = num / den
                e["gradients"] = grads
            errors[step] = e
        out[name] = {"losses": losses, "rank_losses": [r["losses"] for r in rows], "step_s": times,
                     "train_s": sum(times), "errors": errors, "hierarchical": rows[0]["hierarchical"],
                     "val_loss": sum(r["val"] for r in rows) / len(rows), "params": rows[0]["params"],
                     "val_exact_loss": (sum(r["val_exact"] for r in rows) / len(rows)
                                        if "val_exact" in rows[0] else None),
                     "setup_s": max(r["_setup_s"] for r in per_rank), "job_wall_s": wall_s}
    return out


def moving_average(xs: list[float], w: int) -> list[float]:
    """Trailing mean over the last ``w`` values (fewer at the start)."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= w:
            acc -= xs[i - w]
        out.append(acc / min(i + 1, w))
    return out


def _seeded(name: str, seed: int) -> str:
    """The name of ``name``'s run from another seed's job."""
    return f"{name} (seed {seed})"


def _seed_of(name: str) -> tuple[str, int]:
    """(the run's name without its seed, its seed); a repeat's suffixes stay: "x (seed 2) (separate job)" is
    ("x (separate job)", 2)."""
    m = re.search(r" \(seed (\d+)\)", name)
    return (name[:m.start()] + name[m.end():], int(m.group(1))) if m else (name, SEED)


def analyse(runs: dict[str, Any], steps: int) -> dict[str, Any]:
    """Each run against the baseline of its seed; then each mode run at every seed, its mean curve over the
    seeds against the baseline's."""
    warmup = max(1, steps // 15)
    from_step = warmup
    summary = {}
    for name, run in runs.items():
        plain, seed = _seed_of(name)
        base = runs.get("baseline" if seed == SEED else _seeded("baseline", seed))
        if base is None:
            continue
        base_ma = moving_average(base["losses"], SMOOTH)
        ma = moving_average(run["losses"], SMOOTH)
        gaps = [(m - b) / b for m, b in zip(ma, base_ma)]
        after = gaps[from_step:] or [float("nan")]  # (a run stopped before the warm-up's end)
        i = max(range(len(after)), key=lambda j: abs(after[j]))
        full_window = gaps[warmup + SMOOTH - 1:] or [0.0]
        n = len(run["losses"])  # a run stopped early is compared with the baseline at its own last steps
        final = sum(run["losses"][-LAST:]) / LAST
        base_final = sum(base["losses"][n - LAST:n]) / LAST
        base_last = base["losses"][n - 1]
        whole = n == len(base["losses"])
        val_rel = (run["val_loss"] - base["val_loss"]) / base["val_loss"] if whole else float("nan")
        summary[name] = {
            "steps": n, "final_mean": final, "final_last": run["losses"][-1],
            "final_rel": (final - base_final) / base_final,
            "last_rel": (run["losses"][-1] - base_last) / base_last,
            "val_loss": run["val_loss"] if whole else float("nan"), "val_rel": val_rel,
            "max_gap": after[i], "max_gap_step": from_step + i,
            "max_gap_full_window": max(full_window, key=abs),
            "gaps": gaps, "smoothed": ma,
        }
    return {"warmup": warmup, "from_step": from_step, "modes": summary,
            "seeds": _across_seeds(runs, summary, steps, from_step)}


def _across_seeds(runs: dict[str, Any], summary: dict[str, Any], steps: int, from_step: int) -> dict[str, Any]:
    """Per mode run to the end at every seed the baseline was: the mean over seeds of the per-step losses, its
    final loss and smoothed curve against the baseline's mean, and each seed's final loss against its own
    baseline's. ``summary``: analyse's per-run results (each run's smoothed gaps to its seed's baseline).
    Empty with one seed."""
    by_mode: dict[str, dict[int, dict[str, Any]]] = {}
    for name, run in runs.items():
        plain, seed = _seed_of(name)
        if _base_name(plain) == plain and len(run["losses"]) == steps:
            by_mode.setdefault(plain, {})[seed] = run
    all_seeds = sorted(by_mode.get("baseline", {}))
    if len(all_seeds) < 2:
        return {}

    def mean_curve(mode: str, seeds: list[int]) -> list[float]:
        return [sum(v) / len(v) for v in zip(*(by_mode[mode][s]["losses"] for s in seeds))]

    def final(losses: list[float]) -> float:
        return sum(losses[-LAST:]) / LAST

    out: dict[str, Any] = {"seeds": all_seeds, "modes": {}}
    for mode, at in by_mode.items():
        seeds = [s for s in all_seeds if s in at]  # a mode run at fewer seeds: against the baseline at those
        if len(seeds) < 2:
            continue
        base = mean_curve("baseline", seeds)
        base_ma = moving_average(base, SMOOTH)
        curve = mean_curve(mode, seeds)
        curve_ma = moving_average(curve, SMOOTH)
        gaps = [(m - b) / b for m, b in zip(curve_ma, base_ma)]
        after = gaps[from_step:]
        i = max(range(len(after)), key=lambda j: abs(after[j]))
        per_seed = [(final(at[s]["losses"]) - final(by_mode["baseline"][s]["losses"])) / final(by_mode["baseline"][s]["losses"])
                    for s in seeds]
        # The seeds' spread: per step, the standard error of the mean of the per-seed smoothed gaps.
        seed_gaps = [summary[mode if s == SEED else _seeded(mode, s)]["gaps"] for s in seeds]
        se = [_std(list(g)) / math.sqrt(len(seeds)) for g in zip(*seed_gaps)]
        final_rel, final_se = (final(curve) - final(base)) / final(base), _std(per_seed) / math.sqrt(len(seeds))
        after_se = se[from_step:]
        # The goals judged on the seeds' evidence: gap ± 2 SE wholly inside the goal, wholly outside, or neither.
        band = [abs(g) + 2 * e for g, e in zip(after, after_se)]  # the widest: reported
        j = max(range(len(band)), key=band.__getitem__)
        out["modes"][mode] = {"seeds": seeds, "final_mean": final(curve), "final_rel": final_rel,
                              "per_seed_final_rel": per_seed, "final_rel_se": final_se,
                              "final_goal": judge([final_rel], [final_se], 0.01),
                              "curve_goal": judge(after, after_se, 0.02),
                              "band": band[j], "band_step": from_step + j,
                              "max_gap": after[i], "max_gap_step": from_step + i, "max_gap_se": se[from_step + i],
                              "steps_ahead": steps_ahead(curve_ma, base_ma, from_step + i),
                              "beyond_2se": sum(abs(g) > 2 * e for g, e in zip(after, after_se)),
                              "gaps": gaps, "se": se, "smoothed": curve_ma}
    return out


BASELINE_STYLE = {"color": "black", "linewidth": 2.2, "linestyle": "--", "zorder": 5}


def _draw(curves: list[tuple[str, dict[str, Any], dict[str, Any]]], from_step: int, title: str, loss_label: str,
          gap_label: str, png: Path, bands: frozenset[str] = frozenset()) -> None:
    """Smoothed loss curves above, their gaps to the baseline below (2% lines, the warm-up's end): one line per
    (name, {"smoothed", "gaps"}, matplotlib style); the curves named in ``bands`` get their ±2 SE shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    for ax in (ax1, ax2):  # 20 colours: the studies hold more than 10 modes
        ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)
    for name, m, style in curves:
        steps = range(1, len(m["smoothed"]) + 1)
        ax1.plot(steps, m["smoothed"], label=name, **style)
        if _seed_of(name)[0] != "baseline":
            line, = ax2.plot(steps, [100 * g for g in m["gaps"]], label=name, **style)
            if name in bands:  # the mean gap ± 2 standard errors over the seeds
                ax2.fill_between(steps, [100 * (g - 2 * e) for g, e in zip(m["gaps"], m["se"])],
                                 [100 * (g + 2 * e) for g, e in zip(m["gaps"], m["se"])],
                                 color=line.get_color(), alpha=0.2, linewidth=0, label=f"{name}: ±2 SE")
    ax1.set_ylabel(loss_label)
    ax1.set_yscale("log")
    ax1.set_title(title, fontsize=10)
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3, which="both")
    for y in (-2, 2):
        ax2.axhline(y, color="red", linestyle=":", linewidth=1)
    ax2.axhline(0, color="black", linewidth=0.8)
    ax2.axvline(from_step, color="grey", linestyle="--", linewidth=1)
    ax2.text(from_step + 3, 1.6, "end of warm-up", fontsize=7, color="grey")
    ax2.set_ylabel(gap_label)
    ax2.set_xlabel("optimizer step")
    ax2.set_ylim(-10, 10)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def plot(runs: dict[str, Any], ana: dict[str, Any], png: Path, batch: int) -> None:
    """One seed's runs (the repeats left out: the same curves)."""
    curves = [(name, ana["modes"][name], BASELINE_STYLE if name == "baseline"
               else {"color": "grey", "linewidth": 1.2, "linestyle": ":"} if "perturbed" in name else {"linewidth": 1.2})
              for name in runs if not (_base_name(name) != name and _base_name(name) in runs)]
    _draw(curves, ana["from_step"],
          f"ZeRO++ convergence: byte-level GPT (3.3M), stage 3, world 4 on 2 emulated nodes,\n"
          f"fp32, micro-batch {batch} per rank, block {BLOCK_SIZE}",
          f"train loss, {SMOOTH}-step trailing mean", "smoothed gap to baseline, %", png)


def _pct(x: float) -> str:
    return "" if math.isnan(x) else f"{100 * x:+.2f}%"


def _num(x: float) -> str:
    return "" if math.isnan(x) else f"{x:.4f}"


def report(payload: dict[str, Any], out: Path = OUT) -> str:
    runs, ana, meta = payload["runs"], payload["analysis"], payload["meta"]
    # the baseline of the default seed, else of the first seed run (a study of other seeds only)
    base_run = runs.get("baseline") or next(r for n, r in runs.items() if _seed_of(n)[0] == "baseline")
    steps, b = meta["steps"], meta["batch"]
    names = list(runs)
    seeds = sorted({_seed_of(n)[1] for n in runs})
    lines = [
        "# ZeRO++ convergence (issue 33)",
        "",
        f"Generated by `{meta['command']}` on {meta['date']} ({meta['host']})"
        + ("; runs of other jobs added with `--merge`: " + "; ".join(f"`{c}`" for c in meta["merged"])
           if meta.get("merged") else "") + ".",
        "",
        "## Method",
        "",
        f"- Model and recipe: examples/train_gpt.py's defaults, its functions imported: the byte-level GPT "
        f"({base_run['params'] / 1e6:.2f}M parameters; 4 layers, 256 wide, 4 heads, context 128) on "
        "examples/data/corpus.txt (last tenth held out), "
        + (f"micro-batch {meta['batch']} per rank (global {4 * meta['batch']}; the example's default is 8, lowered "
           "with its own --batch setting to fit the time on 2 shared cores), " if meta["batch"] != EXAMPLE["batch"]
           else "micro-batch 8 per rank (global 32), ")
        + "AdamW lr 3e-3, "
        f"betas (0.9, 0.95), weight decay 0.1, linear warm-up over {ana['warmup']} steps then cosine to a tenth, "
        "gradient clipping 1.0. **fp32** (the example's default precision; it sets no `precision`).",
        f"- {steps} optimizer steps, ZeRO stage 3, world 4 on the emulated cluster: 2 network-namespace nodes "
        "x 2 gloo ranks, unshaped links, `nodes` passed to `zeroray.initialize` (qgZ hierarchical: "
        + ", ".join(f"{n}: {runs[n]['hierarchical']}" for n in names if runs[n]['hierarchical'] is not None)
        + f"). Quantization block {BLOCK_SIZE} values per fp32 scale; qwZ int8; qgZ in ZeRO++'s own form, quantized "
        "inside the node too (`intra_node_gradients=True`, two roundings; the CPU default sends that stage in fp32 "
        "and rounds once).",
        (f"- Same seed (`torch.manual_seed({SEED})` before the model is built) and same data in every run: step s, "
         if seeds == [SEED] else
         f"- Seeds {', '.join(map(str, seeds))} (`torch.manual_seed(N)` before the model is built; the example's is "
         f"{SEED}; each run is compared with the baseline of its seed) and the same data in every run: step s, ")
        + f"rank r trains on global samples [{4 * b}s + {b}r, {4 * b}s + {b}r + {b}), windows placed by the example's "
        "former `windows_at` (kept in this script). A step's loss is the mean of the 4 ranks' micro-batch losses.",
        "- 'baseline perturbed 1e-6' is a control, not ZeRO++: the baseline with each initial weight scaled by "
        "(1 + 1e-6 N(0,1)), which shows how far this recipe's curves drift apart from a perturbation far below "
        "any quantizer's error.",
        "- Jobs: modes named together in one job ran side by side in the same 4 rank processes, one engine each "
        "(own model, optimizer, process groups), one step of each a round, order rotated every round, a barrier "
        "before each mode's step; which run came from which job is under 'How the runs were made'.",
        f"- Final loss: mean of the last {LAST} steps' losses, and the last step's. Validation: 4 fixed "
        "batches of 8 held-out windows per rank after the last step, forward through the mode's own gathers "
        "(int8 under qwZ); for qwZ runs also through exact fp32 gathers of the same weights ('val, exact gathers'), "
        "which tells qwZ's forward noise at evaluation from what it did to training.",
        f"- Smoothed curve: trailing {SMOOTH}-step moving average of the per-step loss. Gap: (smoothed mode - "
        f"smoothed baseline) / smoothed baseline; max |gap| over steps >= {ana['from_step']} (the end of the "
        f"learning-rate warm-up; the column after it starts at step {ana['warmup'] + SMOOTH - 1}, the first "
        "window wholly after the warm-up).",
        "- Wall time ('train s'): the sum over steps of the slowest rank's step seconds (forward, backward, "
        "optimizer step), error measurements excluded, on 2 shared cores (what else ran: 'How the runs were made').",
        "",
        "## Results",
        "",
        f"| run | steps | final loss (mean last {LAST}) | vs baseline | last step | vs baseline | val loss | vs baseline "
        f"| val, exact gathers | max smoothed gap (step) | max gap from step {ana['warmup'] + SMOOTH - 1} "
        "| train s | s/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        if _base_name(name) != name and _base_name(name) in runs or name not in ana["modes"]:
            continue  # a repeat: bitwise the same losses (see Determinism); or a seed without its baseline
        m, r = ana["modes"][name], runs[name]
        base = _seed_of(name)[0] == "baseline"
        gap = "" if base else f"{_pct(m['max_gap'])} ({m['max_gap_step']})"
        exact = "" if r.get("val_exact_loss") is None else f"{r['val_exact_loss']:.4f}"
        lines.append(
            f"| {name} | {m['steps']} | {m['final_mean']:.4f} | {'' if base else _pct(m['final_rel'])} | {m['final_last']:.4f} | "
            f"{'' if base else _pct(m['last_rel'])} | {_num(m['val_loss'])} | {'' if base else _pct(m['val_rel'])} | "
            f"{exact} | {gap} | "
            f"{'' if base else _pct(m['max_gap_full_window'])} | {r['train_s']:.0f} | "
            f"{r['train_s'] / m['steps']:.3f} |")
    lines += ["", "Goal (issue 33): final loss within 1% of unquantized, smoothed curve within 2% after warm-up.", ""]
    for name in names:
        if _seed_of(name)[0] == "baseline" or name not in ana["modes"]:
            continue
        m = ana["modes"][name]
        ok = abs(m["final_rel"]) <= 0.01 and abs(m["max_gap"]) <= 0.02
        verdict = "not judged (stopped before the warm-up's end)" if math.isnan(m["max_gap"]) else (
            "meets it" if ok else "MISSES it")
        if m["steps"] < steps:
            verdict = f"not judged at {steps} steps (stopped at step {m['steps']}; the numbers are at that step)"
        if _base_name(name) != name and _base_name(name) in runs:
            continue  # a repeat (see Determinism)
        if "_perturb" in MODES.get(name, {}):
            verdict = "control, no quantization: what a 1e-6 perturbation of the initial weights alone does"
        lines.append(f"- {name}: {verdict} (final {_pct(m['final_rel'])}, "
                     f"max gap {_pct(m['max_gap'])}).")
    lines += _seeds_report(ana)
    det = payload.get("determinism")
    if det:
        lines += ["", "## Determinism", "", det, ""]
    lines += ["", "## Errors of the quantized collectives", "",
              f"Relative error per element, `mean|q - exact| / mean|exact|`, on the run's own tensors at steps "
              f"{', '.join(meta['measure_steps'])} (0-based; after that step's optimizer step for weights, the "
              "step's backward for gradients).", "",
              "### Gathered weights (int8, qwZ's `QuantizedGather`, same shards gathered exactly)", "",
              f"In the baseline run (the other runs' weights give the same to two digits, see the JSON). "
              f"`{PROBE_GROUP}` is one transformer block's flat group.", "",
              "| step | block size | " + PROBE_GROUP + " | all groups | max |err| in the block's group | "
              "mean |w| |", "|---|---|---|---|---|---|"]
    for step, e in base_run["errors"].items():
        for bs, w in e["weights"].items():
            p = w[PROBE_GROUP]
            lines.append(f"| {step} | {bs} | {p['group']:.2e} | {w['all_groups']:.2e} | {p['max_abs_err']:.2e} | "
                         f"{p['mean_abs_w']:.2e} |")
    if base_run["errors"]:
        last = list(base_run["errors"])[-1]
        tensors = base_run["errors"][last]["weights"][str(BLOCK_SIZE)][PROBE_GROUP]["tensors"]
        lines += ["", f"Per tensor of `{PROBE_GROUP}` at step {last}, block {BLOCK_SIZE}: "
                  + ", ".join(f"{k.removeprefix(PROBE_GROUP + '.')} {v:.2e}" for k, v in tensors.items()) + "."]
    lines += ["",
              "### Reduced gradients (quantized reduce-scatter vs the exact fp32 sum of the same buffers)", "",
              "Each qgZ run's own unreduced gradient buffers, reduced by its own object ('own') and by int8 / int4, "
              "hierarchical (the engine's form here) and one-level all-to-alls on the same buffers. 'all': every "
              "gradient buffer of the step; 'largest': the largest group's (a transformer block).", "",
              "| run | step | own | int8 hier. | int8 one-level | int4 hier. | int4 one-level | own, largest group |",
              "|---|---|---|---|---|---|---|---|"]
    for name in names:
        if _base_name(name) != name and _base_name(name) in runs:
            continue  # a repeat: the same tensors
        for step, e in runs[name]["errors"].items():
            g = e.get("gradients")
            if not g:
                continue
            lines.append(f"| {name} | {step} | {g['own']['all']:.2e} | {g['int8 hierarchical']['all']:.2e} | "
                         f"{g['int8 one-level']['all']:.2e} | {g['int4 hierarchical']['all']:.2e} | "
                         f"{g['int4 one-level']['all']:.2e} | {g['own']['largest']:.2e} |")
    notes = out / "convergence_notes.md"
    if notes.exists():  # the findings, written by hand after a run
        lines += ["", notes.read_text().strip()]
    plots = ([f"convergence.png (seed {SEED}: smoothed curves; gap to baseline)"] if SEED in seeds else []) + (
        ["convergence_seeds.png (the means over the seeds)"] if ana["seeds"] else []) + (
        ["convergence_shipped.png (the shipped default forms' means, full ZeRO++'s ±2 SE shaded)"]
        if SHIPPED_FULL in ana["seeds"].get("modes", {}) else [])
    lines += ["", "Raw per-step losses (global and per rank) and step times: convergence.json. "
              f"Plots: {', '.join(plots)}.", ""]
    return "\n".join(lines)


def steps_ahead(curve: list[float], base: list[float], t: int, reach: int = 60) -> float:
    """How many steps ``curve`` runs ahead of ``base`` at step ``t`` (behind when negative): the fractional step
    nearest ``t`` (within ``reach``) at which ``base`` passes ``curve[t]``, minus ``t``; nan where it does not. A
    gap where the loss falls fast can be a small shift in time: this says which."""
    v, best = curve[t], float("nan")
    for u in range(max(0, t - reach), min(len(base) - 1, t + reach)):
        a, b = base[u], base[u + 1]
        if a != b and (a - v) * (b - v) <= 0:
            cross = u + (a - v) / (a - b)
            if math.isnan(best) or abs(cross - t) < abs(best - t):
                best = cross
    return best - t


def judge(gaps: list[float], ses: list[float], goal: float) -> str:
    """A goal on means over seeds: "met" when every gap ± 2 standard errors lies within ±goal, "missed" when at
    some step the whole band lies beyond it, else "not resolved" (the seeds cannot tell)."""
    if all(abs(g) + 2 * e <= goal for g, e in zip(gaps, ses)):
        return "met"
    if any(abs(g) - 2 * e > goal for g, e in zip(gaps, ses)):
        return "missed"
    return "not resolved"


def _std(xs: list[float]) -> float:
    """The sample standard deviation (0 for fewer than 2 values)."""
    if len(xs) < 2:
        return 0.0
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


def _seeds_report(ana: dict[str, Any]) -> list[str]:
    """The 'Across seeds' section: each mode's mean over the seeds against the baseline's mean."""
    seeds = ana.get("seeds")
    if not seeds:
        return []
    lines = ["", "## Across seeds", "",
             f"Every run of a mode at seeds {', '.join(map(str, seeds['seeds']))} (the initial weights' seed; the data "
             f"are the same): the mean over the seeds of the per-step losses, against the baseline's mean. This "
             f"averages out the drift one seed's curve shows (the control above), which a 1% goal cannot see past.",
             "A mode run at fewer seeds is set against the baseline's mean over the same seeds (its seeds column).",
             "", "± is the standard error over the seeds (of the per-seed final gaps, and of the per-seed smoothed gaps "
             "at that step); 'steps beyond 2 SE' counts the steps after the warm-up where the means' gap is more than "
             "twice its standard error from 0.", "",
             "'ahead' is that gap as a shift in time: how many steps earlier (ahead) or later (behind, negative) the "
             "baseline's smoothed mean reaches the mode's value at that step.", "",
             "'widest ±2 SE' is the largest |gap| + 2 SE over the steps after the warm-up. The goals (final within 1%, "
             "curve within 2%) are judged on that evidence: **met** when the gap ± 2 SE lies inside the goal at every "
             "step, **missed** when at some step it lies wholly outside, **not resolved** otherwise (more seeds "
             "needed).", "",
             f"| mode | seeds | final loss, mean over seeds (last {LAST}) | vs baseline | each seed vs its own baseline "
             f"| max smoothed gap of the means, from step {ana['from_step']} (step) | ahead there (steps) "
             "| steps beyond 2 SE | widest ±2 SE (step) | final goal | curve goal |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, m in seeds["modes"].items():
        base = mode == "baseline"
        lines.append(f"| {mode} | {', '.join(map(str, m['seeds']))} | {m['final_mean']:.4f} | {'' if base else _pct(m['final_rel'])} "
                     f"{'' if base else '± ' + _pct(m['final_rel_se']).lstrip('+')} | "
                     f"{'' if base else ', '.join(_pct(x) for x in m['per_seed_final_rel'])} | "
                     f"{'' if base else _pct(m['max_gap']) + ' ± ' + _pct(m['max_gap_se']).lstrip('+') + ' (' + str(m['max_gap_step']) + ')'} | "
                     f"{'' if base else format(m['steps_ahead'], '+.1f')} | "
                     f"{'' if base else m['beyond_2se']} | "
                     f"{'' if base else _pct(m['band']).lstrip('+') + ' (' + str(m['band_step']) + ')'} | "
                     f"{'' if base else m['final_goal']} | {'' if base else m['curve_goal']} |")
    return lines


def plot_seeds(ana: dict[str, Any], png: Path, batch: int) -> None:
    """The modes' mean curves over the seeds and their gaps to the baseline's mean."""
    seeds = ana["seeds"]
    curves = [(mode, m, BASELINE_STYLE if mode == "baseline" else {}) for mode, m in seeds["modes"].items()]
    _draw(curves, ana["from_step"],
          f"ZeRO++ convergence, each mode's mean over its seeds (up to {len(seeds['seeds'])}): byte-level GPT, "
          f"stage 3,\nworld 4 on 2 emulated nodes, fp32, micro-batch {batch} per rank, block {BLOCK_SIZE}",
          f"train loss, mean over the seeds, {SMOOTH}-step trailing mean",
          "gap to the baseline's mean\nover the same seeds, %", png)


# The shipped defaults: full ZeRO++, and each collective alone (stochastic rounding, 8-bit draws, int8 codes).
SHIPPED_FULL = "qwZ+qgZ int8 SR (8-bit noise)"
SHIPPED = {SHIPPED_FULL: ("full ZeRO++ (qwZ + qgZ)", {"color": "tab:blue", "linewidth": 1.8}),
           "qwZ SR (8-bit noise)": ("qwZ alone", {"color": "tab:green", "linewidth": 1.2}),
           "qgZ int8 SR": ("qgZ alone", {"color": "tab:orange", "linewidth": 1.2}),
           "baseline perturbed 1e-6": ("control: 1e-6 perturbation, no quantization",
                                       {"color": "grey", "linewidth": 1.2, "linestyle": ":"})}


def plot_shipped(ana: dict[str, Any], png: Path, batch: int) -> None:
    """The README's plot: the shipped default forms' mean curves, full ZeRO++'s ±2 SE band shaded."""
    modes = ana["seeds"]["modes"]
    curves = [("baseline", modes["baseline"], BASELINE_STYLE)] + [
        (f"{label}, {len(modes[mode]['seeds'])} seeds", modes[mode], style)
        for mode, (label, style) in SHIPPED.items() if mode in modes]
    _draw(curves, ana["from_step"],
          "ZeRO++ as shipped (int8, stochastic rounding): mean over seeds against the unquantized mean\n"
          f"byte-level GPT, stage 3, world 4 on 2 emulated nodes, fp32, micro-batch {batch}, block {BLOCK_SIZE}",
          f"train loss, mean over the seeds, {SMOOTH}-step trailing mean",
          "gap to the baseline's mean\nover the same seeds, %", png, bands=frozenset({curves[1][0]}))  # full ZeRO++'s


def _base_name(name: str) -> str:
    """The mode a run repeats: its name less " (repeat)", " (separate job)" and a " [label]"."""
    name = name.split(" [")[0]
    for suffix in (" (repeat)", " (separate job)"):
        name = name.removesuffix(suffix)
    return name


def determinism(runs: dict[str, Any]) -> str:
    """Each repeated mode against its first run, over the steps both have: per-rank losses bitwise equal?"""
    lines = []
    for name, run in runs.items():
        first = _base_name(name)
        if first == name or first not in runs:
            continue
        other = runs[first]
        n = min(len(run["losses"]), len(other["losses"]))
        same = all(a[:n] == b[:n] for a, b in zip(run["rank_losses"], other["rank_losses"]))
        diff = max(abs(x - y) for x, y in zip(run["losses"][:n], other["losses"][:n]))
        lines.append(f"- {name} against {first}: per-rank losses of the {n} steps both ran "
                     f"{'bitwise identical' if same else 'DIFFER'} (max |difference| of the global loss {diff:.3g}).")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=EXAMPLE["batch"], help="micro-batch per rank (the example's --batch)")
    p.add_argument("--modes", default="all", help="comma-separated names of MODES, or all")
    p.add_argument("--measure-steps", default="0,100,200,399")
    p.add_argument("--separate", action="store_true", help="one job per mode instead of all side by side")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--timeout", type=float, default=6000.0, help="seconds per job")
    p.add_argument("--progress", default="/tmp/zeropp_convergence.progress",
                   help="rank 0 appends a line per step here (empty: none)")
    p.add_argument("--from-partial", default=None, metavar="PROGRESS",
                   help="report from the partial dumps of a run stopped early (its --progress path)")
    p.add_argument("--no-baseline", action="store_true", help="run --modes without the baseline (then --merge)")
    p.add_argument("--merge", default=None, metavar="JSON",
                   help="add the runs of another job's convergence.json to this one's (a name already there gets "
                        "' (separate job)': the determinism check across processes)")
    p.add_argument("--merge-label", default=None, help="--merge: append ' [LABEL]' to each added run's name")
    p.add_argument("--plot-only", action="store_true", help="redraw the md and png from the json")
    p.add_argument("--seed", type=int, default=SEED,
                   help=f"the initial weights' seed (the example's {SEED}); another seed names its runs '<mode> (seed N)', "
                        "to add with --merge: the report then compares the modes' mean over seeds")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    js = out / "convergence.json"
    if args.plot_only:
        payload = json.loads(js.read_text())
    elif args.from_partial:  # a run stopped early: the steps every rank finished, from its partial dumps
        meta = json.loads(Path(args.from_partial + ".meta.json").read_text())
        per_rank = [json.loads(Path(f"{args.from_partial}.rank{r}.json").read_text()) for r in range(NODES * RANKS_PER_NODE)]
        names = [n for n in per_rank[0] if not n.startswith("_")]
        done = min(len(r[n]["losses"]) for r in per_rank for n in names)
        for r in per_rank:
            for n in names:
                r[n]["losses"], r[n]["times"] = r[n]["losses"][:done], r[n]["times"][:done]
                r[n]["errors"] = {k: v for k, v in r[n]["errors"].items() if int(k) < done}
        meta["measure_steps"] = [k for k in meta["measure_steps"] if int(k) < done]
        meta["stopped_at"] = done
        seed = meta.get("seed", SEED)  # named as a whole job's runs are
        runs = {n if seed == SEED else _seeded(n, seed): r for n, r in merge(per_rank, names, float("nan")).items()}
        payload = {"meta": meta, "runs": runs}
    elif args.merge:  # another job's runs (a control, a repeat in fresh processes) added to convergence.json
        payload = json.loads(js.read_text())
        other = json.loads(Path(args.merge).read_text())
        payload["meta"].setdefault("merged", []).append(
            f"{other['meta']['command']}" + (" (stopped early, reported with --from-partial)"
                                             if "stopped_at" in other["meta"] else ""))
        for name, run in other["runs"].items():
            if args.merge_label:
                name = f"{name} [{args.merge_label}]"
            elif name in payload["runs"]:
                name = f"{name} (separate job)"
            payload["runs"][name] = run
    else:
        why = unavailable()
        if why:
            sys.exit(f"the emulated cluster cannot run here: {why}")
        names = list(DEFAULT_MODES) if args.modes == "all" else [n.strip() for n in args.modes.split(",")]
        if "baseline" not in names and not args.no_baseline:
            names.insert(0, "baseline")
        measure = [int(s) for s in args.measure_steps.split(",") if int(s) < args.steps]
        runs: dict[str, Any] = {}
        meta = {"command": "PYTHONPATH=. python benchmarks/zeropp_convergence.py " + shlex.join(sys.argv[1:]),
                "date": datetime.datetime.now().isoformat(timespec="seconds"),
                "host": f"{platform.node()}, {platform.processor() or platform.machine()}",
                "steps": args.steps, "measure_steps": [str(s) for s in measure],
                "together": not args.separate, "batch": args.batch, "block_size": BLOCK_SIZE, "example": EXAMPLE,
                "smooth": SMOOTH, "last": LAST, "seed": args.seed}
        if args.progress:
            Path(args.progress + ".meta.json").write_text(json.dumps(meta))
        jobs = [[n] for n in names] if args.separate else [names]
        for job in jobs:
            t0 = time.perf_counter()
            per_rank = run_job(job, args.steps, measure, args.batch, args.seed, args.timeout, args.progress)
            merged = merge(per_rank, job, time.perf_counter() - t0)
            runs.update({n if args.seed == SEED else _seeded(n, args.seed): r for n, r in merged.items()})
            print(f"{job}: {time.perf_counter() - t0:.0f} s", flush=True)
        payload = {"meta": meta, "runs": runs}
    if not args.plot_only and not args.merge:
        js.write_text(json.dumps(payload, indent=1))  # the raw results first, whatever the analysis does
        if not any(_seed_of(n)[0] == "baseline" for n in payload["runs"]):
            print(f"no baseline in this job: raw results in {js}; add them with --merge {js}")
            return
    payload["analysis"] = analyse(payload["runs"], payload["meta"]["steps"])
    payload["determinism"] = determinism(payload["runs"])
    js.write_text(json.dumps(payload, indent=1))
    (out / "convergence.md").write_text(report(payload, out))
    default_seed = {n: r for n, r in payload["runs"].items() if _seed_of(n)[1] == SEED}
    if default_seed:  # (a study of other seeds only has convergence_seeds.png)
        plot(default_seed, payload["analysis"], out / "convergence.png", payload["meta"]["batch"])
    if payload["analysis"]["seeds"]:
        plot_seeds(payload["analysis"], out / "convergence_seeds.png", payload["meta"]["batch"])
        if SHIPPED_FULL in payload["analysis"]["seeds"]["modes"]:
            plot_shipped(payload["analysis"], out / "convergence_shipped.png", payload["meta"]["batch"])
    print(report(payload, out))


if __name__ == "__main__":
    main()
