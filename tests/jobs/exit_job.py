"""One rank of a user's world-2 script, as torchrun would run it: join a gloo group, train a few
steps at every stage (with an evaluation forward), then let the interpreter exit.

``python tests/jobs/exit_job.py RANK WORLD STORE_FILE [--destroy]``; ``--destroy`` calls
``dist.destroy_process_group()`` before exit, as the torch docs ask. Launched by tests.support.jobs for
tests/test_exit.py and tests/jobs/exit_loop.py (python -m tests.jobs.exit_loop), which count launches
that do not exit with 0.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import zeroray
from tests.support.models import TinyLM, batches, param_groups
from tests.support.recipe import train


def main(rank: int, world: int, store: str, destroy: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    for stage in range(4):
        torch.manual_seed(0)
        model = TinyLM()
        engine = zeroray.initialize(model, torch.optim.AdamW(param_groups(model)), zeroray.ZeroConfig(stage=stage))
        data = batches(rank, 2)
        train(engine, data)
        x, y = data[-1]
        with torch.no_grad():
            model.eval()
            engine(x, y)
            model.train()
    if destroy:
        dist.destroy_process_group()
    print(f"rank {rank} done")  # left in the buffer, as usual: flushed at exit, with the GIL released


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], "--destroy" in sys.argv[4:])
