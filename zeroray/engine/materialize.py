"""Meta-built models: give parameters and buffers built under ``torch.device("meta")`` real values.

A model too big for one rank is built on the meta device (shapes only, no memory), as FSDP2 and
torchtitan do. The engine then materializes it here, module by module in ``model.modules()`` order:
each module that directly holds a meta tensor gets its direct tensors allocated on the compute
device (zero-filled), then its initializer runs, then a *sink* decides what to keep. At stage 3 the
sink copies this rank's slice of each parameter into its flat group's shard and the full tensor is
dropped as soon as the last module holding it was initialized, so set-up never holds more than a
module's tensors (tied ones: from their first holder to their last) beside the shards. At stages
0-2 every tensor is kept: each rank materializes the whole model once.

No broadcast is needed: every rank replays the same RNG stream, so every rank computes the same
values, provided every rank seeded the same (``torch.manual_seed(s)`` before ``initialize``, as
torchtitan asks). The values equal, bitwise, those of the model materialized whole on the same
device (ties kept), seeded the same, with the same initializer run over ``model.modules()`` in order.

The initializer of a module is ``init_fn(module)`` when given, else ``module.reset_parameters()``.
It must write only the module's own tensors (``recurse=False``), as torch's ``reset_parameters`` do:
a submodule's tensors are still on meta when their parent's initializer runs, and an op on a meta
tensor would silently do nothing (and draw nothing from the RNG), so it raises, naming both. A real (non-meta) tensor of a module that also holds meta ones keeps its value:
the initializer writes a scratch copy. A meta tensor no initializer writes holds zeros, the same on
every rank; without ``init_fn`` a meta tensor whose modules have no ``reset_parameters`` is refused
up front, since it would certainly stay zero.

Tensors whose values will be loaded right after (``loaded``: the keys of a pretrained checkpoint, as
Hugging Face skips initializing the keys it loads) are materialized but not initialized: a module
whose meta tensors are all loaded is skipped (it needs no ``reset_parameters``, and costs no
initializer time); :attr:`MetaInit.initialized` names the tensors an initializer did write.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from zeroray.engine import names as tensor_names

InitFn = Callable[[nn.Module], None]
# Called with a materialized tensor once the last module holding it was initialized; returns True
# to keep it (the tensor stays as it is), False to drop its storage.
Sink = Callable[[torch.Tensor], bool]


def meta_tensor_ids(model: nn.Module) -> set[int]:
    """ids of the model's parameters and buffers that are on the meta device."""
    return {id(t) for t in [*model.parameters(), *model.buffers()] if t.is_meta}


def compute_device(model: nn.Module, device: str | torch.device | None, process_group: dist.ProcessGroup | None) -> torch.device:
    """The device the engine computes on: the device of the model's real parameters if it has any,
    else ``device``, else the current CUDA device when CUDA is available and the process group
    (if any) is NCCL, else the CPU (FSDP2's rule: the accelerator the process group runs on)."""
    real = sorted({str(p.device) for p in model.parameters() if not p.is_meta})
    if len(real) > 1:
        raise ValueError(f"all model parameters must be on one real device (or on meta), found {real}")
    wanted = None if device is None else _usable(device)
    if real:
        found = torch.device(real[0])
        if wanted is not None and wanted != found:
            raise ValueError(
                f"device={str(device)!r} but the model's non-meta parameters are on {found}; move the model "
                "there or leave device out"
            )
        return found
    if wanted is not None:
        return wanted
    backend = None if process_group is None else str(dist.get_backend(process_group)).lower()
    if torch.cuda.is_available() and backend in (None, "nccl"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _usable(device: str | torch.device) -> torch.device:
    """``device`` as a concrete device this process can allocate on, or a clear error."""
    out = torch.device(device)
    if out.type == "meta":
        raise ValueError("device='meta' cannot hold the engine's buffers; give the device to compute on")
    if out.type == "cpu":
        return torch.device("cpu")  # "cpu:0" is the CPU too
    if out.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r} but CUDA is not available in this process")
        if out.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        if out.index >= torch.cuda.device_count():
            raise ValueError(f"device={str(device)!r} but this process sees {torch.cuda.device_count()} CUDA device(s)")
    return out


@dataclass
class _Holder:
    name: str
    module: nn.Module
    tensors: list[torch.Tensor]  # the module's direct parameters and buffers
    initialize: bool  # some meta tensor of it is not loaded afterwards: its initializer runs


