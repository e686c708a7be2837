"""``load_config``: any config a user hands zeroray -> a validated :class:`~zeroray.config.ZeroConfig`.

A ZeroConfig is used as it is. A DeepSpeed dict or JSON file is read through the key table
(:mod:`zeroray.config.deepspeed`), its ``"auto"`` values resolved from the model and the optimizer
(:mod:`zeroray.config.hf_auto`), and judged by ``ZeroConfig.validate``; every problem, each naming the JSON
key the user wrote, comes back in one :class:`~zeroray.config.deepspeed.DeepSpeedConfigError`. A good
config's ignored keys (WARNING) and resolved "auto"s (INFO) are logged on the ``"zeroray"`` logger,
one line each.
"""

from __future__ import annotations

import os
from typing import Any

from zeroray.config import ConfigError, ZeroConfig
from zeroray.config.deepspeed import DeepSpeedConfigError, read_deepspeed
from zeroray.config.hf_auto import log_resolutions, resolve_autos

__all__ = ["load_config"]

ConfigArg = ZeroConfig | dict[str, Any] | str | os.PathLike[str] | None


def load_config(config: ConfigArg, *, model: Any = None, optimizer: Any = None, defer: bool = False) -> ZeroConfig:
    """A ZeroConfig from a ZeroConfig, a DeepSpeed-style dict, a path to a DeepSpeed JSON file, or None.

    ``model`` and ``optimizer`` (what ``zeroray.initialize`` gets) resolve HF-style ``"auto"``
    values: bucket sizes from ``model.config.hidden_size``, ``optimizer.params`` from the optimizer.
    ``defer=True`` is for an early check before they exist (the Ray trainer's driver): the "auto"s
    they would resolve are left at ZeroConfig's defaults, so pass the original config on to
    ``initialize``, not the result.
    """
    if config is None:
        return ZeroConfig()
    if isinstance(config, ZeroConfig):
        return config
    if not isinstance(config, (dict, str, os.PathLike)):
        raise TypeError(
            f"config must be a ZeroConfig, a DeepSpeed-style dict or a path to a JSON file, got {type(config).__name__}"
        )
    reading = read_deepspeed(config)
    params = reading.values.get("optimizer.params", (None, None))[1]
    config_lr = params.get("lr") if isinstance(params, dict) else None
    resolved, problems, log = resolve_autos(
        reading.autos, model=model, optimizer=optimizer, config_lr=config_lr, defer=defer
    )
    problems = reading.problems + problems
    result = None
    try:
        result = ZeroConfig(**reading.kwargs(resolved))
    except ConfigError as e:
        listed = {key for key, _ in problems}  # e.g. an unresolved "auto" need not also be "required"
        for field, message in e.problems:
            key = reading.key_for(field)
            if key not in listed:
                problems.append((key, f"DeepSpeed config key '{key}': {message}"))
    if problems or result is None:
        raise DeepSpeedConfigError(problems)
    reading.log_ignored()
    log_resolutions(log)
    return result
