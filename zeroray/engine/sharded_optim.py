"""The optimizer over this rank's shards: one object that owns the fp32 masters, the fp32
gradients it steps with and the torch optimizer, and steps them sub-group by sub-group.

The user builds an optimizer over ``model.parameters()`` (or passes a callable, or names one in the
config). zeroray keeps its class, its param groups and their hyperparameters, and builds the same
optimizer over the flat fp32 master shards this rank owns, so a no-weight-decay group stays one
group and an LR scheduler sees the groups the user made.

The master shards are cut into *sub-groups* of at most ``sub_group_size`` elements (DeepSpeed's
key): consecutive slices of consecutive flat groups, each slice one parameter of the torch
optimizer. :meth:`ShardedOptimizer.step` steps them one after another, giving a gradient only to
the current sub-group's parameters (torch optimizers skip parameters without one). That loop is
where offload plugs in: where a sub-group's master and states live between steps is a
:class:`~zeroray.engine.offload.home.StateHome` (device memory, host memory, or NVMe files with
read-ahead and write-behind). Elementwise optimizers (Adam, AdamW, SGD, ...) give the same bits
whatever the sub-group size.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zeroray.config import ZeroConfig
from zeroray.engine.flat_group import FlatGroup
from zeroray.engine.offload.home import zeros_like_state
from zeroray.engine.sub_groups import ParamSlice, SubGroup, plan_sub_groups

if TYPE_CHECKING:
    from zeroray.engine.offload.home import Fill, StateHome

# Lazy fp32 gradients (16-bit gradient shards on the device) are made for at most this many elements at
# once: a sub-group is stepped in runs of pieces that fit, so the step's transient is 512 MB whatever the
# sub_group_size (DeepSpeed's default 1e9 would make it 4 GB). Elementwise optimizers give the same bits.
CAST_RUN = 1 << 27

OptimizerArg = torch.optim.Optimizer | Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None


def template_optimizer(model: nn.Module, optimizer: OptimizerArg, config: ZeroConfig, *, warn: bool = True
                       ) -> torch.optim.Optimizer:
    """The optimizer over the model's parameters whose shape zeroray reproduces over the shards;
    ``warn``: say that a config's optimizer block is ignored (one rank says it for all)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if optimizer is None:
        if config.optimizer is None:
            raise ValueError(
                "no optimizer: pass one to zeroray.initialize(model, optimizer, ...) or name one in the "
                "config's 'optimizer' block"
            )
        from zeroray.engine.named_optim import build_optimizer

        opt = build_optimizer(config.optimizer, trainable)
    elif isinstance(optimizer, torch.optim.Optimizer):
        opt = optimizer
    elif callable(optimizer):
        opt = optimizer(trainable)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"the optimizer callable returned {type(opt).__name__}, not a torch.optim.Optimizer")
    else:
        raise TypeError(
            "optimizer must be a torch.optim.Optimizer over model.parameters(), a callable params -> "
            f"Optimizer, or None; got {type(optimizer).__name__}"
        )
    in_model = {id(p) for p in model.parameters()}
    foreign = [p for g in opt.param_groups for p in g["params"] if id(p) not in in_model]
    if foreign:
        shapes = ", ".join(str(tuple(p.shape)) for p in foreign[:5])
        raise ValueError(
            f"the optimizer holds {len(foreign)} parameter(s) that are not parameters of the model "
            f"(shapes {shapes}); build it over model.parameters()"
        )
    if warn and optimizer is not None and config.optimizer is not None:
        # DeepSpeed logs "Using client Optimizer" here; a silent choice would hide a block that does nothing.
        warnings.warn(
            f"zeroray: the config's 'optimizer' block ({config.optimizer.get('type')!r}) is ignored: "
            f"zeroray.initialize was given an optimizer ({type(opt).__name__}), and that one is used",
            UserWarning,
            stacklevel=5,  # the caller of zeroray.initialize (through ZeroEngine and build_engine)
        )
    return opt


def _refuse_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    raise RuntimeError(
        "zeroray: call engine.step(), not optimizer.step(): the optimizer passed to zeroray.initialize "
        "was rebuilt over this rank's shards (engine.optimizer), and stepping the original would do nothing"
    )


