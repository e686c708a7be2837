"""``zt.report``'s process memory: the peak RSS is never below the current RSS.

The kernel's high-water mark (``ru_maxrss``) is kept from approximate per-CPU counters while /proc sums
them exactly, so read alone it trailed the RSS read just before it in about 5% of reads here (by up to
96 KiB; 0.4 MiB in a run's metrics.jsonl). Measured in this process while it really allocates and frees.
"""

from __future__ import annotations

from zeroray.train.worker.reporting import process_memory


def test_peak_rss_is_never_below_the_current_rss():
    keep: list[bytearray] = []
    for i in range(3000):
        keep.append(bytearray(64 * 1024 * (i % 7 + 1)))  # zero-filled: its pages are touched
        if i % 11 == 0:
            del keep[:-50]
        memory = process_memory()
        assert memory["process_peak_rss"] >= memory["process_rss"] > 0, (i, memory)
