"""Launch the world-2 job of tests/jobs/exit_job.py many times and count how each rank exited.

    ../shared/tools/under-load -- python -m tests.jobs.exit_loop --launches 200

A rank that ends with SIGABRT after its work is done ("terminate called without an active
exception") shows as exit code -6. Prints a histogram of exit codes and the stderr of failures.
"""

from __future__ import annotations

import argparse
import collections

from tests.support.jobs import launch_exit_job


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    codes: collections.Counter[tuple[bool, int]] = collections.Counter()
    bad = 0
    for i in range(args.launches):
        destroy = i % 2 == 1  # half the launches destroy the process group before exit
        results = launch_exit_job(args.world, destroy)
        for rank, (rc, err) in enumerate(results):
            codes[(destroy, rc)] += 1
            if rc != 0:
                print(f"launch {i} (destroy={destroy}) rank {rank}: exit {rc}\n{err[-2000:]}", flush=True)
        bad += any(rc != 0 for rc, _ in results)
        if (i + 1) % 10 == 0:
            print(f"{i + 1} launches, {bad} with a non-zero exit; codes {dict(codes)}", flush=True)
    print(f"TOTAL: {args.launches} launches, {bad} with a non-zero exit; (destroy, code) -> ranks: {dict(codes)}")


if __name__ == "__main__":
    main()
