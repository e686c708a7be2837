"""Block-wise symmetric integer quantization: the kernels of ZeRO++'s quantized collectives (qwZ, qgZ).

A row of values is cut into blocks of ``block`` elements (the last one padded with zeros). Each block
keeps one fp32 scale, its largest magnitude divided by the largest code (127 for int8, 7 for int4), and
each element keeps the nearest integer code of value / scale (round half to even), or, given ``noise`` (uniform
in [0, 1), one value per element: zeroray.engine.rounding), the code below value / scale + noise (stochastic
rounding: up with a probability equal to the fraction, so the expected code is value / scale). int4 codes are
stored two a byte, offset by 8. With ``codes="fp8"`` each element keeps value / scale as a float8 e4m3 number
(qmax 448; rounded to nearest by the float8 conversion, or stochastically: ``noise`` added as random bits
below the 3 mantissa bits e4m3 keeps of the fp32 value, then cut off; values below e4m3's normal range,
2**-6 scale, are rounded to nearest): 3 mantissa bits, so an element's relative error is at
most 1/16 whatever its size against the block's largest, where an int8 code gives an element 127 times smaller
than the block's largest a relative error up to 1/2. A quantized row is one uint8 buffer, codes then scales,
so one collective moves both: ``row_bytes(n) = ceil(n / block) * (block * bits / 8 + 4)``.

Error: each int code is within ``scale / 2 = max|block| / (2 * qmax)`` of its value (within ``scale`` when
rounded stochastically); each fp8 code within 1/16 of its value (1/8 when rounded stochastically), or
``scale * 2**-10`` where it is below e4m3's normal range.
Non-finite values: a block holding inf or nan gets a non-finite scale and dequantizes to non-finite values
(0 x inf = nan), so the fp16 overflow check after a quantized reduction still sees the overflow.

Only vectorized torch ops: the same code runs on CPU and CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zeroray.engine.scratch import ScratchPool

SCALE_BYTES = 4  # one fp32 scale per block
BITS = (4, 8)
CODES = ("int", "fp8")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
FP32_CUT = 20  # fp32's 23 mantissa bits less e4m3's 3: what stochastic rounding to fp8 draws and cuts off


@dataclass(frozen=True)
class BlockQuantizer:
    """``bits``-bit codes, integers (``codes="int"``) or float8 e4m3 (``"fp8"``, 8 bits), with one scale per
    ``block`` elements (a power of two, at least 8)."""

    bits: int
    block: int
    codes: str = "int"

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"bits must be 4 or 8, got {self.bits!r}")
        if not isinstance(self.block, int) or self.block < 8 or self.block & (self.block - 1):
            raise ValueError(f"block must be a power of two >= 8, got {self.block!r}")
        if self.codes not in CODES:
            raise ValueError(f"codes must be 'int' or 'fp8', got {self.codes!r}")
        if self.codes == "fp8" and self.bits != 8:
            raise ValueError(f"fp8 codes have 8 bits, got bits={self.bits!r}")

    @property
    def qmax(self) -> float:
        """The largest code: a block's largest magnitude maps to it."""
        return FP8_MAX if self.codes == "fp8" else 2 ** (self.bits - 1) - 1

    def blocks(self, n: int) -> int:
        return -(-n // self.block)

    def code_bytes(self, n: int) -> int:
        return self.blocks(n) * self.block * self.bits // 8

    def padded_numel(self, x: torch.Tensor) -> int:
        """The values of ``x``'s rows padded to whole blocks: the size of the noise that rounds them stochastically."""
        return x.numel() // x.shape[-1] * self.blocks(x.shape[-1]) * self.block

    def row_bytes(self, n: int) -> int:
        """Bytes of one quantized row of ``n`` values: codes, then the scales."""
        return self.code_bytes(n) + self.blocks(n) * SCALE_BYTES

    def quantize(self, x: torch.Tensor, out: torch.Tensor | None = None, work: torch.Tensor | None = None,
                 noise: torch.Tensor | None = None) -> torch.Tensor:
        """Quantize each row of ``x`` (``(..., n)``, any float dtype and strides; R rows in all) into ``out``
        (uint8 ``(R, row_bytes(n))``, made when None); returns ``out``. ``work``: an fp32 ``(R, padded)``
        buffer for the intermediate values (made when None). ``noise``: R x padded fp32 values in [0, 1) to
        round stochastically with (None: to nearest)."""
        n = x.shape[-1]
        rows = x.numel() // n
        nb, padded, cb = self.blocks(n), self.blocks(n) * self.block, self.code_bytes(n)
        if out is None:
            out = torch.empty(rows, self.row_bytes(n), dtype=torch.uint8, device=x.device)
        if work is None:
            work = torch.empty(rows, padded, dtype=torch.float32, device=x.device)
        work = work.view(rows, nb, self.block)
        if padded == n and x.is_contiguous():  # whole blocks where they lie: read x itself
            blocks = x.view(rows, nb, self.block)
        else:  # padded, or rows that do not view as one: copied into work (whose tail is zeroed)
            flat = work.view(*x.shape[:-1], padded)
            flat[..., :n].copy_(x)
            flat[..., n:].zero_()
            blocks = work
        # Each block's largest magnitude as max(max, -min), with no |x| tensor (a pass and an allocation fewer);
        # abs_ makes a block of -0.0 scale +0.0, as |x| would. (rows, nb); inf or nan where the block has one.
        scale = torch.maximum(blocks.amax(-1), blocks.amin(-1).neg()).to(torch.float32).abs_().div_(self.qmax)
        inv = torch.where(scale > 0, scale.reciprocal(), torch.zeros((), dtype=scale.dtype, device=scale.device))
        # In fp32 whatever x's dtype (type promotion), so the codes are those of x converted first.
        codes = torch.mul(blocks, inv.unsqueeze(-1), out=work)
        if self.codes == "fp8":
            if noise is not None:  # random bits added below e4m3's 3 mantissa bits of the fp32 values, then cut
                bits = codes.view(torch.int32)
                bits.add_(noise.view_as(codes).mul(1 << FP32_CUT).to(torch.int32)).bitwise_and_(-(1 << FP32_CUT))
                codes.clamp_(-FP8_MAX, FP8_MAX)  # the block's largest, a hair above 448 after x * inv, stays 448
            # within +-448 by the scale: the conversion rounds to nearest (the cut values are e4m3's already)
            out[:, :cb].view(FP8).copy_(codes.view(rows, padded))
            out[:, cb:].view(torch.float32).copy_(scale)
            return out
        codes = codes.round_() if noise is None else codes.add_(noise.view_as(codes)).floor_()
        codes = codes.clamp_(-self.qmax, self.qmax).view(rows, padded)
        if self.bits == 8:
            out[:, :cb].view(torch.int8).copy_(codes)
        else:  # two codes a byte: the first in the low nibble
            pairs = codes.add_(8).view(rows, padded // 2, 2)
            out[:, :cb].copy_(pairs[..., 1].mul(16).add_(pairs[..., 0]))
        out[:, cb:].view(torch.float32).copy_(scale)
        return out

    def dequantize(self, q: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The values ``(R, n)`` of the quantized rows ``q`` (uint8 ``(R, row_bytes(n))``), computed in fp32 and
        written into ``out`` (any float dtype; its last dimension contiguous; fp32, made when None)."""
        rows = q.shape[0]
        nb, padded, cb = self.blocks(n), self.blocks(n) * self.block, self.code_bytes(n)
        if out is None:
            out = torch.empty(rows, n, dtype=torch.float32, device=q.device)
        codes = q[:, :cb]
        if self.codes == "fp8":  # a 256-entry table of the codes' values: 2.3x the float8 conversion on CPU
            table = torch.arange(256, dtype=torch.uint8, device=q.device).view(FP8).to(torch.float32)
            codes = torch.index_select(table, 0, codes.reshape(-1).to(torch.int32)).view(rows, padded)
        elif self.bits == 8:
            codes = codes.view(torch.int8)
        else:
            codes = torch.stack((codes & 15, codes >> 4), dim=-1).view(rows, padded).view(torch.int8).sub_(8)
        scale = q[:, cb:].view(torch.float32)
        whole = n // self.block  # blocks wholly inside the row; the last one may be cut short
        if whole:
            torch.mul(codes[:, : whole * self.block].unflatten(1, (whole, self.block)), scale[:, :whole, None],
                      out=out[:, : whole * self.block].unflatten(1, (whole, self.block)))
        if whole < nb:
            torch.mul(codes[:, whole * self.block : n], scale[:, whole:], out=out[:, whole * self.block :])
        return out


class QuantizeKernels:
    """A quantizer's two ops as this device runs them best: the eager torch ops above on CPU, and on CUDA the
    same ops compiled by inductor into fused Triton kernels (``compiled=True``), which move 3-7x the GB/s of
    the eager ops on an H100 (benchmarks/results/gpu/gpu_quantize.md). They are compiled for static shapes:
    dynamic-shape kernels measured no faster than the eager ops there, and a run has few distinct sizes (a
    unit's shard, the root's). The compiled ops may round a value that lies within an ulp of a half-step the
    other way than the eager ops do (0.02-0.05% of bf16 codes, by one step), so a run is deterministic for a
    fixed choice, which every rank makes alike: it follows the device type.

    The buffers the ops write, and those of the collectives around them, come from a
    :class:`~zeroray.engine.scratch.ScratchPool`: on CPU, reused memory instead of fresh pages."""

    def __init__(self, quantizer: BlockQuantizer, compiled: bool):
        self.quantizer = quantizer
        self.compiled = compiled
        self.pool = ScratchPool()
        self._quantize, self._dequantize = quantizer.quantize, quantizer.dequantize
        if compiled:
            self._quantize = torch.compile(quantizer.quantize, dynamic=False)
            self._dequantize = torch.compile(quantizer.dequantize, dynamic=False)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer for a collective of these kernels' (give it back with :meth:`release` once it is done)."""
        return self.pool.take(shape, dtype, device)

    def quantize(self, x: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        """``x``'s rows quantized (``BlockQuantizer.quantize``, rounded stochastically with ``noise`` when given),
        into a buffer to :meth:`release` once sent."""
        if self.compiled:
            return self._quantize(x, noise=noise)
        q, n = self.quantizer, x.shape[-1]
        rows = x.numel() // n
        out = self.pool.take((rows, q.row_bytes(n)), torch.uint8, x.device)
        work = self.pool.take((rows, q.blocks(n) * q.block), torch.float32, x.device)
        self._quantize(x, out, work, noise)
        self.pool.give(work)
        return out

    def dequantize(self, q: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The values of the quantized rows ``q`` (``BlockQuantizer.dequantize``) in ``out``; when None, in an
        fp32 buffer to :meth:`release` once read."""
        if self.compiled:
            values = self._dequantize(q, n)
            return values if out is None else out.copy_(values)
        if out is None:
            out = self.pool.take((q.shape[0], n), torch.float32, q.device)
        return self._dequantize(q, n, out)

    def release(self, *tensors: torch.Tensor) -> None:
        """Give back buffers from :meth:`empty`, :meth:`quantize` or :meth:`dequantize` that nothing uses now."""
        self.pool.give(*tensors)
