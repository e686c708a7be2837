"""``zt.prepare``: wrap the user's model and optimizer in a ZeRO engine with the trainer's config, and
resume it from the run's newest committed checkpoint, so ``engine.global_step`` says where the loop is."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from zeroray.config import CompileConfig, ZeroConfig
from zeroray.config.load import load_config
from zeroray.train.worker import recovery
from zeroray.train.worker.context import get_session

logger = logging.getLogger(__name__)


def prepare(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Callable[..., Any] | None = None,
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    *,
    init_fn: Callable[[torch.nn.Module], None] | None = None,
    pretrained: str | None = None,
    pretrained_key_map: Any = None,
    compile: bool | dict[str, Any] | CompileConfig | None = None,
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

    ``pretrained``: a Hugging Face safetensors directory (any fsspec URL; ``RunConfig.storage_options``
    are used) loaded into the shards by ``zeroray.load_pretrained`` (strict, ``pretrained_key_map`` as
    its ``key_map``) when the run has no checkpoint yet; on a resume the run's own checkpoint wins.
    A meta-built model then initializes only what the file lacks (``zeroray.pretrained_keys``), as
    Hugging Face does for missing keys; rank 0 logs their names. ``init_fn`` is needed only where a
    tensor the file lacks sits in a module without ``reset_parameters()`` (e.g. a rotary embedding's
    non-persistent ``inv_freq``: HF's ``model._init_weights``).

    ``compile``: torch.compile each block (the trainer config's ``compile`` otherwise): True, a
    ``CompileConfig``, or its fields as a dict (``{"kwargs": {"mode": "max-autotune-no-cudagraphs"}}``,
    enabled unless it says ``"enabled": False``). The engine's gathers and reductions run around the
    compiled blocks, at every stage.
    """
    session = get_session("prepare()")
    if session.engine is not None:
        raise RuntimeError("zt.prepare() was already called in this train loop; call it once per run")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"zt.prepare expects a torch.nn.Module, got {type(model).__name__}")
    from zeroray.engine import initialize

    device = session.context.device
    tensors = [*model.parameters(), *model.buffers()]
    loaded_keys: list[str] = []
    if pretrained is not None and any(t.is_meta for t in tensors):
        from zeroray.checkpoint.pretrained import pretrained_keys

        loaded_keys = pretrained_keys(model, pretrained, key_map=pretrained_key_map, storage_options=session.storage_options)
    if any(t.is_meta for t in tensors):
        # Module.to() cannot copy out of meta; move only the real tensors (keeping their objects).
        with torch.no_grad():
            for t in tensors:
                if not t.is_meta:
                    t.data = t.data.to(device)
    else:
        model.to(device)
    config, nodes = _topology(session, model, optimizer)
    if compile is not None:
        config = dataclasses.replace(config, compile=compile_config(compile))
    with session.group_sockets.recording() if session.group_sockets is not None else contextlib.nullcontext():
        engine = initialize(  # creates the engine's process groups under hybrid sharding (group_sockets.py)
            model,
            optimizer=optimizer,
            config=config,
            process_group=None,
            nodes=nodes,
            lr_scheduler=lr_scheduler,
            init_fn=init_fn,
            device=device,
            loaded_keys=loaded_keys,
        )
    session.engine = engine
    for name, obj in session.stateful.items():  # data positions made before zt.prepare: resumed with the engine
        engine.register_stateful(name, obj)
    if loaded_keys and session.context.get_world_rank() == 0:
        names = engine.initialized_names
        logger.info("zeroray: initialized %d tensor(s) the pretrained weights lack%s", len(names),
                    f": {', '.join(names[:20])}{' ...' if len(names) > 20 else ''}" if names else "")
    if not recovery.resume(session) and pretrained is not None:
        from zeroray.checkpoint.pretrained import load_pretrained

        report = load_pretrained(engine, pretrained, key_map=pretrained_key_map, storage_options=session.storage_options)
        if session.context.get_world_rank() == 0:
            logger.info(
                "zeroray: loaded pretrained weights from %s: %d tensors in %.2f s; the ranks read %.1f MB of the "
                "checkpoint's %.1f MB (this rank %.1f MB)", pretrained, len(report.loaded), report.seconds,
                report.total_bytes_read / 1e6, report.checkpoint_bytes / 1e6, report.bytes_read / 1e6,
            )
    session.last_global_step = engine.global_step
    return engine


def _topology(session: Any, model: torch.nn.Module, optimizer: Any) -> tuple[ZeroConfig, list[str]]:
    """Collective: every rank's node (the ranks of a node are consecutive), and the trainer's config with
    ``shard_group_size="auto"`` (and hpZ's) resolved to the ranks per node, so no shard group spans nodes.
    Sets the group's id (rank 0's) for its snapshots: a failed group's ranks file their state under it with
    no collective."""
    gathered = session.report_comm.all_gather_object((session.context.get_node_rank(), uuid.uuid4().hex))
    session.snapshot_group = (gathered[0][1], [node for node, _ in gathered])
    nodes = [f"node-{n}" for n, _ in gathered]
    config = load_config(session.zero_config, model=model, optimizer=optimizer)  # what initialize would load
    autos = [name for name in ("shard_group_size", "hpz_partition_size") if getattr(config, name) == "auto"]
    if autos:
        config = dataclasses.replace(config, **dict.fromkeys(autos, ranks_per_node(nodes)))
    return config, nodes


def compile_config(value: bool | dict[str, Any] | CompileConfig) -> CompileConfig:
    """``zt.prepare(compile=...)`` as a CompileConfig."""
    if isinstance(value, CompileConfig):
        return value
    if isinstance(value, bool):
        return CompileConfig(enabled=value)
    if isinstance(value, dict):
        return CompileConfig(**{"enabled": True, **value})
    raise TypeError(f"zt.prepare(compile=...) takes True/False, a CompileConfig or a dict of its fields, got {value!r}")


def ranks_per_node(nodes: list[str]) -> int:
    """``"auto"``: the ranks of one node, the same on every node (else an error naming them)."""
    counts = Counter(nodes)
    if len(set(counts.values())) > 1:
        held = ", ".join(f"{node} {n}" for node, n in sorted(counts.items()))
        raise ValueError(
            f"shard_group_size / hpz_partition_size 'auto' needs the same number of ranks on every node, but the ranks per node "
            f"are: {held}; give an integer that divides each count, or place equal ranks per node"
        )
    return next(iter(counts.values()))
