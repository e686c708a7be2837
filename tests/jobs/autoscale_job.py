"""The elastic job of tests/test_deploy_autoscale.py, submitted with ``ray job submit``.

    python tests/jobs/autoscale_job.py STORAGE_PATH STOP_FILE

A tiny GPT trains on 1 to 3 ranks (ZeRO-2, global batch 6, so every size in between is exact), checking
every second whether to resize. It reports its world size with every step and trains until the test
creates STOP_FILE; rank 0 reads it and broadcasts the answer, so every rank ends at the same step.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import zeroray.train as zt
from zeroray import ZeroConfig
from zeroray.models.gpt import GPT, GPTConfig
from zeroray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, ZeroTrainer

VOCAB, BLOCK = 64, 16


def loop(config: dict) -> None:
    ctx = zt.get_context()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=1, n_head=2, n_embd=16))
    engine = zt.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    while True:
        step = engine.global_step
        samples = ctx.sample_indices(step)
        x = torch.randint(VOCAB, (len(samples), BLOCK + 1), generator=torch.Generator().manual_seed(samples.start))
        _, loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        stop = torch.tensor([float(ctx.get_world_rank() == 0 and os.path.exists(config["stop_file"]))])
        dist.broadcast(stop, src=0)
        zt.report({"loss": loss.item(), "world": ctx.get_world_size()},
                  checkpoint=engine.global_step % 5 == 0 or bool(stop.item()))
        if stop.item():
            return


if __name__ == "__main__":
    storage_path, stop_file = sys.argv[1], sys.argv[2]
    result = ZeroTrainer(
        loop,
        train_loop_config={"stop_file": stop_file},
        zero_config=ZeroConfig(stage=2, train_batch_size=6),
        scaling_config=ScalingConfig(num_workers=(1, 3), elastic_resize_monitor_interval_s=1.0),
        run_config=RunConfig(name="elastic", storage_path=storage_path, checkpoint_config=CheckpointConfig(num_to_keep=2),
                             failure_config=FailureConfig(max_failures=2)),  # the node the test terminates
    ).fit()
    last = result.metrics_history[-1]
    print(f"finished at step {last['_global_step']} on {last['world']} ranks")
