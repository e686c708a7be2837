"""ZeroConfig: the settings of a ZeRO run, as dataclasses, with clear errors for bad input.

The field names follow DeepSpeed's JSON keys where DeepSpeed has one, so that a DeepSpeed user
finds what they know. :meth:`ZeroConfig.validate` is the only validator: readers of other formats
(``zeroray.config.deepspeed``, loaded through ``zeroray.config.load.load_config``) only convert
and map, and turn a :class:`ConfigError`'s field paths back into the keys their user wrote. This
module imports neither of them, nor the engine.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from zeroray.config.optim_spec import optimizer_spec_problems, scheduler_spec_problems

Precision = Literal["fp32", "bf16", "fp16"]
OffloadDevice = Literal["none", "cpu", "nvme"]

_PRECISIONS = ("fp32", "bf16", "fp16")


class ConfigError(ValueError):
    """Bad settings. ``field`` is the dotted path in :class:`ZeroConfig` of the first
    (``comm.reduce_bucket_size``), so a reader of another format (DeepSpeed JSON) can name the key the
    user wrote instead; ``problems`` holds every ``(field, message)`` found, so one error lists them all."""

    def __init__(self, field: str, message: str, problems: tuple[tuple[str, str], ...] = ()) -> None:
        self.problems = problems or ((field, message),)
        self.field, self.message = self.problems[0]
        lines = [f"ZeroConfig.{f}: {m}" for f, m in self.problems]
        super().__init__(lines[0] if len(lines) == 1 else f"{len(lines)} bad settings:\n  " + "\n  ".join(lines))

    @classmethod
    def of(cls, problems: list[tuple[str, str]]) -> ConfigError:
        return cls(*problems[0], problems=tuple(problems))


Problems = Iterator[tuple[str, str]]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _positive_int(field: str, v: Any, what: str = "a positive integer") -> Problems:
    if not _is_int(v) or v < 1:
        yield field, f"must be {what}, got {v!r}"


def _flag(field: str, v: Any, auto: bool = False) -> Problems:
    if not isinstance(v, bool) and not (auto and v is None):
        yield field, f"must be true or false{' or None (automatic)' if auto else ''}, got {v!r}"


@dataclass(frozen=True)
class PrecisionPolicy:
    """The dtype of each copy of the weights and gradients, like FSDP2's ``MixedPrecisionPolicy``.

    ``param_dtype``: parameters and gradients in forward/backward; ``reduce_dtype``: gradients while
    they are reduced and accumulated (None = ``param_dtype``); ``master_dtype``: the copy the optimizer
    updates; ``buffer_dtype``: the floating-point buffers (None = each keeps the dtype it was built
    with, as DeepSpeed and FSDP2 do: a rotary ``inv_freq`` stays fp32 under bf16 parameters). fp16
    parameters turn on dynamic loss scaling. ``"bf16"`` is short for ``PrecisionPolicy(param_dtype="bf16")``.
    """

    param_dtype: Precision = "fp32"
    reduce_dtype: Precision | None = None
    master_dtype: Precision = "fp32"
    buffer_dtype: Precision | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "master_dtype", "buffer_dtype"):
            v = getattr(self, name)
            if v is None and name in ("reduce_dtype", "buffer_dtype"):
                continue
            if v not in _PRECISIONS:
                raise ConfigError(f"precision.{name}", f"must be 'fp32', 'bf16' or 'fp16', got {v!r}")
        if self.master_dtype != "fp32":
            raise ConfigError("precision.master_dtype", f"only 'fp32' master weights are supported, got {self.master_dtype!r}")

    @classmethod
    def coerce(cls, value: PrecisionPolicy | str | dict[str, Any]) -> PrecisionPolicy:
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value in _PRECISIONS:
            return cls(param_dtype=value)  # type: ignore[arg-type]
        if isinstance(value, dict):
            try:
                return cls(**value)
            except TypeError as e:
                raise ConfigError("precision", str(e)) from None
        raise ConfigError("precision", f"must be 'fp32', 'bf16', 'fp16' or a PrecisionPolicy, got {value!r}")

    @property
    def loss_scaling(self) -> bool:
        return self.param_dtype == "fp16"

    @property
    def name(self) -> str:
        """``"bf16"`` for the plain policies, else every dtype spelled out (the buffers' only when cast)."""
        if self.reduce_dtype in (None, self.param_dtype) and self.master_dtype == "fp32" and self.buffer_dtype is None:
            return self.param_dtype
        buffers = f",buffer={self.buffer_dtype}" if self.buffer_dtype is not None else ""
        return (f"param={self.param_dtype},reduce={self.reduce_dtype or self.param_dtype},"
                f"master={self.master_dtype}{buffers}")


@dataclass(frozen=True)
class Sharding:
    """What a ZeRO stage shards, as named flags (stage 1: optimizer states; 2: + gradients; 3: + parameters)."""

    shards_optimizer: bool
    shards_grads: bool
    shards_params: bool

    @classmethod
    def for_stage(cls, stage: int) -> Sharding:
        return cls(shards_optimizer=stage >= 1, shards_grads=stage >= 2, shards_params=stage >= 3)


@dataclass(frozen=True)
class CommConfig:
    """Communication. Sizes are in elements, as in DeepSpeed."""

    reduce_bucket_size: int = 5_000_000
    allgather_bucket_size: int = 50_000_000
    prefetch_bucket_size: int = 5_000_000  # stage 3: gather ahead up to this many elements (>= one unit)
    overlap_comm: bool = True
    # None = chosen by backend: reduce-scatter on NCCL, all-reduce on gloo (cheaper there, docs/platform-notes.md).
    reduce_scatter: bool | None = None
    # None = chosen by backend: one broadcast per rank's shard on gloo, all_gather on NCCL.
    all_gather_by_broadcast: bool | None = None

    def problems(self) -> Problems:
        for name in ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size"):
            yield from _positive_int(f"comm.{name}", getattr(self, name), "a positive number of elements")
        yield from _flag("comm.overlap_comm", self.overlap_comm)
        yield from _flag("comm.reduce_scatter", self.reduce_scatter, auto=True)
        yield from _flag("comm.all_gather_by_broadcast", self.all_gather_by_broadcast, auto=True)


@dataclass(frozen=True)
class LossScaleConfig:
    """fp16 dynamic loss scaling (DeepSpeed's ``fp16`` block). ``loss_scale`` > 0 means a static scale."""

    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0

    def problems(self) -> Problems:
        ls, mls = self.loss_scale, self.min_loss_scale
        if not _is_number(ls) or not math.isfinite(ls) or ls < 0:
            yield "loss_scaling.loss_scale", f"must be a finite number >= 0 (0 = dynamic), got {ls!r}"
        if not _is_number(mls) or not math.isfinite(mls) or mls <= 0:
            yield "loss_scaling.min_loss_scale", f"must be a finite number > 0, got {mls!r}"
        if not _is_int(self.initial_scale_power) or not 0 <= self.initial_scale_power < 128:
            yield "loss_scaling.initial_scale_power", f"must be an integer in [0, 128), got {self.initial_scale_power!r}"
        yield from _positive_int("loss_scaling.loss_scale_window", self.loss_scale_window)
        yield from _positive_int("loss_scaling.hysteresis", self.hysteresis)


@dataclass(frozen=True)
class OffloadConfig:
    """Where a state lives between uses (DeepSpeed's ``offload_optimizer`` / ``offload_param``).

    ``cpu``: host memory (on a CPU-only machine that is the device: nothing moves). ``nvme``: files in
    ``nvme_path``, a local directory on each worker node (a subdirectory per rank, removed on close).
    ``buffer_count``: host buffers of one sub-group each that NVMe swapping cycles through (>= 3
    overlaps the read of the next sub-group and the write of the previous one with the step).
    ``pin_memory``: page-locked host buffers on CUDA (faster copies; ignored on a CPU-only machine).
    """

    device: OffloadDevice = "none"
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = 4

    def problems(self, field: str) -> Problems:
        if self.device not in ("none", "cpu", "nvme"):
            yield f"{field}.device", f"must be 'none', 'cpu' or 'nvme', got {self.device!r}"
        if self.nvme_path is not None and not isinstance(self.nvme_path, str):
            yield f"{field}.nvme_path", f"must be a path (a string), got {self.nvme_path!r}"
        elif self.device == "nvme" and not self.nvme_path:
            yield f"{field}.nvme_path", "device 'nvme' needs nvme_path, a local directory on each worker node"
        yield from _flag(f"{field}.pin_memory", self.pin_memory)
        yield from _positive_int(f"{field}.buffer_count", self.buffer_count)


@dataclass(frozen=True)
class OffloadIOConfig:
    """NVMe swap I/O (DeepSpeed's ``aio`` block). ``block_size``: bytes per request; ``queue_depth``:
    requests in flight (threads of the pool); ``direct_io``: bypass the page cache with O_DIRECT where
    the filesystem allows (else buffered I/O whose pages are dropped behind)."""

    block_size: int = 8 << 20
    queue_depth: int = 4  # measured: docs/architecture.md, "I/O" (per pool; every rank has one or two)
    direct_io: bool = True

    def problems(self) -> Problems:
        if not _is_int(self.block_size) or self.block_size < 4096 or self.block_size % 4096:
            yield "offload_io.block_size", f"must be a positive multiple of 4096 bytes, got {self.block_size!r}"
        yield from _positive_int("offload_io.queue_depth", self.queue_depth)
        yield from _flag("offload_io.direct_io", self.direct_io)


# torch.compile modes that capture CUDA graphs: they need every parameter at a fixed address.
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


@dataclass(frozen=True)
class CompileConfig:
    """torch.compile of each unit (each block; the same modules stage 3 shards by), as FSDP2 + torchtitan
    compile: the engine's gathers, frees and reductions stay in eager hooks around the compiled blocks.

    ``backend``: torch.compile's backend; ``kwargs``: torch.compile's other arguments (``mode``,
    ``fullgraph``, ``dynamic``, ``options``). At stage 3, modes that capture CUDA graphs are refused:
    the gathers put the parameters at a new address each step."""

    enabled: bool = False
    backend: str = "inductor"
    kwargs: dict[str, Any] = field(default_factory=dict)

    def problems(self, stage: Any) -> Problems:
        yield from _flag("compile.enabled", self.enabled)
        if not isinstance(self.backend, str) or not self.backend:
            yield "compile.backend", f"must be a torch.compile backend name, got {self.backend!r}"
        if not isinstance(self.kwargs, dict):
            yield "compile.kwargs", f"must be a dict of torch.compile arguments, got {self.kwargs!r}"
            return
        known = ("mode", "fullgraph", "dynamic", "options")
        for key in self.kwargs:
            if key not in known:
                yield f"compile.kwargs.{key}", f"is not a torch.compile argument zeroray passes on (one of {', '.join(known)})"
        if self.enabled and stage == 3 and self.kwargs.get("mode") in CUDAGRAPH_MODES:
            yield "compile.kwargs.mode", (
                f"{self.kwargs['mode']!r} captures CUDA graphs, which need fixed parameter addresses, and stage 3 "
                f"gathers parameters into new memory each step; use 'default' or 'max-autotune-no-cudagraphs'"
            )


@dataclass(frozen=True)
class QuantizeConfig:
    """ZeRO++'s quantized collectives (DeepSpeed's ``zero_quantized_weights`` / ``zero_quantized_gradients``).

    ``weights`` (qwZ, stage 3): a step's parameter all-gathers move int8 codes, one fp32 scale per ``block_size``
    values, the backward's too, so it computes with the weights its forward used (as DeepSpeed does);
    ``exact_backward_weights`` gathers the backward's in full precision instead (the form that lagged in the
    convergence study). ``gradients`` (qgZ, stages 2-3): the gradient reduce-scatter is an all-to-all of ``gradient_bits``
    codes (4 or 8), hierarchical when the node layout is known. ``intra_node_gradients``: whether the hierarchical
    reduction quantizes its stage inside the node too (True: ZeRO++'s form) or sends it in fp32 and quantizes
    only the node's sum, once, before it crosses nodes (False: a third of the quantizing work and one rounding
    instead of two, for 4x the bytes on the node's own links). None (the default) picks by device: False on
    CPU, where quantizing costs more than the node's links save (docs/multi-node.md), True on CUDA. Masters and
    optimizer states stay full precision. ``gradient_codes``: qgZ's codes, ``"int"`` (``gradient_bits``-bit
    integers, DeepSpeed's) or ``"fp8"`` (float8 e4m3 with the block's scale, 8 bits: an error relative to each
    element instead of to its block's largest). ``weight_rounding`` / ``gradient_rounding``: how codes are
    rounded, ``"stochastic"`` (the default: unbiased, from seeded draws, zeroray.engine.rounding; the form that
    kept the convergence study's curves within 2% of the unquantized one) or ``"nearest"`` (DeepSpeed's)."""

    weights: bool = False
    gradients: bool = False
    block_size: int = 256
    gradient_bits: int = 8
    intra_node_gradients: bool | None = None
    exact_backward_weights: bool = False
    gradient_codes: str = "int"
    weight_rounding: str = "stochastic"
    gradient_rounding: str = "stochastic"

    def problems(self, stage: Any) -> Problems:
        yield from _flag("quantize.weights", self.weights)
        yield from _flag("quantize.exact_backward_weights", self.exact_backward_weights)
        yield from _flag("quantize.gradients", self.gradients)
        yield from _flag("quantize.intra_node_gradients", self.intra_node_gradients, auto=True)
        b = self.block_size
        if not _is_int(b) or b < 8 or b > 65536 or b & (b - 1):
            yield "quantize.block_size", f"must be a power of two from 8 to 65536 (values per scale), got {b!r}"
        if self.gradient_bits not in (4, 8) or isinstance(self.gradient_bits, bool):
            yield "quantize.gradient_bits", f"must be 4 or 8, got {self.gradient_bits!r}"
        for name in ("weight_rounding", "gradient_rounding"):
            if getattr(self, name) not in ("nearest", "stochastic"):
                yield f"quantize.{name}", f"must be 'nearest' or 'stochastic', got {getattr(self, name)!r}"
        if self.gradient_codes not in ("int", "fp8"):
            yield "quantize.gradient_codes", f"must be 'int' or 'fp8', got {self.gradient_codes!r}"
        elif self.gradient_codes == "fp8" and self.gradient_bits != 8:
            yield "quantize.gradient_bits", f"fp8 gradient codes have 8 bits, got {self.gradient_bits!r}"
        if self.weights is True and stage != 3:
            yield "quantize.weights", (
                f"qwZ quantizes stage 3's parameter gathers; it needs stage 3, got stage {stage!r}"
            )
        if self.gradients is True and stage not in (2, 3):
            yield "quantize.gradients", (
                f"qgZ quantizes the reduce-scatter of sharded gradients; it needs stage 2 or 3, got stage {stage!r}"
            )


_SUB = {
    "comm": CommConfig,
    "compile": CompileConfig,
    "quantize": QuantizeConfig,
    "loss_scaling": LossScaleConfig,
    "offload_optimizer": OffloadConfig,
    "offload_param": OffloadConfig,
    "offload_io": OffloadIOConfig,
}


@dataclass(frozen=True)
class ZeroConfig:
    """All settings of the ZeRO engine, validated on construction (the only validator).

    Sub-configs may be given as dicts and the precision as a string (``precision="bf16"``).
    """

    stage: int = 0
    precision: PrecisionPolicy = field(default_factory=PrecisionPolicy)
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float = 0.0
    train_micro_batch_size_per_gpu: int | None = None
    train_batch_size: int | None = None
    # Stage 3 units: module names or class names; None = blocks of each nn.ModuleList, else top-level children.
    units: tuple[str, ...] | None = None
    # Optimizer / scheduler named in the config ({"type": ..., "params": {...}}), used when
    # zeroray.initialize gets no optimizer.
    optimizer: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    comm: CommConfig = field(default_factory=CommConfig)
    loss_scaling: LossScaleConfig = field(default_factory=LossScaleConfig)
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)
    offload_io: OffloadIOConfig = field(default_factory=OffloadIOConfig)
    # The optimizer steps this rank's shard in sub-groups of at most this many elements, one after
    # another (DeepSpeed's key and default); with NVMe offload it sizes the host buffers.
    sub_group_size: int = 1_000_000_000
    # Stage 3 on CPU: return the C heap's free pages to the OS after each unit's backward (glibc's
    # malloc_trim; engine/heap_trim.py). Lower peak RSS for more step time, so off by default.
    trim_host_heap: bool = False
    # Hybrid sharding (MiCS, FSDP2's HSDP; DeepSpeed's mics_shard_size): the states are sharded over groups
    # of this many consecutive ranks and replicated across the groups. None: over all ranks. "auto":
    # the ranks of one node (ZeroTrainer resolves it from its placement group).
    shard_group_size: int | str | None = None
    # hpZ (ZeRO++, stage 3; DeepSpeed's zero_hpz_partition_size): after a unit's forward each rank keeps
    # 1/h of its parameters, gathered in backward from the h ranks of its node. None or 1: off; "auto": the
    # ranks of one node (ZeroTrainer). Must divide shard_group_size (or the world size).
    hpz_partition_size: int | str | None = None
    # torch.compile of each unit, the engine's hooks around them (see CompileConfig).
    compile: CompileConfig = field(default_factory=CompileConfig)
    # ZeRO++'s quantized weight gathers (qwZ) and gradient reductions (qgZ) (see QuantizeConfig).
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)

    def __post_init__(self) -> None:
        problems: list[tuple[str, str]] = []
        try:
            object.__setattr__(self, "precision", PrecisionPolicy.coerce(self.precision))
        except ConfigError as e:
            problems += e.problems
        for name, cls in _SUB.items():
            v = getattr(self, name)
            if isinstance(v, dict):
                try:
                    v = cls(**v)
                except TypeError as e:
                    problems.append((name, str(e)))
                object.__setattr__(self, name, v)
        if isinstance(self.units, list):
            object.__setattr__(self, "units", tuple(self.units))
        if problems:
            raise ConfigError.of(problems)
        self.validate()

    @property
    def sharding(self) -> Sharding:
        return Sharding.for_stage(self.stage)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise one :class:`ConfigError` listing every bad field; called on construction."""
        problems = list(self.problems())
        if problems:
            raise ConfigError.of(problems)

    def problems(self) -> Problems:
        """Each bad field as ``(dotted field, message)``."""
        if isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3):
            yield "stage", f"must be 0, 1, 2 or 3, got {self.stage!r}"
        for name in ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu", "train_batch_size"):
            v = getattr(self, name)
            if v is not None:
                yield from _positive_int(name, v)
        clip = self.gradient_clipping
        if not _is_number(clip) or not math.isfinite(clip) or clip < 0:
            yield "gradient_clipping", f"must be a finite number >= 0 (0 = off), got {clip!r}"
        for name, sub in (("comm", self.comm), ("loss_scaling", self.loss_scaling), ("offload_io", self.offload_io)):
            if isinstance(sub, _SUB[name]):
                yield from sub.problems()
            else:
                yield name, f"must be a {_SUB[name].__name__} or a dict, got {sub!r}"
        if isinstance(self.compile, CompileConfig):
            yield from self.compile.problems(self.stage)
        else:
            yield "compile", f"must be a CompileConfig or a dict, got {self.compile!r}"
        if isinstance(self.quantize, QuantizeConfig):
            yield from self.quantize.problems(self.stage)
        else:
            yield "quantize", f"must be a QuantizeConfig or a dict, got {self.quantize!r}"
        for name in ("offload_optimizer", "offload_param"):
            sub = getattr(self, name)
            if isinstance(sub, OffloadConfig):
                yield from sub.problems(name)
            else:
                yield name, f"must be an OffloadConfig or a dict, got {sub!r}"
        yield from _positive_int("sub_group_size", self.sub_group_size, "a positive number of elements")
        yield from _flag("trim_host_heap", self.trim_host_heap)
        yield from self._hybrid_problems()
        yield from self._offload_problems()
        if self.units is not None and (
            not isinstance(self.units, tuple) or not all(isinstance(u, str) for u in self.units)
        ):
            yield "units", f"must be a list of module or class names, got {self.units!r}"
        if self.optimizer is not None:
            yield from optimizer_spec_problems(self.optimizer)
        if self.scheduler is not None:
            yield from scheduler_spec_problems(self.scheduler)

    def _hybrid_problems(self) -> Problems:
        def bad_size(v: Any) -> bool:
            return v not in (None, "auto") and (isinstance(v, bool) or not isinstance(v, int) or v < 1)

        for name in ("hpz_partition_size", "shard_group_size"):
            if bad_size(getattr(self, name)):
                yield name, f"must be a positive integer, 'auto' or None, got {getattr(self, name)!r}"
        h = self.hpz_partition_size
        if not bad_size(h) and h not in (None, 1) and self.stage != 3:
            yield "hpz_partition_size", (
                f"hpZ keeps a secondary copy of stage 3's sharded parameters; it needs stage 3, got stage {self.stage!r}"
            )
        k = self.shard_group_size
        if k is None or bad_size(k):
            return
        if self.stage == 0:
            yield "shard_group_size", (
                "hybrid sharding applies to stages 1-3; stage 0 replicates every state already (set stage, or "
                "leave shard_group_size out)"
            )

    def _offload_problems(self) -> Problems:
        opt, par = self.offload_optimizer, self.offload_param
        if not isinstance(opt, OffloadConfig) or not isinstance(par, OffloadConfig) or isinstance(self.stage, bool):
            return
        if opt.device in ("cpu", "nvme") and self.stage == 0:
            yield "offload_optimizer.device", (
                f"{opt.device!r} needs a sharded optimizer (stage 1, 2 or 3); stage 0 keeps it whole on every rank"
            )
        if par.device in ("cpu", "nvme") and self.stage != 3:
            yield "offload_param.device", f"{par.device!r} needs stage 3 (sharded parameters), got stage {self.stage!r}"

    # ------------------------------------------------------------------ batch sizes
    def resolve_batch(self, world_size: int) -> ZeroConfig:
        """Fill in batch sizes as DeepSpeed does: train = micro x accumulation x world size.

        Any two given determine the third; all three must agree. Only ``train_batch_size``: one
        accumulation step. Only the micro batch: one accumulation step. Neither: accumulation as
        given (default 1) and batch sizes left unknown.
        """
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        tb, mb, gas = self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps
        ws = world_size
        if tb is not None and mb is not None and gas is not None:
            if tb != mb * gas * ws:
                raise ValueError(
                    f"train_batch_size ({tb}) must equal train_micro_batch_size_per_gpu ({mb}) x "
                    f"gradient_accumulation_steps ({gas}) x data-parallel world size ({ws}) = {mb * gas * ws}"
                )
        elif tb is not None and mb is not None:
            if tb % (mb * ws):
                raise ValueError(
                    f"train_batch_size ({tb}) is not divisible by train_micro_batch_size_per_gpu ({mb}) x "
                    f"world size ({ws})"
                )
            gas = tb // (mb * ws)
        elif tb is not None and gas is not None:
            if tb % (gas * ws):
                raise ValueError(
                    f"train_batch_size ({tb}) is not divisible by gradient_accumulation_steps ({gas}) x "
                    f"world size ({ws})"
                )
            mb = tb // (gas * ws)
        elif mb is not None:
            gas = gas or 1
            tb = mb * gas * ws
        elif tb is not None:
            gas = 1
            if tb % ws:
                raise ValueError(f"train_batch_size ({tb}) is not divisible by the world size ({ws})")
            mb = tb // ws
        else:
            gas = gas or 1
        return dataclasses.replace(
            self, train_batch_size=tb, train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=gas
        )
