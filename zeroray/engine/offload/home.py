"""Where the sharded optimizer's fp32 masters and states live between steps: the interface.

- :class:`~zeroray.engine.offload.resident.ResidentHome`: in memory, on the compute device (no
  offload) or in host memory (``offload_optimizer.device="cpu"``).
- :class:`~zeroray.engine.offload.nvme.NvmeHome`: in swap files (``offload_optimizer.device="nvme"``),
  one per sub-group, through a fixed pool of aligned host buffers.

:class:`~zeroray.engine.sharded_optim.ShardedOptimizer` drives a home through :class:`StateHome` and
never knows which one it has: stepping (:meth:`StateHome.cycle`), reading (:meth:`StateHome.stream`)
and loading (:meth:`StateHome.load`, :meth:`StateHome.load_stream`) go through the same methods
whichever it is; each home moves the values its own way (live tensors, or bounded swap buffers).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

import torch

from zeroray.engine.flat_group import FlatGroup
from zeroray.engine.sub_groups import ParamSlice, SubGroup

# ``fill(parts)``: write into each ``dest`` the values ``[lo, hi)`` of flat group ``group``'s shard of ``key``.
Fill = Callable[[list[tuple[FlatGroup, str, int, int, torch.Tensor]]], None]
# A piece's scalar optimizer states to load (Adam's ``step``); None: it starts fresh (never stepped).
PieceScalars = Callable[[ParamSlice], dict[str, float] | None]


def elementwise_states(state: dict, numel: int) -> dict[str, torch.Tensor]:
    """The states shaped like their parameter (Adam's moments); scalars (``step``) are left out."""
    return {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0 and v.numel() == numel}


def scalar_state(scalars: dict[str, float]) -> dict[str, torch.Tensor]:
    """Scalar optimizer states (Adam's ``step``) as the torch optimizer keeps them."""
    return {k: torch.tensor(v, dtype=torch.float32) for k, v in scalars.items()}


def zeros_like_state(per_piece: Sequence[Mapping[str, torch.Tensor]], key: str, numel: int) -> torch.Tensor:
    """A never-stepped piece's ``key``: zeros where the group's other pieces keep theirs."""
    like = next(st[key] for st in per_piece if key in st)
    return torch.zeros(numel, dtype=like.dtype, device=like.device)


class HomeCopy(Protocol):
    """A copy of a home's masters and states that training may run past (:meth:`StateHome.copy`)."""

    def stream(self, pieces: Sequence[ParamSlice], key: str) -> Iterator[torch.Tensor]: ...

    def close(self) -> None: ...


class StateHome(ABC):
    """Interface; see the module docstring. A home must say how it serves each abstract method; the others
    have the default of a home that needs no such step."""

    def attach(self, groups: Sequence[FlatGroup]) -> None:
        """Called once, before the optimizer's parameters are made."""
        return None  # a home that needs no such step

    @abstractmethod
    def param_data(self, g: FlatGroup, lo: int, hi: int) -> torch.Tensor:
        """The master values ``[lo, hi)`` of ``g``'s shard that the optimizer's parameter for them views."""

    def prepare(self, subs: Sequence[SubGroup], optimizer: torch.optim.Optimizer) -> None:
        """Called once the optimizer exists."""
        return None  # a home that needs no such step

    lazy_grads = False  # see GradShards: fp32 gradients made per sub-group, as it is stepped
    early_grads = False  # grad_ready() wants each group's final gradient shard as soon as it is reduced
    publishes_shards = False  # publish() writes the compute shards itself (the engine need not copy the masters)

    def grad_ready(self, g: FlatGroup) -> None:
        """``g``'s gradient shard holds its final value for this step (called during backward when
        :attr:`early_grads`)."""
        return None  # a home that needs no such step

    def settle(self) -> None:
        """Wait for copies in flight that read the masters, before anyone writes them."""
        return None  # a home that needs no such step

    @abstractmethod
    def grad(self, g: FlatGroup, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """``g``'s gradient shard (or its ``[lo, hi)``) in fp32 where the optimizer runs; eager
        homes may return the shard itself (scaled in place) or a reused buffer."""

    @abstractmethod
    def cycle(self, subs: Sequence[SubGroup], optimizer: torch.optim.Optimizer) -> Iterator[tuple[SubGroup, None]]:
        """Yield each sub-group with its master and states in place for ``optimizer.step()``."""

    def publish(self, sub: SubGroup) -> None:
        """The sub-group was stepped: its new masters may go into the compute shards now."""
        return None  # a home that needs no such step

    @abstractmethod
    def master(self, g: FlatGroup) -> torch.Tensor:
        """``g``'s fp32 master shard, readable now."""

    @abstractmethod
    def states(self, piece: ParamSlice, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        """``piece``'s elementwise optimizer states by name, readable now."""

    # What :meth:`stream` yields: live tensors, no copy (False: the home's bounded swap buffers, each
    # valid until the next is asked for). Only a reader that keeps them needs to know.
    in_memory = True

    def state_keys(self, piece: ParamSlice, optimizer: torch.optim.Optimizer) -> list[str]:
        """Names of ``piece``'s elementwise optimizer states (none before its first step), sorted."""
        return sorted(self.states(piece, optimizer))

    @abstractmethod
    def stream(self, pieces: Sequence[ParamSlice], key: str, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
        """The values of ``key`` ("weight": the master) of ``pieces`` (one flat group's, in order) as
        consecutive 1-D fp32 tensors; each is valid until the next one is asked for (a never-stepped
        piece's states: zeros)."""

    @abstractmethod
    def load(self, subs: Sequence[SubGroup], tensors: Mapping[FlatGroup, Mapping[str, torch.Tensor]],
             scalars: PieceScalars, optimizer: torch.optim.Optimizer) -> None:
        """Install each group's whole-shard ``tensors`` ("weight" and the states it was saved with, or
        "weight" alone: fresh states; a piece whose ``scalars`` are None starts fresh too). A home
        that keeps no ``FlatGroup.master`` (swap files) writes the compute shards here."""

    @abstractmethod
    def load_stream(self, subs: Sequence[SubGroup], keys: Mapping[FlatGroup, Sequence[str]], fill: Fill,
                    scalars: PieceScalars, optimizer: torch.optim.Optimizer) -> None:
        """As :meth:`load`, with each group's ``keys[group]`` written by ``fill`` into destinations of
        the home's choosing."""

    def copy(self) -> HomeCopy | None:
        """A copy of the masters and states on disk that training may run past (None: they are not
        in files, or the disk has no room for a copy)."""
        return None

    @abstractmethod
    def set_master(self, piece: ParamSlice, values: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        """Overwrite ``piece``'s master with ``values`` (a user's write through the engine)."""

    @abstractmethod
    def memory(self, subs: Sequence[SubGroup], optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """``{"master": , "states": , "host": , "nvme": }`` bytes: masters and states held on the compute
        device; host memory held for offload (masters, states, grad copies, swap buffers); swap files."""

    def io_report(self) -> dict[str, float]:
        """Swap traffic and the time the step spent blocked on it (NVMe only)."""
        return {}

    def close(self) -> None:
        """Release what the home holds (swap files included)."""
        return None  # a home that needs no such step


def expected_state_count(optimizer: torch.optim.Optimizer) -> int:
    """Elementwise states per parameter the optimizer will make (for the free-space check and the
    first buffers; a wrong guess only costs a resize at the first step)."""
    name = type(optimizer).__name__
    d = optimizer.defaults
    if name in ("Adam", "AdamW", "NAdam", "RAdam", "Adamax"):
        return 3 if d.get("amsgrad") else 2
    if name == "SGD":
        return 1 if d.get("momentum", 0) else 0
    if name in ("Adagrad", "Adadelta"):
        return 1 if name == "Adagrad" else 2
    if name == "RMSprop":
        return 1 + bool(d.get("momentum", 0)) + bool(d.get("centered"))
    return 2

