"""zeroray.load_pretrained: Hugging Face safetensors straight into shards, each rank reading only its
byte ranges, from a local directory and from a real S3 endpoint; bad input refused before any
weight changes, on every rank."""

from __future__ import annotations

import json
import mmap
import os
import random
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import s3fs
import torch
from safetensors.torch import load_file, save_file

import zeroray
from tests.support.dist import run_ranks
from tests.support.pretrained import (
    BUILDERS,
    assert_loaded,
    engine_for,
    load_all,
    upload,
    write_sources,
    zgpt,
)
from zeroray import PretrainedError
from zeroray.checkpoint.safetensors_file import (
    _ALIGN,
    MAX_RUN,
    RangeReader,
    _open_direct,
    _read_direct,
    merge,
    read_header,
)

ON_S3 = ("llama_bf16", "gpt2")


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory, s3: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = write_sources(tmp_path_factory.mktemp("pretrained"))
    fs = s3fs.S3FileSystem(**s3["options"])
    for name, src in out.items():
        if name in ON_S3:
            src["url"], src["options"] = f"{s3['bucket']}/{name}", s3["options"]
            upload(fs, src["dir"], src["url"])
        else:
            src["url"], src["options"] = str(src["dir"]), None
    return out


@pytest.fixture(scope="module")
def loaded(sources: dict[str, dict[str, Any]]) -> Callable[[int, int], list[dict[str, Any]]]:
    """Every source loaded at (world, stage), one run of processes per configuration (spawning
    ranks that import transformers is what costs); at world 2 rank 1 also asks for a directory
    that does not exist, to see every rank fail together."""
    srcs = {n: {k: s[k] for k in ("url", "options", "model")} for n, s in sources.items()}
    runs: dict[tuple[int, int], list[dict[str, Any]]] = {}

    def get(world: int, stage: int) -> list[dict[str, Any]]:
        if (world, stage) not in runs:
            runs[(world, stage)] = run_ranks(load_all, world, stage, srcs, str(sources["zgpt"]["dir"]) if world == 2 else None)
        return runs[(world, stage)]

    return get


@pytest.mark.parametrize(
    "world,stage",
    [(2, 3), (3, 1), pytest.param(3, 3, marks=pytest.mark.slow), pytest.param(2, 1, marks=pytest.mark.slow)],
)
def test_load_pretrained(sources: dict[str, dict[str, Any]], loaded: Callable, world: int, stage: int) -> None:
    results = loaded(world, stage)
    for name, src in sources.items():
        what = f"{name} at world {world} stage {stage}"
        for r in results:
            assert_loaded(r[name]["sd"], src["expected"], what)
        reports = [r[name]["report"] for r in results]
        assert reports[0].checkpoint_bytes == src["bytes"]
        assert not reports[0].missing and not reports[0].unexpected and not reports[0].mismatched
        assert all(rep.total_bytes_read == sum(x.bytes_read for x in reports) for rep in reports)
        assert reports[0].total_bytes_read <= 1.1 * src["bytes"], (what, reports[0].total_bytes_read, src["bytes"])
        assert all(rep.bytes_read < 0.7 * src["bytes"] for rep in reports), (what, [x.bytes_read for x in reports])
        assert reports[0].prefix == ("stripped 'model.'" if name == "zgpt" else None)
    trained = [r["llama"] for r in results]
    assert all(t["before"][0] == 1 and t["before"][1] > 0 for t in trained)
    assert all(t["after"] == (0, 0) for t in trained), "the optimizer starts fresh at step 0"
    assert all(torch.isfinite(torch.tensor(t["loss"])) for t in trained)


# ------------------------------------------------------------------- bad input, world 1 in-process