def refuse_direct_step(template: torch.optim.Optimizer) -> RemovableHandle:
    """Make ``template.step()`` raise (a per-instance hook, no patching): the user's optimizer holds
    the model's parameters, not the shards the engine trains, so stepping it is silently a no-op."""
    return template.register_step_pre_hook(_refuse_step)


def param_group_index(model: nn.Module, template: torch.optim.Optimizer) -> dict[int, int | None]:
    """id(param) -> index of its optimizer param group, or None for frozen parameters."""
    group_of: dict[int, int | None] = {}
    for gi, g in enumerate(template.param_groups):
        for p in g["params"]:
            group_of[id(p)] = gi if p.requires_grad else None
    for name, p in model.named_parameters():
        if id(p) not in group_of:
            if p.requires_grad:
                raise ValueError(
                    f"parameter {name!r} requires grad but is in no param group of the optimizer; add it to "
                    "the optimizer or set requires_grad=False"
                )
            group_of[id(p)] = None
    return group_of


def _constructor_kwargs(cls: type, defaults: dict) -> dict:
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}


def _mul(t: torch.Tensor, factor: float | torch.Tensor) -> None:
    t.mul_(factor.to(t.device) if torch.is_tensor(factor) else factor)


class GradShards:
    """The gradient shards the optimizer steps with: ``source(g)`` (the fp32 cast of ``g``'s reduced
    shard, where the optimizer runs) times the factors given to :meth:`scale_`, in order.

    Eager: one fp32 tensor per group, made at once and scaled in place (the gradient shard itself
    when it is fp32 already). Lazy (NVMe offload with a 16-bit reduce dtype): each sub-group's fp32
    gradients are made only when it is stepped, so a rank never holds its whole fp32 gradient shard;
    the same elementwise casts and multiplications in the same order give the same bits.
    """

    def __init__(self, groups: Sequence[FlatGroup], source: Callable[[FlatGroup], torch.Tensor], lazy: bool):
        self.groups = groups
        self._source = source
        self.lazy = lazy
        self._factors: list[float | torch.Tensor] = []
        self._eager = {} if lazy else {g: source(g) for g in groups}

    def scale_(self, factor: float | torch.Tensor) -> None:
        if self.lazy:
            self._factors.append(factor)
        else:
            for t in self._eager.values():
                _mul(t, factor)

    def _made(self, t: torch.Tensor) -> torch.Tensor:
        for f in self._factors:
            _mul(t, f)
        return t

    def each(self) -> Iterator[torch.Tensor]:
        """Each group's scaled fp32 gradients (lazy: a temporary at a time)."""
        for g in self.groups:
            yield self._eager[g] if not self.lazy else self._made(self._source(g))

    def piece(self, g: FlatGroup, lo: int, hi: int) -> torch.Tensor:
        if not self.lazy:
            return self._eager[g][lo:hi]
        return self._made(self._source(g, lo, hi))


@dataclass(frozen=True)
class StateCopy:
    """See :meth:`ShardedOptimizer.copy`; ``close()`` removes it."""

    read: Callable[[FlatGroup, str], Iterator[torch.Tensor]]
    close: Callable[[], None]


