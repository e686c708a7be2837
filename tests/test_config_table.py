"""Every entry of the DeepSpeed key table behaves as its kind says; an ignored key is one log line."""

from __future__ import annotations

import logging
import warnings

import pytest

from zeroray.config.deepspeed import TABLE, DeepSpeedConfigError, Feature, Ignored, Refused
from zeroray.config.load import load_config


def _nested(dotted: str, value: object) -> dict:
    *parents, last = dotted.split(".")
    out: dict = {last: value}
    for part in reversed(parents):
        out = {part: out}
    return out


def _keys(kind: type) -> list[str]:
    return [k for k, e in TABLE.items() if isinstance(e, kind)]


def _warned(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "zeroray" and r.levelno == logging.WARNING]


@pytest.mark.parametrize("key", _keys(Ignored))
def test_every_ignored_key_is_logged_naming_itself(key, caplog):
    with caplog.at_level(logging.WARNING, logger="zeroray"):
        load_config(_nested(key, 1))
    assert _warned(caplog) == [f"zeroray ignores DeepSpeed config key '{key}': {TABLE[key].why}"]


@pytest.mark.parametrize("key", _keys(Refused))
def test_every_refused_key_names_itself_and_accepts_its_off_values(key, caplog):
    entry = TABLE[key]
    with pytest.raises(DeepSpeedConfigError, match=rf"^DeepSpeed config key '{key}' = True is not supported by zeroray: ") as info:
        load_config(_nested(key, True))
    assert info.value.keys == [key]
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="zeroray"):
        warnings.simplefilter("error")
        for off in entry.unless:
            load_config(_nested(key, off))
    assert not _warned(caplog)


@pytest.mark.parametrize("key", _keys(Feature))
def test_every_feature_block_is_refused_when_enabled_and_ignored_when_not(key, caplog):
    with pytest.raises(DeepSpeedConfigError, match=rf"^DeepSpeed config key '{key}' is not supported by zeroray: "):
        load_config({key: {"enabled": True}})
    with caplog.at_level(logging.WARNING, logger="zeroray"):
        load_config({key: {"enabled": False, "anything": 1}})
    assert _warned(caplog) == [f"zeroray ignores DeepSpeed config key '{key}': the block is disabled"]


def test_ignored_keys_are_log_lines_not_warnings_and_only_for_a_good_config(caplog):
    """A UserWarning echoes a line of the caller's source under it; a stock HF config has seven such keys.
    A refused config logs nothing: its error is the one thing said."""
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="zeroray"):
        warnings.simplefilter("error")
        load_config({"steps_per_print": 10, "wall_clock_breakdown": False})
        assert _warned(caplog) == [
            "zeroray ignores DeepSpeed config key 'steps_per_print': " + TABLE["steps_per_print"].why,
            "zeroray ignores DeepSpeed config key 'wall_clock_breakdown': " + TABLE["wall_clock_breakdown"].why,
        ]
        caplog.clear()
        with pytest.raises(DeepSpeedConfigError, match="stgae"):
            load_config({"steps_per_print": 10, "zero_optimization": {"stgae": 3}})
    assert not _warned(caplog)


def test_null_means_not_given():
    assert load_config({"zero_optimization": None, "gradient_clipping": None, "fp16": {"enabled": None}}) == load_config({})
