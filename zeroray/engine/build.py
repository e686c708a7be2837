"""A :class:`~zeroray.engine.engine.ZeroEngine`'s set-up, apart from what the engine then does with it.

In order: validate everything (no communication yet), lay parameters out in flat groups, start all
ranks from rank 0's weights, rebuild the optimizer over the shards, install hooks. A model built on
the meta device is initialized instead, the same on every rank, with no broadcast
(:mod:`zeroray.engine.materialize`).
"""

from __future__ import annotations

import functools
import weakref
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from zeroray.config import ZeroConfig
from zeroray.config.load import ConfigArg, load_config
from zeroray.engine import plan as unit_plan
from zeroray.engine.comm import Comm
from zeroray.engine.compiled import compile_units
from zeroray.engine.flat_group import FlatGroup
from zeroray.engine.gather_check import GatherCheck
from zeroray.engine.gather_pool import GatherPool
from zeroray.engine.heap_trim import HeapTrimmer
from zeroray.engine.loss_scaler import LossScaler
from zeroray.engine.materialize import InitFn, MetaInit, compute_device, meta_tensor_ids
from zeroray.engine.offload.files import SwapDir, check_nvme_path
from zeroray.engine.offload.home import StateHome, expected_state_count
from zeroray.engine.offload.nvme import NvmeHome
from zeroray.engine.offload.param_files import ParamFiles
from zeroray.engine.offload.resident import ResidentHome
from zeroray.engine.param_guard import ParamGuard
from zeroray.engine.phase_timer import PhaseTimer
from zeroray.engine.quantized_comm import QuantizedGather, QuantizedReduceScatter
from zeroray.engine.reducer import GradReducer
from zeroray.engine.rounding import Draws
from zeroray.engine.schedule import UnitScheduler
from zeroray.engine.sharded_optim import (
    OptimizerArg,
    ShardedOptimizer,
    param_group_index,
    refuse_direct_step,
    template_optimizer,
)
from zeroray.engine.shared_grads import SharedGradSum
from zeroray.engine.topology import Topology
from zeroray.engine.unit import Unit

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Modules whose parameters a live engine has turned into views of its buffers (until its close()):
# a second engine over one of them is refused before any work.
HELD: weakref.WeakKeyDictionary[nn.Module, object] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class EngineParts:
    """Everything an engine holds once set up; the engine's own counters start at zero beside them."""

    config: ZeroConfig  # batch sizes resolved for the world size
    device: torch.device
    initialized_names: list[str]  # the meta tensors an initializer wrote (those loaded_keys does not name)
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    master_dtype: torch.dtype
    comm: Comm  # every rank (control messages, checkpoints)
    topology: Topology  # the shard group and replicas the states' collectives run on
    loss_scaler: LossScaler
    phases: PhaseTimer  # forward / backward / optimizer / comm wait, never syncs
    host_device: torch.device
    # Where a stage-3 compute shard lives between gathers: host memory under parameter offload (NVMe:
    # only at set-up, then in a file, see ParamFiles).
    shard_device: torch.device
    units: list[tuple[str, nn.Module]]  # stage 3's units by name; empty at stages 0-2
    groups: list[FlatGroup]
    gather_pool: GatherPool  # stage 3: gathers reuse freed gather memory
    gather_check: GatherCheck | None  # stage 3: the ranks agree on each gather's group in the first passes
    optim: ShardedOptimizer
    param_files: ParamFiles | None  # offload_param "nvme": the parked compute shards
    template_hook: RemovableHandle  # makes the user's optimizer refuse step()
    lr_scheduler: Any
    scheduler: UnitScheduler | None  # stage 3's hooks
    guard: ParamGuard | None
    heap_trimmer: HeapTrimmer | None
    reducer: GradReducer
    shared_grads: SharedGradSum  # tied parameters' gradients summed in place
    frozen: list[tuple[str, nn.Parameter]]  # frozen at set-up: no gradient buffer or optimizer state
    # Optimizer steps each trainable parameter took (it is skipped at a step where no rank gave it a
    # gradient), the same on every rank: a checkpoint keeps the counts that differ within a param group.
    param_steps: dict[FlatGroup, list[int]]
    setup_comm: dict[str, int]  # bytes set-up moved, by collective kind
    draws: Draws  # stochastic rounding's (quantize.*_rounding), keyed by the micro-batch the engine counts


