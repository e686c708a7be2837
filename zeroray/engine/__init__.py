"""The ZeRO engine: plain PyTorch, no Ray. See :mod:`zeroray.engine.engine`."""

from zeroray.engine.engine import ZeroEngine, initialize

__all__ = ["ZeroEngine", "initialize"]
