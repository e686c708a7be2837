"""Per-rank memory of model states under ZeRO stages 0-3, from the ZeRO paper's formulas.

With Ψ parameters, N ranks and K optimizer bytes per parameter, a rank holds
``(p + g + K)Ψ`` at stage 0, ``(p + g)Ψ + KΨ/N`` at stage 1, ``pΨ + (g + K)Ψ/N`` at stage 2 and
``(p + g + K)Ψ/N`` at stage 3, where p and g are the bytes of a parameter and of a gradient in the
compute precision. Mixed precision (bf16/fp16): p = g = 2 and K = 12 (fp32 master weights and two
Adam moments; the master weights are counted under ``optimizer``). Plain fp32: p = g = 4 and K = 8
(the parameters are their own master copy). A shard is ``shard_numel(Ψ, N)`` elements (Ψ/N rounded
up, from :mod:`zeroray.engine.layout`), the same arithmetic the engine uses, so the estimate and
``engine.memory_report()`` agree.

Offload follows DeepSpeed's ``offload_optimizer``: the optimizer states (fp32 master weights and
moments) leave the device, and so does an fp32 copy of the rank's gradient partition, which the
host-side optimizer reads (DeepSpeed's CPU Adam keeps one). The device keeps its parameters and its
gradient partition (the reduce buckets the gradients pass through before being copied out). Both
leave the device as ``offloaded`` bytes: host RAM for ``cpu``, NVMe files for ``nvme`` (NVMe also
needs pinned host swap buffers, which depend on the swap settings and are not counted). Stage 0
does not partition, so there the whole optimizer moves.
"""

from __future__ import annotations

from typing import Literal

from zeroray.engine.layout import shard_numel

Precision = Literal["fp32", "bf16", "fp16"]
Offload = Literal["none", "cpu", "nvme"]

STAGES = (0, 1, 2, 3)
_FP32_GRAD_COPY = 4  # bytes per element of the host-side fp32 gradient partition under offload


def precision_bytes(precision: Precision, optimizer_bytes: int | None = None) -> tuple[int, int, int]:
    """``(param, grad, optimizer)`` bytes per parameter for a precision (optimizer: Adam unless given)."""
    if precision == "fp32":
        p, k = 4, 8
    elif precision in ("bf16", "fp16"):
        p, k = 2, 12
    else:
        raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp16', got {precision!r}")
    if optimizer_bytes is not None:
        if optimizer_bytes < 0:
            raise ValueError(f"optimizer_bytes must be >= 0, got {optimizer_bytes}")
        k = optimizer_bytes
    return p, p, k


def _one_stage(
    numel: int, world_size: int, stage: int, p: int, g: int, k: int, offload: Offload
) -> dict[str, int | str]:
    shard = shard_numel(numel, world_size)
    params = numel if stage < 3 else shard
    grads = numel if stage < 2 else shard
    opt = numel if stage < 1 else shard
    out: dict[str, int | str] = {"params": p * params, "grads": g * grads, "optimizer": k * opt}
    out["offloaded"] = 0
    if offload != "none":
        out["offloaded"] = k * opt + _FP32_GRAD_COPY * opt
        out["optimizer"] = 0
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    out["offload_device"] = offload
    return out


def estimate(
    params: float,
    world_size: int,
    stage: int | None = None,
    precision: Precision = "fp32",
    offload: Offload = "none",
    optimizer_bytes: int | None = None,
    reduce_dtype: Precision | None = None,
) -> dict:
    """Per-rank model-state bytes, so a run can be sized before it is launched.

    Returns, for one ``stage``, ``{"params", "grads", "optimizer", "total", "offloaded",
    "offload_device"}`` (bytes; ``total`` is what stays on the device, ``offloaded`` what lives in
    host RAM or on NVMe). With ``stage=None``, a dict ``{stage: that dict}`` for stages 0-3.
    ``optimizer_bytes`` overrides K (e.g. 4 for SGD with momentum in fp32). ``reduce_dtype``: the
    gradients' precision when it differs from the parameters' (``PrecisionPolicy.reduce_dtype``).
    """
    numel = round(params)
    if numel < 1:
        raise ValueError(f"params must be >= 1, got {params}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if offload not in ("none", "cpu", "nvme"):
        raise ValueError(f"offload must be 'none', 'cpu' or 'nvme', got {offload!r}")
    p, g, k = precision_bytes(precision, optimizer_bytes)
    if reduce_dtype is not None:
        g = precision_bytes(reduce_dtype)[0]
    if stage is None:
        return {s: _one_stage(numel, world_size, s, p, g, k, offload) for s in STAGES}
    if stage not in STAGES:
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    return _one_stage(numel, world_size, stage, p, g, k, offload)