def build_engine(
    model: nn.Module,
    optimizer: OptimizerArg,
    config: ConfigArg,
    process_group: dist.ProcessGroup | None,
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None,
    *,
    init_fn: InitFn | None,
    device: str | torch.device | None,
    loaded_keys: Collection[str],
    mesh: object | None = None,
    nodes: Sequence[object] | None = None,
) -> EngineParts:
    """Set up an engine over ``model`` (arguments as :func:`zeroray.initialize`'s)."""
    # ---- validation: everything that can be wrong fails here, before any communication
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if init_fn is not None and not callable(init_fn):
        raise TypeError(f"init_fn must be a callable module -> None, got {type(init_fn).__name__}")
    config = load_config(config, model=model, optimizer=optimizer)
    if process_group is None and dist.is_available() and dist.is_initialized():
        process_group = dist.group.WORLD
    world = 1 if process_group is None else dist.get_world_size(process_group)
    config = config.resolve_batch(world)
    params = list(model.parameters())
    if not params:
        raise ValueError("the model has no parameters")
    if any(m in HELD for m in model.modules()):
        raise RuntimeError(
            f"this {type(model).__name__} (or a module in it) is already held by a ZeroEngine; call "
            "engine.close() first (at stage 3 that also puts the full weights back into the parameters)"
        )
    device = compute_device(model, device, process_group)
    meta = meta_tensor_ids(model)
    meta_init = MetaInit(model, init_fn, loaded_keys) if meta else None
    if not meta and init_fn is not None:
        raise ValueError(
            "init_fn was given but no parameter or buffer of the model is on the meta device; build the "
            "model under `with torch.device('meta'):` or leave init_fn out"
        )
    template = template_optimizer(model, optimizer, config, warn=process_group is None or dist.get_rank(process_group) == 0)
    group_of = param_group_index(model, template)
    if lr_scheduler is not None and not callable(lr_scheduler):
        raise TypeError("lr_scheduler must be a callable optimizer -> scheduler")
    _check_nvme_paths(config, model, template, world)

    precision = config.precision
    compute_dtype = _DTYPES[precision.param_dtype]
    reduce_dtype = _DTYPES[precision.reduce_dtype or precision.param_dtype]
    master_dtype = _DTYPES[precision.master_dtype]
    if config.stage == 0 and mesh is not None:
        raise ValueError("a mesh (hybrid sharding) applies to stages 1-3; stage 0 replicates every state already")
    topology = Topology.build(process_group, config.comm, shard_group_size=config.shard_group_size, mesh=mesh,
                              nodes=nodes, hpz_partition_size=config.hpz_partition_size,
                              node_levels=config.quantize.gradients)
    comm = topology.world
    loss_scaler = LossScaler(config)
    draws = Draws()  # the quantized collectives' stochastic rounding; the engine counts its micro-batches
    phases = PhaseTimer(device)
    host_device = torch.device("cpu")
    # Where the fp32 masters live: the device, host memory (CPU offload) or files (NVMe, None).
    master_device: torch.device | None = {"none": device, "cpu": host_device, "nvme": None}[config.offload_optimizer.device]
    shard_device = host_device if config.offload_param.device in ("cpu", "nvme") else device
    start = functools.partial(
        _start, meta=meta, config=config, master_dtype=master_dtype, master_device=master_device,
        host_device=host_device, shard_device=shard_device,
    )

    # ---- layout (stages 0-2: a meta model is first materialized whole, the same on every rank)
    units, groups, unit_groups, gather_pool, gather_check = _lay_out(
        model, config, topology, device, group_of, compute_dtype, reduce_dtype, meta_init, start, draws
    )
    _sync_buffers(model, comm, meta, precision.buffer_dtype)

    # ---- optimizer over the shards
    home = _state_home(config, device, master_device, host_device, comm.rank, template)
    try:
        optim = ShardedOptimizer(template, groups, config.sub_group_size, home)
    except BaseException:
        home.close()  # e.g. a full disk while writing the swap files: nothing is left behind
        raise
    param_files = _park_params(config, comm.rank, groups, optim) if config.offload_param.device == "nvme" else None
    template_hook = refuse_direct_step(template)  # the user's optimizer would step nothing
    scheduler_of_lr = _lr_scheduler(lr_scheduler, config, optim.optimizer)

    # ---- hooks
    scheduler: UnitScheduler | None = None
    guard: ParamGuard | None = None
    hooked: list[Unit] = []
    if config.sharding.shards_params:
        root = Unit("root", model, unit_groups.get(None, []), root=True)
        hooked = [Unit(name, m, unit_groups.get(i, [])) for i, (name, m) in enumerate(units)]
        read_ahead = param_files.read_ahead if param_files is not None else None
        scheduler = UnitScheduler(model, root, hooked, config.comm.prefetch_bucket_size, read_ahead)
        hooked = [root, *hooked]
        guard = ParamGuard(model, groups, {g: u.name for u in hooked for g in u.groups})
    if config.compile.enabled:  # each block compiled, the hooks above around it
        compile_units(units or unit_plan.find_units(model, config.units), config.compile)
    # Stage 3 with trim_host_heap: the C heap's free pages go back to the OS after each unit's
    # backward (a no-op where the C library is not glibc).
    heap_trimmer = HeapTrimmer() if config.trim_host_heap and config.sharding.shards_params else None
    reducer = GradReducer(
        groups,
        reduce_every_micro_step=config.sharding.shards_grads,
        overlap=config.comm.overlap_comm,
        max_inflight=config.comm.reduce_bucket_size,
        units=hooked,
        on_final=home.grad_ready if home.early_grads else None,
        trimmer=heap_trimmer,
    )
    # Tied parameters (reached under several names): their gradients are summed in place.
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    shared_grads = SharedGradSum(p for p in model.parameters() if p.requires_grad and uses[id(p)] > 1)
    setup_comm = topology.report()
    topology.reset()  # the report counts training traffic, not set-up
    return EngineParts(
        config=config, device=device, initialized_names=meta_init.initialized if meta_init is not None else [],
        compute_dtype=compute_dtype, reduce_dtype=reduce_dtype, master_dtype=master_dtype, comm=comm,
        topology=topology,
        loss_scaler=loss_scaler, phases=phases, host_device=host_device, shard_device=shard_device, units=units,
        groups=groups, gather_pool=gather_pool, gather_check=gather_check, optim=optim, param_files=param_files,
        template_hook=template_hook, lr_scheduler=scheduler_of_lr, scheduler=scheduler, guard=guard,
        heap_trimmer=heap_trimmer, reducer=reducer, shared_grads=shared_grads,
        frozen=[(n, p) for g in groups if not g.trainable for n, p in zip(g.param_names, g.params)],
        param_steps={g: [0] * len(g.params) for g in groups if g.trainable},
        setup_comm=setup_comm, draws=draws,
    )


