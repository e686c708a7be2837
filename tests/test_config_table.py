"""Every entry of the DeepSpeed key table behaves as its kind says, and warnings point at the caller."""

from __future__ import annotations

import re
import warnings

import pytest

from zeroray.config_loader import load_config
from zeroray.deepspeed_config import TABLE, DeepSpeedConfigError, Feature, Ignored, Refused


def _nested(dotted: str, value: object) -> dict:
    *parents, last = dotted.split(".")
    out: dict = {last: value}
    for part in reversed(parents):
        out = {part: out}
    return out


def _keys(kind: type) -> list[str]:
    return [k for k, e in TABLE.items() if isinstance(e, kind)]


@pytest.mark.parametrize("key", _keys(Ignored))
def test_every_ignored_key_warns_naming_itself(key):
    with pytest.warns(UserWarning, match=re.escape(f"zeroray ignores DeepSpeed config key '{key}': {TABLE[key].why}")):
        load_config(_nested(key, 1))


@pytest.mark.parametrize("key", _keys(Refused))
def test_every_refused_key_names_itself_and_accepts_its_off_values(key):
    entry = TABLE[key]
    with pytest.raises(DeepSpeedConfigError, match=rf"^DeepSpeed config key '{key}' = True is not supported by zeroray: ") as info:
        load_config(_nested(key, True))
    assert info.value.keys == [key]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for off in entry.unless:
            load_config(_nested(key, off))


@pytest.mark.parametrize("key", _keys(Feature))
def test_every_feature_block_is_refused_when_enabled_and_ignored_when_not(key):
    with pytest.raises(DeepSpeedConfigError, match=rf"^DeepSpeed config key '{key}' is not supported by zeroray: "):
        load_config({key: {"enabled": True}})
    with pytest.warns(UserWarning, match=rf"'{key}': the block is disabled"):
        load_config({key: {"enabled": False, "anything": 1}})


def test_warnings_point_at_the_callers_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config({"steps_per_print": 10})
    assert [w.filename for w in caught] == [__file__]


def test_null_means_not_given():
    assert load_config({"zero_optimization": None, "gradient_clipping": None, "fp16": {"enabled": None}}) == load_config({})
