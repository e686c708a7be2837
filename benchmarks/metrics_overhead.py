"""What monitoring costs a training step: the engine's phase timer and the Ray metrics of every report.

    python benchmarks/metrics_overhead.py [--params 10e6] [--world-size 2] [--stage 3] [--steps 24]

A real ``ZeroTrainer`` run (a local Ray cluster, ``--world-size`` rank actors, gloo) trains zeroray's
GPT with ``zt.report`` after every optimizer step (the worst case: loops usually report less often).
Inside each rank it measures, on the live engine and session:

- end to end: the median step (forward, backward, step, report) in blocks that alternate between
  monitoring on and off in the order on, off, off, on (off: the engine's phase timer replaced by a no-op and the rank's report
  callbacks removed), so the machine's drift hits both alike;
- by part: the phase timer's calls of one optimizer step, what the report now reads from the engine
  (``phase_report()``, ``comm_report()``, peak RSS), the Ray metrics export of one report, and one
  refresh of every gauge by the background thread, each the median of many repetitions.

The overhead is the sum of the parts over the median step (the end-to-end difference is printed too;
on a shared 2-core machine it is noise of a few percent either way). Goal: at most 1%.
Results: benchmarks/results/metrics_overhead.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


class _NullTimer:
    """The engine's phase timer with every call a no-op: monitoring off."""

    def start(self, phase: str) -> None:
        pass

    def stop(self, phase: str) -> None:
        pass

    @contextlib.contextmanager
    def phase(self, phase: str):
        yield

    def report(self):
        from zeroray.engine.phase_timer import StepTimes

        return StepTimes(0, 0.0, 0.0, 0.0, 0.0)