def _check_nvme_paths(config: ZeroConfig, model: nn.Module, template: torch.optim.Optimizer, world: int) -> None:
    """A bad nvme_path fails here, before any work; one path for both counts both."""
    need: dict[str, int] = {}
    if config.offload_param.device == "nvme":
        need[config.offload_param.nvme_path] = _param_swap_bytes(model, world, config.precision.param_dtype)
    if config.offload_optimizer.device == "nvme":
        path = config.offload_optimizer.nvme_path
        need[path] = need.get(path, 0) + _swap_bytes(model, template, world, config.sub_group_size)
    for name in ("offload_optimizer", "offload_param"):
        block = getattr(config, name)
        if block.device == "nvme":
            check_nvme_path(block.nvme_path, f"{name}.nvme_path", need[block.nvme_path])


def _param_swap_bytes(model: nn.Module, world: int, param_dtype: str) -> int:
    """An upper bound of this rank's parameter swap bytes (offload_param "nvme"): its share of every
    parameter in the compute dtype, with the 4 KiB padding of every group."""
    params = list({id(p): p for p in model.parameters()}.values())
    mine = -(-sum(p.numel() for p in params) // world) + world
    return _DTYPES[param_dtype].itemsize * mine + 4096 * len(params)


def _swap_bytes(model: nn.Module, template: torch.optim.Optimizer, world: int, sub_group_size: int) -> int:
    """An upper bound of this rank's NVMe swap bytes: its fp32 share of the trainable parameters
    times (master + the optimizer's states), with the 4 KiB padding of every sub-group."""
    numel = sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())
    mine = -(-numel // world) + world  # padding
    subs = -(-mine // sub_group_size) + len(list(model.parameters()))
    return (1 + expected_state_count(template)) * (4 * mine + 4096 * subs)


def _lay_out(
    model: nn.Module,
    config: ZeroConfig,
    topology: Topology,
    device: torch.device,
    group_of: dict[int, int | None],
    compute_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    meta_init: MetaInit | None,
    start: Callable[[FlatGroup], None],
    draws: Draws,
) -> tuple[list[tuple[str, nn.Module]], list[FlatGroup], dict[int | None, list[FlatGroup]], GatherPool, GatherCheck | None]:
    """The flat groups, each started (``start``) once its values are there: stage-3 units, the
    groups by unit index (None: the root), the gather pool and check. ``draws``: the quantized collectives'
    stochastic rounding, where the config asks for it."""
    sharding = config.sharding
    if meta_init is not None and not sharding.shards_params:
        meta_init.run(device, sink=lambda t: True)
    if sharding.shards_params:
        units = unit_plan.find_units(model, config.units)
        plans = unit_plan.plan_units(model, units, group_of)
    else:
        units = []
        plans = unit_plan.plan_buckets(model, group_of, config.comm.reduce_bucket_size)
    groups: list[FlatGroup] = []
    gather_pool = GatherPool()
    gather_check = GatherCheck(topology.shard) if sharding.shards_params else None
    quantize = config.quantize
    kernels = device.type == "cuda"  # the quantizer's ops compiled into fused kernels where that wins: CUDA
    qwz = qgz = None
    if quantize.weights:
        qwz = QuantizedGather(quantize.block_size, kernels, quantize.exact_backward_weights,
                              draws=draws if quantize.weight_rounding == "stochastic" else None)
    if quantize.gradients:
        qgz = QuantizedReduceScatter(
            quantize.gradient_bits, quantize.block_size, topology.shard, topology.node, topology.cross, kernels,
            quantize_node=quantize.intra_node_gradients if quantize.intra_node_gradients is not None else device.type != "cpu",
            draws=draws if quantize.gradient_rounding == "stochastic" else None, codes=quantize.gradient_codes,
        )
    unit_groups: dict[int | None, list[FlatGroup]] = {}
    pending: list[FlatGroup] = []  # stage 3: groups with meta parameters, installed once initialized
    for plan in plans:
        floating = plan.params[0][1].is_floating_point()
        dtype = compute_dtype if floating else plan.params[0][1].dtype
        g = FlatGroup(
            plan.name,
            plan.params,
            topology.shard,
            sharding=sharding,
            compute_dtype=dtype,
            reduce_dtype=reduce_dtype if floating else dtype,
            trainable=plan.param_group is not None,
            param_group=plan.param_group,
            device=device,
            pool=gather_pool,
            check=gather_check,
            replicas=topology.replicas,
            world=topology.world,
            secondary=topology.secondary,
            qwz=qwz if floating else None,
            qgz=qgz if floating and plan.param_group is not None else None,
        )
        if g.has_meta:
            pending.append(g)
        else:
            start(g)
        groups.append(g)
        unit_groups.setdefault(plan.unit, []).append(g)
    if meta_init is not None and sharding.shards_params:
        # One module at a time, straight into the shards; buffers are kept whole.
        owner = {id(p): g for g in pending for p in g.params}

        def sink(t: torch.Tensor) -> bool:
            g = owner.get(id(t))
            if g is None:
                return True
            g.write(t)
            return False

        meta_init.run(device, sink)
        for g in pending:
            start(g)
    return units, groups, unit_groups, gather_pool, gather_check


def _start(
    g: FlatGroup,
    *,
    meta: set[int],
    config: ZeroConfig,
    master_dtype: torch.dtype,
    master_device: torch.device | None,
    host_device: torch.device,
    shard_device: torch.device,
) -> None:
    """Collective: a group's values agree across ranks (rank 0's, unless every parameter in it
    was meta-built: those are the same everywhere), then it installs its shards and buffers."""
    if any(id(p) not in meta for p in g.params):
        g.sync_from_rank0()
    floating = g.compute_dtype.is_floating_point
    g.install(
        master_dtype=master_dtype if floating else g.compute_dtype,
        master_device=master_device or host_device,
        shard_device=shard_device,
        keep_master=master_device is not None,
        own_master=config.offload_param.device == "nvme",
        pin_memory=config.offload_optimizer.pin_memory or config.offload_param.pin_memory,
    )


def _sync_buffers(model: nn.Module, comm: Comm, meta: set[int], buffer_dtype: str | None) -> None:
    """Buffers keep their dtype (a rotary inv_freq stays fp32), as FSDP2's and DeepSpeed's do, unless
    the precision policy names one for them (DeepSpeed's data_types.buffer_dtype); rank 0's values."""
    dtype = _DTYPES[buffer_dtype] if buffer_dtype else None
    with torch.no_grad():
        for b in model.buffers():
            if dtype is not None and b.is_floating_point():
                b.data = b.data.to(dtype)
            if id(b) not in meta:  # a meta-built buffer is the same on every rank already
                comm.broadcast(b, src=0)


def _state_home(
    config: ZeroConfig, device: torch.device, master_device: torch.device | None, host_device: torch.device, rank: int,
    template: torch.optim.Optimizer,
) -> StateHome:
    """Where the optimizer's masters and states live (the one place that decides)."""
    offload = config.offload_optimizer
    if offload.device != "nvme":
        return ResidentHome(device, master_device, offload.pin_memory)
    io = config.offload_io
    swap = SwapDir(offload.nvme_path, rank, io.queue_depth, io.direct_io, io.block_size)
    return NvmeHome(swap, offload.buffer_count, host_device, expected_state_count(template))


def _park_params(config: ZeroConfig, rank: int, groups: list[FlatGroup], optim: ShardedOptimizer) -> ParamFiles:
    """offload_param "nvme": write every compute shard to its file and drop it from memory."""
    par, io = config.offload_param, config.offload_io
    files = ParamFiles(SwapDir(par.nvme_path, rank, io.queue_depth, io.direct_io, io.block_size), par.buffer_count)
    try:
        files.attach(groups)
    except BaseException:
        files.close()
        optim.close()
        raise
    for g in groups:
        g.park(files)
    return files


def _lr_scheduler(
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None, config: ZeroConfig, optimizer: torch.optim.Optimizer
) -> Any:
    """The caller's scheduler over the sharded optimizer, else the config's, else None."""
    if lr_scheduler is not None:
        return lr_scheduler(optimizer)
    if config.scheduler is not None:
        from zeroray.engine.named_optim import build_scheduler

        return build_scheduler(config.scheduler, optimizer)
    return None
