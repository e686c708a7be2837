"""Failure detection: how soon the driver notices a SIGKILLed rank, and a SIGSTOPped (hung) one.

    python benchmarks/elastic_bench.py [--workers 2] [--kills 20] [--hangs 3] [--heartbeat-timeout 30]

A ZeroTrainer run (stage 2, a small model, a step every ~20 ms, a checkpoint every 20 steps) on an
embedded local Ray cluster; a thread in this driver waits for each new group to train for 1-2 s (a
random phase), then sends SIGKILL (``--kills`` times), then SIGSTOP (``--hangs`` times) to rank 1's
process. For each fault:

- detection: from the signal to the moment the controller ended the attempt (``Attempt.ended_at``:
  the failure was seen and its root cause collected);
- restart: from the signal to the next group running again (``Attempt.started_at`` of the next one:
  placement, actors, rendezvous; then the loop loads the checkpoint);
- steps lost: ``Attempt.steps_lost``.

A hang is noticed by the driver's watchdog (``FailureConfig.worker_heartbeat_timeout_s``, default 30 s)
or by the peers' collective timeout, whichever comes first. Results: benchmarks/results/elastic.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from zeroray.train import FailureConfig, RunConfig, ScalingConfig, ZeroTrainer  # noqa: E402


def _loop(config):
    import torch
    import torch.distributed as dist

    import zeroray.train as zt

    ctx = zt.get_context()
    model = torch.nn.Linear(16, 1)
    engine = zt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    control = Path(config["control"])
    (control / f"rank{ctx.get_world_rank()}-{os.getpid()}").write_text("")
    x = torch.ones(4, 16)
    while True:
        stop = torch.tensor([float((control / "stop").exists())])
        dist.broadcast(stop, 0)  # rank 0 decides, so every rank reports the same number of times
        if stop.item():
            return
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        zt.report({"loss": loss.item()}, checkpoint=engine.global_step % 20 == 0)
        time.sleep(0.02)


def _faults(control: Path, signals: list[signal.Signals], hits: list[tuple[str, float]], errors: list[str]) -> None:
    """Hit rank 1 of each new group once; then tell the last group to stop."""
    seen: set[str] = set()

    def next_group(timeout_s: float = 300.0) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            new = [p for p in control.glob("rank1-*") if p.name not in seen]
            if new:
                seen.add(new[0].name)
                return int(new[0].name.split("-")[1])
            time.sleep(0.05)
        raise TimeoutError("no new group")

    try:
        for sig in signals:
            pid = next_group()
            time.sleep(1.0 + random.random())  # training by now; a random phase within its steps
            hits.append((sig.name, time.time()))
            os.kill(pid, sig)
        next_group()
    except Exception as e:  # the run's own error is what matters; say this one too
        errors.append(f"{type(e).__name__}: {e}")
    finally:
        (control / "stop").write_text("")


def _stats(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=float)
    return {"n": int(a.size), "p50": float(np.percentile(a, 50)), "p95": float(np.percentile(a, 95)),
            "max": float(a.max())} if a.size else {"n": 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--hangs", type=int, default=3)
    ap.add_argument("--heartbeat-timeout", type=float, default=30.0)
    ap.add_argument("--out", default=str(HERE / "results" / "elastic"))
    args = ap.parse_args()
    import ray

    ray.init(num_cpus=max(args.workers, 2) + 1, include_dashboard=False)
    signals = [signal.SIGKILL] * args.kills + [signal.SIGSTOP] * args.hangs
    hits: list[tuple[str, float]] = []
    errors: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        control = Path(tmp) / "control"
        control.mkdir()
        thread = threading.Thread(target=_faults, args=(control, signals, hits, errors), daemon=True)
        thread.start()
        result = ZeroTrainer(
            _loop, train_loop_config={"control": str(control)}, zero_config={"zero_optimization": {"stage": 2}},
            scaling_config=ScalingConfig(num_workers=args.workers),
            run_config=RunConfig(name="elastic-bench", storage_path=str(Path(tmp) / "runs"), progress_bar=False,
                                 failure_config=FailureConfig(max_failures=-1,
                                                              worker_heartbeat_timeout_s=args.heartbeat_timeout)),
        ).fit()
        thread.join(timeout=60)
    ray.shutdown()
    attempts = result.attempt_history
    rows = []
    for i, (sig, t) in enumerate(hits):
        ended, following = attempts[i], attempts[i + 1]
        rows.append({"signal": sig, "detect_s": ended.ended_at - t, "restart_s": following.started_at - t,
                     "steps_lost": ended.steps_lost, "end": ended.end, "rank": ended.rank})
    out = {
        "machine": f"{platform.node()} ({os.cpu_count()} cores)",
        "workers": args.workers, "heartbeat_timeout_s": args.heartbeat_timeout, "errors": errors,
        "sigkill": {k: _stats([r[k] for r in rows if r["signal"] == "SIGKILL"]) for k in ("detect_s", "restart_s")},
        "sigstop": {k: _stats([r[k] for r in rows if r["signal"] == "SIGSTOP"]) for k in ("detect_s", "restart_s")},
        "steps_lost": _stats([r["steps_lost"] for r in rows]),
        "rows": rows,
    }
    Path(args.out + ".json").write_text(json.dumps(out, indent=1))
    lines = [
        "# Failure detection (benchmarks/elastic_bench.py)", "",
        f"{out['machine']}; world {args.workers}, gloo, embedded Ray; a step every ~20 ms, a checkpoint every 20; "
        f"FailureConfig.worker_heartbeat_timeout_s={args.heartbeat_timeout:g}. Times from the signal (seconds).", "",
        "| fault | n | detection p50 | detection p95 | detection max | group running again p50 | p95 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("sigkill", "sigstop"):
        d, r = out[name]["detect_s"], out[name]["restart_s"]
        if d["n"]:
            lines.append(f"| {name.upper()} rank 1 | {d['n']} | {d['p50']:.2f} | {d['p95']:.2f} | {d['max']:.2f} | "
                         f"{r['p50']:.2f} | {r['p95']:.2f} |")
    lost = out["steps_lost"]
    if lost["n"]:
        lines += ["", f"Steps lost per failure (checkpoint every 20 steps): p50 {lost['p50']:.0f}, max {lost['max']:.0f}."]
    if errors:
        lines += ["", "Errors: " + "; ".join(errors)]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
