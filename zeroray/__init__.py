"""zeroray: ZeRO stages 0-3 on torch.distributed, made native to Ray.

The engine (``zeroray.initialize``) is plain PyTorch; the config (``ZeroConfig``, ``load_config``) is
plain data. Everything heavier is imported on first use, so ``import zeroray`` never imports Ray and
reading a config imports neither torch nor the engine.
"""

from __future__ import annotations

from typing import Any

from zeroray.config import OffloadConfig, PrecisionPolicy, ZeroConfig

__version__ = "0.1.0"

_TRAIN_EXPORTS = ("ZeroTrainer", "ScalingConfig", "RunConfig", "FailureConfig", "CheckpointConfig", "Result")


def __getattr__(name: str) -> Any:
    if name in ("ZeroEngine", "initialize"):
        import zeroray.engine as engine

        return getattr(engine, name)
    if name == "load_config":
        from zeroray.config.load import load_config

        return load_config
    if name in _TRAIN_EXPORTS:
        import zeroray.train as train

        return getattr(train, name)
    if name in ("load_pretrained", "pretrained_keys", "LoadReport", "PretrainedError"):
        import zeroray.checkpoint.pretrained as pretrained

        return getattr(pretrained, name)
    if name == "estimate":
        from zeroray.estimate import estimate

        return estimate
    raise AttributeError(f"module 'zeroray' has no attribute {name!r}")


__all__ = [
    "ZeroConfig", "OffloadConfig", "PrecisionPolicy", "load_config", "ZeroEngine", "initialize", "estimate",
    "load_pretrained", "pretrained_keys", "LoadReport", "PretrainedError",
    *_TRAIN_EXPORTS,
]
