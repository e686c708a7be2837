"""Hybrid sharding (MiCS / HSDP), hpZ and ZeRO++ against flat ZeRO-3 and FSDP2 on the emulated multi-node cluster.

    sudo PYTHONPATH=. python benchmarks/hybrid_bench.py [--suite hybrid|zeropp] [--params 25e6] [--steps 5]
                                                          [--warmup 2] [--cases 2x2:none,2x2:1gbit,3x2:1gbit]
                                                          [--modes ...] [--deepspeed] [--batch 2] [--seq 64]
                                                          [--out results.md] [--plot-only] [--plot-from a.md,b.md]

Nodes are network namespaces joined by a bridge (tests/support/netcluster.py), each node's link
unshaped or shaped with tbf (1 or 10 Gbit/s, burst 256kb, latency 50ms); ranks 2r and 2r+1 sit on node r,
so a shard group of k = 2 consecutive ranks stays inside a node. Every case (nodes x ranks, link) is one
gloo job (one thread a rank) that builds every mode side by side on zeroray's GPT (~25M parameters,
fp32, AdamW, 2 sequences of 64 tokens a rank; ``--batch 1 --seq 32`` makes communication dominate the step)
and steps them in turn, one step each a round, the order rotated every round, so that a shared machine's
drifting load hits all modes alike:

- zeroray flat stage 3 (states sharded over all ranks);
- zeroray hybrid k=2 at stage 3 and at stage 2 (sharded over the 2 ranks of a node, replicated across nodes);
- zeroray hpZ (``hpz_partition_size=2``: backward's gathers from a secondary copy inside the node);
- on 4 nodes and more (``--modes``): hybrid k=4 (a shard group of 2 nodes) alone and with hpZ h=2, the
  combination that needs a shard group spanning nodes (with k = 2, h = 2 is the shard group and is dropped);
- FSDP2 flat (``fully_shard`` over a 1-D mesh of all ranks) and FSDP2 HSDP (a (nodes, 2) mesh
  ``("replicate", "shard")``); each transformer block ``fully_shard``-ed, then the root.

For each mode: the median over ``--steps`` steps (after ``--warmup`` untimed ones) of the slowest
rank's step time (forward, backward, optimizer step; a barrier before and after each); zeroray's
inter-node bytes per step and rank from ``comm_report(by_scope=True)`` (a collective counts as
inter-node when its group spans nodes, so flat ZeRO counts all its bytes there), beside the formula for
hybrid: 2 x (Psi_padded / k) x 4 bytes per rank and micro-step; and the bytes that really crossed the
links: the sum over nodes of each node NIC's sent bytes per step (read from /sys/class/net inside the
node around each timed step). Prints a markdown table and writes it to
benchmarks/results/hybrid/results.md, with the load averages as each case began and ended. Needs root
(network namespaces); the default six cases (2 and 3 nodes; 1 and 10 Gbit/s, unshaped) took about 30
minutes with ``--steps 3 --warmup 1`` on 2 cores at load 40. The plot (step_vs_link.png beside ``--out``)
has a panel for each file of ``--plot-from`` (default: ``--out``).

``--suite zeropp`` (issue 33) runs ZeRO++'s modes instead, on 2 and 3 nodes x 2 ranks, unshaped, 10 and 1
Gbit/s, and writes benchmarks/results/zeropp/results.md: flat stage 3, hybrid k=2 stage 3, hpZ
(``hpz_partition_size=2`` over the flat group), full ZeRO++ (hpZ + qwZ + qgZ, ``gradient_bits`` 8 and 4, block
256) and qwZ + qgZ without hpZ; besides the step ratios it reports the ratios of inter-node bytes (comm_report
and the links' counters) to flat stage 3's. ``--modes`` picks any of the modes of either suite.

``--deepspeed`` adds DeepSpeed's ZeRO-3 to the suite's modes (DS_ACCELERATOR=cpu; ``deepspeed.initialize`` on the
ranks' gloo group, which ``deepspeed.init_distributed`` finds initialized and wraps): flat and hpZ
(``zero_hpz_partition_size=2``, the secondary partition inside the node), and zeroray's hpZ where the suite
lacks it (the hybrid suite), with their ratios. DeepSpeed runs as ZeRO-3 with every parameter sharded and
gathered again in backward (DEEPSPEED_ZERO3 says why its defaults would not). It has no comm report, so only
the links' counters count its inter-node bytes. DeepSpeed's MiCS does not run on gloo, and DeepSpeed 0.19.7+
has none (benchmarks/results/zeropp/deepspeed.md says why). Eight modes instead of five make the default
cases take about 1.6 times as long (~18 minutes; give ``--timeout 1200``), hence the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.util
import os
import platform
import re
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.netcluster import LinkSpec, NetCluster, run_ranks, unavailable  # noqa: E402

RANKS_PER_NODE = 2
K = 2  # hybrid shard group size: the ranks of one node
LINKS = {
    "none": None,
    "1gbit": LinkSpec(rate="1gbit", burst="256kb", latency="50ms"),
    "10gbit": LinkSpec(rate="10gbit", burst="256kb", latency="50ms"),
}
LINK_NAMES = {"none": "unshaped", "1gbit": "1 Gbit/s", "10gbit": "10 Gbit/s"}
HPZ = 2  # hpZ's secondary group: the ranks of one node
QUANTIZE_BLOCK = 256  # qwZ / qgZ values per fp32 scale
# zeroray's modes: their ZeroConfig
# The ZeRO++ modes recorded before stochastic rounding became the default (2026-11-28) round to nearest.
NEAREST = {"weight_rounding": "nearest", "gradient_rounding": "nearest"}
ZERORAY_MODES: dict[str, dict[str, Any]] = {
    "zeroray-flat-s3": {"stage": 3},
    "zeroray-hybrid-s3": {"stage": 3, "shard_group_size": K},
    "zeroray-hybrid-s2": {"stage": 2, "shard_group_size": K},
    "zeroray-hpz-s3": {"stage": 3, "hpz_partition_size": HPZ},
    # a shard group of 2 nodes (k = 4; 4 nodes and more): hybrid alone, and with hpZ's secondary copy inside the node
    "zeroray-hybrid4-s3": {"stage": 3, "shard_group_size": 2 * K},
    "zeroray-hybrid4-hpz-s3": {"stage": 3, "shard_group_size": 2 * K, "hpz_partition_size": HPZ},
    # ZeRO++'s own form, quantized inside the node too (the default on CUDA), and (zpp8n) fp32 inside the node
    **{f"zeroray-zpp{bits}-s3": {"stage": 3, "hpz_partition_size": HPZ, "quantize": {
        "weights": True, "gradients": True, "block_size": QUANTIZE_BLOCK, "gradient_bits": bits,
        "intra_node_gradients": True, **NEAREST}} for bits in (8, 4)},
    "zeroray-zpp8n-s3": {"stage": 3, "hpz_partition_size": HPZ, "quantize": {
        "weights": True, "gradients": True, "block_size": QUANTIZE_BLOCK, "gradient_bits": 8,
        "intra_node_gradients": False, **NEAREST}},
    # zpp8n with stochastic rounding of both collectives' codes (the default since 2026-11-28)
    "zeroray-zpp8n-sr-s3": {"stage": 3, "hpz_partition_size": HPZ, "quantize": {
        "weights": True, "gradients": True, "block_size": QUANTIZE_BLOCK, "gradient_bits": 8,
        "intra_node_gradients": False, "weight_rounding": "stochastic", "gradient_rounding": "stochastic"}},
    # zpp8n-sr with qgZ's codes fp8 (e4m3), rounded stochastically
    "zeroray-zpp-fp8-s3": {"stage": 3, "hpz_partition_size": HPZ, "quantize": {
        "weights": True, "gradients": True, "block_size": QUANTIZE_BLOCK, "gradient_codes": "fp8",
        "intra_node_gradients": False, "weight_rounding": "stochastic"}},
    "zeroray-qwz-qgz8-s3": {"stage": 3, "quantize": {
        "weights": True, "gradients": True, "block_size": QUANTIZE_BLOCK, "gradient_bits": 8,
        "intra_node_gradients": True, **NEAREST}},
}
MODES = ["zeroray-flat-s3", "zeroray-hybrid-s3", "zeroray-hybrid-s2", "fsdp2-flat", "fsdp2-hsdp"]
MODE_NAMES = {
    "zeroray-flat-s3": "zeroray flat, stage 3",
    "zeroray-hybrid-s3": f"zeroray hybrid k={K}, stage 3",
    "zeroray-hybrid-s2": f"zeroray hybrid k={K}, stage 2",
    "fsdp2-flat": "FSDP2 flat",
    "fsdp2-hsdp": f"FSDP2 HSDP ({K} a shard group)",
    "zeroray-hpz-s3": f"zeroray hpZ (h={HPZ}), stage 3",
    "zeroray-hybrid4-s3": f"zeroray hybrid k={2 * K}, stage 3",
    "zeroray-hybrid4-hpz-s3": f"zeroray hybrid k={2 * K} + hpZ (h={HPZ}), stage 3",
    "zeroray-zpp8-s3": "zeroray ZeRO++ (hpZ + qwZ + qgZ int8)",
    "zeroray-zpp4-s3": "zeroray ZeRO++ (hpZ + qwZ + qgZ int4)",
    "zeroray-zpp8n-s3": "zeroray ZeRO++ (hpZ + qwZ + qgZ int8, fp32 inside the node)",
    "zeroray-zpp8n-sr-s3": "zeroray ZeRO++ (hpZ + qwZ + qgZ int8, fp32 inside the node, stochastic rounding)",
    "zeroray-zpp-fp8-s3": "zeroray ZeRO++ (hpZ + qwZ + qgZ fp8, fp32 inside the node, stochastic rounding)",
    "zeroray-qwz-qgz8-s3": "zeroray qwZ + qgZ int8, no hpZ",
    "deepspeed-flat-s3": "DeepSpeed ZeRO-3 flat",
    "deepspeed-hpz-s3": f"DeepSpeed hpZ (zero_hpz_partition_size={HPZ})",
}
# DeepSpeed's modes (--deepspeed): their zero_optimization keys beside DEEPSPEED_ZERO3
DEEPSPEED_MODES: dict[str, dict[str, Any]] = {
    "deepspeed-flat-s3": {},
    "deepspeed-hpz-s3": {"zero_hpz_partition_size": HPZ},
}
# ZeRO-3 as the other modes run it: every parameter partitioned (DeepSpeed keeps those under 1e5 elements whole by
# default) and released after its use, so that backward gathers again. DeepSpeed's defaults keep a parameter
# gathered while its next use lies within 1e9 elements of the step's trace, and do not release one prefetched for
# a later use, and its 5e7-element prefetch bucket holds all of these models: it gathers the whole model once in
# forward and never in backward, so hpZ (which serves backward's gathers) has nothing to do (measured: one gather
# of all parameters a step, and the same link bytes for flat and hpZ).
DEEPSPEED_ZERO3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                   "stage3_prefetch_bucket_size": 0}
DEEPSPEED_RATIOS = (("DS hpZ / DS flat", "deepspeed-hpz-s3", "deepspeed-flat-s3"),
                    ("zeroray flat s3 / DS flat", "zeroray-flat-s3", "deepspeed-flat-s3"),
                    ("zeroray hybrid s3 / DS hpZ", "zeroray-hybrid-s3", "deepspeed-hpz-s3"),
                    ("zeroray hpZ / DS hpZ", "zeroray-hpz-s3", "deepspeed-hpz-s3"))
DEEPSPEED_LINK_RATIOS = (("DS flat / zeroray flat s3", "deepspeed-flat-s3", "zeroray-flat-s3"),
                         ("DS hpZ / DS flat", "deepspeed-hpz-s3", "deepspeed-flat-s3"),
                         ("zeroray hybrid s3 / DS hpZ", "zeroray-hybrid-s3", "deepspeed-hpz-s3"))
DEEPSPEED_NOTES = (
    "DeepSpeed (--deepspeed): ZeRO-3 on the ranks' gloo group, DS_ACCELERATOR=cpu, fp32, torch AdamW"
    " (`zero_allow_untested_optimizer`), `stage3_param_persistence_threshold`, `stage3_max_reuse_distance` and"
    " `stage3_prefetch_bucket_size` 0 (every parameter sharded and gathered again in backward, as in the other"
    " modes; with DeepSpeed's defaults its 5e7-element prefetch gathers all of these models at once in forward and"
    " keeps them through backward, and hpZ changes nothing), its defaults otherwise; hpZ"
    " `zero_hpz_partition_size=2` (ranks 2r, 2r+1: a node)."
    " No comm report: the link MB column is its inter-node traffic. DeepSpeed's MiCS does not run on gloo"
    " (benchmarks/results/zeropp/deepspeed.md).",)
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Suite:
    """A set of modes and cases with its results file: its title, the ratios of step times it reports (label,
    numerator mode, denominator mode) and, optionally, of inter-node bytes."""

    title: str
    modes: tuple[str, ...]
    cases: str
    out: Path
    ratios: tuple[tuple[str, str, str], ...]
    byte_ratios: tuple[tuple[str, str, str], ...] = ()
    notes: tuple[str, ...] = ()
    link_ratios: tuple[tuple[str, str, str], ...] = ()  # of the links' bytes only (modes with no comm report)

    def with_deepspeed(self) -> Suite:
        """This suite with DeepSpeed's modes, ratios and notes added (--deepspeed), and zeroray's hpZ where the
        suite lacks it, to set beside DeepSpeed's."""
        hpz = () if "zeroray-hpz-s3" in self.modes else ("zeroray-hpz-s3",)
        return dataclasses.replace(self, modes=self.modes + hpz + tuple(DEEPSPEED_MODES),
                                   ratios=self.ratios + DEEPSPEED_RATIOS,
                                   link_ratios=self.link_ratios + DEEPSPEED_LINK_RATIOS,
                                   notes=self.notes + DEEPSPEED_NOTES)


