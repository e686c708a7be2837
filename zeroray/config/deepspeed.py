"""Read a DeepSpeed JSON config: one table of its keys, and a small walker over it.

Every key a user may write is in :data:`TABLE` as one of

- :class:`Field`: used. Its value is converted (JSON ``5e8`` -> ``500000000``, ``true`` -> ``"fp16"``)
  and placed at a :class:`~zeroray.config.ZeroConfig` path; ``"auto"`` is left to
  :mod:`zeroray.config.hf_auto`. Values are judged only by ``ZeroConfig.validate``; its errors are mapped
  back to the key (:meth:`Reading.key_for`).
- :class:`Ignored`: ignored, with a WARNING line on the ``"zeroray"`` logger naming the key and why that is safe.
- :class:`Refused`: refused with an error naming the key, unless the value is one of ``unless``
  (DeepSpeed's "off" default), which is accepted silently.
- :class:`Feature`: a block with an ``enabled`` switch: refused when enabled, ignored with a warning
  when disabled.

Keys that are not in the table are refused with a did-you-mean: a typo such as ``"stgae"`` must not
quietly train with stage 0. ``null`` means "not given". The key reference in docs/configuration.md is generated
from this table (``zeroray/config/reference.py``).
"""

from __future__ import annotations

import difflib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from zeroray.config.hf_auto import NOT_GIVEN

__all__ = ["AUTO", "TABLE", "DeepSpeedConfigError", "Feature", "Field", "Ignored", "Reading", "Refused", "read_deepspeed"]

logger = logging.getLogger("zeroray")

AUTO = "auto"
SKIP: Any = object()  # a converter's answer for "this value sets nothing" (e.g. "enabled": false)


class _Bad(ValueError):
    """A value a converter cannot turn into a ZeroConfig value (its type is wrong)."""


def _as_is(v: Any) -> Any:
    return v


def _int(v: Any) -> Any:
    """JSON writes sizes as ``5e8``: a whole float becomes an int; anything else is left to validate."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _size_or_off(*off: int) -> Callable[[Any], Any]:
    """A group size whose DeepSpeed "off" values (``mics_shard_size`` -1 and 0, ``zero_hpz_partition_size``
    1 and 0) become None."""
    def convert(v: Any) -> Any:
        v = _int(v)
        return None if any(_same(v, o) for o in off) else v

    return convert


def _negate(v: Any) -> Any:
    if not isinstance(v, bool):
        raise _Bad(f"must be true or false, got {v!r}")
    return not v


def _number(v: Any) -> Any:
    return float(v) if isinstance(v, int) and not isinstance(v, bool) else v


def _copy(v: Any) -> Any:
    return dict(v) if isinstance(v, dict) else v


def _switch(on: Any) -> Callable[[Any], Any]:
    """``true`` -> ``on``, ``false`` -> nothing."""

    def convert(v: Any) -> Any:
        if not isinstance(v, bool):
            raise _Bad(f"must be true or false, got {v!r}")
        return on if v else SKIP

    return convert


_DTYPES = {
    **dict.fromkeys(("fp32", "float32", "float", "torch.float32"), "fp32"),
    **dict.fromkeys(("fp16", "float16", "half", "torch.float16"), "fp16"),
    **dict.fromkeys(("bf16", "bfloat16", "bfloat", "bfp16", "torch.bfloat16"), "bf16"),
}


def _dtype(v: Any) -> Any:
    """DeepSpeed's dtype spellings (``"float32"``, ``"bfp16"``, any case) -> ``"fp32"`` / ``"bf16"`` / ``"fp16"``."""
    return _DTYPES.get(v.lower(), v) if isinstance(v, str) else v


# ------------------------------------------------------------------------------------ entries
@dataclass(frozen=True)
class Field:
    """A key zeroray uses: ``convert`` its value and put it at ``path`` (or several paths) in ZeroConfig.

    ``whole``: the value is a dict taken as it is (``optimizer.params``); an ``"auto"`` inside it is
    resolved per key (``optimizer.params.lr``).
    """

    path: str | tuple[str, ...]
    convert: Callable[[Any], Any] = _as_is
    note: str = ""
    whole: bool = False

    @property
    def paths(self) -> tuple[str, ...]:
        return (self.path,) if isinstance(self.path, str) else self.path


@dataclass(frozen=True)
class Ignored:
    why: str


