"""The config: plain data, no torch. ``ZeroConfig`` and its parts (``zero_config``), the named optimizer
(``optim_spec``), DeepSpeed JSON as a table (``deepspeed``), Hugging Face's ``"auto"`` (``hf_auto``),
``load_config`` for any of them (``load``) and the reference table docs/configuration.md follows
(``reference``). Importing the package imports only ``zero_config``."""

from zeroray.config.zero_config import (
    CommConfig,
    CompileConfig,
    ConfigError,
    LossScaleConfig,
    OffloadConfig,
    OffloadIOConfig,
    PrecisionPolicy,
    QuantizeConfig,
    Sharding,
    ZeroConfig,
)

__all__ = [
    "CommConfig",
    "CompileConfig",
    "ConfigError",
    "LossScaleConfig",
    "OffloadConfig",
    "OffloadIOConfig",
    "PrecisionPolicy",
    "QuantizeConfig",
    "Sharding",
    "ZeroConfig",
]
