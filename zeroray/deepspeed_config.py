"""Read a DeepSpeed JSON config into a :class:`~zeroray.config.ZeroConfig`.

Nothing is silently dropped: every key is either used, ignored with a ``UserWarning`` that names it
and says why ignoring it is safe, or refused with a ``ValueError`` that names it. Unknown keys are
refused too (a typo such as ``"stgae"`` must not quietly train with stage 0). Dotted paths name
nested keys, e.g. ``zero_optimization.sub_group_size``.

Used (-> ZeroConfig field)::

    zero_optimization.stage                        -> stage
    zero_optimization.reduce_bucket_size           -> reduce_bucket_size       (5e8 -> int; "auto" = default)
    zero_optimization.allgather_bucket_size        -> allgather_bucket_size    (same)
    zero_optimization.stage3_prefetch_bucket_size  -> prefetch_bucket_size     (same)
    zero_optimization.overlap_comm / reduce_scatter -> overlap_comm / reduce_scatter
    zero_optimization.offload_optimizer / offload_param {device, nvme_path, pin_memory} -> OffloadConfig
    zero_optimization.cpu_offload / cpu_offload_param / cpu_offload_use_pin_memory (deprecated
        DeepSpeed spellings) -> the same OffloadConfig fields
    zero_optimization.zeroray_units                -> units                    (zeroray's own)
    zero_optimization.all_gather_by_broadcast      -> all_gather_by_broadcast  (zeroray's own)
    fp16.enabled / bf16.enabled (alias bfloat16)   -> precision "fp16" | "bf16" | "fp32"
    fp16.{loss_scale, initial_scale_power, loss_scale_window, hysteresis, min_loss_scale}
    train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps, gradient_clipping
        ("auto" = not given)
    optimizer {type, params}, scheduler {type, params} -> dicts, checked by zeroray.engine.named_optim

Ignored with a warning (no effect on zeroray's numerics or memory, or replaced by zeroray's own way)::

    key                                         why
    steps_per_print, wall_clock_breakdown,      logging / profiling only; zeroray reports through
    memory_breakdown, dump_state, timers,       its own metrics
    tensorboard, wandb, csv_monitor, comet,
    comms_logger, flops_profiler
    zero_allow_untested_optimizer,              zeroray shards any torch optimizer
    zero_force_ds_cpu_optimizer
    zero_allow_comm_data_type_fp32              only an allowance for communication_data_type
    dataloader_drop_last                        zeroray builds no data loader
    checkpoint, aio, autotuning, compile,       DeepSpeed checkpoint-format / NVMe-I/O / tuner /
    graph_harvesting                            compile knobs; zeroray's checkpoints load at any size
    activation_checkpointing (without           zeroray does not configure checkpointing: use
      partitioning / CPU checkpointing)         torch.utils.checkpoint in the model
    <feature>.enabled = false blocks            disabled features (elasticity, amp, nebula, ...)
    fp16.auto_cast                              zeroray does not cast inputs; cast them yourself
    fp16.consecutive_hysteresis                 zeroray's loss scaler resets hysteresis DeepSpeed's
                                                default way (not per consecutive step)
    bf16.immediate_grad_update,                 DeepSpeed bf16-optimizer scheduling details
    bf16.check_grad_overflow
    zero_optimization.contiguous_gradients      zeroray always uses flat contiguous grad buffers
    zero_optimization.allgather_partitions      zeroray always all-gathers (see all_gather_by_broadcast)
    zero_optimization.round_robin_gradients,    CPU/NVMe offload tuning
      sub_group_size, offload_*.{buffer_count,
      buffer_size, max_in_cpu, fast_init,
      pipeline, pipeline_read, pipeline_write,
      cpuadam_cores_perc}
    optimizer.legacy_fusion                     DeepSpeed kernel choice
    zero_optimization.stage3_max_live_parameters, stage3_max_reuse_distance,
      stage3_param_persistence_threshold, stage3_model_persistence_threshold,
      stage3_module_granularity_threshold, stage3_use_all_reduce_for_fetch_params,
      stage3_allgather_sequential, stage3_partition_stream_chunk_size, memory_efficient_linear,
      use_multi_rank_bucket_allreduce, override_module_apply, log_trace_cache_warnings,
      enable_sanity_checks, pipeline_loading_checkpoint, leaf_module
                                                DeepSpeed stage-3 fetch heuristics; zeroray gathers
                                                whole units (zeroray_units) with bucketed prefetch
    zero_optimization.stage3_gather_16bit_weights_on_model_save (and the fp16 spelling)
                                                zeroray checkpoints hold logical tensors; export
                                                gathers them
    zero_optimization.load_from_fp32_weights    zeroray always restores the fp32 master copy
    zero_optimization.elastic_checkpoint,       zeroray checkpoints load at any world size
      ignore_unused_parameters                  (stage-2 check of DeepSpeed's hooks only)

Refused with ValueError (would change the run and zeroray cannot do it), accepted silently when the
value is DeepSpeed's "off" default::

    amp, elasticity, hybrid_engine, nebula, torch_autocast, data_efficiency, curriculum_learning,
      quantize_training, eigenvalue, progressive_layer_drop (when "enabled": true)
    compression_training, sparse_attention, pipeline, tensor_parallel, weight_quantization
      (whenever present)
    activation_checkpointing.partition_activations / cpu_checkpointing = true
    prescale_gradients = true, gradient_predivide_factor != 1, sparse_gradients = true,
    communication_data_type, seq_parallel_communication_data_type, data_types.grad_accum_dtype
      (not null), sequence_parallel_size != 1, use_data_before_expert_parallel_ = true
    fp16.fp16_master_weights_and_grads, bf16.bf16_master_weights_and_grads,
      bf16.bf16_optimizer_states = true
    zero_optimization.zero_quantized_weights / zero_quantized_nontrainable_weights /
      zero_quantized_gradients / mics_hierarchical_params_gather / legacy_stage1 = true,
      zero_hpz_partition_size != 1, mics_shard_size != -1, zeropp_loco_param, zenflow (not null),
      offload_optimizer.ratio != 1, offload_optimizer.super_offload = true
    fp16.enabled / bf16.enabled = "auto" (no trainer to resolve it), "auto" in optimizer/scheduler params
    any key not listed here
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

from zeroray.config import CommConfig, LossScaleConfig, OffloadConfig, ZeroConfig

__all__ = ["parse_deepspeed"]

AUTO = "auto"

_LOGGING = "logging/profiling only; zeroray reports through its own metrics"
_OFFLOAD_TUNING = "CPU/NVMe offload tuning knob"
_STAGE3_HEURISTIC = (
    "DeepSpeed stage-3 fetch heuristic; zeroray gathers whole units (zeroray_units) with bucketed prefetch"
)

# Dotted key -> why ignoring it leaves zeroray's numerics and memory as the user expects.
_IGNORED: dict[str, str] = {
    "steps_per_print": _LOGGING,
    "wall_clock_breakdown": _LOGGING,
    "memory_breakdown": _LOGGING,
    "dump_state": _LOGGING,
    "timers": _LOGGING,
    "tensorboard": _LOGGING,
    "wandb": _LOGGING,
    "csv_monitor": _LOGGING,
    "comet": _LOGGING,
    "comms_logger": _LOGGING,
    "flops_profiler": _LOGGING,
    "zero_allow_untested_optimizer": "zeroray shards any torch optimizer",
    "zero_force_ds_cpu_optimizer": "zeroray uses the torch optimizer it is given",
    "zero_allow_comm_data_type_fp32": "only an allowance for communication_data_type, which zeroray does not use",
    "dataloader_drop_last": "zeroray builds no data loader",
    "checkpoint": "DeepSpeed checkpoint-format options; zeroray checkpoints load at any world size and stage",
    "aio": "NVMe I/O tuning for DeepSpeed's offload",
    "autotuning": "zeroray has no autotuner; the config is used as written",
    "compile": "zeroray does not compile the model; call torch.compile yourself",
    "graph_harvesting": "CUDA-graph knob of DeepSpeed's engine; no effect on numerics",
    "optimizer.legacy_fusion": "DeepSpeed kernel choice; no effect on numerics",
    "fp16.auto_cast": "zeroray does not cast the model's inputs; cast them to fp16 yourself",
    "fp16.consecutive_hysteresis": "zeroray's loss scaler uses DeepSpeed's default hysteresis rule",
    "bf16.immediate_grad_update": "DeepSpeed bf16-optimizer scheduling detail; no effect on numerics",
    "bf16.check_grad_overflow": "DeepSpeed bf16-optimizer debug check",
    "zero_optimization.contiguous_gradients": "zeroray always uses flat contiguous gradient buffers",
    "zero_optimization.allgather_partitions": "zeroray always all-gathers (see all_gather_by_broadcast)",
    "zero_optimization.round_robin_gradients": _OFFLOAD_TUNING,
    "zero_optimization.sub_group_size": _OFFLOAD_TUNING,
    "zero_optimization.stage3_max_live_parameters": _STAGE3_HEURISTIC,
    "zero_optimization.stage3_max_reuse_distance": _STAGE3_HEURISTIC,
    "zero_optimization.stage3_param_persistence_threshold": _STAGE3_HEURISTIC,
    "zero_optimization.stage3_model_persistence_threshold": _STAGE3_HEURISTIC,
    "zero_optimization.stage3_module_granularity_threshold": _STAGE3_HEURISTIC,
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": _STAGE3_HEURISTIC,
    "zero_optimization.stage3_allgather_sequential": _STAGE3_HEURISTIC,
    "zero_optimization.stage3_partition_stream_chunk_size": _STAGE3_HEURISTIC,
    "zero_optimization.memory_efficient_linear": _STAGE3_HEURISTIC,
    "zero_optimization.use_multi_rank_bucket_allreduce": _STAGE3_HEURISTIC,
    "zero_optimization.override_module_apply": "zeroray never patches nn.Module",
    "zero_optimization.log_trace_cache_warnings": _LOGGING,
    "zero_optimization.enable_sanity_checks": "DeepSpeed internal debug checks",
    "zero_optimization.pipeline_loading_checkpoint": "DeepSpeed pipeline-engine checkpoint loading",
    "zero_optimization.leaf_module": _STAGE3_HEURISTIC,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": (
        "zeroray checkpoints hold logical tensors; export gathers them"
    ),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": (
        "zeroray checkpoints hold logical tensors; export gathers them"
    ),
    "zero_optimization.load_from_fp32_weights": "zeroray always restores the fp32 master copy",
    "zero_optimization.elastic_checkpoint": "zeroray checkpoints load at any world size",
    "zero_optimization.ignore_unused_parameters": "a check of DeepSpeed's stage-2 hooks; zeroray has no such check",
}
for _block in ("offload_optimizer", "offload_param"):
    for _k in (
        "buffer_count",
        "buffer_size",
        "max_in_cpu",
        "fast_init",
        "pipeline",
        "pipeline_read",
        "pipeline_write",
        "cpuadam_cores_perc",
    ):
        _IGNORED[f"zero_optimization.{_block}.{_k}"] = _OFFLOAD_TUNING


def _off(v: Any) -> bool:
    return v is False or v is None


# Dotted key -> (why zeroray refuses it, predicate for the harmless "off" value accepted silently).
_REFUSED: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "prescale_gradients": ("zeroray averages gradients after reduction only", _off),
    "gradient_predivide_factor": ("zeroray does not pre-divide gradients", lambda v: v in (1, 1.0)),
    "sparse_gradients": ("zeroray reduces dense gradients only", _off),
    "communication_data_type": ("zeroray communicates in the compute dtype", lambda v: v is None),
    "seq_parallel_communication_data_type": ("zeroray has no sequence parallelism", lambda v: v is None),
    "sequence_parallel_size": ("zeroray has no sequence parallelism", lambda v: v == 1),
    "use_data_before_expert_parallel_": ("zeroray has no expert parallelism", _off),
    "compression_training": ("zeroray does not compress models", lambda v: False),
    "sparse_attention": ("zeroray does not replace attention kernels", lambda v: False),
    "pipeline": ("zeroray has no pipeline parallelism", lambda v: False),
    "tensor_parallel": ("zeroray has no tensor parallelism", lambda v: False),
    "weight_quantization": ("zeroray does not quantize weights", lambda v: False),
    "data_types.grad_accum_dtype": (
        "zeroray accumulates gradients in the compute dtype",
        lambda v: v is None,
    ),
    "activation_checkpointing.partition_activations": (
        "zeroray does not partition activations; use torch.utils.checkpoint",
        _off,
    ),
    "activation_checkpointing.cpu_checkpointing": ("zeroray does not offload activations", _off),
    "fp16.fp16_master_weights_and_grads": ("zeroray keeps fp32 master weights", _off),
    "bf16.bf16_master_weights_and_grads": ("zeroray keeps fp32 master weights", _off),
    "bf16.bf16_optimizer_states": ("zeroray keeps fp32 optimizer states", _off),
    "zero_optimization.zero_quantized_weights": ("ZeRO++ quantized weights are not implemented", _off),
    "zero_optimization.zero_quantized_nontrainable_weights": (
        "ZeRO++ quantized weights are not implemented",
        _off,
    ),
    "zero_optimization.zero_quantized_gradients": ("ZeRO++ quantized gradients are not implemented", _off),
    "zero_optimization.zero_hpz_partition_size": (
        "ZeRO++ hierarchical partitioning is not implemented",
        lambda v: v in (0, 1),
    ),
    "zero_optimization.zeropp_loco_param": ("ZeRO++ LoCo is not implemented", lambda v: v is None),
    "zero_optimization.mics_shard_size": (
        "MiCS sub-group sharding is not implemented",
        lambda v: v in (-1, 0),
    ),
    "zero_optimization.mics_hierarchical_params_gather": ("MiCS is not implemented", _off),
    "zero_optimization.legacy_stage1": ("only zeroray's own stage 1 exists", _off),
    "zero_optimization.zenflow": ("ZenFlow is not implemented", lambda v: v is None),
    "zero_optimization.offload_optimizer.ratio": (
        "partial offload is not implemented",
        lambda v: v in (1, 1.0),
    ),
    "zero_optimization.offload_optimizer.super_offload": ("SuperOffload is not implemented", _off),
}

# Top-level blocks with an "enabled" switch: refused when enabled, ignored with a warning when not.
_FEATURES: dict[str, str] = {
    "amp": "NVIDIA apex AMP is not supported; use fp16 or bf16",
    "elasticity": "DeepSpeed elasticity rewrites batch sizes; zeroray resizes through its Ray trainer",
    "hybrid_engine": "the RLHF hybrid engine is not implemented",
    "nebula": "zeroray writes its own checkpoints",
    "torch_autocast": "zeroray casts parameters (fp16/bf16), it does not autocast",
    "data_efficiency": "data sampling/routing is not implemented",
    "curriculum_learning": "curriculum learning is not implemented",
    "quantize_training": "quantized training is not implemented",
    "eigenvalue": "eigenvalue computation is not implemented",
    "progressive_layer_drop": "progressive layer drop is not implemented",
}

_TOP_USED = (
    "zero_optimization",
    "fp16",
    "bf16",
    "bfloat16",
    "optimizer",
    "scheduler",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "activation_checkpointing",
    "data_types",
)
_ZERO_USED = (
    "stage",
    "reduce_bucket_size",
    "allgather_bucket_size",
    "stage3_prefetch_bucket_size",
    "overlap_comm",
    "reduce_scatter",
    "offload_optimizer",
    "offload_param",
    "cpu_offload",
    "cpu_offload_param",
    "cpu_offload_use_pin_memory",
    "zeroray_units",
    "all_gather_by_broadcast",
)
_FP16_USED = (
    "enabled",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "min_loss_scale",
)
_OFFLOAD_USED = ("device", "nvme_path", "pin_memory")
_ACTIVATION_CKPT_KEYS = (
    "partition_activations",
    "contiguous_memory_optimization",
    "cpu_checkpointing",
    "number_checkpoints",
    "synchronize_checkpoint_boundary",
    "profile",
)


def _known_at(prefix: str, used: tuple[str, ...]) -> list[str]:
    """All keys zeroray knows directly under ``prefix`` (for did-you-mean suggestions)."""
    names = set(used)
    for table in (_IGNORED, _REFUSED):
        for dotted in table:
            head, _, last = dotted.rpartition(".")
            if head == prefix:
                names.add(last)
    if not prefix:
        names.update(_FEATURES)
    return sorted(names)


def _check_rest(block: dict[str, Any], prefix: str, used: tuple[str, ...], shown: str | None = None) -> None:
    """Warn about ignorable keys, raise on refused or unknown ones; ``used`` keys are skipped.

    ``prefix`` is the canonical dotted path used in the tables; ``shown`` the one the user wrote
    (they differ only for the ``bfloat16`` alias of ``bf16``).
    """
    shown = prefix if shown is None else shown
    for key, value in block.items():
        if key in used:
            continue
        canonical = f"{prefix}.{key}" if prefix else key
        dotted = f"{shown}.{key}" if shown else key
        if canonical in _IGNORED:
            _warn(dotted, _IGNORED[canonical])
        elif canonical in _REFUSED:
            why, harmless = _REFUSED[canonical]
            if not harmless(value):
                raise ValueError(
                    f"DeepSpeed config key '{dotted}' = {value!r} is not supported by zeroray: {why}"
                )
        elif not prefix and key in _FEATURES:
            if isinstance(value, dict) and not value.get("enabled", False):
                _warn(key, "the block is disabled")
            else:
                raise ValueError(
                    f"DeepSpeed config key '{key}' is not supported by zeroray: {_FEATURES[key]}"
                )
        else:
            close = difflib.get_close_matches(key, _known_at(prefix, used), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ValueError(f"unknown DeepSpeed config key '{dotted}'{hint}")


def _warn(dotted: str, why: str) -> None:
    # Point the warning at the user's call (parse_deepspeed / ZeroConfig.from_deepspeed / coerce).
    level, frame = 2, sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") in (__name__, "zeroray.config"):
        level, frame = level + 1, frame.f_back
    warnings.warn(f"zeroray ignores DeepSpeed config key '{dotted}': {why}", UserWarning, stacklevel=level)


# ------------------------------------------------------------------------------------- values
def _block(parent: dict[str, Any], key: str, dotted: str) -> dict[str, Any]:
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"DeepSpeed config key '{dotted}' must be an object, got {value!r}")
    return value


def _bool(value: Any, dotted: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"DeepSpeed config key '{dotted}' must be true or false, got {value!r}")
    return value


def _int(value: Any, dotted: str, *, auto_ok: bool = False) -> int | None:
    """An integer, also from a whole float (JSON 5e8); ``"auto"`` -> None where allowed."""
    if auto_ok and value == AUTO:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"DeepSpeed config key '{dotted}' must be an integer, got {value!r}")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"DeepSpeed config key '{dotted}' must be a whole number, got {value!r}")
        value = int(value)
    return value


def _float(value: Any, dotted: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"DeepSpeed config key '{dotted}' must be a number, got {value!r}")
    return float(value)


def _enabled(block: dict[str, Any], dotted: str) -> bool:
    value = block.get("enabled", False)
    if value == AUTO:
        raise ValueError(
            f"DeepSpeed config key '{dotted}.enabled' is 'auto': zeroray has no trainer arguments to "
            "resolve it; set true or false"
        )
    return _bool(value, f"{dotted}.enabled")


# ------------------------------------------------------------------------------------- blocks
def _load(config: dict[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    if isinstance(config, dict):
        return config
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"a DeepSpeed config is a dict or a path to a JSON file, got {type(config).__name__}")
    path = os.fspath(config)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"DeepSpeed config file not found: {path}")
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"DeepSpeed config file {path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"DeepSpeed config file {path} must hold a JSON object, got {type(data).__name__}")
    return data


def _offload(zero: dict[str, Any], key: str) -> OffloadConfig | None:
    if zero.get(key) is None:
        return None
    dotted = f"zero_optimization.{key}"
    block = _block(zero, key, dotted)
    _check_rest(block, dotted, _OFFLOAD_USED)
    device = block.get("device", "none")
    if device is None:
        device = "none"
    if device not in ("none", "cpu", "nvme"):
        raise ValueError(
            f"DeepSpeed config key '{dotted}.device' must be 'none', 'cpu' or 'nvme', got {device!r}"
        )
    nvme_path = block.get("nvme_path")
    if nvme_path is not None and not isinstance(nvme_path, str):
        raise ValueError(
            f"DeepSpeed config key '{dotted}.nvme_path' must be a string path, got {nvme_path!r}"
        )
    pin = _bool(block.get("pin_memory", False), f"{dotted}.pin_memory")
    return OffloadConfig(device=device, nvme_path=nvme_path, pin_memory=pin)


def _zero(raw: dict[str, Any], out: dict[str, Any]) -> None:
    if isinstance(raw.get("zero_optimization"), bool):
        raise ValueError(
            "DeepSpeed config key 'zero_optimization' = true/false is DeepSpeed's deprecated form; "
            'write {"stage": N}'
        )
    zero = _block(raw, "zero_optimization", "zero_optimization")
    _check_rest(zero, "zero_optimization", _ZERO_USED)
    if "stage" in zero:
        stage = _int(zero["stage"], "zero_optimization.stage")
        if stage not in (0, 1, 2, 3):
            raise ValueError(
                f"DeepSpeed config key 'zero_optimization.stage' must be 0, 1, 2 or 3, got {stage}"
            )
        out["stage"] = stage
    for key, field in (
        ("reduce_bucket_size", "reduce_bucket_size"),
        ("allgather_bucket_size", "allgather_bucket_size"),
        ("stage3_prefetch_bucket_size", "prefetch_bucket_size"),
    ):
        if key in zero:
            # "auto" (Hugging Face) = zeroray's default size.
            size = _int(zero[key], f"zero_optimization.{key}", auto_ok=True)
            if size is not None:
                if size < 1:
                    raise ValueError(
                        f"DeepSpeed config key 'zero_optimization.{key}' must be >= 1, got {size}"
                    )
                out[field] = size
    if "overlap_comm" in zero and zero["overlap_comm"] is not None:
        out["overlap_comm"] = _bool(zero["overlap_comm"], "zero_optimization.overlap_comm")
    if "reduce_scatter" in zero and zero["reduce_scatter"] is not None:
        out["reduce_scatter"] = _bool(zero["reduce_scatter"], "zero_optimization.reduce_scatter")
    if "all_gather_by_broadcast" in zero and zero["all_gather_by_broadcast"] is not None:
        out["all_gather_by_broadcast"] = _bool(
            zero["all_gather_by_broadcast"], "zero_optimization.all_gather_by_broadcast"
        )
    if "zeroray_units" in zero and zero["zeroray_units"] is not None:
        units = zero["zeroray_units"]
        if not isinstance(units, list) or not all(isinstance(u, str) for u in units):
            raise ValueError(
                f"DeepSpeed config key 'zero_optimization.zeroray_units' must be a list of module or class "
                f"names, got {units!r}"
            )
        out["units"] = list(units)

    # Deprecated DeepSpeed spellings map onto the offload blocks (giving both is ambiguous).
    legacy = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
    pin_legacy = zero.get("cpu_offload_use_pin_memory")
    if pin_legacy is not None:
        pin_legacy = _bool(pin_legacy, "zero_optimization.cpu_offload_use_pin_memory")
    legacy_used = False
    for key in ("offload_optimizer", "offload_param"):
        off = _offload(zero, key)
        old = next(k for k, v in legacy.items() if v == key)
        if zero.get(old) is not None and _bool(zero[old], f"zero_optimization.{old}"):
            if off is not None:
                raise ValueError(
                    f"DeepSpeed config keys 'zero_optimization.{old}' and 'zero_optimization.{key}' are both "
                    f"given; use only '{key}'"
                )
            off = OffloadConfig(device="cpu", pin_memory=bool(pin_legacy))
            legacy_used = True
        if off is not None:
            out[key] = off
    if pin_legacy is not None and not legacy_used:
        _warn(
            "zero_optimization.cpu_offload_use_pin_memory",
            "it only applies with cpu_offload / cpu_offload_param",
        )


def _precision(raw: dict[str, Any], out: dict[str, Any]) -> None:
    if "bf16" in raw and "bfloat16" in raw:
        raise ValueError("DeepSpeed config keys 'bf16' and 'bfloat16' are both given; use only 'bf16'")
    bf_key = "bfloat16" if "bfloat16" in raw else "bf16"
    bf16 = _block(raw, bf_key, bf_key)
    fp16 = _block(raw, "fp16", "fp16")
    _check_rest(bf16, "bf16", ("enabled",), shown=bf_key)
    _check_rest(fp16, "fp16", _FP16_USED)
    fp16_on = _enabled(fp16, "fp16")
    bf16_on = _enabled(bf16, bf_key)
    if fp16_on and bf16_on:
        raise ValueError("fp16 and bf16 are both enabled; enable at most one")
    out["precision"] = "fp16" if fp16_on else "bf16" if bf16_on else "fp32"
    if "loss_scale" in fp16:
        out["loss_scale"] = _float(fp16["loss_scale"], "fp16.loss_scale")
    if "min_loss_scale" in fp16:
        out["min_loss_scale"] = _float(fp16["min_loss_scale"], "fp16.min_loss_scale")
    for key in ("initial_scale_power", "loss_scale_window", "hysteresis"):
        if key in fp16:
            out[key] = _int(fp16[key], f"fp16.{key}")
    # Checked here too so that the error names the DeepSpeed key, not the ZeroConfig field.
    for key, ok, rule in (
        ("loss_scale", lambda v: v >= 0, ">= 0 (0 = dynamic)"),
        ("min_loss_scale", lambda v: v > 0, "> 0"),
        ("loss_scale_window", lambda v: v >= 1, ">= 1"),
        ("hysteresis", lambda v: v >= 1, ">= 1"),
    ):
        if key in out and not ok(out[key]):
            raise ValueError(f"DeepSpeed config key 'fp16.{key}' must be {rule}, got {out[key]}")


def _batch(raw: dict[str, Any], out: dict[str, Any]) -> None:
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if key in raw and raw[key] is not None:
            value = _int(raw[key], key, auto_ok=True)  # "auto" (Hugging Face) = not given
            if value is not None:
                if value < 1:
                    raise ValueError(f"DeepSpeed config key '{key}' must be a positive integer, got {value}")
                out[key] = value
    clip = raw.get("gradient_clipping")
    if clip is not None and clip != AUTO:
        clip = _float(clip, "gradient_clipping")
        if clip < 0:
            raise ValueError(f"DeepSpeed config key 'gradient_clipping' must be >= 0 (0 = off), got {clip}")
        out["gradient_clipping"] = clip


def _named(raw: dict[str, Any], out: dict[str, Any]) -> None:
    # Imported here: zeroray.engine.named_optim imports torch, which a config-only import should not need.
    from zeroray.engine.named_optim import validate_optimizer_spec, validate_scheduler_spec

    for key, validate in (("optimizer", validate_optimizer_spec), ("scheduler", validate_scheduler_spec)):
        block = raw.get(key)
        if block is None:
            continue
        block = _block(raw, key, key)
        spec = {k: block[k] for k in ("type", "params") if k in block}
        _check_rest(block, key, ("type", "params"))
        validate(spec)
        out[key] = {"type": spec["type"], "params": dict(spec.get("params") or {})}


def _activation_checkpointing(raw: dict[str, Any]) -> None:
    block = _block(raw, "activation_checkpointing", "activation_checkpointing")
    if not block:
        return
    for key in block:
        if key not in _ACTIVATION_CKPT_KEYS:
            raise ValueError(f"unknown DeepSpeed config key 'activation_checkpointing.{key}'")
    _check_rest(
        block,
        "activation_checkpointing",
        tuple(k for k in _ACTIVATION_CKPT_KEYS if f"activation_checkpointing.{k}" not in _REFUSED),
    )
    _warn("activation_checkpointing", "zeroray does not configure checkpointing; use torch.utils.checkpoint")


def _data_types(raw: dict[str, Any]) -> None:
    _check_rest(_block(raw, "data_types", "data_types"), "data_types", ())


def parse_deepspeed(config: dict[str, Any] | str | os.PathLike[str]) -> ZeroConfig:
    """Build a ZeroConfig from a DeepSpeed config dict or JSON file; see the module doc for each key."""
    raw = _load(config)
    _check_rest(raw, "", _TOP_USED)
    out: dict[str, Any] = {}
    _zero(raw, out)
    _precision(raw, out)
    _batch(raw, out)
    _named(raw, out)
    _activation_checkpointing(raw)
    _data_types(raw)
    nested: dict[str, Any] = {}
    for sub, keys in (("comm", CommConfig), ("loss_scaling", LossScaleConfig)):
        part = {f.name: out.pop(f.name) for f in dataclasses.fields(keys) if f.name in out}
        if part:
            nested[sub] = part
    return ZeroConfig(**out, **nested)