SUITES = {
    "hybrid": Suite(
        "Hybrid sharding vs flat ZeRO-3 and FSDP2 on the emulated multi-node cluster",
        (*MODES, "zeroray-hpz-s3"), "2x2:none,2x2:10gbit,2x2:1gbit,3x2:none,3x2:10gbit,3x2:1gbit",
        RESULTS / "hybrid" / "results.md",
        (("hybrid s3 / flat s3", "zeroray-hybrid-s3", "zeroray-flat-s3"),
         ("hybrid s2 / flat s3", "zeroray-hybrid-s2", "zeroray-flat-s3"),
         ("hpZ / flat s3", "zeroray-hpz-s3", "zeroray-flat-s3"),
         ("hybrid k=4 s3 / flat s3", "zeroray-hybrid4-s3", "zeroray-flat-s3"),
         ("hybrid k=4 + hpZ / flat s3", "zeroray-hybrid4-hpz-s3", "zeroray-flat-s3"),
         ("hybrid s3 / FSDP2 HSDP", "zeroray-hybrid-s3", "fsdp2-hsdp"),
         ("FSDP2 HSDP / FSDP2 flat", "fsdp2-hsdp", "fsdp2-flat")),
        notes=(f"hpZ: `hpz_partition_size={HPZ}` over a flat shard group of all ranks (backward's gathers read a"
               " secondary copy inside the node). Hybrid + hpZ needs a shard group that spans nodes: with k = 2"
               f" (a node) hpZ's h = {HPZ} is the shard group itself and is dropped (topology.build), so it runs"
               f" as `shard_group_size={2 * K}, hpz_partition_size={HPZ}` on 4 nodes and more (`--cases 4x2:...`),"
               f" beside hybrid k={2 * K} alone.",)),
    "zeropp": Suite(
        "ZeRO++ (hpZ, qwZ, qgZ) vs flat ZeRO-3, hybrid and hpZ alone on the emulated multi-node cluster",
        ("zeroray-flat-s3", "zeroray-hybrid-s3", "zeroray-hpz-s3", "zeroray-zpp8-s3", "zeroray-zpp4-s3",
         "zeroray-qwz-qgz8-s3"),
        "2x2:none,2x2:10gbit,2x2:1gbit,3x2:none,3x2:10gbit,3x2:1gbit", RESULTS / "zeropp" / "results.md",
        (("ZeRO++ int8 / hpZ", "zeroray-zpp8-s3", "zeroray-hpz-s3"),
         ("ZeRO++ int8, fp32 in node / hpZ", "zeroray-zpp8n-s3", "zeroray-hpz-s3"),
         ("ZeRO++ int8, fp32 in node, stochastic / hpZ", "zeroray-zpp8n-sr-s3", "zeroray-hpz-s3"),
         ("ZeRO++ stochastic / nearest rounding", "zeroray-zpp8n-sr-s3", "zeroray-zpp8n-s3"),
         ("ZeRO++ qgZ fp8 / hpZ", "zeroray-zpp-fp8-s3", "zeroray-hpz-s3"),
         ("ZeRO++ int4 / hpZ", "zeroray-zpp4-s3", "zeroray-hpz-s3"),
         ("ZeRO++ int8 / flat s3", "zeroray-zpp8-s3", "zeroray-flat-s3"),
         ("qwZ+qgZ / flat s3", "zeroray-qwz-qgz8-s3", "zeroray-flat-s3"),
         ("hpZ / flat s3", "zeroray-hpz-s3", "zeroray-flat-s3"),
         ("hybrid s3 / flat s3", "zeroray-hybrid-s3", "zeroray-flat-s3")),
        (("ZeRO++ int8 / flat s3", "zeroray-zpp8-s3", "zeroray-flat-s3"),
         ("ZeRO++ int4 / flat s3", "zeroray-zpp4-s3", "zeroray-flat-s3"),
         ("qwZ+qgZ int8 / flat s3", "zeroray-qwz-qgz8-s3", "zeroray-flat-s3"),
         ("hpZ / flat s3", "zeroray-hpz-s3", "zeroray-flat-s3")),
        (f"hpZ: `hpz_partition_size={HPZ}` over a flat shard group of all ranks (the backward's gathers read a"
         " secondary copy inside the node); qwZ + qgZ: `quantize={\"weights\": True, \"gradients\": True,"
         f" \"block_size\": {QUANTIZE_BLOCK}, \"gradient_bits\": 8 or 4}}`, the qgZ all-to-all hierarchical"
         " (inside the node, then across) since `nodes=` gives each rank's node.",
         "qwZ's forward gather runs over the flat group, so comm_report counts all of its bytes as inter-node"
         " (as for flat stage 3) though (m-1)/N of them stay inside the node; the link MB column is the truth.")),
}
UNSHAPED_GBIT = 21.0  # what an unshaped veth carried here (../shared/NOTES.md): the plot's x for "unshaped"


