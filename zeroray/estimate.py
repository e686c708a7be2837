"""Per-rank memory of model states under ZeRO stages 0-3, from the ZeRO paper's formulas, and of
optimizer offload as the engine lays it out, so a run can be sized before it is launched.

With Ψ parameters, N ranks and K optimizer bytes per parameter, a rank holds on its device
``(p + g + K)Ψ`` at stage 0, ``(p + g)Ψ + KΨ/N`` at stage 1, ``pΨ + (g + K)Ψ/N`` at stage 2 and
``(p + g + K)Ψ/N`` at stage 3, where p and g are the bytes of a parameter and of a gradient in the
compute precision. Mixed precision (bf16/fp16): p = g = 2 and K = 12 (fp32 master weights and two
Adam moments; the master weights are counted under ``optimizer``). Plain fp32: p = g = 4 and K = 8
(the parameters are their own master copy). A shard is ``shard_numel(Ψ, N)`` elements (Ψ/N rounded
up, from :mod:`zeroray.engine.layout`), the same arithmetic the engine uses, so the estimate and
``engine.memory_report()`` agree (within the padding of each flat group, a few elements). The swap
files' page alignment and the parameter buffer pool come from there too; none of it imports torch,
so ``zeroray estimate`` starts in a fraction of a second.

Offload (``offload_optimizer``, stages 1-3; the engine refuses it at stage 0) takes the optimizer's
masters and states off the device, which keeps its parameters and gradients; it is counted as
``memory_report()`` counts it:

- ``cpu``: ``host`` holds an fp32 master (a separate copy in plain fp32 too: the device keeps its
  own parameters), the optimizer's states, and the fp32 copy of the gradient partition the host-side
  step reads: ``(4 + S + 4)`` bytes per element of the partition, S the state bytes (K less the
  master in mixed precision, K in fp32). On a CPU-only machine the host *is* the device: the engine
  then makes no copy and reports what it would without offload.
- ``nvme``: ``nvme`` is the swap files: per sub-group of at most ``sub_group_size`` elements of the
  partition (packed in order, so all but the last are full), the fp32 master and each fp32 state,
  every one a segment padded to 4 KiB. ``host`` is the swap buffers: ``min(buffer_count,
  sub-groups)`` of them, each the largest sub-group's segments. No fp32 gradient copy persists
  (gradients are cast one sub-group at a time, as it is stepped).

Parameter offload (``offload_param``, stage 3 only) takes the compute-dtype parameter shard off the
device (``params`` becomes 0: the gathered units are working memory, like activations): ``cpu`` puts
it in ``host``; ``nvme`` puts it in ``nvme`` (one file per flat group, each padded to 4 KiB: a few
KiB more than ``p·Ψ/N``) and adds to ``host`` the buffers it is read through, ``buffer_count`` of
them, each the largest flat group's shard: give ``largest_unit`` (elements of the largest stage-3
unit, e.g. 12·d² for a transformer block, or the embedding's vocabulary × d) to count them.

``offloaded`` is ``host + nvme``. Not counted: model buffers, activations, the reduce buckets'
temporaries and the step's transient fp32 copy of 16-bit gradients (at most 2**27 elements at a time,
512 MB, see ``zeroray.engine.sharded_optim.CAST_RUN``).
"""

from __future__ import annotations

import math
from typing import Literal

from zeroray.config import OffloadConfig, ZeroConfig
from zeroray.engine.layout import param_pool_size, precision_bytes, shard_numel, swap_aligned, swap_bytes

Precision = Literal["fp32", "bf16", "fp16"]
Offload = Literal["none", "cpu", "nvme"]

STAGES = (0, 1, 2, 3)
OFFLOAD_STAGES = (1, 2, 3)  # offload needs a sharded optimizer (ZeroConfig refuses stage 0)
_F32 = 4  # bytes of an fp32 master, state or gradient element
SUB_GROUP_SIZE = ZeroConfig().sub_group_size  # the engine's defaults
BUFFER_COUNT = OffloadConfig().buffer_count


