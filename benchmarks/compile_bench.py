"""torch.compile on CPU: step time eager against per-block compiled, zeroray stages 0-3, DDP and FSDP2.

    python benchmarks/compile_bench.py [--params 25e6] [--world-size 2] [--precision fp32] [--repeats 1]

Every system is run.py's job (worker.py, one process per rank, gloo, one thread a rank, the same GPT
and token batches); a ``-compiled`` system compiles each transformer block with inductor
(systems.py). Each job gets an empty inductor cache, so its first step holds a cold compile, which
is reported apart from the median of the timed steps that follow the warm-up. Dynamo's counters per
job: graphs compiled, graph breaks, and frames compiled after step 2 (recompiles; the goal is 0).
Writes ``--out-dir``/results.json and results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from run import run_job
from systems import COMPILED, SYSTEMS, expand

HERE = Path(__file__).resolve().parent
BASE = "ddp"
CPU = "median_cpu_s"


def summarize(jobs: list[dict]) -> dict[str, dict]:
    """Per system: median step over all repeats' timed steps, first step, dynamo counts (most of any rank)."""
    rows: dict[str, dict] = {}
    for job in jobs:
        row = rows.setdefault(
            job["system"], {"times": [], "cpu": [], "first": [], "errors": [], "losses": None}
        )
        if "error" in job:
            row["errors"].append(job["error"])
            continue
        row["times"] += job["step_times"]
        row["cpu"] += job["cpu_step_times"]
        row["first"].append(job["warmup_times"][0])
        row["losses"] = job["losses"]
        row["load"] = max(row.get("load", 0.0), job["loadavg_1min_after"])
        counts = [r["dynamo"] for r in job["ranks"]]
        row["dynamo"] = {k: max(c[k] for c in counts) for k in counts[0]}
    for row in rows.values():
        if row["times"]:
            row["median_s"] = statistics.median(row["times"])
            row["median_cpu_s"] = statistics.median(row["cpu"])
            row["first_s"] = statistics.median(row["first"])
    return rows


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def _ratio(rows: dict[str, dict], a: str, b: str, key: str = "median_s") -> float | None:
    ra, rb = rows.get(a, {}), rows.get(b, {})
    return ra[key] / rb[key] if key in ra and key in rb else None


def eager_of(system: str) -> str:
    """The eager namesake a compiled system is compared with."""
    return "fsdp2-reshard" if system == "fsdp2-compiled" else system.removesuffix(COMPILED)


