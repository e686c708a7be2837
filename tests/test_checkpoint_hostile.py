"""A checkpoint's manifest is input: forged manifests (resealed, so only the checks stand in the way)
naming files outside the checkpoint, claiming sizes its files do not have, or holding fields out of
range are refused with one line before any read or allocation; and a checkpoint deleted by retention
between ``zeroray ls``'s listing and its reads is gone, not broken."""

from __future__ import annotations

import hashlib
import json
import math
import os
import posixpath
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import zeroray.checkpoint as zc
from tests.support.checkpoint import make_engine
from tests.support.models import batches
from tests.support.recipe import train
from zeroray.checkpoint import storage
from zeroray.checkpoint.manifest import MANIFEST, file_digest, rank_file
from zeroray.cli import _verify, main

_WATCHED: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _WATCHED is not None and isinstance(args[0], (str, bytes, os.PathLike)):
        _WATCHED.append(os.path.realpath(os.fsdecode(args[0])))


sys.addaudithook(_audit)


@contextmanager
def _opens() -> Iterator[list[str]]:
    """Every file this process opens meanwhile (Python's ``open`` audit event: ``open``, ``os.open``)."""
    global _WATCHED
    _WATCHED = []
    try:
        yield _WATCHED
    finally:
        _WATCHED = None


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A committed world-1, stage-2 checkpoint: one rank file of one chunk, with a buffer section."""
    engine = make_engine(2)
    train(engine, batches(0, 1))
    url = zc.checkpoint_url(str(tmp_path_factory.mktemp("hostile") / "run"), 1)
    zc.save(engine, url)
    engine.close()
    return url


def _vm_peak() -> int:
    """This process's peak virtual memory in bytes: a 10 TB allocation shows here even untouched."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmPeak:"))


def _forge(src: str, dst: Path, edit: Callable[[dict[str, Any]], Any]) -> str:
    """A copy of the checkpoint ``src`` with its manifest edited and resealed (its own sha256)."""
    shutil.copytree(src, dst)
    body = json.loads((dst / MANIFEST).read_bytes())
    body.pop("sha256")
    edit(body)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    body["sha256"] = hashlib.sha256(canonical).hexdigest()
    (dst / MANIFEST).write_text(json.dumps(body, sort_keys=True, indent=1))
    return str(dst)


def _refused(url: str, match: str) -> list[str]:
    """zc.load refuses ``url`` with a one-line CheckpointError matching ``match``, weights unchanged;
    returns the files opened meanwhile."""
    engine = make_engine(2, seed=5)
    before, peak = engine.full_state_dict(), _vm_peak()
    with _opens() as opened, pytest.raises(zc.CheckpointError, match=match) as e:
        zc.load(engine, url)
    assert "\n" not in str(e.value), str(e.value)
    assert _vm_peak() - peak < 1 << 40, "a claimed size was allocated"
    after = engine.full_state_dict()
    assert all(v.equal(after[k]) for k, v in before.items())
    engine.close()
    return list(opened)


