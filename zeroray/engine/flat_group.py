"""FlatGroup: a set of parameters laid out in one flat, padded buffer, sharded across ranks.

Each ``nn.Parameter`` in the group becomes a view into ``full`` (the compute-precision flat
buffer), so the user's module runs unchanged. What this rank keeps persistently follows the
config's :class:`~zeroray.config.Sharding` flags:

- parameters: ``full`` (every parameter), or with ``shards_params`` only ``shard`` (its slice);
  then ``full``'s storage gives its memory back to the :class:`GatherPool` between uses and is
  gathered again on demand. While freed, each parameter points at a placeholder of its own shape
  over one NaN element (all strides 0), so nothing can reach freed memory and ``p.shape`` /
  ``p.numel()`` stay right for code that counts or checks them (:mod:`zeroray.engine.param_guard`
  turns any use of the values into an error naming the parameter);
- gradients (in the precision policy's ``reduce_dtype``): a full :class:`GradBuffer`, or with
  ``shards_grads`` only the gradient shard (stage 2-3 reduce from pooled temporaries), held from a step's
  first reduction to the end of the step;
- the fp32 master shard (a view of the compute shard in plain fp32, its own tensor otherwise)
  that the optimizer updates; the optimizer's states are shaped like it.

Which slice a rank owns comes from :mod:`zeroray.engine.layout`.

A group whose parameters are all on the meta device with ``shards_params`` never allocates
``full`` at set-up: it starts from a zero shard, :meth:`write` copies this rank's slice of each
parameter into it as :mod:`zeroray.engine.materialize` initializes them, and ``full`` gets storage
at the first gather. Any other group with meta parameters (partly real) starts from a ``full``
holding its real parameters, and :meth:`write` fills in the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum
from typing import Protocol

import torch
from torch import nn

from zeroray.config import Sharding
from zeroray.engine import layout
from zeroray.engine.comm import Chain, Comm, Handle
from zeroray.engine.gather_pool import GatherPool
from zeroray.engine.grad_buffer import GradBuffer
from zeroray.engine.quantized_comm import Phase, QuantizedGather, QuantizedReduceScatter


class ShardFiles(Protocol):
    """Where parked compute shards live (offload_param "nvme"), as a group uses it; implemented by
    :class:`~zeroray.engine.offload.param_files.ParamFiles`, which this module does not import."""

    def write(self, g: FlatGroup, lo: int, hi: int, values: torch.Tensor) -> None:
        """Set ``[lo, hi)`` of ``g``'s shard in its file."""

    def values(self, g: FlatGroup) -> torch.Tensor:
        """A fresh copy of ``g``'s shard, read from its file."""

    def fill(self, g: FlatGroup, dst: torch.Tensor) -> None:
        """Read ``g``'s shard (usually read ahead already) into ``dst``."""