def _one_stage(
    numel: int, world_size: int, stage: int, p: int, g: int, k: int, offload: Offload, mixed: bool,
    sub_group_size: int, buffer_count: int, offload_param: Offload = "none", largest_unit: int = 0,
    param_buffer_count: int = BUFFER_COUNT, hpz: int | None = None,
) -> dict[str, int | str]:
    shard = shard_numel(numel, world_size)
    params = numel if stage < 3 else shard
    grads = numel if stage < 2 else shard
    opt = numel if stage < 1 else shard
    out: dict[str, int | str] = {"params": p * params, "grads": g * grads, "optimizer": k * opt}
    host = nvme = 0
    if offload != "none":
        state_bytes = max(k - _F32, 0) if mixed else k  # K counts the master only in mixed precision
        if offload == "cpu":
            host = (_F32 + state_bytes + _F32) * opt  # master + states + the fp32 gradient copy
        else:
            segments = 1 + math.ceil(state_bytes / _F32)  # the master and each state, in fp32
            host, nvme = swap_bytes(opt, segments, sub_group_size, buffer_count)
        out["optimizer"] = 0
    if offload_param == "cpu":
        host += out["params"]
    elif offload_param == "nvme":
        nvme += swap_aligned(out["params"])
        host += param_pool_size(param_buffer_count) * swap_aligned(p * shard_numel(largest_unit, world_size)) if largest_unit else 0
    if offload_param != "none":
        out["params"] = 0
    # hpZ: the secondary copy of the compute-dtype parameters over h ranks, on the device between a unit's
    # forward and backward (all units at once at the end of forward).
    out["params_secondary"] = p * shard_numel(numel, hpz) if hpz else 0
    out["total"] = out["params"] + out["grads"] + out["optimizer"] + out["params_secondary"]
    out["host"], out["nvme"] = host, nvme
    out["offloaded"] = host + nvme
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
    sub_group_size: int = SUB_GROUP_SIZE,
    buffer_count: int = BUFFER_COUNT,
    offload_param: Offload = "none",
    largest_unit: int = 0,
    param_buffer_count: int = BUFFER_COUNT,
    shard_group_size: int | None = None,
    hpz_partition_size: int | None = None,
) -> dict:
    """Per-rank model-state bytes, so a run can be sized before it is launched.

    Returns, for one ``stage``, ``{"params", "grads", "optimizer", "total", "host", "nvme",
    "offloaded", "offload_device"}`` (bytes; ``total`` is what stays on the device, ``host`` and
    ``nvme`` what offload puts in host memory and in swap files, ``offloaded`` their sum). With
    ``stage=None``, a dict ``{stage: that dict}`` for stages 0-3 (1-3 with offload).
    ``optimizer_bytes`` overrides K (e.g. 4 for SGD with momentum in fp32). ``reduce_dtype``: the
    gradients' precision when it differs from the parameters' (``PrecisionPolicy.reduce_dtype``).
    ``sub_group_size`` and ``buffer_count``: the NVMe offload settings (ZeroConfig's keys and
    defaults), which size the swap buffers in host memory. ``offload_param`` (stage 3), with
    ``largest_unit`` and ``param_buffer_count`` for its NVMe read buffers: see the module docstring.
    ``shard_group_size`` k (hybrid sharding, stages 1-3): the states are sharded over k ranks, not N, so
    every formula above holds with N -> k. ``hpz_partition_size`` h (hpZ, stage 3): adds the secondary
    parameter copy, pΨ/h, under ``params_secondary`` (and in ``total``).
    """
    numel = round(params)
    if numel < 1:
        raise ValueError(f"params must be >= 1, got {params}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if offload not in ("none", "cpu", "nvme"):
        raise ValueError(f"offload must be 'none', 'cpu' or 'nvme', got {offload!r}")
    for name, value in (("sub_group_size", sub_group_size), ("buffer_count", buffer_count)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    p, g, k = precision_bytes(precision, optimizer_bytes)
    if reduce_dtype is not None:
        g = precision_bytes(reduce_dtype)[0]
    stages = STAGES if offload == "none" else OFFLOAD_STAGES
    if offload_param not in ("none", "cpu", "nvme"):
        raise ValueError(f"offload_param must be 'none', 'cpu' or 'nvme', got {offload_param!r}")
    if offload_param != "none":
        if stage not in (None, 3):
            raise ValueError(f"offload_param {offload_param!r} needs stage 3 (sharded parameters), got stage {stage}")
        stages = (3,)
    if stage is not None and stage not in stages:
        if stage == 0:
            raise ValueError(
                f"offload {offload!r} needs a sharded optimizer (stage 1, 2 or 3); stage 0 keeps it whole on every rank"
            )
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if shard_group_size is not None:
        if isinstance(shard_group_size, bool) or not isinstance(shard_group_size, int) or shard_group_size < 1:
            raise ValueError(f"shard_group_size must be an integer >= 1, got {shard_group_size!r}")
        if world_size % shard_group_size:
            raise ValueError(f"shard_group_size {shard_group_size} does not divide the world size {world_size}")
        if stage == 0:
            raise ValueError("hybrid sharding (shard_group_size) applies to stages 1-3; stage 0 replicates every state")
        stages = tuple(s for s in stages if s > 0)
    hpz = None
    if hpz_partition_size not in (None, 1):
        shard_world = shard_group_size or world_size
        if isinstance(hpz_partition_size, bool) or not isinstance(hpz_partition_size, int) or hpz_partition_size < 1:
            raise ValueError(f"hpz_partition_size must be an integer >= 1, got {hpz_partition_size!r}")
        if shard_world % hpz_partition_size:
            raise ValueError(f"hpz_partition_size {hpz_partition_size} does not divide the shard group size {shard_world}")
        if stage not in (None, 3):
            raise ValueError(f"hpZ (hpz_partition_size) needs stage 3, got stage {stage}")
        stages = (3,)
        hpz = None if hpz_partition_size == shard_world else hpz_partition_size
    args = (numel, shard_group_size or world_size)
    rest = (p, g, k, offload, precision != "fp32", sub_group_size, buffer_count, offload_param, largest_unit,
            param_buffer_count, hpz)
    if stage is None:
        return {s: _one_stage(*args, s, *rest) for s in stages}
    return _one_stage(*args, stage, *rest)
