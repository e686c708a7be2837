"""Stochastic rounding for the quantized collectives (qwZ, qgZ): reproducible draws, the same for a micro-batch's
forward and backward.

Rounding to nearest gives a weight the same error at every step while it moves by less than a quantization
step, and errors that depend on the weights' values; the convergence study measured its curves running ahead
of the unquantized run's by 4.5-5.7% where the loss falls fastest (benchmarks/results/zeropp/batch8). A value
rounded stochastically goes up with a probability equal to its fraction of a step: its expected code is the
value itself, so the error is zero-mean noise, fresh at every micro-batch.

The noise of one quantization is a function of its key (the rank in its group and what it quantizes) and the
micro-batch number, drawn from a generator seeded with their CRC-32:

- a run gives the same draws every time, also after a resume (the engine saves the micro-step it counts);
- the backward's gather of a forward's weights draws the same noise, so it computes with the same weights;
- the ranks do not share draws.

The noise has 8 bits: 256 levels (k + 0.5) / 256, one byte of a 64-bit random word each. Drawing a word for 8
values costs a quarter of fp32 ``torch.rand``'s per-value draw on CPU (4 ms against 16 ms for 8M values on 2
cores, a tenth of a ZeRO++ step), and the expected code stays within 1/512 of a step of value / scale.
"""

from __future__ import annotations

import zlib

import torch

from zeroray.engine.scratch import ScratchPool


class Draws:
    """The uniform noise of stochastic rounding, keyed; ``micro_batch`` (counted from 1) is kept by the engine."""

    def __init__(self) -> None:
        self.micro_batch = 1

    def uniform(self, key: str, numel: int, device: torch.device, pool: ScratchPool) -> torch.Tensor:
        """``(1, numel)`` fp32 values uniform on the 256 levels (k + 0.5) / 256 in (0, 1), a fixed function of
        ``key`` and the micro-batch, in a buffer of ``pool`` (give it back once used)."""
        gen = torch.Generator(device=device).manual_seed(zlib.crc32(f"{key}/{self.micro_batch}".encode()))
        words = pool.take((-(-numel // 8),), torch.int64, device)
        words.random_(-(2**63), None, generator=gen)  # the full 64-bit range: every byte uniform
        out = pool.take((1, numel), torch.float32, device)
        out.view(-1).copy_(words.view(torch.uint8)[:numel]).add_(0.5).mul_(1 / 256)
        pool.give(words)
        return out
