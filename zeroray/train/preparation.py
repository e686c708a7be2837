"""``zt.prepare``: wrap the user's model and optimizer in a ZeRO engine with the trainer's config, and
resume it from the run's newest committed checkpoint, so ``engine.global_step`` says where the loop is."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zeroray.train import checkpoint_manager
from zeroray.train.context import get_session


def prepare(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Callable[..., Any] | None = None,
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    *,
    init_fn: Callable[[torch.nn.Module], None] | None = None,
) -> Any:
    """Move ``model`` to this rank's device and return ``zeroray.initialize(model, optimizer, config)``.

    The config is the trainer's ZeroConfig; the process group is the one the actors formed (WORLD).
    The optimizer may be built before this call: moving a module keeps its Parameter objects.
    ``lr_scheduler`` (``optimizer -> scheduler``) is passed to the engine, which steps it.

    A model built (wholly or partly) under ``with torch.device("meta"):`` is not moved: its real
    tensors go to this rank's device and the engine initializes the meta ones there, by
    ``init_fn(module)`` or each module's ``reset_parameters()`` (see ``zeroray.initialize``); an
    optimizer built over the meta parameters is fine.

    Collective: when the run (``<storage_path>/<name>``) has a committed checkpoint — after a restart,
    or in a new ``fit()`` with the same name — every rank loads the newest one, whatever world size and
    stage saved it: weights, optimizer and scheduler state, step counters. Loop from
    ``engine.global_step`` on; use a new ``RunConfig.name`` to start from scratch.
    """
    session = get_session("prepare()")
    if session.engine is not None:
        raise RuntimeError("zt.prepare() was already called in this train loop; call it once per run")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"zt.prepare expects a torch.nn.Module, got {type(model).__name__}")
    from zeroray.engine import initialize

    device = session.context.device
    tensors = [*model.parameters(), *model.buffers()]
    if any(t.is_meta for t in tensors):
        # Module.to() cannot copy out of meta; move only the real tensors (keeping their objects).
        with torch.no_grad():
            for t in tensors:
                if not t.is_meta:
                    t.data = t.data.to(device)
    else:
        model.to(device)
    engine = initialize(
        model,
        optimizer=optimizer,
        config=session.zero_config,
        process_group=None,
        lr_scheduler=lr_scheduler,
        init_fn=init_fn,
        device=device,
    )
    session.engine = engine
    checkpoint_manager.resume(session)
    session.last_global_step = engine.global_step
    return engine
