"""The commit protocol under failure: a disk that fills up at the manifest write (a real tmpfs), a torn
or damaged newest checkpoint (resume and ``Result.checkpoint`` fall back to the one before, ``ls``
lists it as broken), a rank marker seen before its content, and manifests of format version 1."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from fsspec.implementations.local import LocalFileSystem

import zeroray.checkpoint as zc
from tests.support.checkpoint import assemble, assert_same, make_engine, snapshot
from tests.support.models import batches
from tests.support.recipe import train
from zeroray.checkpoint import commit as protocol
from zeroray.checkpoint.manifest import FORMAT, MANIFEST, FileEntry, file_digest, part_file, rank_file
from zeroray.cli import main
from zeroray.train.result import Checkpoint, latest_checkpoint

PAGE = 4096


def _pages(n: int) -> int:
    return -(-n // PAGE)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs (a real filesystem that can fill up), unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill up (needs root / CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def _free(path: Path) -> int:
    s = os.statvfs(path)
    return s.f_bavail * s.f_frsize


def test_disk_full_at_the_manifest_leaves_the_previous_checkpoint(small_disk: Path) -> None:
    run = str(small_disk / "run")
    engine = make_engine(2)
    train(engine, batches(0, 1))
    zc.save(engine, zc.checkpoint_url(run, 1))
    saved = snapshot(engine)
    first = Path(zc.checkpoint_url(run, 1))
    rank_bytes = (first / rank_file(0)).stat().st_size
    manifest = json.loads((first / MANIFEST).read_bytes())
    marker_bytes = len(json.dumps({"file": manifest["files"][0]}).encode())
    manifest_bytes = (first / MANIFEST).stat().st_size
    assert manifest_bytes > PAGE  # so a full disk tears it rather than leaving nothing

    # Leave room for the next save's rank file and marker and part of its manifest: the disk fills
    # up in the middle of the manifest write.
    room = (_pages(rank_bytes) + _pages(marker_bytes) + _pages(manifest_bytes) - 1) * PAGE
    (small_disk / "filler").write_bytes(bytes(_free(small_disk) - room))
    train(engine, batches(0, 1))
    with pytest.raises(zc.CheckpointError, match="No space left on device"):
        zc.save(engine, zc.checkpoint_url(run, 2))
    engine.close()
    second = Path(zc.checkpoint_url(run, 2))
    assert (second / rank_file(0)).stat().st_size == rank_bytes, "the disk filled up before the manifest"
    assert not (second / MANIFEST).exists()  # no torn manifest: it was written under a temporary name
    assert sorted(p.name for p in second.iterdir() if ".tmp-" in p.name) == []

    assert zc.latest_committed(run) == str(first)
    assert latest_checkpoint(run) == Checkpoint(str(first), 1)
    fresh = make_engine(2, seed=1)
    zc.load(fresh, zc.latest_committed(run))
    assert_same(assemble([snapshot(fresh)]), assemble([saved]), "previous checkpoint")
    fresh.close()


@pytest.fixture
def two_saves(tmp_path: Path) -> str:
    """A run with checkpoints 1 and 2 (world 1, stage 2)."""
    run = str(tmp_path / "run")
    engine = make_engine(2)
    for step in (1, 2):
        train(engine, batches(0, 1))
        zc.save(engine, zc.checkpoint_url(run, step))
    engine.close()
    return run


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("torn manifest", "is not a valid manifest"),
        ("empty manifest", "is not a valid manifest"),
        ("missing rank file", "rank-00000.bin is missing"),
        ("short rank file", "rank-00000.bin has 100 bytes, the manifest says"),
    ],
)
def test_damaged_newest_checkpoint_falls_back(
    two_saves: str, damage: str, reason: str, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    run = two_saves
    newest = Path(zc.checkpoint_url(run, 2))
    if damage == "torn manifest":
        raw = (newest / MANIFEST).read_bytes()
        (newest / MANIFEST).write_bytes(raw[: len(raw) // 2])
    elif damage == "empty manifest":
        (newest / MANIFEST).write_bytes(b"")
    elif damage == "missing rank file":
        (newest / rank_file(0)).unlink()
    else:
        os.truncate(newest / rank_file(0), 100)

    previous = zc.checkpoint_url(run, 1)
    with caplog.at_level(logging.WARNING, logger="zeroray.checkpoint.storage"):
        assert zc.latest_committed(run) == previous  # what resume loads
    (warned,) = [r.getMessage() for r in caplog.records]  # the steps a resume loses are not lost silently
    assert warned.startswith(f"zeroray: {newest} is not a valid checkpoint (") and reason in warned, warned
    assert warned.endswith(f"): the newest valid one is {previous}"), warned
    assert latest_checkpoint(run) == Checkpoint(previous, 1)  # Result.checkpoint
    engine = make_engine(2, seed=1)
    zc.load(engine, zc.latest_committed(run))
    assert engine.global_step == 1
    engine.close()

    infos = zc.list_checkpoints(run)
    assert [(i.step, i.committed) for i in infos] == [(1, True), (2, False)]
    assert reason in infos[1].broken

    assert main(["ls", run]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines[1:]] == [["1", "yes"], ["2", "broken"]]
    assert reason in lines[2]


def test_marker_seen_before_its_content_is_not_there_yet(tmp_path: Path) -> None:
    """Rank 0 polls for the ranks' markers; a marker file that exists but does not parse (a writer
    that creates it before writing it) counts as not there yet, never as an error."""
    fs, path = LocalFileSystem(), tmp_path / "checkpoint_1"
    path.mkdir()
    entries = [FileEntry(rank_file(r), r, 0, "crc32c", 4 << 20, [], file_digest([]), []) for r in (0, 1)]
    protocol.write_marker(fs, str(path), 0, entries[0])
    for torn in (b"", b'{"file": '):
        (path / part_file(1)).write_bytes(torn)  # created, not (fully) written yet
        with pytest.raises(zc.CheckpointError, match=r"ranks \[1\] did not finish writing"):
            protocol.await_markers(fs, str(path), str(path), 2, timeout=0.3)
    protocol.write_marker(fs, str(path), 1, entries[1])
    assert protocol.await_markers(fs, str(path), str(path), 2, timeout=0.3) == entries


def _as_version_1(url: str) -> None:
    """Rewrite a checkpoint as zeroray wrote it before format version 2: crc32 (zlib) chunk
    checksums, version 1, the same JSON keys, resealed."""
    root = Path(url)
    body = json.loads((root / MANIFEST).read_bytes())
    body.pop("sha256")
    for f in body["files"]:
        raw = (root / f["path"]).read_bytes()
        c = f["chunk_bytes"]
        f["chunks"] = [f"{zlib.crc32(raw[i : i + c]):08x}" for i in range(0, len(raw), c)]
        f["algorithm"] = "crc32"
        f["sha256"] = hashlib.sha256(",".join(f["chunks"]).encode()).hexdigest()
    body["version"] = 1
    assert body["format"] == FORMAT
    seal = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    (root / MANIFEST).write_bytes(json.dumps({**body, "sha256": seal}, sort_keys=True, indent=1).encode())


def test_version_1_checkpoint_still_loads(two_saves: str, tmp_path: Path) -> None:
    url = zc.checkpoint_url(two_saves, 2)
    engine = make_engine(2, seed=1)
    zc.load(engine, url)
    want = assemble([snapshot(engine)])
    engine.close()
    _as_version_1(url)
    engine = make_engine(2, seed=2)
    manifest = zc.load(engine, url)
    assert manifest.version == 1 and {f.algorithm for f in manifest.files} == {"crc32"}
    assert_same(assemble([snapshot(engine)]), want, "version 1")
    engine.close()
    zc.CheckpointReader(url).verify()
    raw = bytearray((Path(url) / rank_file(0)).read_bytes())
    raw[len(raw) // 2] ^= 1
    (Path(url) / rank_file(0)).write_bytes(bytes(raw))
    with pytest.raises(zc.CheckpointError, match="checksum mismatch .* crc32 "):
        zc.CheckpointReader(url).verify()