def _bad_sources(root: Path, good: Path) -> dict[str, tuple[Path, str]]:
    """{case: (source, message pattern)} made from the good fp32 llama directory."""
    data = (good / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    cases: dict[str, tuple[Path, str]] = {}

    def case(name: str, files: dict[str, bytes], pattern: str) -> None:
        d = root / name
        d.mkdir()
        for f, b in files.items():
            (d / f).write_bytes(b)
        cases[name] = (d, pattern)

    case("empty", {"README.md": b"hi"}, r"holds no safetensors file .*README\.md")
    case("truncated", {"model.safetensors": data[: len(data) // 2]}, r"model\.safetensors: tensor '.*' has data_offsets .* truncated")
    case("short_header", {"model.safetensors": data[:100]}, r"model\.safetensors is truncated or not a safetensors file")
    key = "model.norm.weight"
    moved = dict(header)
    a, b = moved[key]["data_offsets"]
    moved[key] = {**moved[key], "data_offsets": [a + 10**6, b + 10**6]}
    raw = json.dumps(moved).encode()
    case("outside", {"model.safetensors": struct.pack("<Q", len(raw)) + raw + data[8 + n :]},
         rf"tensor '{key}' has data_offsets \[{a + 10**6}, {b + 10**6}\] outside the file")
    state = _tensors(good)
    without = {k: v for k, v in state.items() if k != key}
    case("missing", {}, rf"missing keys \['{key}'\], unexpected keys \[\]")
    save_file(without, root / "missing" / "model.safetensors", metadata={"format": "pt"})
    reshaped = {**state, key: torch.zeros(32)}
    case("mismatch", {}, rf"shape mismatches \['{key}: file \[32\], model \[64\]'\]")
    save_file(reshaped, root / "mismatch" / "model.safetensors", metadata={"format": "pt"})
    extra = {**state, "model.extra.weight": torch.zeros(2)}
    case("unexpected", {}, r"unexpected keys \['model\.extra\.weight'\]")
    save_file(extra, root / "unexpected" / "model.safetensors", metadata={"format": "pt"})
    case("pickle", {"pytorch_model.bin": b"\x80\x04not really"}, r"pickle checkpoint \(pytorch_model\.bin\).*safe_serialization=True")
    case("absent", {}, r"absent-not-here do not exist")
    cases["absent"] = (root / "absent-not-here", cases["absent"][1])
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "../model.safetensors"}}
    case("escaping_index", {"model.safetensors.index.json": json.dumps(index).encode()}, r"names files outside its directory")
    return cases


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    return load_file(d / "model.safetensors")


def test_bad_input_changes_nothing(sources: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    engine = engine_for(BUILDERS["llama"](1), 3)
    before = engine.full_state_dict()
    for case, (src, pattern) in _bad_sources(tmp_path, sources["llama"]["dir"]).items():
        with pytest.raises(PretrainedError, match=pattern):
            zeroray.load_pretrained(engine, str(src))
        after = engine.full_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), f"{case} changed weights"
    engine.close()


def test_not_strict_reports_and_loads_what_fits(sources: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    cases = _bad_sources(tmp_path, sources["llama"]["dir"])
    want = sources["llama"]["expected"]
    for case, kept, lists in (
        ("missing", True, (["model.norm.weight"], [], [])),
        ("mismatch", True, ([], [], ["model.norm.weight: file [32], model [64]"])),
        ("unexpected", False, ([], ["model.extra.weight"], [])),
    ):
        engine = engine_for(BUILDERS["llama"](1), 3)
        before = engine.full_state_dict()
        report = zeroray.load_pretrained(engine, str(cases[case][0]), strict=False)
        assert (report.missing, report.unexpected, report.mismatched) == lists
        for k, t in engine.full_state_dict().items():
            assert torch.equal(t, before[k] if kept and k == "model.norm.weight" else want[k]), (case, k)
        engine.close()


def test_key_map_and_prefixes(sources: dict[str, dict[str, Any]]) -> None:
    """zeroray's GPT file carries a "model." prefix: found automatically, or given as key_map; a
    key_map that maps nothing leaves every key unexpected and every parameter missing."""
    src, want = str(sources["zgpt"]["dir"]), sources["zgpt"]["expected"]
    for key_map, prefix in ((None, "stripped 'model.'"), (lambda k: k.removeprefix("model."), None)):
        engine = engine_for(zgpt(1), 3)
        report = zeroray.load_pretrained(engine, src, key_map=key_map)
        assert report.prefix == prefix
        assert_loaded(engine.full_state_dict(), want, str(key_map))
        engine.close()
    engine = engine_for(zgpt(1), 3)
    with pytest.raises(PretrainedError, match=r"missing keys \['transformer\.h\.0\."):
        zeroray.load_pretrained(engine, src, key_map={})
    engine.close()


def test_header_reads_and_merged_ranges(sources: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The header costs two small reads; adjacent byte ranges of one file become one request, and
    a request never holds more than MAX_RUN bytes (a larger tensor is read in parts)."""
    import fsspec

    from zeroray.checkpoint import safetensors_file

    path = str(sources["llama"]["dir"] / "model.safetensors")
    want = sources["llama"]["expected"]
    for max_run, requests in ((64 << 20, 1), (10_000, None)):
        monkeypatch.setattr(safetensors_file, "MAX_RUN", max_run)
        reader = RangeReader(fsspec.filesystem("file"))
        f = read_header(reader, path, path)
        assert reader.bytes_read == f.header_bytes < 10_000
        infos = sorted(f.tensors.values(), key=lambda t: t.start)
        dests = [torch.empty(t.numel) for t in infos]
        ranges = merge([(path, t.start, t.end, t.dtype, d) for t, d in zip(infos, dests)])
        assert ranges[0].start == f.header_bytes and ranges[-1].end == f.size
        assert all(r.end - r.start <= max_run for r in ranges)
        assert len(ranges) == requests if requests else len(ranges) > (f.size - f.header_bytes) // max_run
        reader.fill(ranges, {path: path})
        assert reader.bytes_read == f.size
        for t, d in zip(infos, dests):
            assert torch.equal(d.view(t.shape), want[t.key])


def test_a_failing_rank_fails_every_rank(loaded: Callable) -> None:
    r0, r1 = (r["one_rank_fails"] for r in loaded(2, 3))
    assert r1["error"] and "-missing-on-rank-1 do not exist" in r1["error"]
    assert r0["error"] and "failed on another rank (no weights changed): rank 1:" in r0["error"]
    assert r0["same"] and r1["same"]


def test_pickle_file_url_refused(tmp_path: Path) -> None:
    engine = engine_for(zgpt(1), 1)
    (tmp_path / "weights.pt").write_bytes(b"x")
    with pytest.raises(PretrainedError, match=r"weights\.pt.*zeroray loads no pickle"):
        zeroray.load_pretrained(engine, str(tmp_path / "weights.pt"))
    shutil.rmtree(tmp_path)
    engine.close()


@pytest.mark.parametrize("tied", ["both names", "lm_head only"])
def test_bf16_engine_and_tied_names(sources: dict[str, dict[str, Any]], tmp_path: Path, tied: str) -> None:
    """A bf16 engine gets the file's fp32 values in its fp32 masters (its compute weights the bf16
    cast). A tied weight loads from whichever of its names the file holds (both: nothing is
    unexpected; only the head's: the embedding gets it). A file:// URL works as a path does."""
    state = {k.removeprefix("model."): v for k, v in _tensors(sources["zgpt"]["dir"]).items()}
    state["lm_head.weight"] = state["transformer.wte.weight"].clone()
    if tied == "lm_head only":
        del state["transformer.wte.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = zgpt(1)
    engine = zeroray.initialize(
        model, torch.optim.AdamW(model.parameters()), zeroray.ZeroConfig(stage=3, precision="bf16")
    )
    report = zeroray.load_pretrained(engine, f"file://{tmp_path}")
    assert (report.missing, report.unexpected, report.prefix) == ([], [], None)
    want = {**state, "transformer.wte.weight": state["lm_head.weight"]}
    assert_loaded(engine.full_state_dict(), want, tied)
    with engine.gathered_parameters():
        for name, p in engine.named_parameters():
            assert p.dtype == torch.bfloat16 and torch.equal(p, want[name].to(torch.bfloat16)), name
    engine.close()


def test_direct_reads_of_unaligned_ranges_into_split_buffers(tmp_path: Path) -> None:
    # O_DIRECT reads whole aligned blocks into a bounce buffer; every byte must land where it belongs.
    path = tmp_path / "data.bin"
    data = torch.randint(0, 256, (3 * MAX_RUN + 12345,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    path.write_bytes(data.numpy().tobytes())
    raw = path.read_bytes()
    bounce = mmap.mmap(-1, MAX_RUN + 2 * _ALIGN)
    gen = random.Random(0)
    for _ in range(100):
        start = gen.randrange(len(raw) - 1)
        total = gen.randrange(min(MAX_RUN, len(raw) - start) + 1)
        cuts = sorted(gen.randrange(total + 1) for _ in range(gen.randrange(5)))
        buffers = [memoryview(bytearray(b - a)) for a, b in zip([0, *cuts], [*cuts, total])]
        fd = _open_direct(str(path))
        assert fd is not None, "this filesystem refuses O_DIRECT: the test needs one that takes it"
        try:
            assert _read_direct(fd, bounce, start, buffers) == total
        finally:
            os.close(fd)
        assert b"".join(bytes(b) for b in buffers) == raw[start : start + total]
    fd = _open_direct(str(path))
    try:  # past the end of the file: the bytes that are there
        assert _read_direct(fd, bounce, len(raw) - 40, [memoryview(bytearray(100))]) == 40
    finally:
        os.close(fd)


def test_a_meta_built_model_initializes_only_what_the_pretrained_file_lacks(sources: dict[str, dict[str, Any]]) -> None:
    """Hugging Face skips initializing the keys it loads: a meta-built Llama given pretrained_keys runs
    its initializer only on modules holding something the file lacks (the rotary embedding's
    non-persistent inv_freq), none on the 70B-sized rest; RMSNorm, with no reset_parameters(), needs
    nothing; the loaded weights are the file's."""
    src = sources["llama"]
    with torch.device("meta"):
        model = BUILDERS["llama"](0)
    keys = zeroray.pretrained_keys(model, str(src["dir"]))
    assert "model.norm.weight" in keys and "lm_head.weight" in keys  # tied: both names
    assert not any("inv_freq" in k for k in keys)  # not persistent, not in the file
    ran: list[str] = []

    def init_fn(module: torch.nn.Module) -> None:
        ran.append(type(module).__name__)
        model._init_weights(module)

    torch.manual_seed(0)
    engine = zeroray.initialize(model, torch.optim.AdamW(model.parameters()), zeroray.ZeroConfig(stage=3),
                                init_fn=init_fn, loaded_keys=keys)
    assert set(ran) == {"LlamaRotaryEmbedding"}, ran
    assert engine.initialized_names == ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
    zeroray.load_pretrained(engine, str(src["dir"]))
    assert_loaded(engine.full_state_dict(), src["expected"], "llama")
    engine.close()

    with torch.device("meta"):
        model = BUILDERS["llama"](0)
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*held only by modules without reset_parameters"):
        zeroray.initialize(model, torch.optim.AdamW(model.parameters()), zeroray.ZeroConfig(stage=3))
