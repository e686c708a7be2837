"""Stage-3 gradient temporaries: the root unit borrows a block's pooled temporary.

The root unit (tied embedding, layer norms) gets its small gradients at the start of backward and
its embedding's at the end. Its temporary is taken only when the bulk arrives, from the pool of
block temporaries, so a backward allocates just the temporaries the blocks need (one being filled,
and those of reductions still in flight) and none for the root. A finished reduction is completed as
the next gradients arrive, which gives its temporary back: at world 1 a reduction is done when it is
launched, so the blocks and the root share one. They are released at the end of backward: between
steps the reducer holds none.
"""

from __future__ import annotations

import torch

import zeroray
from tests.support.recipe import train_gpt
from zeroray.models.gpt import GPT, GPTConfig


def _engine(reduce_bucket_size: int) -> tuple[zeroray.ZeroEngine, GPTConfig]:
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    config = zeroray.ZeroConfig(stage=3, comm={"reduce_bucket_size": reduce_bucket_size})
    return zeroray.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=config), cfg


def _steps(engine: zeroray.ZeroEngine, cfg: GPTConfig, n: int) -> list[float]:
    return train_gpt(engine, cfg.vocab_size, n)


def test_root_borrows_a_block_temporary_and_none_are_kept_between_steps() -> None:
    engine, cfg = _engine(reduce_bucket_size=1)  # one reduction in flight beside the one being filled
    units = engine.scheduler.units
    assert engine.scheduler.root.numel < units[0].numel  # the root fits in a block's temporary
    for _ in range(3):
        _steps(engine, cfg, 1)
        assert engine.reducer.temporaries_allocated == 1  # 3 blocks and the root, each done before the next
        assert engine.memory_report()["grad_buffers_cached"] == 0
    engine.close()


def test_losses_do_not_depend_on_which_temporary_a_group_borrows() -> None:
    one_in_flight, cfg = _engine(reduce_bucket_size=1)
    all_in_flight, _ = _engine(reduce_bucket_size=10**9)  # every group its own temporary
    assert _steps(one_in_flight, cfg, 4) == _steps(all_in_flight, cfg, 4)
    one_in_flight.close()
    all_in_flight.close()
