"""The config side imports neither the engine nor the DeepSpeed reader (nor torch, through the package's
lazy names); the optimizer name tables match torch."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch

from zeroray.config.optim_spec import OPTIMIZER_PARAMS, SCHEDULER_PARAMS


def _imported_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", "import sys\n" + code + "\nprint(' '.join(sorted(sys.modules)))"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    return set(out.stdout.split())


def test_config_imports_neither_the_engine_nor_the_deepspeed_reader():
    mods = _imported_after("import zeroray.config")
    assert "zeroray.config" in mods
    assert not {m for m in mods if m.startswith("zeroray.engine")}
    assert "zeroray.config.deepspeed" not in mods and "zeroray.config.load" not in mods
    assert "torch" not in mods  # the config side is pure data


def test_reading_a_deepspeed_config_with_an_optimizer_does_not_import_the_engine():
    mods = _imported_after(
        "from zeroray.config.load import load_config\n"
        "cfg = load_config({'zero_optimization': {'stage': 3}, 'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-3}},"
        " 'scheduler': {'type': 'WarmupLR', 'params': {}}})\n"
        "assert cfg.optimizer['type'] == 'AdamW'"
    )
    assert not {m for m in mods if m.startswith("zeroray.engine")}
    assert "torch" not in mods


def _constructor_keys(cls: type, skip: tuple[str, ...]) -> tuple[str, ...]:
    sig = inspect.signature(cls.__init__)
    return tuple(
        n for n, p in sig.parameters.items() if n not in skip and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    )


@pytest.mark.parametrize("name", sorted(OPTIMIZER_PARAMS))
def test_optimizer_tables_match_the_installed_torch(name):
    assert set(OPTIMIZER_PARAMS[name]) == set(_constructor_keys(getattr(torch.optim, name), ("self", "params")))


@pytest.mark.parametrize("key", sorted(SCHEDULER_PARAMS))
def test_scheduler_tables_match_the_schedules(key):
    from zeroray.engine import named_optim

    name, params, _ = SCHEDULER_PARAMS[key]
    assert set(params) == set(_constructor_keys(getattr(named_optim, name), ("self", "optimizer")))
