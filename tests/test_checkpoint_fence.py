"""The epoch fence (zeroray/checkpoint/fence.py) on a local disk and on S3 (moto on loopback): a writer of an
older epoch is refused at the commit, with its message, and leaves nothing committed; it cannot empty a
newer epoch's checkpoint; a manifest that landed after the fence moved (the object store's race) is never
taken as committed; on S3 a stale commit's manifest PUT that lands after the fence moved is taken back by the
commit itself, and one that meets a newer epoch's manifest is refused by the store; a mixed checkpoint is refused in one line; unfenced checkpoints load as before."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import zeroray.checkpoint as zc
from tests.support.checkpoint import make_engine
from tests.support.models import batches
from tests.support.recipe import train
from tests.support.s3 import SlowProxy
from zeroray.checkpoint import fence, writer
from zeroray.checkpoint.manifest import (
    MANIFEST,
    CheckpointError,
    dump_manifest,
    parse_manifest,
    part_file,
    rank_file,
)
from zeroray.checkpoint.storage import advance_epoch, open_url
from zeroray.storage import atomic_write


@pytest.fixture(params=["local", "s3"])
def run(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any] | None]:
    if request.param == "local":
        return str(tmp_path / "run"), None
    s3 = request.getfixturevalue("s3")
    return f"{s3['bucket']}/fence-{tmp_path.name}", s3["options"]


def _names(url: str, options: dict[str, Any] | None) -> list[str]:
    fs, path = open_url(url, options)
    fs.invalidate_cache(path)
    try:
        return sorted(p.rstrip("/").rsplit("/", 1)[1] for p in fs.ls(path, detail=False))
    except FileNotFoundError:
        return []


def test_a_stale_writer_is_refused_at_commit_and_leaves_nothing_committed(run: tuple[str, Any]) -> None:
    run_url, options = run
    engine = make_engine(2)
    train(engine, batches(0, 1))
    assert advance_epoch(run_url, options) == 1
    zc.save(engine, zc.checkpoint_url(run_url, 1), storage_options=options, epoch=1)
    assert _names(zc.checkpoint_url(run_url, 1), options) == [MANIFEST, rank_file(0, 1)]

    # Epoch 1's rank writes its file and marker for step 2, then stalls (a partition); epoch 2 begins.
    url = zc.checkpoint_url(run_url, 2)
    train(engine, batches(0, 1))
    fs, path, sections, commit = writer._start(engine, url, options, None, 30.0, epoch=1)
    writer._write_rank(fs, path, 0, sections, writer._views(sections), epoch=1)
    assert advance_epoch(run_url, options) == 2
    with pytest.raises(fence.StaleEpochError, match=(
            rf"^refused committing {url}: this rank writes for epoch 1, but the run is at epoch 2 \(a newer group "
            r"started; this rank was cut off from it\), so nothing of epoch 1 may be committed$")):
        commit.run(fs, path, url)
    assert MANIFEST not in _names(url, options)
    assert [(c.step, c.committed, c.epoch) for c in zc.list_checkpoints(run_url, options)] == [
        (1, True, 1), (2, False, None)]
    assert zc.latest_committed(run_url, options) == zc.checkpoint_url(run_url, 1)

    # Nor can it write a file, or empty a checkpoint directory that a newer epoch may hold.
    with pytest.raises(fence.StaleEpochError, match=r"^refused writing .*rank-00000\.e1\.bin: this rank writes for "
                                                    r"epoch 1, but the run is at epoch 2"):
        writer._write_rank(fs, path, 0, sections, writer._views(sections), epoch=1)
    with pytest.raises(CheckpointError, match=r"preparing the save to .* failed: rank 0: StaleEpochError: refused "
                                              r"preparing .*checkpoint_1: this rank writes for epoch 1"):
        zc.save(engine, zc.checkpoint_url(run_url, 1), storage_options=options, epoch=1)
    assert _names(zc.checkpoint_url(run_url, 1), options) == [MANIFEST, rank_file(0, 1)]

    # Epoch 2 commits the same step; its manifest and files name epoch 2 only.
    zc.save(engine, url, storage_options=options, epoch=2)
    manifest = zc.CheckpointReader(url, options).manifest
    assert manifest.epoch == 2 and [f.path for f in manifest.files] == [rank_file(0, 2)]
    fresh = make_engine(2, seed=1)
    zc.load(fresh, zc.latest_committed(run_url, options), storage_options=options)
    assert fresh.global_step == 2
    engine.close()
    fresh.close()


def test_a_manifest_that_landed_after_the_fence_moved_is_never_taken_as_committed(run: tuple[str, Any]) -> None:
    """On an object store a stale commit's PUT can land after the fence moved (it read the fence just before):
    the new epoch's fence does not list it, so listings call it broken and loads refuse it."""
    run_url, options = run
    engine = make_engine(2)
    advance_epoch(run_url, options)
    for step in (1, 2):
        train(engine, batches(0, 1))
        zc.save(engine, zc.checkpoint_url(run_url, step), storage_options=options, epoch=1)
    fs, _ = open_url(run_url, options)
    late_raw = fs.cat_file(f"{open_url(zc.checkpoint_url(run_url, 2), options)[1]}/{MANIFEST}")
    fs.rm_file(f"{open_url(zc.checkpoint_url(run_url, 2), options)[1]}/{MANIFEST}")  # not committed yet ...
    assert advance_epoch(run_url, options) == 2  # ... when epoch 2 began
    atomic_write(fs, f"{open_url(zc.checkpoint_url(run_url, 2), options)[1]}/{MANIFEST}", late_raw)  # the late PUT

    infos = zc.list_checkpoints(run_url, options)
    assert [(c.step, c.committed) for c in infos] == [(1, True), (2, False)]
    assert infos[1].broken.endswith("was committed by epoch 1 after epoch 2 began (a cut-off rank's commit): never "
                                    "taken as committed")
    assert zc.latest_committed(run_url, options) == zc.checkpoint_url(run_url, 1)
    with pytest.raises(CheckpointError, match="committed by epoch 1 after epoch 2 began"):
        zc.load(make_engine(2, seed=1), zc.checkpoint_url(run_url, 2), storage_options=options)
    zc.load(make_engine(2, seed=1), zc.checkpoint_url(run_url, 1), storage_options=options)  # accepted: before
    engine.close()