def _same(a: Any, b: Any) -> bool:
    return a == b and isinstance(a, bool) == isinstance(b, bool)


@dataclass(frozen=True)
class Refused:
    why: str
    unless: tuple[Any, ...] = (False, None)  # DeepSpeed's "off" values, accepted silently

    def harmless(self, v: Any) -> bool:
        return any(_same(v, u) for u in self.unless)


@dataclass(frozen=True)
class Feature:
    why: str


Entry = Field | Ignored | Refused | Feature

_LOGGING = "logging/profiling only; zeroray reports through its own metrics"
_OFFLOAD_TUNING = "CPU/NVMe offload tuning knob"
_STAGE3 = "DeepSpeed stage-3 fetch heuristic; zeroray gathers whole units (zeroray_units) with bucketed prefetch"
_EXPORT = "zeroray checkpoints hold logical tensors; export gathers them"
_CKPT = "zeroray does not configure activation checkpointing; use torch.utils.checkpoint in the model"

TABLE: dict[str, Entry] = {
    # ---- batch and step
    "train_batch_size": Field("train_batch_size", _int),
    "train_micro_batch_size_per_gpu": Field("train_micro_batch_size_per_gpu", _int),
    "gradient_accumulation_steps": Field("gradient_accumulation_steps", _int),
    "gradient_clipping": Field("gradient_clipping", _number),
    # ---- ZeRO
    "zero_optimization.stage": Field("stage", _int),
    "zero_optimization.reduce_bucket_size": Field("comm.reduce_bucket_size", _int),
    "zero_optimization.allgather_bucket_size": Field("comm.allgather_bucket_size", _int),
    "zero_optimization.stage3_prefetch_bucket_size": Field("comm.prefetch_bucket_size", _int),
    "zero_optimization.overlap_comm": Field("comm.overlap_comm"),
    "zero_optimization.reduce_scatter": Field("comm.reduce_scatter"),
    "zero_optimization.all_gather_by_broadcast": Field("comm.all_gather_by_broadcast", note="zeroray's own"),
    "zero_optimization.zeroray_units": Field("units", note="zeroray's own"),
    "zero_optimization.zero_hpz_partition_size": Field(
        "hpz_partition_size", _size_or_off(1, 0), note="ZeRO++ hpZ at stage 3; 0 or 1 = off; \"auto\" = the ranks of a node"
    ),
    "zero_optimization.mics_shard_size": Field(
        "shard_group_size", _size_or_off(-1, 0), note="hybrid sharding at stages 1-3; -1 = off; \"auto\" = the ranks of a node"
    ),
    "zero_optimization.zeroray_trim_host_heap": Field("trim_host_heap", note="zeroray's own"),
    "zero_optimization.zero_quantized_weights": Field("quantize.weights", note="ZeRO++ qwZ at stage 3: int8 parameter gathers (forward and backward)"),
    "zero_optimization.zero_quantized_gradients": Field(
        "quantize.gradients", note="ZeRO++ qgZ at stages 2-3: quantized all-to-all gradient reduction"
    ),
    "zero_optimization.zeroray_quantize_block_size": Field("quantize.block_size", _int, note="zeroray's own"),
    "zero_optimization.zeroray_quantize_gradient_bits": Field("quantize.gradient_bits", _int, note="zeroray's own"),
    "zero_optimization.zeroray_quantize_gradient_codes": Field(
        "quantize.gradient_codes", note="zeroray's own: 'int' (DeepSpeed's) or 'fp8' (float8 e4m3) codes for qgZ"
    ),
    "zero_optimization.zeroray_quantize_exact_backward_weights": Field(
        "quantize.exact_backward_weights", note="zeroray's own: True gathers the backward's weights in full precision under qwZ"
    ),
    "zero_optimization.zeroray_quantize_weight_rounding": Field(
        "quantize.weight_rounding", note="zeroray's own: 'nearest' (DeepSpeed's) or 'stochastic' rounding of qwZ's codes"
    ),
    "zero_optimization.zeroray_quantize_gradient_rounding": Field(
        "quantize.gradient_rounding", note="zeroray's own: 'nearest' (DeepSpeed's) or 'stochastic' rounding of qgZ's codes"
    ),
    "zero_optimization.zeroray_quantize_intra_node_gradients": Field(
        "quantize.intra_node_gradients", note="zeroray's own: False sends qgZ's stage inside the node in fp32 (the default on CPU), True quantizes it"
    ),
    "zero_optimization.offload_optimizer.device": Field("offload_optimizer.device"),
    "zero_optimization.offload_optimizer.nvme_path": Field("offload_optimizer.nvme_path"),
    "zero_optimization.offload_optimizer.pin_memory": Field("offload_optimizer.pin_memory"),
    "zero_optimization.offload_param.device": Field("offload_param.device"),
    "zero_optimization.offload_param.nvme_path": Field("offload_param.nvme_path"),
    "zero_optimization.offload_param.pin_memory": Field("offload_param.pin_memory"),
    "zero_optimization.offload_optimizer.buffer_count": Field("offload_optimizer.buffer_count", _int),
    "zero_optimization.offload_param.buffer_count": Field("offload_param.buffer_count", _int),
    "zero_optimization.sub_group_size": Field("sub_group_size", _int),
    "aio.block_size": Field("offload_io.block_size", _int),
    "aio.queue_depth": Field("offload_io.queue_depth", _int),
    "zero_optimization.cpu_offload": Field(
        "offload_optimizer.device", _switch("cpu"), note="deprecated spelling: true = offload_optimizer.device cpu"
    ),
    "zero_optimization.cpu_offload_param": Field(
        "offload_param.device", _switch("cpu"), note="deprecated spelling: true = offload_param.device cpu"
    ),
    "zero_optimization.cpu_offload_use_pin_memory": Field(
        ("offload_optimizer.pin_memory", "offload_param.pin_memory"), note="deprecated spelling of both pin_memory"
    ),
    # ---- precision
    "fp16.enabled": Field("precision.param_dtype", _switch("fp16"), note="true = fp16 parameters and gradients"),
    "fp16.loss_scale": Field("loss_scaling.loss_scale", _number),
    "fp16.initial_scale_power": Field("loss_scaling.initial_scale_power", _int),
    "fp16.loss_scale_window": Field("loss_scaling.loss_scale_window", _int),
    "fp16.hysteresis": Field("loss_scaling.hysteresis", _int),
    "fp16.min_loss_scale": Field("loss_scaling.min_loss_scale", _number),
    "bf16.enabled": Field("precision.param_dtype", _switch("bf16"), note="true = bf16 parameters and gradients"),
    "data_types.grad_accum_dtype": Field(
        "precision.reduce_dtype", _dtype, note="gradients reduced and accumulated in this dtype"
    ),
    "data_types.buffer_dtype": Field(
        "precision.buffer_dtype", _dtype, note="floating-point buffers cast to this dtype (default: kept as built)"
    ),
    "communication_data_type": Field("precision.reduce_dtype", _dtype, note="the same as data_types.grad_accum_dtype"),
    # ---- named optimizer and schedule
    "optimizer.type": Field("optimizer.type"),
    "optimizer.params": Field("optimizer.params", _copy, whole=True),
    "scheduler.type": Field("scheduler.type"),
    "scheduler.params": Field("scheduler.params", _copy, whole=True),
    # ---- ignored: no effect on zeroray's numerics or memory, or replaced by zeroray's own way
    **dict.fromkeys(
        (
            "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state", "timers", "tensorboard",
            "wandb", "csv_monitor", "comet", "comms_logger", "flops_profiler",
            "zero_optimization.log_trace_cache_warnings",
        ),
        Ignored(_LOGGING),
    ),
    "zero_allow_untested_optimizer": Ignored("zeroray shards any torch optimizer"),
    "zero_force_ds_cpu_optimizer": Ignored("zeroray uses the torch optimizer it is given"),
    "zero_allow_comm_data_type_fp32": Ignored("only an allowance for communication_data_type, which needs none"),
    "dataloader_drop_last": Ignored("zeroray builds no data loader"),
    "checkpoint": Ignored("DeepSpeed checkpoint-format options; zeroray checkpoints load at any world size and stage"),
    "aio.thread_count": Ignored("zeroray's swap I/O runs queue_depth requests on its own thread pool"),
    "aio.single_submit": Ignored("a libaio submission detail; zeroray's thread pool submits each request alone"),
    "aio.overlap_events": Ignored("a libaio detail; zeroray always overlaps swap reads and writes with the step"),
    "aio.use_gds": Refused("GPUDirect Storage is not implemented"),
    "autotuning": Ignored("zeroray has no autotuner; the config is used as written"),
    "compile.deepcompile": Field(
        "compile.enabled", note="true = torch.compile of each unit, the engine's hooks around it (not DeepCompile's passes)"
    ),
    "compile.disable": Field("compile.enabled", _negate, note="DeepSpeed's older spelling: false = compile each unit"),
    "compile.backend": Field("compile.backend", note="torch.compile's backend"),
    "compile.kwargs": Field("compile.kwargs", _copy, note="torch.compile's mode, fullgraph, dynamic, options"),
    **{
        f"compile.{k}": Ignored("a DeepCompile graph pass; zeroray compiles each unit and runs its own hooks around it")
        for k in ("free_activation", "free_activation_threshold", "offload_activation", "offload_opt_states",
                  "double_buffer", "symmetric_memory", "dump_graphs")
    },
    "graph_harvesting": Ignored("CUDA-graph knob of DeepSpeed's engine; no effect on numerics"),
    "optimizer.legacy_fusion": Ignored("DeepSpeed kernel choice; no effect on numerics"),
    "fp16.auto_cast": Ignored("zeroray does not cast the model's inputs; cast them to fp16 yourself"),
    "fp16.consecutive_hysteresis": Ignored("zeroray's loss scaler uses DeepSpeed's default hysteresis rule"),
    "bf16.immediate_grad_update": Ignored("DeepSpeed bf16-optimizer scheduling detail; no effect on numerics"),
    "bf16.check_grad_overflow": Ignored("DeepSpeed bf16-optimizer debug check"),
    "zero_optimization.contiguous_gradients": Ignored("zeroray always uses flat contiguous gradient buffers"),
    "zero_optimization.allgather_partitions": Ignored("zeroray always all-gathers (see all_gather_by_broadcast)"),
    "zero_optimization.round_robin_gradients": Ignored(_OFFLOAD_TUNING),
    **{
        f"zero_optimization.{block}.{knob}": Ignored(why)
        for block in ("offload_optimizer", "offload_param")
        for knob, why in (
            ("buffer_size", "zeroray sizes swap buffers by sub_group_size"),
            ("max_in_cpu", "zeroray keeps no parameter cache in host memory beside the swap buffers"),
            ("fast_init", "a DeepSpeed set-up shortcut; zeroray writes the swap files once at set-up either way"),
            ("pipeline", "zeroray always reads ahead and writes behind the optimizer step"),
            ("pipeline_read", "zeroray always reads ahead of the optimizer step"),
            ("pipeline_write", "zeroray always writes behind the optimizer step"),
            ("cpuadam_cores_perc", "zeroray steps with the torch optimizer on the threads torch uses"),
        )
    },
    **{
        f"zero_optimization.{k}": Ignored(_STAGE3)
        for k in (
            "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_param_persistence_threshold",
            "stage3_model_persistence_threshold", "stage3_module_granularity_threshold",
            "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential",
            "stage3_partition_stream_chunk_size", "memory_efficient_linear", "use_multi_rank_bucket_allreduce",
            "leaf_module",
        )
    },
    "zero_optimization.override_module_apply": Ignored("zeroray never patches nn.Module"),
    "zero_optimization.enable_sanity_checks": Ignored("DeepSpeed internal debug checks"),
    "zero_optimization.pipeline_loading_checkpoint": Ignored("DeepSpeed pipeline-engine checkpoint loading"),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": Ignored(_EXPORT),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": Ignored(_EXPORT),
    "zero_optimization.load_from_fp32_weights": Ignored("zeroray always restores the fp32 master copy"),
    "zero_optimization.elastic_checkpoint": Ignored("zeroray checkpoints load at any world size"),
    "zero_optimization.ignore_unused_parameters": Ignored(
        "a check of DeepSpeed's stage-2 hooks; zeroray has no such check"
    ),
    **{
        f"activation_checkpointing.{k}": Ignored(_CKPT)
        for k in ("contiguous_memory_optimization", "number_checkpoints", "synchronize_checkpoint_boundary", "profile")
    },
    # ---- refused: would change the run, and zeroray cannot do it
    "activation_checkpointing.partition_activations": Refused(
        "zeroray does not partition activations; use torch.utils.checkpoint"
    ),
    "activation_checkpointing.cpu_checkpointing": Refused("zeroray does not offload activations"),
    "prescale_gradients": Refused("zeroray averages gradients after reduction only"),
    "gradient_predivide_factor": Refused("zeroray does not pre-divide gradients", unless=(1, None)),
    "sparse_gradients": Refused("zeroray reduces dense gradients only"),
    "seq_parallel_communication_data_type": Refused("zeroray has no sequence parallelism", unless=(None,)),
    "sequence_parallel_size": Refused("zeroray has no sequence parallelism", unless=(1, None)),
    "use_data_before_expert_parallel_": Refused("zeroray has no expert parallelism"),
    "compression_training": Refused("zeroray does not compress models", unless=()),
    "sparse_attention": Refused("zeroray does not replace attention kernels", unless=()),
    "pipeline": Refused("zeroray has no pipeline parallelism", unless=()),
    "tensor_parallel": Refused("zeroray has no tensor parallelism", unless=()),
    "weight_quantization": Refused("zeroray does not quantize weights", unless=()),
    "fp16.fp16_master_weights_and_grads": Refused("zeroray keeps fp32 master weights"),
    "bf16.bf16_master_weights_and_grads": Refused("zeroray keeps fp32 master weights"),
    "bf16.bf16_optimizer_states": Refused("zeroray keeps fp32 optimizer states"),
    "zero_optimization.zero_quantized_nontrainable_weights": Refused(
        "zeroray keeps frozen weights in the compute dtype; only the gathers of stage 3 are quantized (zero_quantized_weights)"
    ),
    "zero_optimization.zeropp_loco_param": Refused("ZeRO++'s LoCo error feedback is not implemented", unless=(None,)),
    "zero_optimization.mics_hierarchical_params_gather": Refused(
        "zeroray's shard groups stay inside a node (shard_group_size), so their gathers need no hierarchy"
    ),
    "zero_optimization.legacy_stage1": Refused("only zeroray's own stage 1 exists"),
    "zero_optimization.zenflow": Refused("ZenFlow is not implemented", unless=(None,)),
    "zero_optimization.offload_optimizer.ratio": Refused("partial offload is not implemented", unless=(1, None)),
    "zero_optimization.offload_optimizer.super_offload": Refused("SuperOffload is not implemented"),
    # ---- blocks with an "enabled" switch: refused when enabled, ignored (with a warning) when disabled
    "amp": Feature("NVIDIA apex AMP is not supported; use fp16 or bf16"),
    "elasticity": Feature("DeepSpeed elasticity rewrites batch sizes; zeroray resizes through its Ray trainer"),
    "hybrid_engine": Feature("the RLHF hybrid engine is not implemented"),
    "nebula": Feature("zeroray writes its own checkpoints"),
    "torch_autocast": Feature("zeroray casts parameters (fp16/bf16), it does not autocast"),
    "data_efficiency": Feature("data sampling/routing is not implemented"),
    "curriculum_learning": Feature("curriculum learning is not implemented"),
    "quantize_training": Feature("quantized training is not implemented"),
    "eigenvalue": Feature("eigenvalue computation is not implemented"),
    "progressive_layer_drop": Feature("progressive layer drop is not implemented"),
}
# "bfloat16" is DeepSpeed's other spelling of the "bf16" block.
ALIASES = {"bfloat16": "bf16"}
# Objects the walker descends into: every proper prefix of a key.
BLOCKS = frozenset(k.rsplit(".", i)[0] for k in TABLE for i in range(1, k.count(".") + 1))


