"""Benchmark zeroray stages 0-3 against DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed.

    python benchmarks/run.py [--quick] [--world-sizes 2,4] [--params 25e6] [--precision fp32,bf16]
                             [--systems zeroray,peers] [--repeats 2]

Every (system, world size, precision) is a real multi-process job on gloo, one thread per rank,
on the same GPT model and the same token batches. Systems run round-robin, one job each per
repeat, so that drift of a shared machine hits all of them alike. Results go to
benchmarks/results/ (results.json, results.md, PNG plots).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report import write_report
from systems import SYSTEMS, expand

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(system: str, world_size: int, precision: str, args: argparse.Namespace) -> dict:
    """Start ``world_size`` worker processes for one system; return rank 0's result or the error."""
    port = free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size))
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT)]))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable, str(HERE / "worker.py"), "--system", system, "--params", str(args.params),
            "--precision", precision, "--micro-batch", str(args.micro_batch), "--seq", str(args.seq),
            "--warmup", str(args.warmup), "--steps", str(args.steps), "--out", str(out),
        ]  # fmt: skip
        logs = [Path(tmp) / f"rank{r}.log" for r in range(world_size)]
        procs = []
        for r in range(world_size):
            with open(logs[r], "w") as log:
                procs.append(
                    subprocess.Popen(
                        cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=log, stderr=log
                    )
                )
        t0 = time.monotonic()
        deadline = t0 + args.timeout
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                for q in procs:
                    q.wait()
        wall = time.monotonic() - t0
        if out.exists() and procs[0].returncode == 0:
            # Rank 0 writes only after every rank has finished measuring and sent its numbers;
            # a crash of another rank while tearing down after that is recorded, not fatal.
            result = json.loads(out.read_text())
            result["job_wall_s"] = wall
            result["exit_codes"] = [p.returncode for p in procs]
            return result
        tail = "\n".join(log.read_text()[-2000:] for log in logs)
        return {"system": system, "world_size": world_size, "precision": precision, "job_wall_s": wall,
                "error": f"exit codes {[p.returncode for p in procs]}\n{tail}"}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small model, world size 2, fp32, few steps")
    ap.add_argument("--world-sizes", default=None, help="comma-separated (default 2,4; quick: 2)")
    ap.add_argument("--params", type=float, default=None, help="model size (default 25e6; quick: 2e6)")
    ap.add_argument("--precision", default=None, help="fp32,bf16 (default both; quick: fp32)")
    ap.add_argument(
        "--systems", default="all", help=f"names or groups: {', '.join(SYSTEMS)}, zeroray, peers, ..."
    )
    ap.add_argument("--repeats", type=int, default=None, help="jobs per system (default 2; quick: 1)")
    ap.add_argument("--micro-batch", type=int, default=None, help="sequences per rank per step (default 4)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 128; quick: 64)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps (default 3; quick: 2)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 10; quick: 4)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per job before it is killed")
    ap.add_argument("--out-dir", type=Path, default=HERE / "results")
    args = ap.parse_args(argv)
    sys.path.append(str(ROOT))  # the report imports zeroray.estimate from this checkout
    quick = args.quick
    defaults = {
        "world_sizes": "2" if quick else "2,4", "params": 2e6 if quick else 25e6,
        "precision": "fp32" if quick else "fp32,bf16", "repeats": 1 if quick else 2,
        "micro_batch": 2 if quick else 4, "seq": 64 if quick else 128,
        "warmup": 2 if quick else 3, "steps": 3 if quick else 10,
    }  # fmt: skip
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    systems = expand(args.systems)
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    precisions = [p.strip() for p in args.precision.split(",")]

    jobs: list[dict] = []
    t0 = time.monotonic()
    for precision in precisions:
        for ws in world_sizes:
            for rep in range(args.repeats):
                # Rotate the order each repeat, so no system always runs first (or last).
                order = systems[rep % len(systems) :] + systems[: rep % len(systems)]
                for system in order:
                    res = run_job(system, ws, precision, args)
                    res["repeat"] = rep
                    jobs.append(res)
                    status = "FAILED" if "error" in res else f"{res['median_step_s']:.3f} s/step"
                    print(f"[{time.monotonic() - t0:6.0f}s] {precision} world {ws} {system:14s} {status}"
                          f"  (job {res['job_wall_s']:.0f}s)", flush=True)  # fmt: skip
                    if "error" in res:
                        print(res["error"][-1500:], file=sys.stderr)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    meta = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    meta["total_wall_s"] = time.monotonic() - t0
    (args.out_dir / "results.json").write_text(json.dumps({"settings": meta, "jobs": jobs}, indent=1))
    md = write_report(jobs, meta, args.out_dir)
    print(md)


if __name__ == "__main__":
    main()