def test_a_mixed_checkpoint_is_refused_in_one_line(tmp_path: Path) -> None:
    run_url = str(tmp_path / "run")
    engine = make_engine(2)
    train(engine, batches(0, 1))
    advance_epoch(run_url)
    advance_epoch(run_url)
    url = zc.checkpoint_url(run_url, 1)
    zc.save(engine, url, epoch=2)
    manifest_path = Path(url) / MANIFEST
    manifest = parse_manifest(manifest_path.read_bytes(), str(manifest_path))
    manifest.files[0].path = rank_file(0, 1)  # a file an epoch-1 rank wrote, resealed (a forger, or a bug)
    (Path(url) / rank_file(0, 2)).rename(Path(url) / rank_file(0, 1))
    manifest_path.write_bytes(dump_manifest(manifest))
    with pytest.raises(CheckpointError) as e:
        zc.load(make_engine(2, seed=1), url)
    assert str(e.value) == (f"{url}/{MANIFEST} is not a valid manifest: a mixed checkpoint: rank-00000.e1.bin is a "
                            "file of epoch 1, the manifest's epoch is 2")
    (info,) = zc.list_checkpoints(run_url)
    assert not info.committed and "a mixed checkpoint" in info.broken
    engine.close()


def test_unfenced_checkpoints_load_as_before_in_a_fenced_run(tmp_path: Path) -> None:
    run_url = str(tmp_path / "run")
    engine = make_engine(2)
    train(engine, batches(0, 1))
    url = zc.checkpoint_url(run_url, 1)
    zc.save(engine, url)  # no epoch: a checkpoint from before fencing, or a user's own loop
    assert "epoch" not in json.loads((Path(url) / MANIFEST).read_bytes())
    assert sorted(p.name for p in Path(url).iterdir()) == [MANIFEST, rank_file(0)]
    assert advance_epoch(run_url) == 1 and advance_epoch(run_url) == 2
    assert json.loads((Path(run_url) / fence.FENCE).read_bytes())["accepted"] == {}
    assert zc.latest_committed(run_url) == url
    fresh = make_engine(2, seed=1)
    zc.load(fresh, url)
    assert fresh.global_step == 1
    engine.close()
    fresh.close()