def _series(md: Path) -> tuple[str, dict[tuple[str, str], list[tuple[float, float]]]]:
    """A results file's setting (model and tokens, from its model line) and, from its first table, each
    mode's (link Gbit/s, step s) points by mode and cluster shape."""
    gbit = {name: float(key.removesuffix("gbit")) for key, name in LINK_NAMES.items() if key != "none"}
    gbit[LINK_NAMES["none"]] = UNSHAPED_GBIT
    setting = md.name
    series: dict[str, list[tuple[float, float]]] = {}
    for line in md.read_text().splitlines():
        if line.startswith("- model: "):
            model, tokens = line.removeprefix("- model: ").split(";")[:2]
            setting = f"{model.removeprefix('zeroray GPT, ')};{tokens}"
            continue
        if line.startswith("- machine load"):  # the 1-minute load averages as each case began and ended
            loads = [float(m) for m in re.findall(r"(\d+\.\d) \d+\.\d \d+\.\d", line)]
            setting += f"; load {min(loads):.0f}-{max(loads):.0f}" if loads else ""
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or cells[1] not in gbit or cells[2] not in MODE_NAMES.values():
            continue
        try:
            seconds = float(cells[3])
        except ValueError:
            continue
        series.setdefault((cells[2], cells[0]), []).append((gbit[cells[1]], seconds))
    return setting, series


