"""One rank of a world-4 gloo job in which rank 1 dies in the middle of a backward, with bucket
reductions of every rank in flight; the survivors do what a rank actor does on a failed loop (leave
the group; the engine gave it up itself when its collective failed) and record how long after the
death their own step failed.

``python tests/jobs/peer_loss_job.py RANK WORLD STORE_FILE OUT_DIR STAGE TIMEOUT_S``. Writes
``OUT_DIR/rank<R>.json``: ``{"failed_after_s": ..., "error": ...}``. Used by tests/test_engine_peer_loss.py;
tests/test_elastic_reuse.py kills a rank actor the same way (tests.support.jobs.die_mid_backward).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import zeroray
from tests.support.jobs import die_mid_backward
from tests.support.models import TinyLM, batches, param_groups
from tests.support.recipe import train
from zeroray.engine import import_before_group

DYING = 1


def main(rank: int, world: int, store: str, out: str, stage: int, timeout_s: float) -> None:
    torch.set_num_threads(1)
    import_before_group()  # as a rank actor does
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    torch.manual_seed(0)
    model = TinyLM(d=64, n_layer=6)
    # Small buckets: many reductions in flight on every rank when the peer dies.
    config = zeroray.ZeroConfig(stage=stage, comm={"reduce_bucket_size": 2000, "allgather_bucket_size": 2000})
    engine = zeroray.initialize(model, torch.optim.AdamW(param_groups(model)), config)
    if rank == DYING:
        die_mid_backward(model, engine, os.path.join(out, "died"))
    try:
        train(engine, batches(rank, 50))
        result = {"failed_after_s": None, "error": None}
    except Exception as e:
        failed_at = time.time()
        with open(os.path.join(out, "died")) as f:
            died_at = float(f.read())
        result = {"failed_after_s": failed_at - died_at, "error": f"{type(e).__name__}: {e}"[:300]}
    _write(os.path.join(out, f"rank{rank}.json"), result)
    # What a rank actor does with a failed loop: leave the group at once, while the session still holds
    # the engine (until the driver releases the rank). Then wait for the other survivors.
    dist.destroy_process_group()
    deadline = time.time() + 2 * timeout_s
    while time.time() < deadline and not all(
        os.path.exists(os.path.join(out, f"rank{r}.json")) for r in range(world) if r != DYING
    ):
        time.sleep(0.1)
    # A failed group's gloo workers may still hold tensors of the dropped collectives: exiting through
    # the interpreter's teardown could meet them there (the abort of issue #8); this job measures the failure.
    os._exit(0)


def _write(path: str, result: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), float(sys.argv[6]))