# ------------------------------------------------------------------------------------ errors
class DeepSpeedConfigError(ValueError):
    """Everything wrong with a DeepSpeed config, each problem naming its key, in one error."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems  # (key, line)
        self.keys = [k for k, _ in problems]
        lines = [line for _, line in problems]
        super().__init__(
            lines[0] if len(lines) == 1
            else f"{len(lines)} problems in the DeepSpeed config (all of them):\n  - " + "\n  - ".join(lines)
        )


# ------------------------------------------------------------------------------------ reading
@dataclass
class Reading:
    """What a DeepSpeed config says, before ``"auto"`` is resolved and before ZeroConfig judges it."""

    values: dict[str, tuple[str, Any]] = field(default_factory=dict)  # ZeroConfig path -> (key, value)
    autos: dict[str, str] = field(default_factory=dict)  # key whose value is "auto" -> ZeroConfig path
    problems: list[tuple[str, str]] = field(default_factory=list)  # (key, line)
    ignored: list[tuple[str, str]] = field(default_factory=list)  # (key, why ignoring it is safe)

    def problem(self, key: str, message: str) -> None:
        self.problems.append((key, f"DeepSpeed config key '{key}'{message}"))

    def set(self, path: str, key: str, value: Any) -> None:
        if path in self.values:
            other = self.values[path][0]
            self.problems.append(
                (key, f"DeepSpeed config keys '{other}' and '{key}' both set ZeroConfig.{path}; give only one")
            )
        else:
            self.values[path] = (key, value)

    def use(self, entry: Field, key: str, value: Any) -> None:
        if value is None:
            return
        if isinstance(value, str) and value == AUTO:
            self.autos[key] = entry.paths[0]
            return
        if entry.whole and isinstance(value, dict):
            for sub, v in value.items():
                if isinstance(v, str) and v == AUTO:
                    self.autos[f"{key}.{sub}"] = f"{entry.paths[0]}.{sub}"
        try:
            value = entry.convert(value)
        except _Bad as e:
            self.problem(key, f": {e}")
            return
        if value is not SKIP:
            for path in entry.paths:
                self.set(path, key, value)

    def log_ignored(self) -> None:
        """One WARNING line per ignored key on the "zeroray" logger, once the whole config is known good
        (a UserWarning would echo a line of the caller's source under each; a stock HF config has seven)."""
        for key, why in self.ignored:
            logger.warning("zeroray ignores DeepSpeed config key '%s': %s", key, why)

    def key_for(self, path: str) -> str:
        """The key the user wrote (or would write) for a ZeroConfig field path, for error messages."""
        for p in sorted(self.values, key=len, reverse=True):
            if path == p or path.startswith(p + "."):
                return self.values[p][0] + path[len(p):]
        for key, entry in TABLE.items():
            if isinstance(entry, Field):
                for p in entry.paths:
                    if path == p or path.startswith(p + "."):
                        return key + path[len(p):]
        return f"ZeroConfig.{path}"

    def kwargs(self, resolved: dict[str, Any]) -> dict[str, Any]:
        """ZeroConfig keyword arguments: the values by path (sub-configs as dicts), plus resolved autos."""
        out: dict[str, Any] = {}
        for path, value in [*((p, v) for p, (_, v) in self.values.items()), *resolved.items()]:
            *parents, last = path.split(".")
            node = out
            for part in parents:
                node = node.setdefault(part, {})
            if value is NOT_GIVEN:
                node.pop(last, None)
            else:
                node[last] = value
        return out


def _children(prefix: str) -> list[str]:
    """The names the table knows directly under ``prefix`` (for did-you-mean)."""
    names = {k.rpartition(".")[2] for k in (*TABLE, *BLOCKS) if k.rpartition(".")[0] == prefix}
    return sorted(names | (set(ALIASES) if not prefix else set()))


def _walk(block: dict[str, Any], prefix: str, shown: str, reading: Reading) -> None:
    """Handle each key of ``block``; ``prefix`` is its canonical dotted path, ``shown`` the user's spelling."""
    for name, value in block.items():
        canonical = f"{prefix}.{name}" if prefix else ALIASES.get(name, name)
        key = f"{shown}.{name}" if shown else name
        entry = TABLE.get(canonical)
        if entry is None and canonical in BLOCKS:
            if isinstance(value, dict):
                _walk(value, canonical, key, reading)
            elif value is not None:
                reading.problem(key, f": must be an object {{...}}, got {value!r}")
        elif isinstance(entry, Field):
            reading.use(entry, key, value)
        elif isinstance(entry, Ignored):
            reading.ignored.append((key, entry.why))
        elif isinstance(entry, Refused):
            if not entry.harmless(value):
                reading.problem(key, f" = {value!r} is not supported by zeroray: {entry.why}")
        elif isinstance(entry, Feature):
            if isinstance(value, dict) and value.get("enabled", False) is False:
                reading.ignored.append((key, "the block is disabled"))
            else:
                reading.problem(key, f" is not supported by zeroray: {entry.why}")
        else:
            close = difflib.get_close_matches(name, _children(prefix), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            reading.problems.append((key, f"unknown DeepSpeed config key '{key}'{hint}"))


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


def read_deepspeed(config: dict[str, Any] | str | os.PathLike[str]) -> Reading:
    """Walk a DeepSpeed config (a dict or a JSON file) through :data:`TABLE`.

    Problems are collected, not raised, so that one error can list them all; the ignored keys too, for
    :meth:`Reading.log_ignored`.
    """
    reading = Reading()
    _walk(_load(config), "", "", reading)
    return reading
