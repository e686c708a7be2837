"""The ZeRO engine: plain PyTorch, no Ray. See :mod:`zeroray.engine.engine`."""

from zeroray.engine.engine import GroupShard, ZeroEngine, initialize

__all__ = ["GroupShard", "ZeroEngine", "initialize"]