@pytest.mark.parametrize("entry", [
    "../../outside/victim.bin", "{victim}", "file://{victim}", "sub/../../../outside/victim.bin", "..",
])
def test_a_file_entry_outside_the_checkpoint_is_never_opened(
    ckpt: str, tmp_path: Path, entry: str, capsys: pytest.CaptureFixture
) -> None:
    """The victim is the real rank file moved outside: were it read, the load would succeed."""
    victim = tmp_path / "outside" / "victim.bin"
    victim.parent.mkdir()
    url = _forge(ckpt, tmp_path / "run" / "checkpoint_1",
                 lambda m: m["files"][0].update(path=entry.format(victim=victim)))
    shutil.move(Path(url) / rank_file(0), victim)
    opened = _refused(url, "is not a plain file name inside the checkpoint directory")
    with _opens() as opened_by_export:
        assert main(["export", url, str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a plain file name" in err, err
    assert str(victim) not in opened + opened_by_export
    assert sorted(os.listdir(tmp_path)) == ["outside", "run"]


def _chunks_for(f: dict[str, Any], size: int, chunk_bytes: int) -> None:
    """Make a file entry claim ``size`` bytes consistently: chunk count and digest to match."""
    f["size"], f["chunk_bytes"] = size, chunk_bytes
    f["chunks"] = ["00000000"] * math.ceil(size / chunk_bytes)
    f["sha256"] = file_digest(f["chunks"])


def _buffer(m: dict[str, Any]) -> dict[str, Any]:
    return next(s for s in m["files"][0]["sections"] if s["kind"] == "buffer")


def _huge_buffer(m: dict[str, Any]) -> None:
    """The last section, a float32 buffer, claims 10 TB, and its file the size that holds it."""
    buf = _buffer(m)
    buf["nbytes"], buf["shape"] = 10**13, [10**13 // 4]
    _chunks_for(m["files"][0], buf["offset"] + buf["nbytes"], 1 << 30)


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """An edit setting ``path`` ("files.0.chunk_bytes") to ``value``."""

    def edit(m: dict[str, Any]) -> None:
        *head, last = path.split(".")
        for p in head:
            m = m[int(p)] if p.isdigit() else m[p]
        m[int(last) if last.isdigit() else last] = value

    return edit


def _file(m: dict[str, Any]) -> dict[str, Any]:
    return m["files"][0]


def _rng(m: dict[str, Any]) -> dict[str, Any]:
    return next(s for s in m["files"][0]["sections"] if s["kind"] == "rng")


# name: (edit of the manifest, what the one-line error says)
FORGED: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "buffer_of_10_tb": (_huge_buffer, r"rank-00000\.bin has \d+ bytes, the manifest says 10000000\d+"),
    "buffer_past_its_file": (lambda m: _buffer(m).update(nbytes=10**13, shape=[10**13 // 4]),
                             r"buffer section .* runs past the file's \d+ bytes"),
    "chunk_bytes_negative": (_set("files.0.chunk_bytes", -1), r"chunk_bytes is -1, not an integer in \[1, "),
    "size_zero": (lambda m: _chunks_for(_file(m), 0, 4 << 20), r"runs past the file's 0 bytes"),
    "size_1e18_chunks_unchanged": (_set("files.0.size", 10**18), r"has 1 chunk checksums; 10+ bytes .* need \d+"),
    "size_1e12_chunks_to_match": (lambda m: _chunks_for(_file(m), 10**12, 1 << 30),
                                  r"has \d+ bytes, the manifest says 1000000000000"),
    "rank_outside_the_world": (_set("files.0.rank", 3), r"files are of ranks \[3\], not one for each of the 1"),
    "world_size_bool": (_set("world_size", True), r"world_size is True, not an integer"),
    "stage_string": (_set("stage", "2"), r"stage is '2', not an integer in \[0, 3\]"),
    "stage_7": (_set("stage", 7), r"stage is 7"),
    "unknown_section_kind": (_set("files.0.sections.0.kind", "code"), r"kind is 'code', not one of"),
    "unknown_group_dtype": (_set("groups.0.dtype", "object"), r"dtype is 'object', not one of"),
    "shard_section_short": (lambda m: _file(m)["sections"][0].update(nbytes=_file(m)["sections"][0]["nbytes"] - 4),
                            r"has \d+ bytes; a shard of \d+ elements over 1 is \d+"),
    "shard_section_missing": (lambda m: _file(m)["sections"].pop(0), r"tensors x 1 shards have no section"),
    "sections_overlap": (lambda m: _file(m)["sections"][1].update(offset=_file(m)["sections"][0]["offset"]),
                         r"\[0, 1104\) overlaps the section before it"),
    "slot_past_its_group": (lambda m: m["groups"][0]["slots"][0].update(offset=m["groups"][0]["numel"]),
                            r"runs past the group's \d+ elements"),
    "no_weight_key": (_set("groups.0.keys", ["exp_avg"]), r"with 'weight' among them"),
    "checksum_not_hex": (_set("files.0.chunks", ["zzzzzzzz"]), r"8-digit hex"),
    "digest_mismatch": (_set("files.0.sha256", "0" * 64), r"sha256 does not match its chunk checksums"),
    "unknown_algorithm": (_set("files.0.algorithm", "md5"), r"algorithm is 'md5', not one of"),
    "buffer_shape_and_bytes_disagree": (lambda m: _buffer(m).update(shape=[10, 1]), r"has 36 bytes; float32 \[10, 1\] is 40"),
    "rng_state_short": (lambda m: _rng(m).update(nbytes=16), r"RNG state 'cpu' has 16 bytes; this torch's is 5056"),
    "rng_state_float32": (lambda m: _rng(m).update(dtype="float32"), r"RNG state 'cpu' is float32, not uint8"),
    "rng_state_unknown_key": (lambda m: _rng(m).update(key="tpu"), r"RNG state 'tpu' is not one of \['cpu', 'cuda'\]"),
    "meta_not_an_object": (_set("meta", []), r"meta is \[\], not a JSON object"),
    "size_missing": (lambda m: _file(m).pop("size"), r"files\[0\] \(rank-00000\.bin\) has no 'size'"),
    "groups_not_a_list": (_set("groups", {}), r"groups is \{\}, not a list"),
    "file_entry_a_string": (_set("files", ["rank-00000.bin"]), r"files\[0\] is 'rank-00000\.bin', not a JSON object"),
}


@pytest.mark.parametrize("case", sorted(FORGED))
def test_forged_fields_are_refused_before_any_read(ckpt: str, tmp_path: Path, case: str) -> None:
    edit, match = FORGED[case]
    url = _forge(ckpt, tmp_path / "checkpoint_1", edit)
    opened = _refused(url, match)
    assert str(Path(url) / rank_file(0)) not in opened, "the rank file was opened"


@pytest.mark.parametrize("case", ["buffer_of_10_tb", "chunk_bytes_negative", "size_zero"])
def test_export_of_a_forged_manifest_is_one_line_and_writes_nothing(
    ckpt: str, tmp_path: Path, case: str, capsys: pytest.CaptureFixture
) -> None:
    """Before: a traceback from a 10 TB allocation, and exit 0 after writing uninitialized memory."""
    url = _forge(ckpt, tmp_path / "checkpoint_1", FORGED[case][0])
    peak = _vm_peak()
    assert main(["export", url, str(tmp_path / "hf")]) == 1
    assert _vm_peak() - peak < 1 << 40, "a claimed size was allocated"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "not a valid manifest" in err or "the manifest says" in err, err
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_1"]


def test_verify_of_a_file_claimed_at_1e18_bytes_returns_at_once(ckpt: str, tmp_path: Path) -> None:
    """Before: 2.4e11 chunk numbers in a Python loop. The claim is checked against the chunk list and
    the listing before the reader exists."""
    for case in ("size_1e18_chunks_unchanged", "size_1e12_chunks_to_match"):
        edit, match = FORGED[case]
        url = _forge(ckpt, tmp_path / case, edit)
        with pytest.raises(zc.CheckpointError, match=match):
            zc.CheckpointReader(url).verify()


def test_an_existing_checkpoint_still_loads(ckpt: str, tmp_path: Path) -> None:
    """The control: the same copy-and-reseal with no edit loads, and the checks cost one listing."""
    url = _forge(ckpt, tmp_path / "checkpoint_1", lambda m: None)
    engine = make_engine(2, seed=5)
    zc.load(engine, url)
    zc.CheckpointReader(url).verify()
    engine.close()


# ------------------------------------------------------------------------- deleted while listing


def test_a_checkpoint_deleted_after_the_listing_is_gone_not_broken(tmp_path: Path) -> None:
    """``zeroray ls`` lists the run, then a run saving with ``num_to_keep=1`` deletes the checkpoint
    before ls reads its manifest (or, with --verify, its files): it is left out, not called broken."""
    run = str(tmp_path / "run")
    engine = make_engine(2)
    train(engine, batches(0, 1))
    for step in (1, 2):
        zc.save(engine, zc.checkpoint_url(run, step))
    fs, path = storage.open_url(run)
    listed = storage._scan(fs, path, run)  # ls's listing: both committed
    assert [MANIFEST in files for _, files in listed.values()] == [True, True]
    assert zc.apply_retention(run, 1) == [zc.checkpoint_url(run, 1)]  # what the saving run does next
    infos = [storage._info(fs, zc.checkpoint_url(run, s), p, s, files) for s, (p, files) in listed.items()]
    assert infos[0] is None and infos[1] is not None and infos[1].committed
    assert _verify(zc.checkpoint_url(run, 1), {}) is None  # --verify: listed, then gone
    assert _verify(zc.checkpoint_url(run, 2), {}) == "ok"

    zc.save(engine, zc.checkpoint_url(run, 3))
    listed = storage._scan(fs, path, run)
    fs.rm_file(posixpath.join(path, "checkpoint_2", MANIFEST))  # delete_checkpoint's first step, then listed
    step2 = listed[2]
    assert storage._info(fs, zc.checkpoint_url(run, 2), step2[0], 2, step2[1]) is None
    assert _verify(zc.checkpoint_url(run, 2), {}) is None
    engine.close()