class MetaInit:
    """Which modules get initialized, in which order, and how (validated at construction)."""

    def __init__(self, model: nn.Module, init_fn: InitFn | None, loaded: Collection[str] = ()):
        self.init_fn = init_fn
        named = [*tensor_names.named_parameters(model, remove_duplicate=False), *tensor_names.named_buffers(model, remove_duplicate=False)]
        skip = {id(t) for n, t in named if n in set(loaded)}
        self.holders: list[_Holder] = []
        for name, m in model.named_modules():
            direct = [t for t in [*m._parameters.values(), *m._buffers.values()] if t is not None]
            if any(t.is_meta for t in direct):
                self.holders.append(_Holder(name, m, direct, any(t.is_meta and id(t) not in skip for t in direct)))
        # Index of the last module holding each meta tensor: after it, the tensor is final.
        self.last: dict[int, int] = {id(t): i for i, h in enumerate(self.holders) for t in h.tensors if t.is_meta}
        # The meta tensors an initializer writes (those not loaded afterwards), by name.
        ids = {id(t) for h in self.holders if h.initialize for t in h.tensors if t.is_meta and id(t) not in skip}
        self.initialized: list[str] = [n for n, t in [*tensor_names.named_parameters(model), *tensor_names.named_buffers(model)] if id(t) in ids]
        if init_fn is None:
            self._refuse_unreachable(model, skip)

    def _refuse_unreachable(self, model: nn.Module, skip: set[int]) -> None:
        reached = {id(t) for h in self.holders if callable(getattr(h.module, "reset_parameters", None)) for t in h.tensors}
        names = [n for n, t in [*tensor_names.named_parameters(model), *tensor_names.named_buffers(model)]
                 if t.is_meta and id(t) not in reached and id(t) not in skip]
        if names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            raise ValueError(
                f"the meta tensor(s) {shown} are held only by modules without reset_parameters(), so nothing "
                "would initialize them; pass init_fn=(module -> None) to initialize every module that holds "
                "meta tensors, or loaded_keys= naming those a checkpoint fills (zt.prepare(pretrained=...) does)"
            )

    def run(self, device: torch.device, sink: Sink) -> None:
        """Materialize and initialize every meta tensor on ``device``, one module at a time."""
        dropped: dict[torch.dtype, torch.Tensor] = {}
        with torch.no_grad():
            for i, h in enumerate(self.holders):
                shielded = []
                for t in h.tensors:
                    if t.is_meta:
                        _materialize(t, device, h)
                    elif id(t) not in self.last:  # a real tensor: the initializer writes a scratch copy
                        shielded.append((t, t.data))
                        t.data = torch.zeros(t.shape, dtype=t.dtype, device=t.device)
                if h.initialize:
                    with _RefuseMeta(h):
                        self._initialize(h.module)
                for t, data in shielded:
                    t.data = data
                for t in h.tensors:
                    if self.last.get(id(t)) == i and not sink(t):
                        one = dropped.setdefault(t.dtype, torch.zeros(1, dtype=t.dtype, device=device))
                        t.data = one.as_strided(t.shape, [0] * t.dim())

    def _initialize(self, module: nn.Module) -> None:
        if self.init_fn is not None:
            self.init_fn(module)
        else:
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()


class _RefuseMeta(TorchDispatchMode):
    """While one module's initializer runs: an op on a tensor still on meta (a submodule's, not
    materialized yet) raises instead of silently doing nothing. Scoped to that call; no patching."""

    def __init__(self, holder: _Holder):
        super().__init__()
        self.holder = holder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        meta = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_meta]
        if meta:
            h = self.holder
            where = f"module {h.name!r} ({type(h.module).__name__})" if h.name else f"the model ({type(h.module).__name__})"
            raise RuntimeError(
                f"the initializer of {where} ran {func} on a tensor of shape {tuple(meta[0].shape)} that is "
                "still on the meta device, which would do nothing: an initializer (init_fn(module) or "
                "reset_parameters()) may write only its module's own parameters and buffers; a submodule's "
                "get initialized at its own turn in model.modules() order"
            )
        return func(*args, **kwargs)


def _materialize(t: torch.Tensor, device: torch.device, holder: _Holder) -> None:
    """Give the meta tensor ``t`` zero-filled storage on ``device``, keeping its Python object
    (ties, the optimizer's param groups and the modules all hold that object)."""
    data = torch.zeros(t.shape, dtype=t.dtype, device=device)
    new = nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data
    try:
        torch.utils.swap_tensors(t, new)
    except RuntimeError as e:
        attr = next(k for k, v in [*holder.module._parameters.items(), *holder.module._buffers.items()] if v is t)
        name = f"{holder.name}.{attr}" if holder.name else attr
        raise RuntimeError(
            f"cannot materialize the meta tensor {name!r} in place ({e}); drop views of or weak "
            "references to the model's meta tensors before zeroray.initialize"
        ) from e
