"""The ZeRO engine: plain PyTorch, no Ray. See :mod:`zeroray.engine.engine`."""

from zeroray.engine.comm import Comm
from zeroray.engine.engine import GroupShard, ZeroEngine, initialize

__all__ = ["Comm", "GroupShard", "ZeroEngine", "initialize"]
