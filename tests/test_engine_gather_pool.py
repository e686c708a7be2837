"""Stage-3 gathers land in pooled memory: after the first step a gather allocates nothing.

A freed unit's gather memory goes back to the engine's pool and the next gather of that size takes
it, so the pool holds as many block buffers as were gathered at once (the one running and the one
prefetched), and no more however many steps run. The root's memory goes back to the allocator when
it is freed early in backward (tests/test_engine_root_early_free.py). Autograd's saved views of a
block's parameters see its values again when it is gathered for backward into another buffer of
the pool: the losses do not depend on which buffer each gather lands in.
"""

from __future__ import annotations

import torch

import zeroray
from zeroray.models.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32)


def _engine(**cfg: object) -> zeroray.ZeroEngine:
    torch.manual_seed(0)
    model = GPT(CFG)
    config = zeroray.ZeroConfig(stage=3, **cfg)
    return zeroray.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=config)


def _step(engine: zeroray.ZeroEngine, g: torch.Generator) -> float:
    tokens = torch.randint(CFG.vocab_size, (2, 9), generator=g)
    _, loss = engine(tokens[:, :-1], tokens[:, 1:])
    engine.backward(loss)
    engine.step()
    return loss.item()


def test_the_pool_holds_two_blocks_and_gathers_reuse_them() -> None:
    engine = _engine(comm={"prefetch_bucket_size": 1})  # gather one block ahead, as a large model does
    units = engine.scheduler.units
    block_bytes = units[0].numel * 4
    # Where each block's parameters live while gathered for its forward.
    addresses: list[int] = []
    hooks = [
        u.module.register_forward_pre_hook(lambda m, a, u=u: addresses.append(u.groups[0].full.data_ptr()))
        for u in units
    ]
    g = torch.Generator().manual_seed(1)
    _step(engine, g)
    held = engine.memory_report()["gather_buffers_cached"]
    assert held == 2 * block_bytes
    first = set(addresses)
    addresses.clear()
    for _ in range(3):
        _step(engine, g)
    assert engine.memory_report()["gather_buffers_cached"] == held  # nothing more is pooled
    assert set(addresses) <= first and len(first) == 2  # every later gather reused the two buffers
    for h in hooks:
        h.remove()
    engine.close()
    assert engine.gather_pool.cached_bytes() == 0


def test_a_block_gathered_again_into_another_buffer_gives_the_same_losses() -> None:
    """Prefetching one block or all of them changes which pooled buffer each block's backward
    gathers into; the losses (bitwise) and the trained weights must not change."""
    one_ahead = _engine(comm={"prefetch_bucket_size": 1})
    all_ahead = _engine(comm={"prefetch_bucket_size": 10**9})
    g1, g2 = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    assert [_step(one_ahead, g1) for _ in range(4)] == [_step(all_ahead, g2) for _ in range(4)]
    a, b = one_ahead.full_state_dict(), all_ahead.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    one_ahead.close()
    all_ahead.close()