@pytest.fixture
def held_commit(s3: dict[str, Any], tmp_path: Path) -> Iterator[tuple[str, dict[str, Any], Any, threading.Event]]:
    """On S3: epoch 1 saved step 1; its rank wrote step 2's file and marker, and rank 0's commit of step 2 passed
    the fence and sent its manifest PUT, which a proxy holds until the test sets the gate. Yields the run, its
    storage options (straight to the store), the commit's future (its error) and the gate."""
    run_url, options = f"{s3['bucket']}/held-{tmp_path.name}", s3["options"]
    engine = make_engine(2)
    train(engine, batches(0, 1))
    assert advance_epoch(run_url, options) == 1
    zc.save(engine, zc.checkpoint_url(run_url, 1), storage_options=options, epoch=1)
    train(engine, batches(0, 1))
    gate = threading.Event()
    proxy = SlowProxy(options["endpoint_url"], lambda method, path: method == "PUT" and path.endswith(f"/{MANIFEST}"),
                      gate=gate)
    with proxy.running(), ThreadPoolExecutor(1) as pool:
        url = zc.checkpoint_url(run_url, 2)
        fs, path, sections, commit = writer._start(engine, url, {**options, "endpoint_url": proxy.url}, None, 30.0,
                                                   epoch=1)
        writer._write_rank(fs, path, 0, sections, writer._views(sections), epoch=1)
        committing = pool.submit(commit.run, fs, path, url)
        assert proxy.arrived(1, timeout_s=30), "the manifest PUT never came"
        try:
            yield run_url, options, committing, gate
        finally:
            gate.set()
    engine.close()


def test_s3_a_manifest_put_that_lands_after_the_fence_moved_is_taken_back(held_commit: tuple) -> None:
    """The race the flock rules out on a disk: on S3 the fence moves between the commit's check and its PUT.
    After the PUT the commit reads the fence again and deletes its own manifest; the store is left with the
    step's uncommitted files only, and the run's newest committed checkpoint is step 1."""
    run_url, options, committing, gate = held_commit
    url = zc.checkpoint_url(run_url, 2)
    assert advance_epoch(run_url, options) == 2
    gate.set()
    with pytest.raises(fence.StaleEpochError, match=(
            rf"^refused committing {url}: this rank writes for epoch 1, but the run is at epoch 2 ")):
        committing.result(timeout=60)
    assert _names(url, options) == [rank_file(0, 1), part_file(0, 1)]  # the manifest taken back, nothing else
    assert [(c.step, c.committed) for c in zc.list_checkpoints(run_url, options)] == [(1, True), (2, False)]
    assert zc.latest_committed(run_url, options) == zc.checkpoint_url(run_url, 1)


def test_s3_a_stale_manifest_put_never_replaces_a_newer_epochs_commit(held_commit: tuple) -> None:
    """Epoch 2 commits the same step while epoch 1's manifest PUT is in flight: the PUT is conditional
    (If-None-Match), so the store refuses it, and epoch 2's checkpoint is left as it committed it."""
    run_url, options, committing, gate = held_commit
    url = zc.checkpoint_url(run_url, 2)
    assert advance_epoch(run_url, options) == 2
    engine = make_engine(2)
    train(engine, batches(0, 2))
    zc.save(engine, url, storage_options=options, epoch=2)
    fs, path = open_url(url, options)
    committed = fs.cat_file(f"{path}/{MANIFEST}")
    gate.set()
    with pytest.raises(CheckpointError, match=rf"^refused committing {url}: a manifest is there already \(another "
                                              r"epoch's\)$"):
        committing.result(timeout=60)
    assert _names(url, options) == [MANIFEST, rank_file(0, 2)]
    fs.invalidate_cache(path)
    assert fs.cat_file(f"{path}/{MANIFEST}") == committed
    fresh = make_engine(2, seed=1)
    zc.load(fresh, zc.latest_committed(run_url, options), storage_options=options)
    assert (fresh.global_step, zc.CheckpointReader(url, options).manifest.epoch) == (2, 2)
    engine.close()
    fresh.close()