def _storageless(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D tensor of ``numel`` elements over no storage. A tensor of this shape cannot be made over
    less: allocate (untouched) and free at once, as FSDP2 does."""
    t = torch.empty(numel, dtype=dtype, device=device)
    t.untyped_storage().resize_(0)
    return t


class ParamState(Enum):
    FREED = 0
    GATHERING = 1
    GATHERED = 2


class FlatGroup:
    """One flat buffer of parameters sharing a unit, an optimizer param group and a dtype."""

    def __init__(
        self,
        name: str,
        params: Sequence[tuple[str, nn.Parameter]],
        comm: Comm,
        *,
        sharding: Sharding,
        compute_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        trainable: bool,
        param_group: int | None,
        device: torch.device,
        pool: GatherPool,
        check: Callable[[str], None] | None = None,
        replicas: Comm | None = None,
        world: Comm | None = None,
        secondary: Comm | None = None,
        qwz: QuantizedGather | None = None,
        qgz: QuantizedReduceScatter | None = None,
    ):
        self.name = name
        self.comm = comm  # the shard group: gathers and reductions (every rank unless hybrid)
        self.replicas = replicas  # hybrid: the ranks holding the same shard in the other shard groups
        self.world = comm if world is None else world  # every rank: the start-up broadcast
        self.world_size = comm.world_size * (1 if replicas is None else replicas.world_size)
        # hpZ (stage 3): the ranks of this node among the shard group. After a forward, this rank keeps its
        # 1/h of the gathered parameters, so the backward's gather runs inside the node (see keep_secondary).
        self.secondary_comm = secondary
        self._secondary: torch.Tensor | None = None
        self.qwz = qwz  # ZeRO++: the step's gathers in int8 (stage 3) ...
        self.qgz = qgz  # ... and the gradient reduce-scatter as a quantized all-to-all (stages 2-3)
        self.pool = pool  # where gathered memory comes from and goes back to (sharded params)
        self.check = check  # called with the group's name before each gather (a GatherCheck)
        self.sharding = sharding
        self.trainable = trainable
        self.param_group = param_group
        self.params = [p for _, p in params]
        self.param_names = [n for n, _ in params]
        self.slots = layout.build_slots(self.param_names, [tuple(p.shape) for p in self.params])
        self.numel = layout.group_numel(self.slots)
        # Without sharding (stage 0): one "shard" that is the whole group.
        sharded = sharding.shards_optimizer
        self.shard_world = comm.world_size if sharded else 1
        self.shard_rank = comm.rank if sharded else 0
        # Which of the identical copies of this shard this rank holds, of how many (see GroupSource).
        if not sharded:
            self.copy, self.copies = self.world.rank, self.world.world_size
        elif replicas is not None:
            self.copy, self.copies = replicas.rank, replicas.world_size
        else:
            self.copy, self.copies = 0, 1
        self.padded = layout.padded_numel(self.numel, self.shard_world)
        self.lo, self.hi = layout.shard_range(self.numel, self.shard_world, self.shard_rank)
        self.shard_numel = self.hi - self.lo
        self.device = device
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self._slot_of = {id(p): slot for slot, p in zip(self.slots, self.params)}
        self.has_meta = any(p.is_meta for p in self.params)
        self.has_real = not all(p.is_meta for p in self.params)

        # Until install(), values are held in the finer of the parameters' and the compute dtype
        # (trainable groups): the fp32 masters start from the values the model was built with, not
        # from their bf16 rounding, as FSDP2's do.
        self._staging_dtype = (
            torch.promote_types(compute_dtype, self.params[0].dtype)
            if trainable and compute_dtype.is_floating_point
            else compute_dtype
        )
        # Built sharded: all-meta parameters that will be sharded need no full buffer at set-up.
        self._built_sharded = not self.has_real and sharding.shards_params
        if self._built_sharded:
            # The storage comes back at the first gather.
            self.full = _storageless(self.padded, compute_dtype, device)
            self.shard = torch.zeros(self.shard_numel, dtype=self._staging_dtype, device=device)
            self.state = ParamState.FREED
        else:
            full = torch.zeros(self.padded, dtype=self._staging_dtype, device=device)
            with torch.no_grad():
                for slot, p in zip(self.slots, self.params):
                    if not p.is_meta:
                        full[slot.offset : slot.end].copy_(p.detach().reshape(-1))
            self.full = full
            self.state = ParamState.GATHERED
        self._gather: Handle | None = None
        self._initial_master: torch.Tensor | None = None  # see take_initial_master
        self.files: ShardFiles | None = None  # offload_param "nvme": the shard lives in a file (park())
        # One element every freed parameter of this group points at (see _free_storage).
        self._placeholder = torch.empty(1, dtype=compute_dtype, device=device)

    # ------------------------------------------------------------------ set-up (collective)
    def sync_from_rank0(self) -> None:
        """All ranks start from rank 0's values, as DDP does at construction."""
        self.world.broadcast(self.full, src=0)

    def write(self, param: nn.Parameter) -> None:
        """Take the (materialized, initialized) value of ``param``, a parameter of this group that was
        on meta: into ``full``, or when built sharded only the part that falls in this rank's shard."""
        slot = self._slot_of[id(param)]
        flat = param.detach().reshape(-1)
        with torch.no_grad():
            if not self._built_sharded:
                self.full[slot.offset : slot.end].copy_(flat)
                return
            lo, hi = max(slot.offset, self.lo), min(slot.end, self.hi)
            if lo < hi:
                self.shard[lo - self.lo : hi - self.lo].copy_(flat[lo - slot.offset : hi - slot.offset])

    def install(
        self,
        master_dtype: torch.dtype,
        master_device: torch.device | None = None,
        shard_device: torch.device | None = None,
        *,
        keep_master: bool = True,
        own_master: bool = False,
        pin_memory: bool = False,
    ) -> None:
        """Point the parameters at ``full``, cut this rank's shard, make master and grad buffers.

        ``master_device``: where the fp32 master lives (host memory under CPU offload; default the
        device); ``keep_master=False`` when the optimizer keeps it elsewhere (NVMe files).
        ``shard_device``: where a sharded compute shard lives between gathers (host memory under
        parameter offload; default the device). ``own_master``: never let the master be the shard
        itself (the shard will be parked in a file). ``pin_memory``: host copies of a CUDA group are
        page-locked (faster, asynchronous copies)."""
        pin = pin_memory and self.device.type == "cuda"
        master_device = self.device if master_device is None else master_device
        shard_device = self.device if shard_device is None or not self.sharding.shards_params else shard_device
        # This rank's values in the staging dtype (finer than the compute dtype: the master's source).
        exact: torch.Tensor | None = None
        if self._staging_dtype != self.compute_dtype:
            if self._built_sharded:
                exact, self.shard = self.shard, self.shard.to(self.compute_dtype)
            else:
                exact, self.full = self.full[self.lo : self.hi], self.full.to(self.compute_dtype)
        if not self._built_sharded:  # else the shard is already filled and full has no storage
            self._point_params_at_full()
            if self.sharding.shards_params:
                self.shard = self.full[self.lo : self.hi].to(shard_device, copy=True)
                if pin and shard_device.type == "cpu":
                    self.shard = self.shard.pin_memory()
            else:
                self.shard = self.full[self.lo : self.hi]
        elif shard_device != self.device:
            self.shard = self.shard.to(shard_device)
            if pin and shard_device.type == "cpu":
                self.shard = self.shard.pin_memory()
        self.grads: GradBuffer | None = None  # the persistent full gradient buffer (unsharded grads)
        if not self.trainable:
            self.master = None
            self.grad_shard = None
        else:
            # Plain fp32 without a copy updates the compute shard in place; other cases keep an fp32 copy.
            # The master's initial values when it lives elsewhere (NVMe files): read once by its home.
            self._initial_master = exact if not keep_master else None
            if not keep_master:
                self.master = None
            elif master_dtype == self.compute_dtype and master_device == self.shard.device and not own_master:
                self.master = self.shard
            else:
                source = self.shard if exact is None else exact
                self.master = source.to(device=master_device, dtype=master_dtype, copy=True)
                if pin and master_device.type == "cpu":
                    self.master = self.master.pin_memory()
            if not self.sharding.shards_grads:
                data = torch.zeros(self.padded, dtype=self.reduce_dtype, device=self.device)
                self.grads = GradBuffer(data, self.slots, self.numel)
                self.grad_shard = data[self.lo : self.hi]
            else:  # made by the step's first reduction, released after the step (see _average_into_shard)
                self.grad_shard = None
        if self.sharding.shards_params:
            self._free_storage(to_pool=False)  # the pool keeps only memory that gathers use

    def park(self, files: ShardFiles) -> None:
        """offload_param "nvme": ``files`` holds this group's shard from now on (it wrote it at its
        attach); the in-memory shard keeps its shape over no storage, so a stray read fails loudly."""
        self.files = files
        self.shard = _storageless(self.shard_numel, self.compute_dtype, self.shard.device)

    def write_shard(self, lo: int, hi: int, values: torch.Tensor, non_blocking: bool = False) -> None:
        """Set the compute shard's ``[lo, hi)`` to ``values`` (cast), in memory or in its file."""
        if self.files is not None:
            self.files.write(self, lo, hi, values)
        else:
            self.shard[lo:hi].copy_(values, non_blocking=non_blocking)

    def shard_values(self) -> torch.Tensor:
        """The compute shard's values: the live tensor, or a fresh copy read from its file."""
        return self.shard if self.files is None else self.files.values(self)

    def _point_params_at_full(self) -> None:
        for slot, p in zip(self.slots, self.params):
            p.data = self.full[slot.offset : slot.end].view(slot.shape)

    # ------------------------------------------------------------------ sharded params: gather / free
    def _free_storage(self, to_pool: bool = True) -> None:
        """Point the parameters at the placeholder; ``full``'s memory goes to the pool (or back to
        the allocator: at set-up, and the root unit freed early in backward)."""
        # Refilled at every free: fill_() on a placeholder (allowed on overlapping memory) must not
        # turn the next reads into plausible numbers.
        self._placeholder.fill_(float("nan") if self.compute_dtype.is_floating_point else 0)
        for slot, p in zip(self.slots, self.params):
            p.data = self._placeholder.as_strided(slot.shape, [0] * len(slot.shape))
        if to_pool:
            self.pool.empty(self.full)
        else:
            self.full.untyped_storage().resize_(0)
        self.state = ParamState.FREED

    def start_gather(self, phase: Phase | None = None) -> None:
        """Issue the all-gather of this group's shards (async); no-op unless freed. ``phase``: the step's gather
        for its "forward" or "backward" (int8 under qwZ, see ``QuantizedGather.quantizes``), None for exact values."""
        if self.state is not ParamState.FREED:
            return
        if self.check is not None:
            self.check(self.name)
        self.pool.fill(self.full, self.padded * self.full.element_size())
        if self._secondary is not None:  # hpZ: the copy kept after forward, gathered inside the node
            secondary, self._secondary = self._secondary, None
            self._gather = self.secondary_comm.all_gather(self.full, secondary, async_op=True)
            self.state = ParamState.GATHERING
            return
        if self.files is not None:  # read (usually ahead already) straight into my slice of full
            shard = self.full[self.lo : self.hi]
            self.files.fill(self, shard)
        elif self.shard.device == self.device:
            shard = self.shard
        else:  # an offloaded shard comes to the device first (on a CPU-only machine it is there already)
            shard = self.shard.to(self.device, non_blocking=True)
        if self.qwz is not None and self.qwz.quantizes(phase):
            self._gather = self.qwz.all_gather(self.comm, self.full, shard, self.name)
        else:
            self._gather = self.comm.all_gather(self.full, shard, async_op=True)
        self.state = ParamState.GATHERING

    def wait_gather(self) -> None:
        if self.state is ParamState.FREED:
            self.start_gather()
        if self.state is ParamState.GATHERING:
            self._gather.wait()
            self._gather = None
            self._point_params_at_full()
            self.state = ParamState.GATHERED

    def free(self, to_pool: bool = True) -> None:
        """Drop the full parameters (sharded params only); waits for an in-flight gather first.
        ``to_pool=False``: the memory goes back to the allocator, not to the gather pool."""
        if not self.sharding.shards_params or self.state is ParamState.FREED:
            return
        if self.state is ParamState.GATHERING:
            self.wait_gather()
        self._free_storage(to_pool)

    def keep_secondary(self) -> None:
        """hpZ, before the free after a forward that a backward follows: keep this rank's part of the
        gathered parameters over the secondary (node) group, which the backward's gather reads."""
        if self.secondary_comm is None or self.state is not ParamState.GATHERED:
            return
        s = self.padded // self.secondary_comm.world_size
        r = self.secondary_comm.rank
        self._secondary = self.full[r * s : (r + 1) * s].clone()

    def drop_secondary(self) -> None:
        """The backward is over (or the weights changed): the secondary copy is stale or unneeded."""
        self._secondary = None

    def secondary_bytes(self) -> int:
        """hpZ: bytes of this group's secondary copy, held from its forward to its backward."""
        if self.secondary_comm is None:
            return 0
        return self.padded // self.secondary_comm.world_size * self.full.element_size()

    def keep_gathered(self) -> None:
        """Gather and stop sharding the parameters for good (the engine is closing)."""
        self.wait_gather()
        self.sharding = Sharding(self.sharding.shards_optimizer, self.sharding.shards_grads, shards_params=False)
        if self.files is not None:  # the file goes with the engine; full holds the values now
            self.shard, self.files = self.full[self.lo : self.hi], None

    # ------------------------------------------------------------------ gradients
    def open_grads(self) -> GradBuffer | None:
        """The persistent gradient buffer, ready for this backward's gradients (None when the
        gradients are sharded: the reducer hands out a temporary from its pool)."""
        if self.grads is not None:
            self.grads.reopen(self.lo, self.hi, self.comm.world_size, sharded=self.shard_world > 1)
        return self.grads

    def new_grad_buffer(self, data: torch.Tensor | None = None) -> GradBuffer:
        """A temporary gradient buffer for sharded gradients, over ``data`` (a pooled tensor of
        ``padded`` elements) or a new one."""
        if data is None:
            data = torch.empty(self.padded, dtype=self.reduce_dtype, device=self.device)
        return GradBuffer(data, self.slots, self.numel)

    def reduce(self, buf: GradBuffer, async_op: bool) -> Handle:
        """Average ``buf`` across ranks into this rank's gradient shard (accumulating). Hybrid: reduced
        inside the shard group, then this rank's shard across the replicas."""
        persistent = buf is self.grads
        if persistent:
            buf.reopen(self.lo, self.hi, self.comm.world_size, sharded=self.shard_world > 1)
        buf.seal()
        data = buf.data
        comm = self.comm
        inv = 1.0 / self.world_size
        if persistent:
            buf.mark_reduced()
        if self.shard_world == 1 or not (comm.use_reduce_scatter or self.qgz is not None):
            h = self._across_replicas(comm.all_reduce(data, async_op=async_op), data[self.lo : self.hi])
            if persistent:  # grad_shard is a view of it: average just that part
                return h.then(lambda: self.grad_shard.mul_(inv)) if inv != 1.0 else h
            lo, hi = self.lo, self.hi
            return h.then(lambda: self._average_into_shard(data[lo:hi], inv, own=False))
        out = torch.empty(self.shard_numel, dtype=data.dtype, device=data.device)
        if self.qgz is not None and not persistent:  # always async
            return self._across_replicas(self.qgz.reduce_scatter(out, data, self.name), out).then(
                lambda: self._average_into_shard(out, inv, own=True))
        h = self._across_replicas(comm.reduce_scatter(out, data, async_op=async_op), out)
        if persistent:
            return h.then(lambda: torch.mul(out, inv, out=self.grad_shard))
        return h.then(lambda: self._average_into_shard(out, inv, own=True))

    def _average_into_shard(self, reduced: torch.Tensor, inv: float, own: bool) -> None:
        """Add ``reduced * inv`` to the gradient shard (stages 2-3). The step's first reduction becomes the shard
        (``own``: ``reduced`` is this reduction's own tensor, scaled in place; else a copy), the same bits as
        adding it to zeros: the shard holds memory only from the first reduction to the end of the step, not
        through the forward, when the activations are there (what torch's own gradients do)."""
        if self.grad_shard is None:
            self.grad_shard = reduced.mul_(inv) if own else torch.mul(reduced, inv)
        else:
            self.grad_shard.add_(reduced, alpha=inv)

    def _across_replicas(self, reduced: Handle, shard: torch.Tensor) -> Handle:
        """Hybrid: once ``reduced`` (in the shard group) is done, sum ``shard`` over the replicas."""
        if self.replicas is None:
            return reduced
        replicas = self.replicas
        return Chain(reduced, lambda: replicas.all_reduce(shard, async_op=True))

    def zero_grad(self) -> None:
        if self.grads is not None:
            self.grads.clear()  # overwritten, not added to, by the next backward
        else:
            self.grad_shard = None  # sharded gradients: the memory goes back until the next backward

    # ------------------------------------------------------------------ after the optimizer step
    def publish_master(self, cast: bool = True) -> Handle:
        """Cast the updated master shard into the compute shard (unless ``cast`` is False: done
        already) and share it with the other ranks."""
        self.drop_secondary()
        if cast and self.master is not None and self.master is not self.shard:
            self.write_shard(0, self.shard_numel, self.master)
        if self.sharding.shards_optimizer and not self.sharding.shards_params:
            return self.comm.all_gather(self.full, self.shard, async_op=True)
        return Handle()

    def adopt_full(self) -> None:
        """Take ``full``'s values (gathered, then written by the user) as this rank's weights: my
        slice goes into the shard, and into the master where it differs from the master's cast
        (elements nobody wrote keep their full master precision)."""
        mine = self.full[self.lo : self.hi]
        with torch.no_grad():
            if self.master is not None and self.master is not self.shard:
                mine_there = mine.to(self.master.device)
                changed = mine_there != self.master.to(self.compute_dtype)
                self.master.copy_(torch.where(changed, mine_there.to(self.master.dtype), self.master))
            if self.sharding.shards_params:  # else the shard is a view of full
                self.write_shard(0, self.shard_numel, mine)

    def take_initial_master(self) -> torch.Tensor:
        """The master's initial values for a home that keeps it elsewhere (NVMe files), once: the
        values the model was built with where they are finer than the compute shard."""
        exact, self._initial_master = self._initial_master, None
        return self.shard_values() if exact is None else exact

    def master_or_shard_fp32(self) -> torch.Tensor:
        """This rank's fp32 slice of the group's weights (frozen groups: cast of the shard)."""
        src = self.master if self.master is not None else self.shard_values()
        return src if src.dtype == torch.float32 else src.float()

    # ------------------------------------------------------------------ accounting
    def param_bytes(self) -> int:
        if self.files is not None:
            return 0  # in its file; the buffers it goes through belong to the ParamFiles
        t = self.shard if self.sharding.shards_params else self.full
        return t.numel() * t.element_size()

    def grad_bytes(self) -> int:
        if self.grads is not None:
            return self.grads.nbytes
        # Sharded gradients: what the shard takes from the step's first reduction to the end of the step.
        return self.shard_numel * self.reduce_dtype.itemsize if self.trainable else 0

    def master_bytes(self) -> int:
        if self.master is None or self.master is self.shard:
            return 0
        return self.master.numel() * self.master.element_size()