class ShardedOptimizer:
    """The fp32 masters, gradients and torch optimizer of this rank's shards, stepped by sub-group.

    ``home`` decides where masters and optimizer states live between steps; the rest of the engine
    asks this object for them (:meth:`master`, :meth:`states`, :meth:`load`) and never looks.
    """

    def __init__(
        self,
        template: torch.optim.Optimizer,
        groups: Sequence[FlatGroup],
        sub_group_size: int,
        home: StateHome,
    ):
        self.groups = [g for g in groups if g.trainable]
        self.home = home
        self.cast_run = CAST_RUN
        plan = plan_sub_groups(self.groups, sub_group_size)
        home.attach(self.groups)
        per_group: list[list[nn.Parameter]] = [[] for _ in template.param_groups]
        subs = []
        self.pieces_of: dict[FlatGroup, list[ParamSlice]] = {g: [] for g in self.groups}
        for i, slices in enumerate(plan):
            pieces = []
            for g, lo, hi, index in slices:
                piece = ParamSlice(g, lo, hi, nn.Parameter(home.param_data(g, lo, hi), requires_grad=True), index)
                pieces.append(piece)
                per_group[g.param_group].append(piece.param)
                self.pieces_of[g].append(piece)
            subs.append(SubGroup(i, tuple(pieces)))
        self.sub_groups = subs
        new_groups = [
            {**{k: v for k, v in tg.items() if k != "params"}, "params": ps}
            for tg, ps in zip(template.param_groups, per_group)
        ]
        cls = type(template)
        self.optimizer = cls(new_groups, **_constructor_kwargs(cls, template.defaults))
        home.prepare(self.sub_groups, self.optimizer)

    # ------------------------------------------------------------------ the step
    def grads(self) -> GradShards:
        """This rank's gradient shards as the optimizer will read them (fp32, where it steps)."""
        return GradShards(self.groups, self.home.grad, lazy=self.home.lazy_grads)

    def step(self, grads: GradShards, used: Mapping[FlatGroup, Sequence[bool]] | None = None) -> None:
        """Step every sub-group in turn with ``grads`` (unscaled and clipped), and write the updated
        masters into the compute shards (cast). ``used[g][i]``: parameter ``i`` of ``g`` got a
        gradient on some rank; the others get none, so the torch optimizer skips them (no decay, no
        moment update, no step counted), as it does under DDP. None: every parameter got one."""
        for sub, _ in self.home.cycle(self.sub_groups, self.optimizer):
            for run in self._runs(sub, grads):
                for piece in run:
                    if piece.index is None or (used is not None and not used[piece.group][piece.index]):
                        continue
                    piece.param.grad = grads.piece(piece.group, piece.lo, piece.hi)
                self.optimizer.step()
                for piece in run:
                    piece.param.grad = None
            self.home.publish(sub)

    def _runs(self, sub: SubGroup, grads: GradShards) -> Iterator[tuple[ParamSlice, ...]]:
        """``sub``'s pieces in runs stepped together: all at once, unless the gradients are made lazily (a
        fp32 copy per piece), then runs of at most :attr:`cast_run` elements (a larger piece alone)."""
        if not grads.lazy:
            yield sub.pieces
            return
        run: list[ParamSlice] = []
        size = 0
        for piece in sub.pieces:
            if run and size + piece.numel > self.cast_run:
                yield tuple(run)
                run, size = [], 0
            run.append(piece)
            size += piece.numel
        if run:
            yield tuple(run)

    @property
    def publishes_shards(self) -> bool:
        """:meth:`step` wrote the updated masters into the compute shards already (the engine need
        not cast them)."""
        return self.home.publishes_shards

    def settle(self) -> None:
        """Wait for copies in flight that read the masters, before anyone writes them."""
        self.home.settle()

    # ------------------------------------------------------------------ state
    @property
    def in_memory(self) -> bool:
        """:meth:`read` yields live tensors (False: swap buffers, each valid until the next is
        asked for); what a checkpoint writer needs to know to hold on to them."""
        return self.home.in_memory

    def master(self, g: FlatGroup) -> torch.Tensor:
        """``g``'s fp32 master shard (frozen groups: their shard cast); a live tensor where it is
        resident, a fresh one read from its file otherwise."""
        if not g.trainable:
            return g.master_or_shard_fp32()
        return self.home.master(g)

    def states(self, g: FlatGroup) -> dict[str, torch.Tensor]:
        """``g``'s elementwise optimizer states, each a 1-D tensor over its whole shard (zeros for
        the pieces never stepped: their parameters got no gradient yet)."""
        pieces = self.pieces_of[g]
        per_piece = [self.home.states(p, self.optimizer) for p in pieces]
        keys = self.state_keys(g)
        if len(pieces) == 1:
            return dict(per_piece[0])
        return {k: torch.cat([st.get(k, zeros_like_state(per_piece, k, p.numel)) for p, st in zip(pieces, per_piece)])
                for k in keys}

    def state_keys(self, g: FlatGroup) -> list[str]:
        """Names of ``g``'s elementwise optimizer states (none before its first step), sorted; reads nothing."""
        found = (self.home.state_keys(p, self.optimizer) for p in self.pieces_of.get(g, ()))
        return max(found, key=len, default=[])

    def read(self, g: FlatGroup, key: str) -> Iterator[torch.Tensor]:
        """``g``'s shard of ``key`` ("weight": the fp32 master, or a state of :meth:`state_keys`) as
        consecutive 1-D fp32 tensors, each valid until the next is asked for (see :meth:`StateHome.stream`;
        a frozen group's "weight": its shard cast, one tensor)."""
        if key == "weight" and not g.trainable:
            yield self.master(g)
        else:
            yield from self.home.stream(self.pieces_of[g], key, self.optimizer)

    def copy(self) -> StateCopy | None:
        """A copy of the masters and states that training may run past, read like :meth:`read`
        (from one thread): the swap files copied on their disk. None where they are in memory (or
        the disk has no room)."""
        files = self.home.copy()
        if files is None:
            return None
        return StateCopy(lambda g, key: files.stream(self.pieces_of[g], key), files.close)

    def _piece_scalars(self, piece: ParamSlice) -> dict[str, float]:
        """``piece``'s scalar states (e.g. Adam's step); empty before its first step."""
        state = self.optimizer.state.get(piece.param, {})
        return {k: float(v) for k, v in state.items() if not torch.is_tensor(v) or v.dim() == 0}

    def scalars(self) -> list[dict[str, float]]:
        """Per param group, the optimizer's scalar states (e.g. Adam's step) of its most stepped
        parameter on this rank (a parameter that got no gradient at some steps counts fewer)."""
        out: list[dict[str, float]] = [{} for _ in self.optimizer.param_groups]
        for pieces in self.pieces_of.values():
            for piece in pieces:
                found = self._piece_scalars(piece)
                best = out[piece.group.param_group]
                if found and found.get("step", 0.0) >= best.get("step", 0.0):
                    out[piece.group.param_group] = found
        return out

    def _load_scalars(self, scalars: Sequence[dict[str, float]], param_scalars: Mapping[str, dict[str, float] | None]
                      ) -> Callable[[ParamSlice], dict[str, float] | None]:
        """Each piece's scalar states to load; None: none, the piece starts fresh (never stepped)."""
        def of(piece: ParamSlice) -> dict[str, float] | None:
            if piece.index is None:
                return None
            return param_scalars.get(piece.group.param_names[piece.index], scalars[piece.group.param_group])

        return of

    def load(self, tensors: Mapping[FlatGroup, Mapping[str, torch.Tensor]], scalars: Sequence[dict[str, float]],
             param_scalars: Mapping[str, dict[str, float] | None] | None = None) -> None:
        """Install every trainable group's master (``"weight"``: fp32 values of its shard) and
        optimizer states (none: fresh); ``scalars`` per param group, ``param_scalars`` by parameter
        name where they differ (None: never stepped, fresh). See :meth:`StateHome.load`."""
        self.home.load(self.sub_groups, {g: tensors[g] for g in self.groups}, self._load_scalars(scalars, param_scalars or {}),
                       self.optimizer)

    def load_stream(self, keys: Mapping[FlatGroup, Sequence[str]], fill: Fill, scalars: Sequence[dict[str, float]],
                    param_scalars: Mapping[str, dict[str, float] | None] | None = None) -> None:
        """As :meth:`load`, with the values written by ``fill(parts)`` into ``(group, key, lo, hi,
        dest)`` destinations (``[lo, hi)`` of the group's shard; ``keys[g]``: "weight" and the
        states to load). See :meth:`StateHome.load_stream`."""
        self.home.load_stream(self.sub_groups, {g: keys[g] for g in self.groups}, fill,
                              self._load_scalars(scalars, param_scalars or {}), self.optimizer)

    def set_master(self, g: FlatGroup, values: torch.Tensor) -> None:
        """Overwrite ``g``'s master with ``values`` (its optimizer states stay)."""
        for piece in self.pieces_of[g]:
            self.home.set_master(piece, values[piece.lo : piece.hi], self.optimizer)

    def adopt(self, g: FlatGroup, mine: torch.Tensor) -> None:
        """``mine`` (compute dtype) was written into ``g``'s slice by the user: elements that differ
        from the master's cast take it, the others keep their fp32 value (as FlatGroup.adopt_full)."""
        master = self.master(g)
        mine = mine.to(master.device)
        changed = mine != master.to(mine.dtype)
        self.set_master(g, torch.where(changed, mine.to(master.dtype), master))

    def memory(self) -> dict[str, int]:
        """Bytes of masters and optimizer states, by where they are: see :meth:`StateHome.memory`."""
        return self.home.memory(self.sub_groups, self.optimizer)

    def io_report(self) -> dict[str, float]:
        """NVMe offload: bytes read and written and seconds the step waited for them, cumulative."""
        return self.home.io_report()

    def close(self) -> None:
        self.home.close()
