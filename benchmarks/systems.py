"""The systems under test, each wrapping one GPT model behind the same three calls.

``forward_backward(x, y)`` and ``optimizer_step()`` make a training step (split so that memory
can be read between them, when gradients and optimizer state both exist); ``state_tensors()``
names the tensors that are parameters and optimizer state, for the peers' memory accounting.
Mixed precision is each system's own way of doing it: zeroray and DeepSpeed keep bf16 parameters
with fp32 master weights; FSDP2 keeps fp32 shards and computes in bf16 (MixedPrecisionPolicy);
DDP and ZeroRedundancyOptimizer use torch autocast over fp32 parameters.

A ``-compiled`` system is its eager namesake with each transformer block compiled
(``block.compile()``, inductor): the per-block recipe of torchtitan, where each system's own hooks
around a block (gathers, frees, reductions) stay eager and only the block's math is compiled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from measure import optimizer_tensors
from torch import nn

LR = 1e-4

# name -> (family, ZeRO stage it is compared with)
SYSTEMS: dict[str, tuple[str, int]] = {
    "zeroray-0": ("zeroray", 0),
    "zeroray-1": ("zeroray", 1),
    "zeroray-2": ("zeroray", 2),
    "zeroray-3": ("zeroray", 3),
    "zeroray-3-trim": ("zeroray", 3),  # trim_host_heap=True
    "ddp": ("ddp", 0),
    "zero_opt": ("zero_opt", 1),
    "fsdp2-reshard": ("fsdp2", 3),
    "fsdp2-keep": ("fsdp2", 3),
    "deepspeed-1": ("deepspeed", 1),
    "deepspeed-2": ("deepspeed", 2),
    "deepspeed-3": ("deepspeed", 3),
}
COMPILED = "-compiled"
# Per-block compiled variants (issue 31), opt-in: no group but "compile" names them.
SYSTEMS.update({f"{s}{COMPILED}": SYSTEMS[s] for s in [*(f"zeroray-{stage}" for stage in range(4)), "ddp"]})
# fsdp2-reshard compiled: torchtitan's default reshards after forward
SYSTEMS["fsdp2-compiled"] = ("fsdp2", 3)
EAGER = [s for s in SYSTEMS if not s.endswith(COMPILED)]
GROUPS = {
    "zeroray": [f"zeroray-{stage}" for stage in range(4)],
    "fsdp2": ["fsdp2-reshard", "fsdp2-keep"],
    "deepspeed": [s for s in SYSTEMS if s.startswith("deepspeed")],
}
GROUPS["peers"] = [s for s in EAGER if not s.startswith("zeroray")]
GROUPS["all"] = EAGER
# compile_bench.py's systems: each compiled one beside its eager namesake.
GROUPS["compile"] = ["ddp", *GROUPS["zeroray"], "fsdp2-reshard", *(s for s in SYSTEMS if s.endswith(COMPILED))]


def expand(names: str) -> list[str]:
    """``"zeroray,ddp,fsdp2"`` -> system names, in SYSTEMS order, each once."""
    wanted: set[str] = set()
    for n in filter(None, (s.strip() for s in names.split(","))):
        if n not in SYSTEMS and n not in GROUPS:
            raise ValueError(f"unknown system {n!r}; known: {', '.join([*SYSTEMS, *GROUPS])}")
        wanted.update(GROUPS.get(n, [n]))
    return [s for s in SYSTEMS if s in wanted]


class System:
    """A model, its optimizer and how one step runs under one training system."""

    comm_source = "measured"

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, autocast: bool = False) -> None:
        self.module, self.optimizer = module, optimizer
        self._autocast = autocast

    def _ctx(self) -> contextlib.AbstractContextManager:
        if self._autocast:
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        with self._ctx():
            _, loss = self.module(x, y)
        loss.backward()
        return loss.item()

    def optimizer_step(self) -> None:
        self.optimizer.step()

    def state_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(parameters, optimizer state incl. master weights) as tensors; grads are the rest."""
        return list(self.module.parameters()), optimizer_tensors(self.optimizer)

    def memory_report(self) -> dict[str, int] | None:
        """The system's own account of its model-state bytes, where it gives one."""
        return None

    def comm_report(self) -> dict[str, int] | None:
        return None

    def reset_comm_report(self) -> None:
        pass


class _Engine(System):
    """A system driven the DeepSpeed way: ``engine(x)``, ``engine.backward(loss)``, ``engine.step()``."""

    engine: Any

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        _, loss = self.engine(x, y)
        self.engine.backward(loss)
        return loss.item()

    def optimizer_step(self) -> None:
        self.engine.step()


