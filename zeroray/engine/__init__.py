"""The ZeRO engine: plain PyTorch, no Ray. See :mod:`zeroray.engine.engine`.

Its names are imported on first use, so the torch-free modules of the package (:mod:`layout`, the
partition arithmetic) can be imported without torch, as ``zeroray estimate`` does."""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "Comm": "comm", "GroupAborted": "comm", "import_before_group": "comm",
    "GroupShard": "shard_state", "GroupSource": "shard_state", "ShardRange": "shard_state",
    "ShardStateCopy": "shard_state", "ZeroEngine": "engine", "initialize": "engine",
}

__all__ = [
    "Comm", "GroupAborted", "GroupShard", "GroupSource", "ShardRange", "ShardStateCopy", "ZeroEngine",
    "import_before_group", "initialize",
]


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"zeroray.engine.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'zeroray.engine' has no attribute {name!r}")
