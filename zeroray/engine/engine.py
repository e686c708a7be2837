"""ZeroEngine: ZeRO stages 0-3 around an unmodified ``nn.Module`` and a torch optimizer.

A training step reads like plain PyTorch::

    engine = zeroray.initialize(model, torch.optim.AdamW(model.parameters()), config={"zero_optimization": {"stage": 3}})
    loss = engine(x).loss
    engine.backward(loss)   # scales by 1/accumulation (and the fp16 loss scale), reduces grads
    engine.step()           # optimizer on this rank's shard at accumulation boundaries

Set-up (validation, layout, rank 0's weights, the optimizer over the shards, hooks) is
:mod:`zeroray.engine.build`; this module is what the engine does with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from zeroray.config.load import ConfigArg
from zeroray.engine import names as tensor_names
from zeroray.engine.build import HELD, build_engine
from zeroray.engine.comm import InFlight
from zeroray.engine.flat_group import FlatGroup
from zeroray.engine.materialize import InitFn
from zeroray.engine.phase_timer import StepTimes
from zeroray.engine.scratch import ScratchPool
from zeroray.engine.shard_state import GroupShard, GroupSource, ShardRange, ShardStateCopy
from zeroray.engine.sharded_optim import GradShards, OptimizerArg

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class Stateful(Protocol):
    """What :meth:`ZeroEngine.register_stateful` saves and loads: a small JSON-able state."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ZeroEngine:
    """One rank's ZeRO engine. Build it with :func:`zeroray.initialize`."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerArg = None,
        config: ConfigArg = None,
        process_group: dist.ProcessGroup | None = None,
        lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        *,
        init_fn: InitFn | None = None,
        device: str | torch.device | None = None,
        loaded_keys: Collection[str] = (),
        mesh: DeviceMesh | None = None,
        nodes: Sequence[object] | None = None,
    ):
        parts = build_engine(model, optimizer, config, process_group, lr_scheduler, init_fn=init_fn, device=device,
                             loaded_keys=loaded_keys, mesh=mesh, nodes=nodes)
        self.module = model
        self.config = parts.config
        self.device = parts.device
        self.initialized_names = parts.initialized_names
        self.stage = self.config.stage
        self.sharding = self.config.sharding
        self.compute_dtype = parts.compute_dtype
        self.reduce_dtype = parts.reduce_dtype
        self.master_dtype = parts.master_dtype
        self.gradient_accumulation_steps = self.config.gradient_accumulation_steps
        self.comm = parts.comm  # every rank
        self.topology = parts.topology  # the shard group and the replicas
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.global_step = 0  # optimizer steps taken (skipped fp16 steps included)
        self._draws = parts.draws
        self.micro_step = 0
        self.skipped_steps = 0
        # True while step() or a load changes the state (from the loss scale to global_step): a failure then
        # leaves weights, optimizer states and counters of different steps, which no recovery may start from.
        self.mid_update = False
        self._backward_since_step = False  # step() without a backward is a no-op, as torch's is
        self._grad_norm: torch.Tensor | None = None  # read lazily: a float here would sync every step
        self.loss_scaler = parts.loss_scaler
        self._phases = parts.phases
        self.host_device = parts.host_device
        self._shard_device = parts.shard_device
        self.units = parts.units
        self.groups = parts.groups
        self.gather_pool = parts.gather_pool
        self.gather_check = parts.gather_check
        self.optim = parts.optim
        self.optimizer = self.optim.optimizer
        self._param_files = parts.param_files
        self._template_hook = parts.template_hook
        self.lr_scheduler = parts.lr_scheduler
        self.scheduler = parts.scheduler
        self._guard = parts.guard
        self.heap_trimmer = parts.heap_trimmer
        self.reducer = parts.reducer
        self.shared_grads = parts.shared_grads
        self._frozen = parts.frozen
        self._param_steps = parts.param_steps
        self._setup_comm = parts.setup_comm
        self._stateful: dict[str, Stateful] = {}  # small JSON state saved beside the engine's (register_stateful)
        self._loaded_stateful: dict[str, Any] = {}  # the last load's, for objects registered after it
        for m in model.modules():
            HELD[m] = self

    # ------------------------------------------------------------------ training
    @property
    def micro_step(self) -> int:
        """Micro-batches stepped (saved with the engine); stochastic rounding draws by it."""
        return self._micro_step

    @micro_step.setter
    def micro_step(self, n: int) -> None:
        self._micro_step = n
        self._draws.micro_batch = n + 1  # the next micro-batch, counted from 1

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: not part of a training step's time
            return self.module(*args, **kwargs)
        with self._phases.phase("forward"):
            return self.module(*args, **kwargs)

    forward = __call__

    # ------------------------------------------------------------------ module-like (as DeepSpeed's engine)
    def train(self, mode: bool = True) -> ZeroEngine:
        self.module.train(mode)
        return self

    def eval(self) -> ZeroEngine:
        self.module.eval()
        return self

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The model's parameters. At stage 3 their storage is freed outside forward and backward:
        read weights with :meth:`full_state_dict`."""
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(*args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The model's ``generate`` (e.g. Hugging Face's). At stage 3 with several ranks every
        forward is collective, so a rank that finished early must keep running forwards until all
        have: ``synced_gpus=True`` is passed unless the caller set it."""
        if self.stage == 3 and self.world_size > 1:
            kwargs.setdefault("synced_gpus", True)
        return self.module.generate(*args, **kwargs)

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the current micro-step is the last of an accumulation cycle."""
        return (self.micro_step + 1) % self.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss / gradient_accumulation_steps`` (times the fp16 loss scale)."""
        for name, p in self._frozen:
            if p.requires_grad:
                raise RuntimeError(
                    f"zeroray: parameter {name!r} was frozen (requires_grad=False) when the engine was built and "
                    "now requires grad; it has no gradient buffer or optimizer state, so it would never train. "
                    "Unfreeze it before zeroray.initialize (or close the engine and initialize again)"
                )
        scale = self.loss_scaler.scale / self.gradient_accumulation_steps
        self.reducer.begin(self.is_gradient_accumulation_boundary())
        with self._phases.phase("backward"):
            scaled = loss * scale if scale != 1 else loss
            self.shared_grads.prepare(scaled)
            scaled.backward()
        with self._phases.phase("comm_wait"):  # the reductions backward could not hide
            self.reducer.finish()
        if self.scheduler is not None:
            self.scheduler.after_backward()
        if self.gather_check is not None:
            self.gather_check.pass_done()
        self._backward_since_step = True

    def step(self) -> None:
        """Call after every micro-batch; applies the optimizer only at accumulation boundaries.

        Without an :meth:`backward` since the last call it does nothing (no micro-step counted),
        as a torch optimizer skips parameters without gradients."""
        if not self._backward_since_step:
            return
        self._backward_since_step = False
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_step += 1
        if not boundary:
            return
        self._phases.start("optimizer")
        trainable = [g for g in self.groups if g.trainable]
        grads = self.optim.grads()
        used = self._agree_used()
        self.mid_update = True
        if self._unscale_and_check(grads):
            self.skipped_steps += 1
        else:
            self._clip(grads)
            self.optim.step(grads, used)
            for g, counts in self._param_steps.items():
                for i in range(len(counts)):
                    counts[i] += 1 if used is None else used[g][i]
            self._publish(trainable, masters_copied=self.optim.publishes_shards)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        for g in trainable:
            g.zero_grad()
        self.global_step += 1
        self.mid_update = False
        self._phases.stop("optimizer")

    def _agree_used(self) -> dict[FlatGroup, list[bool]] | None:
        """Which parameters got a gradient on some rank since the last step (one small control
        all-reduce); None when all did. The others are not stepped, as DDP and FSDP2 leave them."""
        local = self.reducer.take_used()
        groups = list(self._param_steps)
        flags = torch.tensor([u for g in groups for u in local[g]], dtype=torch.bool)
        agreed = self.comm.any_each(flags)
        if bool(agreed.all()):
            return None
        out, at = {}, 0
        for g in groups:
            out[g] = agreed[at : at + len(g.params)].tolist()
            at += len(g.params)
        return out

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm before clipping at the last step (None without clipping)."""
        return None if self._grad_norm is None else float(self._grad_norm)

    def _unscale_and_check(self, grads: GradShards) -> bool:
        """Undo the fp16 loss scale; True when some rank's gradients overflowed (the step is skipped)."""
        if self.loss_scaler.scale != 1.0:
            grads.scale_(1.0 / self.loss_scaler.scale)
        overflow = False
        if self.config.precision.loss_scaling:
            # One flag over every group: the skip decision is the step's only host sync.
            flags = [(~torch.isfinite(t)).any().to(self.device) for t in grads.each()]
            local = torch.stack(flags).any() if flags else torch.zeros((), dtype=torch.bool, device=self.device)
            overflow = self.comm.any_true(local)
            self.loss_scaler.update(overflow)
        return overflow

    def _clip(self, grads: GradShards) -> None:
        """Clip by the global norm over every rank's shard (one scalar all-reduce)."""
        clip = self.config.gradient_clipping
        if clip <= 0:
            self._grad_norm = None
            return
        sq = torch.zeros(1, dtype=torch.float32, device=self.device)
        for t in grads.each():
            sq += t.pow(2).sum().to(self.device)
        if self.sharding.shards_optimizer:  # each rank of a shard group holds a shard of the gradients
            self.topology.shard.sum_scalar(sq)
        norm = sq.sqrt()
        self._grad_norm = norm
        coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
        grads.scale_(coef)

    # ------------------------------------------------------------------ state
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the full fp32 weights, {name: CPU tensor}, on every rank."""
        out: dict[str, torch.Tensor] = {}
        for g in self.groups:
            mine = self.optim.master(g).to(self.device)
            if g.shard_world == 1:
                flat = mine
            else:
                flat = torch.empty(g.padded, dtype=mine.dtype, device=mine.device)
                g.comm.all_gather(flat, mine).wait()
            for slot in g.slots:
                out[slot.name] = flat[slot.offset : slot.end].view(slot.shape).detach().cpu().clone()
        return {n: out[n] for n, _ in tensor_names.named_parameters(self.module)}

    def shard_state(self) -> list[GroupShard]:
        """This rank's slices of every logical flat group: what a sharded checkpoint saves.

        Each tensor is 1-D with ``hi - lo`` elements (padding included): the fp32 weights under
        "weight", and each elementwise optimizer state (e.g. Adam's "exp_avg") under its key.
        The tensors are live; copy them before training goes on. With NVMe offload they are read
        from the swap files into fresh tensors, the whole state at once: to stream it through
        bounded buffers instead, use :meth:`stream_shard_state`.
        """
        out = []
        for g in self.groups:
            tensors = {"weight": self.optim.master(g)}
            if g.trainable:
                tensors.update(self.optim.states(g))
            out.append(GroupShard(g.name, g.slots, g.numel, g.shard_world, g.shard_rank, g.lo, g.hi, g.param_group, tensors))
        return out

    def register_stateful(self, name: str, obj: Stateful) -> None:
        """Save ``obj.state_dict()`` (small, JSON-able: e.g. a data loader's position) with every checkpoint and
        snapshot of this engine, under ``name``, and hand it back to ``obj.load_state_dict`` when one is loaded,
        before the shards (it raises ValueError on a bad state, so bad data in storage fails before any use).
        Registered after a load that holds ``name``, ``obj`` is loaded at once. A later object of the same
        name replaces the earlier one."""
        self._stateful[name] = obj
        if name in self._loaded_stateful:
            obj.load_state_dict(self._loaded_stateful[name])

    def _load_stateful(self, meta: dict[str, Any]) -> None:
        """The registered objects' states from a loaded ``meta`` (checked first: a JSON object per name)."""
        saved = meta.get("stateful") or {}
        if not isinstance(saved, dict) or not all(isinstance(k, str) and isinstance(v, dict) for k, v in saved.items()):
            raise ValueError("the checkpoint's 'stateful' entry must map names to JSON objects")
        for name, obj in self._stateful.items():
            if name in saved:
                obj.load_state_dict(saved[name])
        self._loaded_stateful = saved

    def state_meta(self) -> dict[str, Any]:
        """JSON-able engine state beside the shards: counters, loss scale, LR scheduler, per param
        group optimizer scalars (e.g. Adam's step) and hyperparameters, and the registered objects' states
        (:meth:`register_stateful`)."""
        scalars = self.optim.scalars()  # per param group, e.g. Adam's step
        extra = {"stateful": {n: o.state_dict() for n, o in self._stateful.items()}} if self._stateful else {}
        return {
            **extra,
            "global_step": self.global_step,
            "micro_step": self.micro_step,
            "skipped_steps": self.skipped_steps,
            "loss_scaler": self.loss_scaler.state_dict(),
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "optimizer_class": type(self.optimizer).__name__,
            "optimizer_scalars": scalars,
            "param_steps": self._uneven_param_steps(),
            "param_groups": [
                {k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, str, bool, list, tuple, type(None)))}
                for g in self.optimizer.param_groups
            ],
            "stage": self.stage,
            "world_size": self.world_size,
            "precision": self.config.precision.name,
        }

    def stream_shard_state(self) -> list[GroupSource]:
        """This rank's slices of every logical flat group, as :meth:`shard_state` but read on demand:
        nothing is read until a group's ``read(key)`` is iterated, and then only one bounded piece
        at a time where the states live in swap files (NVMe offload). What a checkpoint save
        streams; its metadata is what a load needs to plan its reads."""
        out = []
        for g in self.groups:
            keys = ("weight", *self.optim.state_keys(g)) if g.trainable else ("weight",)
            out.append(GroupSource(
                g.name, g.slots, g.numel, g.shard_world, g.shard_rank, g.lo, g.hi, g.param_group, keys,
                self.optim.in_memory or not g.trainable, functools.partial(self.optim.read, g), g.copy, g.copies,
            ))
        return out

    def copy_shard_state(self) -> ShardStateCopy | None:
        """What :meth:`stream_shard_state` reads, copied now so that training may run past it (a
        save in the background): with NVMe offload, the swap files copied on their disk through the
        swap buffer pool (no host memory added), then read from one thread through a buffer of
        ``offload_io.block_size`` bytes; ``close()`` removes the copy. None where the optimizer
        states live in memory (copy the live tensors instead) or the disk has no room for a copy.
        Frozen groups' sources stay live tensors (``in_memory``)."""
        copy = self.optim.copy()
        if copy is None:
            return None
        groups = [
            dataclasses.replace(src, read=functools.partial(copy.read, g), in_memory=False) if g.trainable else src
            for g, src in zip(self.groups, self.stream_shard_state(), strict=True)
        ]
        return ShardStateCopy(groups, copy.close)

    def load_shard_state(self, tensors: dict[str, dict[str, torch.Tensor]], meta: dict[str, Any]) -> None:
        """Collective: install shards (keyed like :meth:`shard_state`, for *this* engine's groups)
        and ``meta``, then rebuild every rank's parameters from the loaded weights.

        The engine takes ownership of the optimizer-state tensors (no copy when device and dtype
        already fit): hand it tensors nobody else writes to."""
        param_scalars = self._param_scalars(meta)  # checked before anything changes
        self._load_stateful(meta)
        self.mid_update = True  # until the counters match the loaded state
        with torch.no_grad():
            for g in self.groups:
                if not g.trainable:
                    g.write_shard(0, g.shard_numel, tensors[g.name]["weight"].reshape(-1))
            self.optim.load({g: tensors[g.name] for g in self.optim.groups}, self._scalars(meta), param_scalars)
            self._publish(self.groups)
        self._load_meta(meta)
        self.mid_update = False

    def load_shard_stream(
        self, keys: dict[str, Sequence[str]], fill: Callable[[list[ShardRange]], None], meta: dict[str, Any]
    ) -> None:
        """Collective: as :meth:`load_shard_state`, but the engine asks ``fill`` for the values, into
        destinations of its own: ``keys[group]`` names what to load ("weight" and the optimizer
        states; "weight" alone leaves the states fresh). With the states in memory, one call asks
        for everything before anything changes (a failed read leaves the engine as it was); with
        NVMe offload, one call per sub-group fills the swap buffers and each file is written once,
        so host memory stays bounded by the buffer pool (a failed read leaves part of the state
        loaded: load again)."""
        param_scalars = self._param_scalars(meta)  # checked before anything changes
        self._load_stateful(meta)
        frozen = [g for g in self.groups if not g.trainable]
        weights = {g: torch.empty(g.shard_numel, dtype=torch.float32) for g in frozen}
        self.mid_update = True  # until the counters match the loaded state

        def ranges(parts: list[tuple[FlatGroup, str, int, int, torch.Tensor]]) -> list[ShardRange]:
            return [ShardRange(g.name, k, lo, hi, dest) for g, k, lo, hi, dest in parts]

        with torch.no_grad():
            if weights:
                fill(ranges([(g, "weight", 0, g.shard_numel, t) for g, t in weights.items()]))
            self.optim.load_stream(
                {g: keys[g.name] for g in self.optim.groups}, lambda parts: fill(ranges(parts)), self._scalars(meta),
                param_scalars,
            )
            for g, t in weights.items():
                g.write_shard(0, g.shard_numel, t)
            self._publish(self.groups)
        self._load_meta(meta)
        self.mid_update = False

    def _scalars(self, meta: dict[str, Any]) -> list[dict[str, float]]:
        saved = meta.get("optimizer_scalars") or []
        return [saved[i] if i < len(saved) else {} for i in range(len(self.optimizer.param_groups))]

    def _uneven_param_steps(self) -> dict[str, int]:
        """``{name: steps}`` of the parameters stepped fewer times than their param group's most
        stepped one (they got no gradient at some steps)."""
        most: dict[int | None, int] = {}
        for g, counts in self._param_steps.items():
            most[g.param_group] = max(most.get(g.param_group, 0), *counts)
        return {n: c for g, counts in self._param_steps.items() for n, c in zip(g.param_names, counts)
                if c != most[g.param_group]}

    def _param_scalars(self, meta: dict[str, Any]) -> dict[str, dict[str, float] | None]:
        """Per parameter with uneven steps (see :meth:`_uneven_param_steps`), its scalar states: its
        group's with its own step count, or None (never stepped: fresh). Checks them first."""
        uneven = meta.get("param_steps") or {}
        if not isinstance(uneven, dict) or not all(
            isinstance(k, str) and type(v) is int and v >= 0 for k, v in uneven.items()
        ):
            raise ValueError("the checkpoint's param_steps must map parameter names to step counts >= 0")
        scalars = self._scalars(meta)
        out: dict[str, dict[str, float] | None] = {}
        for g in self._param_steps:
            common = scalars[g.param_group]
            for name in g.param_names:
                if name in uneven:
                    n = uneven[name]
                    out[name] = None if n == 0 else {**common, "step": float(n)} if "step" in common else common
        return out

    def _load_meta(self, meta: dict[str, Any]) -> None:
        # Hyperparameters an LR scheduler changed (lr, ...), as torch's Optimizer.load_state_dict does.
        for group, saved in zip(self.optimizer.param_groups, meta.get("param_groups", [])):
            for k, v in saved.items():
                if k in group:
                    group[k] = tuple(v) if isinstance(group[k], tuple) else v
        self.global_step = int(meta.get("global_step", 0))
        scalars, uneven = self._scalars(meta), meta.get("param_steps") or {}
        for g, counts in self._param_steps.items():
            steps = int(scalars[g.param_group].get("step", self.global_step))
            counts[:] = [uneven.get(name, steps) for name in g.param_names]
        self.micro_step = int(meta.get("micro_step", self.global_step * self.gradient_accumulation_steps))
        self.skipped_steps = int(meta.get("skipped_steps", 0))
        if meta.get("loss_scaler"):
            self.loss_scaler.load_state_dict(meta["loss_scaler"])
        if self.lr_scheduler is not None and meta.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(meta["lr_scheduler"])

    def _publish(self, groups: list[FlatGroup], masters_copied: bool = False) -> None:
        """Rebuild the compute parameters from the (new) master shards (``masters_copied``: the
        optimizer's home wrote them into the compute shards already); stages 1-2 all-gather them,
        allgather_bucket_size elements at a time."""
        gathers = InFlight(self.config.comm.allgather_bucket_size)
        for g in groups:
            gathers.add(g.publish_master(cast=not masters_copied), g.padded)
        with self._phases.phase("comm_wait"):
            gathers.wait_all()

    def _quantize_pools(self) -> list[ScratchPool]:
        """The buffer pools of the groups' quantized collectives (qwZ and qgZ share them across groups)."""
        kernels = {id(c.quantizer): c.quantizer for g in self.groups for c in (g.qwz, g.qgz) if c is not None}
        return [k.pool for k in kernels.values()]

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds persistently, by category (master weights count under optimizer; hpZ's
        secondary parameters, held between a unit's forward and backward, under ``params_secondary``)."""
        opt = self.optim.memory()
        on_device = self._shard_device == self.device
        params = sum(g.param_bytes() for g in self.groups)
        report = {
            "params": params if on_device else 0,
            "grads": sum(g.grad_bytes() for g in self.groups),
            "optimizer": opt["master"] + opt["states"],
            "buffers": sum(b.numel() * b.element_size() for b in self.module.buffers()),
        }
        report["master_weights"] = opt["master"]
        report["grad_buffers_cached"] = self.reducer.cached_bytes()  # reused temporaries, stages 2-3
        report["gather_buffers_cached"] = self.gather_pool.cached_bytes()  # free gather memory, stage 3
        # ZeRO++: the quantized collectives' reused temporaries (CPU), between collectives
        report["quantize_buffers_cached"] = sum(p.cached_bytes() for p in self._quantize_pools())
        report["optimizer_states"] = opt["states"]
        # Of "grads": sharded gradient shards (stages 2-3) given back now, between steps; a backward's first
        # reduction takes them again, so they are in "total", which is the step's persistent peak.
        report["grads_released"] = sum(g.grad_bytes() for g in self.groups if g.grads is None and g.grad_shard is None)
        # hpZ: the secondary copies of the parameters, held from each unit's forward to its backward.
        report["params_secondary"] = sum(g.secondary_bytes() for g in self.groups)
        report["total"] = (report["params"] + report["grads"] + report["optimizer"] + report["buffers"]
                           + report["params_secondary"])
        # Offload: bytes kept off the device, in host memory and in swap files (not in "total").
        report["host"] = opt["host"] + (0 if on_device else params)
        report["nvme"] = opt["nvme"]
        if self._param_files is not None:  # parked shards: their files and the buffers they go through
            report["host"] += self._param_files.host_bytes()
            report["nvme"] += self._param_files.file_bytes()
        return report

    def phase_report(self) -> StepTimes:
        """Mean seconds per optimizer step in forward, backward, optimizer step and exposed
        communication wait since the previous call; reading it never waits for the device (CUDA
        times not yet complete count at a later call)."""
        return self._phases.report()

    def offload_report(self) -> dict[str, int]:
        """Cumulative bytes moved to and from the offload tier since set-up, keyed ``"<tier>:<direction>"``
        (the metrics' offload panels): ``"nvme:read"`` / ``"nvme:write"``, the swap files' traffic;
        ``"cpu:write"`` / ``"cpu:read"``, gradients copied to host memory and updated weights copied back
        (CPU offload on an accelerator). Empty without offload, and with CPU offload on a CPU-only machine
        (host memory is the device: nothing moves)."""
        out: dict[str, int] = {}
        for io in (self.optim.io_report(), self._param_files.io_report() if self._param_files else {}):
            if "bytes_read" in io:
                out["nvme:read"] = out.get("nvme:read", 0) + int(io["bytes_read"])
                out["nvme:write"] = out.get("nvme:write", 0) + int(io["bytes_written"])
            if "bytes_to_host" in io:
                out.update({"cpu:write": int(io["bytes_to_host"]), "cpu:read": int(io["bytes_to_device"])})
        return out

    def offload_io(self) -> dict[str, dict[str, float]]:
        """Offload traffic in detail, cumulative: ``"optimizer"`` (swap files: bytes and the seconds the
        step waited; CPU offload on an accelerator: copies each way, gradient copies started during
        backward or left to the step) and ``"params"`` (parameter files: bytes, read wait, gathers served
        by read-ahead or on demand); empty dicts where nothing is offloaded."""
        return {"optimizer": self.optim.io_report(), "params": self._param_files.io_report() if self._param_files else {}}

    def comm_report(self, by_scope: bool = False) -> dict[str, int]:
        """Cumulative bytes per collective kind since set-up or the last reset. ``by_scope`` (when the
        engine was given each rank's node): keys ``"intra_node:<kind>"`` for collectives among ranks of one
        node, ``"inter_node:<kind>"`` for those that span nodes."""
        return self.topology.report(by_scope)

    def setup_comm_report(self) -> dict[str, int]:
        """Bytes per collective kind that set-up moved (rank 0's weights and buffers broadcast to
        all; nothing for a meta-built model): :meth:`comm_report` starts counting after set-up."""
        return dict(self._setup_comm)

    def reset_comm_report(self) -> None:
        self.topology.reset()

    @contextlib.contextmanager
    def gathered_parameters(
        self, params: nn.Parameter | Iterable[nn.Parameter] | None = None, modifier_rank: int | None = None
    ) -> Iterator[None]:
        """Collective: inside, ``params`` (default: all) hold their full values, at every stage.

        With ``modifier_rank=r``, what rank r wrote into them inside reaches every rank's parameters,
        shards and fp32 master weights on exit (DeepSpeed's ``GatheredParameters``); without it,
        writes are discarded at stage 3. Like every collective, all ranks must enter it."""
        if modifier_rank is not None and not 0 <= modifier_rank < self.world_size:
            raise ValueError(f"modifier_rank {modifier_rank} is outside world size {self.world_size}")
        groups = self.groups
        if params is not None:
            wanted = {id(p) for p in ([params] if isinstance(params, torch.Tensor) else params)}
            known = {id(p) for g in self.groups for p in g.params}
            if wanted - known:
                raise ValueError(f"{len(wanted - known)} of the given parameters are not parameters of this engine's model")
            groups = [g for g in self.groups if any(id(p) in wanted for p in g.params)]
        units = [u for u in self.scheduler.all_units if any(g in groups for g in u.groups)] if self.scheduler else []
        for u in units:
            u.hold()
        try:
            yield
            if modifier_rank is not None:
                with torch.no_grad():
                    for g in groups:
                        self.comm.broadcast(g.full, src=modifier_rank)
                        self.optim.settle()  # no copy of the masters to the device is in flight
                        g.adopt_full()
                        if g.trainable and g.master is None:  # the master is in a swap file
                            self.optim.adopt(g, g.full[g.lo : g.hi])
        finally:
            for u in units:
                u.release()

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group the engine's collectives run on (None at world size 1 without torch.distributed,
        and after :meth:`abort`)."""
        return self.comm.group

    def abort(self, reason: str) -> None:
        """Give up this engine's process group after a failure (a peer died, or this rank's loop raised):
        drop the collectives in flight and the engine's references to the group, without waiting.

        Why: on gloo a collective's work object keeps its transport's connections open. Held by a rank that
        has given up, they leave a peer blocked in a collective with that rank until the collective timeout;
        dropped, the peer's collective fails as soon as this rank leaves the group. The engine does this
        itself when one of its collectives fails; call it when the loop failed elsewhere. Afterwards any
        collective raises ``GroupAborted`` naming ``reason``; :meth:`close` still removes the hooks."""
        self.topology.abort(reason)

    def close(self) -> None:
        """Wait for any collective still in flight, then remove every hook zeroray put on the model
        and on the user's optimizer. Stage 3 (collective): the parameters get their full values back
        and stay gathered, so the model can be used, saved or wrapped again (not after :meth:`abort`:
        each rank keeps only its shard)."""
        self.topology.close()
        self.reducer.remove()
        if self.scheduler is not None:
            self.scheduler.remove()
            if self.comm.aborted is None:
                for g in self.groups:
                    g.keep_gathered()
        self.gather_pool.clear()
        for pool in self._quantize_pools():
            pool.clear()
        if self._guard is not None:
            self._guard.remove()
        self._template_hook.remove()
        try:
            self.optim.close()
        finally:
            if self._param_files is not None:
                self._param_files.close()
        for m in self.module.modules():
            if HELD.get(m) is self:
                del HELD[m]


def initialize(
    model: nn.Module,
    optimizer: OptimizerArg = None,
    config: ConfigArg = None,
    process_group: dist.ProcessGroup | None = None,
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    *,
    init_fn: InitFn | None = None,
    device: str | torch.device | None = None,
    loaded_keys: Collection[str] = (),
    mesh: DeviceMesh | None = None,
    nodes: Sequence[object] | None = None,
) -> ZeroEngine:
    """Wrap ``model`` and ``optimizer`` in a ZeRO engine on ``process_group`` (default: WORLD).

    ``optimizer``: an optimizer over ``model.parameters()`` (rebuilt over this rank's shards), a
    callable ``params -> Optimizer``, or None when ``config`` names one. ``config``: a ZeroConfig,
    a DeepSpeed-style dict, or a path to a DeepSpeed JSON file. ``lr_scheduler``: a callable
    ``optimizer -> scheduler`` (the optimizer it gets is the sharded one), stepped at boundaries.

    ``model`` may be built wholly or partly under ``with torch.device("meta"):``. Its meta
    parameters and buffers are then initialized on every rank alike, module by module in
    ``model.modules()`` order, by ``init_fn(module)`` or else each module's ``reset_parameters()``
    (seed every rank the same first); at stage 3 straight into this rank's shards, one module's
    tensors at a time. No weight is broadcast for them. The engine computes on the device of the
    model's real parameters; for a wholly meta model on ``device``, by default the current CUDA
    device when CUDA is available and the process group is NCCL (or absent), else the CPU.

    ``loaded_keys``: names of meta parameters and buffers that a checkpoint fills right after (e.g.
    ``zeroray.pretrained_keys(model, source)`` before ``zeroray.load_pretrained``): they are not
    initialized, and a module whose meta tensors are all among them needs no initializer, as Hugging
    Face skips the keys it loads; ``engine.initialized_names`` lists what was initialized.

    Hybrid sharding (stages 1-3): ``config.shard_group_size`` k shards the states over k consecutive ranks
    and replicates them across the N/k groups (DeepSpeed's ``mics_shard_size``); or pass ``mesh``, a 2-D
    ``DeviceMesh`` with dims ``("replicate", "shard")`` as FSDP2's HSDP takes. ``nodes``: the node of each
    rank (any labels), so :meth:`ZeroEngine.comm_report` can tell intra-node from inter-node bytes.
    """
    return ZeroEngine(model, optimizer, config, process_group, lr_scheduler, init_fn=init_fn, device=device,
                      loaded_keys=loaded_keys, mesh=mesh, nodes=nodes)