def _median_cost(fn, reps: int) -> float:
    """Median seconds of one call of ``fn`` over ``reps`` timed batches of 10 calls."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        times.append((time.perf_counter() - t0) / 10)
    return statistics.median(times)


def _loop(config: dict[str, Any]) -> None:
    import torch

    import zeroray.train as zt
    from zeroray.engine.phase_timer import PhaseTimer
    from zeroray.models.gpt import GPT, GPTConfig
    from zeroray.train.worker import reporting
    from zeroray.train.worker.context import get_session
    from zeroray.train.worker.metrics import RankMetrics

    torch.set_num_threads(1)
    ctx = zt.get_context()
    session = get_session()
    torch.manual_seed(0)
    cfg = GPTConfig.for_params(config["params"], vocab_size=4096, block_size=128)
    model = GPT(cfg)
    engine = zt.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(ctx.get_world_rank())
    batch = [torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=g) for _ in range(4)]
    real_timer, callbacks = engine._phases, list(session.report_callbacks)

    def step(i: int) -> None:
        x = batch[i % len(batch)]
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        zt.report({"loss": loss.item(), "tokens": (i + 1) * x.numel()})

    for i in range(2):  # warm-up: optimizer state, allocator, first reports
        step(i)
    times: dict[str, list[float]] = {"on": [], "off": []}
    block = config["block"]
    for b in range(config["steps"] // block):
        mode = "on" if b % 4 in (0, 3) else "off"  # on, off, off, on: a linear drift hits both alike
        engine._phases = real_timer if mode == "on" else _NullTimer()
        session.report_callbacks[:] = callbacks if mode == "on" else []
        for i in range(block):
            t0 = time.perf_counter()
            step(i)
            times[mode].append(time.perf_counter() - t0)
    engine._phases, session.report_callbacks[:] = real_timer, callbacks

    # ---- the parts, on this rank alone (no collective below)
    timer = PhaseTimer(torch.device("cpu"))

    def timer_calls() -> None:  # what one optimizer step calls (stage 3, no accumulation)
        with timer.phase("forward"):
            pass
        with timer.phase("backward"):
            pass
        with timer.phase("comm_wait"):
            pass
        timer.start("optimizer")
        with timer.phase("comm_wait"):
            pass
        timer.stop("optimizer")

    def report_reads() -> None:
        engine.phase_report()
        engine.comm_report()
        reporting.process_memory()

    metrics_cb = next((c for c in callbacks if isinstance(c, RankMetrics)), None)
    stats = reporting._rank_stats(session)
    n = [0]

    def export() -> None:
        n[0] += 1
        metrics_cb.after_report({"loss": 1.0, "tokens": n[0] * 512}, stats, n[0])

    parts = {
        "phase_timer_per_step_s": _median_cost(timer_calls, 200),
        "report_engine_reads_s": _median_cost(report_reads, 100),
        "ray_metrics_export_s": _median_cost(export, 50) if metrics_cb else None,
        "gauge_refresh_s": _median_cost(metrics_cb.gauges.refresh, 50) if metrics_cb else None,
        "gauge_refresh_interval_s": None,
        "series": len(metrics_cb.gauges._latest) if metrics_cb else None,
    }
    from zeroray.monitoring.gauges import _refresh_interval_s

    parts["gauge_refresh_interval_s"] = _refresh_interval_s()
    zt.report({"rank": ctx.get_world_rank(), "times": times, "parts": parts,
               "params": cfg.num_params(), "stage": engine.stage})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=10e6)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=48, help="timed steps, half with monitoring on")
    parser.add_argument("--block", type=int, default=4, help="steps per on/off block")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()

    import tempfile

    import ray

    from zeroray.train import RunConfig, ScalingConfig, ZeroTrainer

    ray.init(address="local", num_cpus=max(args.world_size, 2), configure_logging=False, include_dashboard=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            result = ZeroTrainer(
                _loop,
                train_loop_config={"params": args.params, "steps": args.steps, "block": args.block},
                zero_config={"zero_optimization": {"stage": args.stage}, "train_micro_batch_size_per_gpu": 4},
                scaling_config=ScalingConfig(num_workers=args.world_size),
                run_config=RunConfig(name="metrics-overhead", storage_path=tmp, progress_bar=False),
            ).fit()
    finally:
        ray.shutdown()
    final = result.metrics  # rank 0's
    on, off = statistics.median(final["times"]["on"]), statistics.median(final["times"]["off"])
    p = final["parts"]
    per_step = p["phase_timer_per_step_s"] + p["report_engine_reads_s"] + (p["ray_metrics_export_s"] or 0.0)
    per_step += (p["gauge_refresh_s"] or 0.0) * on / p["gauge_refresh_interval_s"]
    out = {
        "params": final["params"], "world_size": args.world_size, "stage": final["stage"],
        "report_every_step": True, "median_step_on_s": on, "median_step_off_s": off,
        "end_to_end_difference": on / off - 1.0, "parts": p, "overhead_per_step_s": per_step,
        "overhead_fraction": per_step / on,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "metrics_overhead.json").write_text(json.dumps(out, indent=2) + "\n")
    md = [
        "# Monitoring overhead",
        "",
        f"`python benchmarks/metrics_overhead.py --params {args.params:g} --world-size {args.world_size} "
        f"--stage {args.stage} --steps {args.steps}`: {final['params'] / 1e6:.1f}M-parameter GPT, world "
        f"{args.world_size}, stage {final['stage']}, gloo on CPU, `zt.report` after every step (rank 0's numbers).",
        "",
        "| part | per step |",
        "|---|---|",
        f"| phase timer (engine) | {p['phase_timer_per_step_s'] * 1e6:.1f} µs |",
        f"| report: phase_report, comm_report, peak RSS | {p['report_engine_reads_s'] * 1e6:.1f} µs |",
        f"| Ray metrics export of one report ({p['series']} series) | {(p['ray_metrics_export_s'] or 0) * 1e6:.1f} µs |",
        f"| background refresh ({(p['gauge_refresh_s'] or 0) * 1e6:.0f} µs every {p['gauge_refresh_interval_s']:.1f} s), "
        f"per step | {(p['gauge_refresh_s'] or 0) * on / p['gauge_refresh_interval_s'] * 1e6:.1f} µs |",
        f"| **total** | **{per_step * 1e6:.0f} µs = {100 * per_step / on:.3f}% of the {on:.3f} s step** |",
        "",
        f"End to end (alternating blocks, median step): on {on:.3f} s, off {off:.3f} s, difference "
        f"{100 * (on / off - 1):+.1f}% (machine noise; the parts above are the measurement).",
        "",
    ]
    (args.out / "metrics_overhead.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
