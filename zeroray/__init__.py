"""zeroray: ZeRO stages 0-3 on torch.distributed, made native to Ray.

The engine (``zeroray.initialize``, ``ZeroConfig``) is plain PyTorch. The Ray layer
(``ZeroTrainer`` and friends) is imported lazily, so ``import zeroray`` never imports Ray.
"""

from __future__ import annotations

from typing import Any

from zeroray.config import OffloadConfig, ZeroConfig
from zeroray.engine import ZeroEngine, initialize

__version__ = "0.1.0"

_TRAIN_EXPORTS = ("ZeroTrainer", "ScalingConfig", "RunConfig", "FailureConfig", "CheckpointConfig", "Result")


def __getattr__(name: str) -> Any:
    if name in _TRAIN_EXPORTS:
        import zeroray.train as train

        return getattr(train, name)
    if name == "estimate":
        from zeroray.estimate import estimate

        return estimate
    raise AttributeError(f"module 'zeroray' has no attribute {name!r}")


__all__ = ["ZeroConfig", "OffloadConfig", "ZeroEngine", "initialize", "estimate", *_TRAIN_EXPORTS]
