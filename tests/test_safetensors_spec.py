"""Hostile safetensors files: zeroray reads a header as the ``safetensors`` package checks it. Every
crafted file gets the same verdict from both (``safe_open`` and zeroray's ``read_header``), and
``load_pretrained`` refuses the package's refusals with one line, weights untouched."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from safetensors import safe_open
from safetensors.torch import save_file

import zeroray
from tests.support.pretrained import engine_for, zgpt
from zeroray import PretrainedError
from zeroray.checkpoint.safetensors_file import RangeReader, read_header

F32x2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


def _file(header: bytes, data: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header + data


def _json(header: dict) -> bytes:
    return json.dumps(header).encode()


def _nested(depth: int) -> bytes:
    """A header whose first tensor carries an extra field nested so that the whole header is
    ``depth`` deep (the package ignores unknown fields, but parses them)."""
    inner = b"[" * (depth - 2) + b"]" * (depth - 2)
    return b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":' + inner + b"}}"


# name: the whole file. Accepted and refused alike, as safetensors 0.8 decides.
CASES: dict[str, bytes] = {
    "plain": _file(_json({"a": F32x2}), bytes(8)),
    "leading_space": _file(b" " + _json({"a": F32x2}), bytes(8)),
    "trailing_whitespace": _file(_json({"a": F32x2}) + b"\t\n\r ", bytes(8)),
    "unknown_field_ignored": _file(_json({"a": {**F32x2, "x": 1}}), bytes(8)),
    "null_metadata": _file(b'{"__metadata__":null,"a":' + _json(F32x2) + b"}", bytes(8)),
    "scalar_and_empty": _file(_json({"a": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]},
                                     "e": {"dtype": "F32", "shape": [0, 3], "data_offsets": [4, 4]}}), bytes(4)),
    "no_tensors": _file(b"{}", b""),
    "repeated_name_keeps_last": _file(b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":'
                                      + _json(F32x2) + b"}", bytes(8)),
    "nested_127": _file(_nested(127), bytes(8)),
    # refused
    "overlapping_offsets": _file(_json({"a": F32x2, "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}),
                                 bytes(8)),
    "hole_before_data": _file(_json({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}), bytes(12)),
    "hole_between": _file(_json({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                                 "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}), bytes(12)),
    "bytes_after_last_tensor": _file(_json({"a": F32x2}), bytes(10)),
    "utf16_header": _file(json.dumps({"a": F32x2}).encode("utf-16"), bytes(8)),
    "utf8_bom": _file(b"\xef\xbb\xbf" + _json({"a": F32x2}), bytes(8)),
    "nested_128": _file(_nested(128), bytes(8)),
    "nested_5000": _file(_nested(5000), bytes(8)),
    "nan": _file(b'{"a":' + _json(F32x2) + b',"__metadata__":{"x":"y"},"z":NaN}', bytes(8)),
    "lone_surrogate": _file(b'{"a":' + _json(F32x2) + b',"__metadata__":{"k":"\\udc00"}}', bytes(8)),
    "metadata_not_strings": _file(b'{"__metadata__":{"x":1},"a":' + _json(F32x2) + b"}", bytes(8)),
    "metadata_repeated": _file(b'{"__metadata__":{},"__metadata__":{},"a":' + _json(F32x2) + b"}", bytes(8)),
    "field_repeated": _file(b'{"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}}', bytes(8)),
    "float_dim": _file(b'{"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}}', bytes(8)),
    "bool_dim": _file(b'{"a":{"dtype":"U8","shape":[true],"data_offsets":[0,1]}}', bytes(1)),
    "string_dim": _file(b'{"a":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}}', bytes(8)),
    "dim_past_u64": _file(b'{"a":{"dtype":"F32","shape":[0,18446744073709551616],"data_offsets":[0,0]},"b":'
                          + _json(F32x2) + b"}", bytes(8)),
    "shape_product_overflows": _file(b'{"a":{"dtype":"F32","shape":[4294967296,4294967296,0],"data_offsets":[0,0]},'
                                     b'"b":' + _json(F32x2) + b"}", bytes(8)),
    "three_offsets": _file(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}}', bytes(8)),
    "offsets_backwards": _file(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}}', bytes(8)),
    "missing_shape": _file(b'{"a":{"dtype":"F32","data_offsets":[0,8]}}', bytes(8)),
    "not_a_tensor": _file(b'{"a":' + _json(F32x2) + b',"q":1}', bytes(8)),
    "a_list": _file(b"[]", b""),
    "lowercase_dtype": _file(b'{"a":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}}', bytes(8)),
    "header_past_the_file": struct.pack("<Q", 64) + b"{}",
}


def _package_accepts(path: Path) -> bool:
    try:
        with safe_open(str(path), "pt") as f:
            f.keys()
    except Exception:  # SafetensorError, the package's only verdict
        return False
    return True


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_verdict_as_the_safetensors_package(case: str, tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(CASES[case])
    accepts = _package_accepts(path)
    try:
        read_header(RangeReader(LocalFileSystem()), str(path), str(path))
    except PretrainedError as e:
        assert not accepts, f"{case}: the package reads it, zeroray refused: {e}"
        assert "\n" not in str(e) and str(path) in str(e), str(e)
        return
    assert accepts, f"{case}: the package refuses it, zeroray read it"


def _hostile(state: dict[str, torch.Tensor], tmp_path: Path, name: str,
             layout: Callable[[dict, list[bytes]], tuple[dict, bytes]], encode: Callable[[str], bytes]) -> Path:
    """A model.safetensors of ``state`` with its header laid out by ``layout`` and encoded by ``encode``."""
    good = tmp_path / "good.safetensors"
    save_file(state, good)
    raw = good.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    order = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    pieces = [data[slice(*header[k]["data_offsets"])] for k in order]
    header = {"__metadata__": header.get("__metadata__", {}), **{k: header[k] for k in order}}
    header, data = layout(header, pieces)
    out = tmp_path / name
    out.mkdir()
    text = encode(json.dumps(header))
    (out / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + data)
    return out


def _overlap(header: dict, pieces: list[bytes]) -> tuple[dict, bytes]:
    """The second tensor starts 4 bytes inside the first; everything after it moves back 4 bytes."""
    keys, pos, data = [k for k in header if k != "__metadata__"], 0, b""
    for i, (k, piece) in enumerate(zip(keys, pieces)):
        if i == 1:
            pos -= 4
            data = data[:-4]
        header[k]["data_offsets"] = [pos, pos + len(piece)]
        pos += len(piece)
        data += piece
    return header, data


def _hole_before(header: dict, pieces: list[bytes]) -> tuple[dict, bytes]:
    for k in header:
        if k != "__metadata__":
            header[k]["data_offsets"] = [x + 64 for x in header[k]["data_offsets"]]
    return header, bytes(64) + b"".join(pieces)


def _deep(header: dict, pieces: list[bytes]) -> tuple[dict, bytes]:
    first = next(k for k in header if k != "__metadata__")
    header[first]["x"] = "DEEP"
    return header, b"".join(pieces)


HOSTILE = {
    "overlapping_offsets": (_overlap, str.encode),
    "hole_before_data": (_hole_before, str.encode),
    "utf16_header": (lambda h, p: (h, b"".join(p)), lambda s: s.encode("utf-16")),
    "deeply_nested": (_deep, lambda s: s.replace('"DEEP"', "[" * 100_000 + "]" * 100_000).encode()),
}


def _weights() -> dict[str, torch.Tensor]:
    return {k: v for k, v in zgpt(2).state_dict().items() if k != "lm_head.weight"}  # tied to the embedding


def test_the_same_weights_laid_out_plainly_load(tmp_path: Path) -> None:
    engine = engine_for(zgpt(1), 3)
    src = _hostile(_weights(), tmp_path, "plain", lambda h, p: (h, b"".join(p)), str.encode)
    assert _package_accepts(src / "model.safetensors")
    zeroray.load_pretrained(engine, str(src))
    got = engine.full_state_dict()
    assert all(torch.equal(got[k], v) for k, v in _weights().items())
    engine.close()


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_load_pretrained_refuses_what_the_package_refuses(case: str, tmp_path: Path) -> None:
    """A file made from the model's own weights, that the package refuses: one line, nothing loaded
    (before, the first three loaded and the fourth raised RecursionError)."""
    engine = engine_for(zgpt(1), 3)
    before = engine.full_state_dict()
    src = _hostile(_weights(), tmp_path, case, *HOSTILE[case])
    assert not _package_accepts(src / "model.safetensors")
    with pytest.raises(PretrainedError) as e:
        zeroray.load_pretrained(engine, str(src))
    assert "\n" not in str(e.value) and "model.safetensors" in str(e.value), str(e.value)
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    engine.close()
