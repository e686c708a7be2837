"""What a rank prints reaches the driver's console prefixed with the run and the rank, as Ray forwards it.

A real 2-worker run on the local Ray cluster; each rank prints a line from its loop, rank 1 then fails
once, and the restarted group prints again (rank 0 from its actor released and set up again, rank 1 from
a new one). The test reads the driver's own stdout (where Ray's log monitor forwards it) until all four
lines arrived, with a deadline.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from tests.support.ray import run_config

DEADLINE_S = 60.0
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _loop(config: dict[str, Any]) -> None:
    import zeroray.train as zt

    rank = zt.get_context().get_world_rank()
    ran = Path(config["dir"]) / f"ran-{rank}"  # this rank's first attempt wrote it
    first = not ran.exists()
    ran.write_text("yes")
    # Words, not digits: Ray folds lines that differ only in numbers into one "[repeated]" line, later.
    print(f"{config['marker']} {'first' if first else 'again'} {('zero', 'one')[rank]}", flush=True)
    if rank == 1 and first:
        raise RuntimeError("rank 1 fails once")
    zt.report({"rank": rank})


def test_rank_lines_carry_the_run_and_rank_not_idle(ray_cluster, tmp_path, capfd):
    from zeroray.train import FailureConfig, ScalingConfig, ZeroTrainer

    marker = "hello-from-the-loop"
    result = ZeroTrainer(_loop, train_loop_config={"marker": marker, "dir": str(tmp_path)},
                         scaling_config=ScalingConfig(num_workers=2),
                         run_config=run_config(tmp_path, "prefixed", failure_config=FailureConfig(max_failures=1))).fit()
    assert result.error is None and result.attempts == 2
    want = {(when, rank): f"{marker} {when} {word}" for when in ("first", "again") for rank, word in enumerate(("zero", "one"))}
    seen = ""
    deadline = time.monotonic() + DEADLINE_S
    while not all(w in seen for w in want.values()):
        assert time.monotonic() < deadline, f"the ranks' lines did not reach the driver: {seen[-2000:]!r}"
        out, err = capfd.readouterr()
        seen += _ANSI.sub("", out + err)
        time.sleep(0.1)
    for (_, rank), w in want.items():
        line = next(line for line in seen.splitlines() if line.endswith(w))
        assert re.match(rf"\(zeroray:prefixed:rank-{rank} pid=\d+\) ", line), line
    assert ":idle" not in seen
