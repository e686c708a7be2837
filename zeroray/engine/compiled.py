"""torch.compile with the engine: compiled blocks, the engine's hooks in eager around them.

The gathers, frees and reductions stay outside compiled regions, as in FSDP2's per-block compile:
every forward hook the engine puts on a module is wrapped by :func:`outside_graph`
(``torch.compiler.disable``), so dynamo runs it eagerly and traces the block between the hooks; the
gradient hooks run in the autograd engine after a compiled backward, in eager anyway. Tracing them
instead (compiled autograd, functional collectives) was not chosen: which unit is gathered, what is
prefetched and which reductions are pending are the scheduler's state, and dynamo would turn each into a
guard and recompile as the state changes; gloo collectives cannot be traced at all.

Two more things make a compiled block compile once and never again:

- a gathered parameter is a view of its unit's flat buffer with the shape and strides it always has,
  and the gather pool moves memory between storages without changing which storage a parameter
  views (:mod:`zeroray.engine.gather_pool`): guards on the parameters' metadata keep holding;
- the parameter guard (:mod:`zeroray.engine.param_guard`) steps aside while dynamo traces: its lookups
  by ``id()`` would become guards naming each block's parameters, one compile per block.

:func:`compile_units` is ``ZeroConfig.compile``: the engine compiles each unit (``module.compile()``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import nn

from zeroray.config.zero_config import CompileConfig

F = TypeVar("F", bound=Callable)

# What dynamo shows when it must stop at an engine hook (with fullgraph=True: in the error).
_WAY_OUT = (
    "zeroray's {what} runs eagerly, outside compiled regions; compile each unit instead of the whole model "
    "(ZeroConfig(compile={{'enabled': True}}), or block.compile() on each block), or leave fullgraph off"
)


def outside_graph(fn: F, what: str) -> F:
    """``fn``, a hook of the engine, run eagerly when dynamo meets it (``what`` names it in dynamo's message)."""
    try:
        return torch.compiler.disable(fn, reason=_WAY_OUT.format(what=what))
    except TypeError:  # torch before 2.7 takes no reason: dynamo's message then names the hook alone
        return torch.compiler.disable(fn)


def compile_units(units: Sequence[tuple[str, nn.Module]], config: CompileConfig) -> None:
    """``module.compile()`` each unit with the config's backend and arguments (the forward hooks the
    engine put on it run outside the compiled region: see :func:`outside_graph`)."""
    for _, module in units:
        module.compile(backend=config.backend, **config.kwargs)
