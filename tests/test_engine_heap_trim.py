"""trim_host_heap: stage 3 hands the C heap's free pages back to the OS after each unit's backward.

Checked against the process itself: freed heap memory stays resident until the trimmer runs, and
then it is gone from RSS. In the engine it runs once per unit when the unit's last reduction is
launched and once at the end of backward, only at stage 3 and only when asked, and it changes no
number: the losses are bitwise those of the same run without it.
"""

from __future__ import annotations

import pytest
import torch

import zeroray
from tests.support.recipe import train_gpt
from zeroray.config import ConfigError
from zeroray.engine.heap_trim import HeapTrimmer
from zeroray.models.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)
MIB = 1 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not HeapTrimmer().available, reason="glibc's malloc_trim")
def test_freed_heap_memory_stays_resident_until_trimmed() -> None:
    trimmer = HeapTrimmer()
    # 64 KiB blocks come from the heap (below glibc's mmap threshold). Every other one is kept, so
    # the freed ones are holes between used memory, which free() never gives back by itself.
    blocks = [torch.ones(16 * 1024) for _ in range(2048)]  # 128 MiB, touched
    kept = blocks[1::2]
    before = _rss()
    del blocks[::2]
    freed = _rss()
    trimmer.trim()
    trimmed = _rss()
    assert before - freed < 16 * MIB  # free() kept the 64 MiB of holes resident
    assert freed - trimmed > 40 * MIB  # the trim returned them
    assert trimmer.trims == 1
    del kept


def _run(trim: bool, stage: int = 3, steps: int = 3) -> tuple[zeroray.ZeroEngine, list[float]]:
    torch.manual_seed(0)
    model = GPT(CFG)
    config = zeroray.ZeroConfig(stage=stage, trim_host_heap=trim)
    engine = zeroray.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=config)
    return engine, train_gpt(engine, CFG.vocab_size, steps)


@pytest.mark.skipif(not HeapTrimmer().available, reason="glibc's malloc_trim")
def test_stage3_trims_after_each_unit_and_at_the_end_of_backward_without_changing_a_loss() -> None:
    trimmed, with_trim = _run(trim=True)
    plain, without = _run(trim=False)
    units = len(trimmed.scheduler.units) + 1  # the blocks and the root
    assert trimmed.heap_trimmer.trims == 3 * (units + 1)
    assert plain.heap_trimmer is None
    assert with_trim == without
    trimmed.close()
    plain.close()


def test_only_stage3_trims() -> None:
    engine, _ = _run(trim=True, stage=2, steps=1)
    assert engine.heap_trimmer is None
    engine.close()


def test_trim_host_heap_must_be_a_flag() -> None:
    with pytest.raises(ConfigError, match="trim_host_heap: must be true or false, got 'yes'"):
        zeroray.ZeroConfig(stage=3, trim_host_heap="yes")