class ZeroRay(_Engine):
    comm_source = "comm_report()"

    def __init__(self, model: nn.Module, stage: int, precision: str, trim_host_heap: bool = False) -> None:
        import zeroray

        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        config = zeroray.ZeroConfig(stage=stage, precision=precision, trim_host_heap=trim_host_heap)
        self.engine = zeroray.initialize(model, opt, config=config)
        super().__init__(model, opt)


    def memory_report(self) -> dict[str, int]:
        return dict(self.engine.memory_report())

    def comm_report(self) -> dict[str, int]:
        return dict(self.engine.comm_report())

    def reset_comm_report(self) -> None:
        self.engine.reset_comm_report()


def _ddp(model: nn.Module, stage: int, precision: str) -> System:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, gradient_as_bucket_view=True)
    return System(ddp, torch.optim.AdamW(ddp.parameters(), lr=LR), autocast=precision != "fp32")


def _zero_opt(model: nn.Module, stage: int, precision: str) -> System:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, gradient_as_bucket_view=True)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)

    class _ZeroOpt(System):
        def state_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            return list(self.module.parameters()), optimizer_tensors(opt.optim)  # the local shard's optimizer

    return _ZeroOpt(ddp, opt, autocast=precision != "fp32")


def _fsdp2(model: nn.Module, reshard: bool, precision: str) -> System:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if precision != "fp32" else MixedPrecisionPolicy()
    for block in model.transformer.h:
        fully_shard(block, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, reshard_after_forward=reshard, mp_policy=mp)
    return System(model, torch.optim.AdamW(model.parameters(), lr=LR))


class _DeepSpeed(_Engine):
    def __init__(self, model: nn.Module, stage: int, precision: str, micro_batch: int) -> None:
        import deepspeed

        from zeroray import ZeroConfig

        deepspeed.init_distributed(dist_backend="gloo")
        # Same bucket sizes as zeroray's defaults, and every parameter partitioned at stage 3 as
        # zeroray does (DeepSpeed's defaults: 5e8-element reduce buckets, 2 GB at fp32, and
        # parameters under 1e5 elements kept whole on every rank).
        zc = ZeroConfig()
        zero = {
            "stage": stage,
            "reduce_bucket_size": zc.comm.reduce_bucket_size,
            "allgather_bucket_size": zc.comm.allgather_bucket_size,
            "stage3_prefetch_bucket_size": zc.comm.prefetch_bucket_size,
            "stage3_param_persistence_threshold": 0,
        }
        config = {
            "train_micro_batch_size_per_gpu": micro_batch,
            "gradient_accumulation_steps": 1,
            "zero_optimization": zero,
            "bf16": {"enabled": precision == "bf16"},
            "fp16": {"enabled": precision == "fp16"},
            "zero_allow_untested_optimizer": True,
            "wall_clock_breakdown": False,
        }
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        super().__init__(self.engine.module, self.engine.optimizer)


    def state_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        params = list(self.module.parameters())
        params += [p.ds_tensor for p in self.module.parameters() if hasattr(p, "ds_tensor")]  # stage 3 shards
        return params, optimizer_tensors(self.engine.optimizer.optimizer)  # fp32 partitions and Adam moments


def compile_blocks(model: nn.Module) -> None:
    """Compile each transformer block in place (``block.compile()``), the module objects unchanged,
    so that hooks registered on them before or after still fire around the compiled forward."""
    for block in model.transformer.h:
        block.compile()


def build(name: str, model: nn.Module, precision: str, micro_batch: int) -> System:
    """Wrap ``model`` (fresh, fp32, identical on every rank) as system ``name``."""
    family, stage = SYSTEMS[name]
    compiled = name.endswith(COMPILED)
    if compiled and family in ("fsdp2", "ddp"):
        compile_blocks(model)  # torchtitan's order: compile each block, then wrap or shard it
    makers: dict[str, Callable[[], System]] = {
        "zeroray": lambda: ZeroRay(model, stage, precision, trim_host_heap=name.endswith("-trim")),
        "ddp": lambda: _ddp(model, stage, precision),
        "zero_opt": lambda: _zero_opt(model, stage, precision),
        "fsdp2": lambda: _fsdp2(model, name != "fsdp2-keep", precision),
        "deepspeed": lambda: _DeepSpeed(model, stage, precision, micro_batch),
    }
    system = makers[family]()
    if compiled and family == "zeroray":
        compile_blocks(model)  # after zeroray.initialize, as a user does (issue 31)
    return system