def plot(mds: list[Path], png: Path) -> None:
    """Step time against link bandwidth, one panel per results file (a setting: model and tokens a rank),
    one line per mode and cluster shape, from each file's first table (so a plot can be redrawn from
    committed results without running again)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(MODE_NAMES.values(), plt.get_cmap("tab20").colors, strict=False))  # a mode's, in every panel
    shapes = {"2x2": ("-", "o"), "3x2": ("--", "s")}  # line and marker of a cluster shape; others dotted
    fig, axes = plt.subplots(1, len(mds), figsize=(7 * len(mds), 4.6), squeeze=False)
    for ax, md in zip(axes[0], mds, strict=True):
        setting, series = _series(md)
        for (mode, shape), points in sorted(series.items()):
            xs, ys = zip(*sorted(points), strict=True)
            line, marker = shapes.get(shape, (":", "^"))
            ax.plot(xs, ys, marker=marker, linestyle=line, color=colors[mode], label=f"{mode} ({shape})")
        ax.set_xscale("log")
        ax.set_xlabel(f"link bandwidth per node, Gbit/s (unshaped veth: ~{UNSHAPED_GBIT:.0f})")
        ax.set_ylabel("step time, s (median, slowest rank)")
        ax.set_title(f"emulated nodes x 2 ranks: {setting}", fontsize=9)
        ax.legend(fontsize=6)
    fig.suptitle("Step time against link bandwidth")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def nic_tx_bytes() -> int:
    """Bytes this node's NIC (GLOO_SOCKET_IFNAME, set by run_ranks) has sent: sysfs is the node's own
    inside its namespace (``ip netns exec`` mounts it)."""
    ifname = os.environ["GLOO_SOCKET_IFNAME"]
    return int(Path(f"/sys/class/net/{ifname}/statistics/tx_bytes").read_text())


def _batch(vocab: int, batch: int, seq: int, rank: int, step: int) -> tuple[Any, Any]:
    """Random tokens seeded by rank and step: the same for every mode."""
    import torch

    g = torch.Generator().manual_seed(1_000_003 * rank + step)
    tokens = torch.randint(vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _zeroray_step(engine: Any, x: Any, y: Any) -> None:
    loss = engine(x, y)[1]
    engine.backward(loss)
    engine.step()


def _deepspeed_engine(model: Any, mode: str, rank: int, batch: int, world: int) -> Any:
    """DeepSpeed's ZeRO-3 engine for ``mode`` on the ranks' gloo group: deepspeed.init_distributed finds the
    default group initialized and wraps it, so DeepSpeed's traffic takes the same links as the other modes'.
    LOCAL_RANK (the rank's place in its node), which DeepSpeed asserts and a launcher would set, is set here."""
    import deepspeed
    import torch

    os.environ.setdefault("LOCAL_RANK", str(rank % RANKS_PER_NODE))
    deepspeed.init_distributed(dist_backend="gloo")
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
              "train_batch_size": batch * world, "zero_optimization": {**DEEPSPEED_ZERO3, **DEEPSPEED_MODES[mode]},
              "zero_allow_untested_optimizer": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def _torch_step(model: Any, opt: Any, x: Any, y: Any) -> None:
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()


def build_mode(rank: int, world: int, mode: str, params: float, batch: int) -> dict[str, Any]:
    """The GPT (seed 0) wrapped for ``mode``: {"step": one training step on (x, y), "engine": zeroray's or
    None, "vocab": the vocabulary size, "setup_s": seconds it took}."""
    import torch

    import zeroray
    from zeroray.models.gpt import GPT, GPTConfig

    start = time.perf_counter()
    cfg = GPTConfig.for_params(params)
    torch.manual_seed(0)
    model = GPT(cfg)
    nodes = [f"n{r // RANKS_PER_NODE}" for r in range(world)]
    engine = None
    if mode.startswith("zeroray"):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine = zeroray.initialize(model, opt, zeroray.ZeroConfig(**ZERORAY_MODES[mode]), nodes=nodes)
        step = functools.partial(_zeroray_step, engine)
    elif mode.startswith("deepspeed"):  # its engine steps as zeroray's does
        step = functools.partial(_zeroray_step, _deepspeed_engine(model, mode, rank, batch, world))
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if mode == "fsdp2-hsdp":
            mesh = init_device_mesh("cpu", (world // K, K), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        step = functools.partial(_torch_step, model, opt)
    return {"step": step, "engine": engine, "vocab": cfg.vocab_size, "setup_s": time.perf_counter() - start}


def bench_case(rank: int, world: int, modes: list[str], params: float, steps: int, warmup: int,
               batch: int, seq: int) -> dict[str, Any]:
    """Every mode on this rank, built side by side and stepped in turn, one step each a round (the order
    rotated every round), so that the load of a shared machine drifts over all of them alike.

    Per mode: the seconds of each timed step, the bytes this node's NIC sent during them (first rank of a
    node, else None; a barrier after each step waits for every rank's traffic), zeroray's comm report
    over them and its padded trainable numel. A mode that fails to build is recorded, and the rest run."""
    import torch.distributed as dist

    runs: dict[str, dict[str, Any]] = {}
    results: dict[str, Any] = {}
    for mode in modes:
        try:
            runs[mode] = build_mode(rank, world, mode, params, batch)
        except Exception as e:  # noqa: BLE001 - a benchmark reports a failing mode and goes on
            results[mode] = {"error": f"{type(e).__name__}: {e}"[:500]}
        dist.barrier()
    leader = rank % RANKS_PER_NODE == 0
    live = [m for m in modes if m in runs]
    for mode in live:
        runs[mode].update(times=[], tx=0)
    for i in range(warmup + steps):
        shift = i % len(live)
        for mode in live[shift:] + live[:shift]:
            run = runs[mode]
            if i == warmup and run["engine"] is not None:
                run["engine"].reset_comm_report()
            x, y = _batch(run["vocab"], batch, seq, rank, i)
            dist.barrier()
            tx0 = nic_tx_bytes()
            start = time.perf_counter()
            run["step"](x, y)
            seconds = time.perf_counter() - start
            dist.barrier()
            if i >= warmup:
                run["times"].append(seconds)
                run["tx"] += nic_tx_bytes() - tx0
    for mode in live:
        run = runs[mode]
        engine = run["engine"]
        results[mode] = {"times": run["times"], "tx": run["tx"] if leader else None, "setup_s": run["setup_s"],
                         "scoped": None if engine is None else engine.comm_report(by_scope=True),
                         "psi_padded": None if engine is None else sum(g.padded for g in engine.groups if g.trainable)}
        if engine is not None:
            engine.close()
    dist.barrier()
    return results


def link_bits_per_s(link: str) -> float | None:
    """A shaped link's rate in bit/s ("1gbit" -> 1e9), None when unshaped."""
    spec = LINKS[link]
    if spec is None or spec.rate is None:
        return None
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for unit, scale in units.items():
        if spec.rate.endswith(unit):
            return float(spec.rate.removesuffix(unit)) * scale
    raise ValueError(f"rate {spec.rate!r}: expected <n>gbit, <n>mbit or <n>kbit")


def summarize(per_rank: list[dict[str, Any]], mode: str, steps: int, link: str) -> dict[str, Any]:
    """Median slowest-rank step time, rank 0's inter-node bytes a step, the formula, link bytes a step and
    the time the busiest node's link needs for its bytes at the shaped rate."""
    errors = [r[mode]["error"] for r in per_rank if "error" in r[mode]]
    if errors:
        return {"error": errors[0]}
    slowest = [max(ts) for ts in zip(*(r[mode]["times"] for r in per_rank))]
    row: dict[str, Any] = {"seconds": statistics.median(slowest), "all": slowest,
                           "setup_s": max(r[mode]["setup_s"] for r in per_rank)}
    node_tx = [r[mode]["tx"] for r in per_rank if r[mode]["tx"] is not None]
    row["link"] = sum(node_tx) / steps
    rate = link_bits_per_s(link)
    row["floor"] = None if rate is None else max(node_tx) / steps * 8 / rate
    scoped = per_rank[0][mode]["scoped"]
    row["scoped"] = None if scoped is None else {key: v / steps for key, v in scoped.items()}
    row["inter"] = None if scoped is None else sum(
        v for key, v in scoped.items() if key.startswith("inter_node:")) / steps
    row["formula"] = None
    zero = ZERORAY_MODES.get(mode, {})
    k = zero.get("shard_group_size")
    if k is not None and k <= RANKS_PER_NODE:  # shard groups inside nodes: only the replicas' all-reduce crosses
        row["formula"] = 2 * (per_rank[0][mode]["psi_padded"] // k) * 4
    return row


def _mb(x: float | None) -> str:
    """Bytes as MB with one decimal, or a dash."""
    return "—" if x is None else f"{x / 1e6:.1f}"


def render(rows: list[tuple[str, str, str, dict[str, Any]]], args: argparse.Namespace, n_params: int,
           command: str, wall: float, kinds: dict[tuple[str, str], dict[str, float]], suite: Suite,
           loads: dict[tuple[str, str], tuple[float, ...]]) -> str:
    """The results as markdown: the table, the ratios, what the columns mean, zeroray's bytes by kind."""
    lines = [
        f"# {suite.title}",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- machine: {os.cpu_count()} cores CPU ({platform.processor() or platform.machine()}), gloo, one thread a rank;"
        " shared with other jobs, so times are noisy",
        f"- command: `{command}`",
        f"- model: zeroray GPT, {n_params / 1e6:.1f}M parameters, fp32, AdamW; {args.batch} sequences of {args.seq}"
        f" tokens a rank; median of {args.steps} steps after {args.warmup} warm-ups, slowest rank per step;"
        " the modes of a case live side by side in the same ranks and take one step each in turn (order rotated"
        " each round)",
        f"- ranks {RANKS_PER_NODE} a node (ranks 2r, 2r+1 on node r); hybrid k = {K} unless the mode names"
        " another; links shaped with tbf (burst 256kb, latency 50ms) on both ends",
        f"- total wall time {wall:.0f} s",
        "- machine load (1, 5, 15-minute load averages, `os.getloadavg()`) as each case began and ended: "
        + "; ".join(f"{case} {LINK_NAMES[link]} {' '.join(f'{v:.1f}' for v in load[:3])}"
                    f" -> {' '.join(f'{v:.1f}' for v in load[3:])}" for (case, link), load in loads.items()),
        "",
        "| nodes x ranks | link | mode | step s | inter-node MB/step/rank (comm_report) | formula MB | link MB/step"
        " | link floor s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case, link, mode, row in rows:
        if "error" in row:
            lines.append(f"| {case} | {LINK_NAMES[link]} | {MODE_NAMES[mode]} | FAILED: {row['error']} | | | | |")
            continue
        lines.append(f"| {case} | {LINK_NAMES[link]} | {MODE_NAMES[mode]} | {row['seconds']:.3f} | {_mb(row['inter'])}"
                     f" | {_mb(row['formula'])} | {_mb(row['link'])}"
                     f" | {'—' if row['floor'] is None else format(row['floor'], '.2f')} |")
    by_case: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for case, link, mode, row in rows:
        by_case.setdefault((case, link), {})[mode] = row

    def ratio(table: dict[str, dict[str, Any]], a: str, b: str, key: str) -> str:
        x, y = table.get(a, {}).get(key), table.get(b, {}).get(key)
        return "—" if x is None or not y else f"{x / y:.2f}"

    def ratio_table(title: str, spec: tuple[tuple[str, str, str], ...], key: str) -> list[str]:
        out = ["", title, "", "| nodes x ranks | link | " + " | ".join(label for label, _, _ in spec) + " |",
               "|---|---|" + "---|" * len(spec)]
        for (case, link), table in by_case.items():
            out.append(f"| {case} | {LINK_NAMES[link]} | "
                       + " | ".join(ratio(table, a, b, key) for _, a, b in spec) + " |")
        return out

    lines += ratio_table("Ratios of step times (median, slowest rank):", suite.ratios, "seconds")
    if suite.byte_ratios:
        lines += ratio_table("Ratios of inter-node bytes per step, comm_report (rank 0):", suite.byte_ratios, "inter")
    if suite.byte_ratios or suite.link_ratios:
        lines += ratio_table("Ratios of bytes that crossed the links per step (NIC counters, all nodes):",
                             suite.byte_ratios + suite.link_ratios, "link")
    lines += [
        "",
        "Columns:",
        "",
        "- *inter-node MB/step/rank*: rank 0's bytes in collectives whose group spans nodes, from"
        " `engine.comm_report(by_scope=True)`, as zeroray counts them (an all-reduce of S bytes counts 2S, a"
        " gather or reduce-scatter of a full S-byte buffer counts S). Flat ZeRO's one group spans the nodes, so"
        " all its bytes are there, though much of its traffic stays inside a node.",
        "- *formula*: hybrid's inter-node bytes per rank and micro-step, 2 x (Psi_padded / k) x 4 with"
        " Psi_padded = sum(g.padded for g in engine.groups if g.trainable), k the mode's shard group (the"
        " all-reduce of each gradient shard over the N/k replicas, fp32); none where the shard group spans nodes"
        " (its gathers cross them too).",
        "- *link MB/step*: bytes that really crossed the links: the sum over nodes of the node NIC's sent bytes"
        " (headers included) over the timed steps, divided by the steps; the barriers add a few KB. A ring"
        " all-reduce of B bytes over r replicas sends 2 (r-1)/r x B per rank, so hybrid's link bytes should be"
        " N x (r-1)/r x formula (r = N/k replicas) plus headers.",
        "- *link floor s*: the busiest node's sent bytes per step over the shaped rate: the least time a step"
        " can take on that link. Where the step time is well above it, the two CPU cores (shared by all ranks and"
        " by other jobs), not the link, set the pace.",
        "- On gloo zeroray's defaults all-reduce the gradients (comm.reduce_scatter off) and gather parameters by"
        " broadcasts (comm.all_gather_by_broadcast on): its flat ZeRO-3 puts more bytes on the links than FSDP2"
        " flat; hybrid keeps both inside the node, where they never touch a link.",
        *(f"- {note}" for note in suite.notes),
    ]
    if kinds:
        lines += ["", "zeroray's comm_report per step and rank (rank 0), MB, by scope and kind:", ""]
        for (case, mode), scoped in kinds.items():
            text = ", ".join(f"{key} {v / 1e6:.1f}" for key, v in sorted(scoped.items()))
            lines.append(f"- {case}, {MODE_NAMES[mode]}: {text}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=25e6)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--suite", choices=sorted(SUITES), default="hybrid",
                        help="the modes, cases, ratios and results file: hybrid (issue 30) or zeropp (issue 33)")
    parser.add_argument("--cases", help="comma-separated <nodes>x<ranks a node>:<none|1gbit|10gbit> (default: the suite's)")
    parser.add_argument("--modes", help=f"comma-separated, of {', '.join(MODE_NAMES)} (default: the suite's)")
    parser.add_argument("--deepspeed", action="store_true",
                        help=f"add DeepSpeed's modes ({', '.join(DEEPSPEED_MODES)}) to the suite's")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a case may run")
    parser.add_argument("--out", type=Path, help="results markdown (default: the suite's)")
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot from --plot-from and stop")
    parser.add_argument("--plot-from", help="comma-separated results files, a panel each (default: --out)")
    args = parser.parse_args()
    suite = SUITES[args.suite].with_deepspeed() if args.deepspeed else SUITES[args.suite]
    args.out = args.out or suite.out
    args.cases = args.cases or suite.cases
    args.modes = args.modes or ",".join(suite.modes)
    png = args.out.with_name("step_vs_link.png")
    panels = [Path(p) for p in args.plot_from.split(",")] if args.plot_from else [args.out]
    if args.plot_only:
        plot(panels, png)
        return
    why = unavailable()
    if why:
        sys.exit(f"no emulated cluster here: {why}")
    from zeroray.models.gpt import GPTConfig

    n_params = GPTConfig.for_params(args.params).num_params()
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODE_NAMES]
    if unknown:
        raise SystemExit(f"unknown modes {unknown}: expected some of {list(MODE_NAMES)}")
    if any(m in DEEPSPEED_MODES for m in modes) and importlib.util.find_spec("deepspeed") is None:
        raise SystemExit("DeepSpeed modes asked for, but deepspeed is not installed (pip install deepspeed)")
    cases = []
    for spec in args.cases.split(","):
        shape, link = spec.split(":")
        n_nodes, per_node = (int(v) for v in shape.split("x"))
        if per_node != RANKS_PER_NODE:
            raise SystemExit(f"{spec}: {RANKS_PER_NODE} ranks a node only")
        cases.append((shape, n_nodes, link))
    pythonpath = f"PYTHONPATH={shlex.quote(os.environ['PYTHONPATH'])} " if os.environ.get("PYTHONPATH") else ""
    command = f"cd {shlex.quote(os.getcwd())} && {pythonpath}{sys.executable} " + " ".join(map(shlex.quote, sys.argv))
    command += " (as root)" if os.geteuid() == 0 else ""

    t0 = time.monotonic()
    rows: list[tuple[str, str, str, dict[str, Any]]] = []
    kinds: dict[tuple[str, str], dict[str, float]] = {}  # (nodes x ranks, mode): bytes a step; the link does not change them
    loads: dict[tuple[str, str], tuple[float, ...]] = {}  # (nodes x ranks, link): load averages before and after
    with NetCluster(max(n for _, n, _ in cases)) as net:
        for shape, n_nodes, link in cases:
            for node in net.nodes:
                net.shape(node, LINKS[link])
            placement = [net.nodes[r // RANKS_PER_NODE] for r in range(n_nodes * RANKS_PER_NODE)]
            t_case = time.time()
            load_before = os.getloadavg()
            try:
                per_rank = run_ranks(net, placement, bench_case, modes, args.params, args.steps, args.warmup,
                                     args.batch, args.seq, timeout_s=args.timeout,
                                     env={"DS_ACCELERATOR": "cpu"})  # read only by DeepSpeed's modes
            except (RuntimeError, TimeoutError) as e:  # the case is lost (every mode in it), the rest run
                per_rank = None
                case_error = f"{type(e).__name__}: {str(e).splitlines()[0]}"[:300]
            loads[shape, link] = load_before + os.getloadavg()
            print(f"{shape} {LINK_NAMES[link]}: {time.time() - t_case:.0f} s, load {loads[shape, link]}", flush=True)
            for mode in modes:
                row = {"error": case_error} if per_rank is None else summarize(per_rank, mode, args.steps, link)
                rows.append((shape, link, mode, row))
                if row.get("scoped") is not None:
                    kinds.setdefault((shape, mode), row["scoped"])
                status = row.get("error") or (f"{row['seconds']:.3f} s/step {[round(t, 2) for t in row['all']]},"
                                            f" link {_mb(row['link'])} MB/step, set-up {row['setup_s']:.1f} s")
                print(f"[{time.monotonic() - t0:5.0f}s] {shape} {LINK_NAMES[link]:9s} {mode:18s} {status}", flush=True)
            # after every case, so that a later case's failure (a timeout on a loaded machine) keeps the rest
            md = render(rows, args, n_params, command, time.monotonic() - t0, kinds, suite, loads)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(md)
    print("\n" + md)
    plot(panels, png)


if __name__ == "__main__":
    main()
