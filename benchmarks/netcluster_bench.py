"""gloo all_reduce over the emulated multi-node cluster (tests/support/netcluster.py): what the links cost.

    sudo python benchmarks/netcluster_bench.py [--mb 25] [--repeats 10]

Two nodes (network namespaces joined by a bridge), each link unshaped or shaped to 1 Gbit/s with tbf.
Cases: world 4 = 2 nodes x 2 ranks, unshaped and at 1 Gbit/s; then at 1 Gbit/s a 2-rank group inside
one node against one across the link. Each case is a fresh gloo job (one thread a rank); a case's time
is the median over the repeats of the slowest rank's all_reduce (a barrier before each), after 2
warm-up rounds. Prints a markdown table beside the values measured by hand in /work/shared/NOTES.md.
Needs root (network namespaces); about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.netcluster import LinkSpec, NetCluster, run_ranks, unavailable  # noqa: E402

GBIT = LinkSpec(rate="1gbit", burst="256kb", latency="50ms")  # NOTES' tbf settings


def time_all_reduce(rank: int, world: int, numel: int, repeats: int) -> list[float]:
    """This rank's seconds per all_reduce of ``numel`` float32 values, after 2 warm-up rounds."""
    import torch
    import torch.distributed as dist

    x = torch.ones(numel)
    times = []
    for i in range(repeats + 2):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(x)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=25.0, help="all_reduce size in MB (float32)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    why = unavailable()
    if why:
        sys.exit(f"no emulated cluster here: {why}")
    numel = int(args.mb * 1e6 / 4)
    rows = []
    with NetCluster(2) as net:
        a, b = net.nodes
        cases = [("world 4, 2 nodes x 2 ranks", [a, a, b, b], None, 0.058),
                 ("world 4, 2 nodes x 2 ranks", [a, a, b, b], GBIT, 0.322),
                 ("2 ranks inside one node", [a, a], GBIT, 0.037),
                 ("2 ranks across the link", [a, b], GBIT, 0.383)]
        for name, placement, link, notes in cases:
            for node in net.nodes:
                net.shape(node, link)
            per_rank = run_ranks(net, placement, time_all_reduce, numel, args.repeats)
            slowest = [max(round_times) for round_times in zip(*per_rank)]
            rows.append((name, "1 Gbit/s" if link else "unshaped", statistics.median(slowest), notes))
    print(f"\ngloo all_reduce, {args.mb:g} MB float32, median of {args.repeats} (slowest rank)\n")
    print("| case | link | seconds | NOTES.md |")
    print("|---|---|---|---|")
    for name, link, seconds, notes in rows:
        print(f"| {name} | {link} | {seconds:.3f} | {notes:.3f} |")


if __name__ == "__main__":
    main()