def markdown(rows: dict[str, dict], meta: dict) -> str:
    """The table, then the issue's goals, met or missed."""
    job = next((j for j in meta["jobs"] if "error" not in j), {})
    lines = [
        "# torch.compile on CPU (issue 31)",
        "",
        f"GPT of {job.get('num_params', 0) / 1e6:.1f}M parameters, {meta['precision']}, world {meta['world_size']} "
        f"(gloo, one thread a rank), AdamW, micro-batch {meta['micro_batch']} × {meta['seq']} tokens; "
        f"{meta['repeats']} job(s) a system, {meta['warmup']} warm-up + {meta['steps']} timed steps each; "
        f"torch {meta['torch']}, {meta['total_wall_s'] / 60:.0f} min in all. `-compiled`: each transformer "
        "block compiled with `block.compile()` (inductor), after `zeroray.initialize` for zeroray, before "
        "DDP's wrap and `fully_shard` for the peers (torchtitan's order). Step: the slowest rank's, median of "
        "the timed steps. First step: with a cold inductor cache, so for a compiled system it holds the "
        "compilation. CPU s/step: the CPU seconds of the busiest rank's threads per step (median), the work "
        "itself, which other load on the machine stretches far less than the wall time. "
        "Dynamo: graphs compiled, graph breaks, frames compiled after step 2 (recompiles). Load: the "
        "machine's 1-minute load average after the job (2 cores, shared with other work).",
        "",
        f"| system | step (s) | ÷ {BASE} eager | ÷ eager namesake | CPU s/step | CPU ÷ {BASE} eager "
        "| CPU ÷ eager namesake | first step (s) | graphs | graph breaks | recompiles after step 2 "
        "| loss Δ vs eager | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for system, row in rows.items():
        if "median_s" not in row:
            err = row["errors"][-1].strip().splitlines()[-1][:120] if row["errors"] else "no result"
            lines.append(f"| {system} | failed: {err} |" + " |" * 11)
            continue
        compiled = system.endswith(COMPILED)
        eager = rows.get(eager_of(system), {})
        delta = (
            max(abs(a - b) for a, b in zip(row["losses"], eager["losses"]))
            if compiled and eager.get("losses")
            else None
        )
        d, eager_name = row["dynamo"], eager_of(system)
        lines.append(
            f"| {system} | {row['median_s']:.3f} | {_fmt(_ratio(rows, system, BASE))} "
            f"| {_fmt(_ratio(rows, system, eager_name) if compiled else None)} | {row['median_cpu_s']:.3f} "
            f"| {_fmt(_ratio(rows, system, BASE, CPU))} "
            f"| {_fmt(_ratio(rows, system, eager_name, CPU) if compiled else None)} | {row['first_s']:.1f} "
            f"| {d['unique_graphs']} | {d['graph_breaks']} | {d['recompiles_after_step2']} "
            f"| {_fmt(delta, '.1e')} | {row['load']:.1f} |"
        )
    goals = [("zeroray-3-compiled", "fsdp2-compiled", "zeroray-3 compiled ÷ FSDP2 compiled")]
    goals += [(s, eager_of(s), f"{eager_of(s)} compiled ÷ eager") for s in rows if s.endswith(COMPILED)]
    lines += ["", "| goal | step ratio | CPU-time ratio | target | |", "|---|---|---|---|---|"]
    for a, b, what in goals:
        r = _ratio(rows, a, b)
        verdict = "—" if r is None else ("met" if r <= 1.0 else "**missed**")
        lines.append(f"| {what} | {_fmt(r)} | {_fmt(_ratio(rows, a, b, CPU))} | ≤ 1.00 | {verdict} |")
    recompiles = {s: r["dynamo"]["recompiles_after_step2"] for s, r in rows.items() if "dynamo" in r}
    bad = {s: n for s, n in recompiles.items() if n}
    lines += ["", f"Recompiles after step 2: {'0 for every system' if not bad else bad}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", default="compile", help="names or groups (default: the group 'compile')")
    ap.add_argument("--params", type=float, default=25e6, help="model size (run.py's default: 26.4M)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--repeats", type=int, default=1, help="jobs per system, rotated as run.py does")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps; the first holds compilation")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per job before it is killed")
    ap.add_argument("--out-dir", type=Path, default=HERE / "results" / "compile")
    args = ap.parse_args(argv)
    if args.warmup < 2:
        ap.error("--warmup must be at least 2: compilation and the recompile check stay out of the median")
    # Each compiled system right after its eager namesake: neighbours in time, and in the table.
    systems = sorted(
        expand(args.systems), key=lambda s: (list(SYSTEMS).index(eager_of(s)), s.endswith(COMPILED))
    )
    jobs: list[dict] = []
    t0 = time.monotonic()
    for rep in range(args.repeats):
        order = systems[rep % len(systems) :] + systems[: rep % len(systems)]
        for system in order:
            with tempfile.TemporaryDirectory() as cache:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # run_job hands os.environ to the ranks
                res = run_job(system, args.world_size, args.precision, args)
            res["repeat"] = rep
            res["loadavg_1min_after"] = os.getloadavg()[0]  # a shared machine: how busy it was
            jobs.append(res)
            status = (
                "FAILED" if "error" in res
                else f"{res['median_step_s']:.3f} s/step, first {res['warmup_times'][0]:.1f} s"
            )  # fmt: skip
            print(
                f"[{time.monotonic() - t0:6.0f}s] {system:20s} {status}  (job {res['job_wall_s']:.0f}s, "
                f"load {res['loadavg_1min_after']:.1f})",
                flush=True,
            )
            if "error" in res:
                print(res["error"][-1500:], file=sys.stderr)
    import torch

    meta = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    meta.update(torch=torch.__version__, total_wall_s=time.monotonic() - t0)
    rows = summarize(jobs)
    md = markdown(rows, {**meta, "jobs": jobs})
    args.out_dir.mkdir(parents=True, exist_ok=True)
    summary = {s: {k: v for k, v in r.items() if k not in ("times", "cpu", "first")} for s, r in rows.items()}
    (args.out_dir / "results.json").write_text(
        json.dumps({"settings": meta, "summary": summary, "jobs": jobs}, indent=1)
    )
    (args.out_dir / "results.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
