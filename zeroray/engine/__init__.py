"""The ZeRO engine: plain PyTorch, no Ray. See :mod:`zeroray.engine.engine`."""

from zeroray.engine.comm import Comm, GroupAborted, import_before_group
from zeroray.engine.engine import GroupShard, ZeroEngine, initialize

__all__ = ["Comm", "GroupAborted", "GroupShard", "ZeroEngine", "import_before_group", "initialize"]
