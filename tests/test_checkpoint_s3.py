"""Sharded checkpoints against a real S3 endpoint (moto over HTTP on loopback): two ranks upload in
parallel, the manifest commits, a fresh engine loads it back, export reads it, no secret is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import s3fs
import torch
from safetensors.torch import load_file

import zeroray.checkpoint as zc
from tests.support.checkpoint import assemble, assert_same, make_engine, snapshot
from tests.support.dist import run_ranks
from tests.support.models import batches
from tests.support.recipe import train
from tests.support.s3 import SECRET


def _worker(rank: int, world: int, run: str, options: dict[str, Any]) -> dict:
    engine = make_engine(3)
    train(engine, batches(rank, 2))
    saved = snapshot(engine)
    saver = zc.AsyncSaver(engine)
    saver.save(zc.checkpoint_url(run, 2), storage_options=options)
    train(engine, batches(rank + 10, 1))
    saver.wait()  # committed on every rank
    url = zc.latest_committed(run, options, engine=engine)  # one answer for every rank
    engine.close()
    fresh = make_engine(2, seed=1)
    zc.load(fresh, url, storage_options=options)
    return {"saved": saved, "loaded": snapshot(fresh)}


def test_s3_round_trip(s3: dict[str, Any], tmp_path: Path) -> None:
    run = f"{s3['bucket']}/run"
    results = run_ranks(_worker, 2, run, s3["options"])
    want = assemble([r["saved"] for r in results])
    assert_same(assemble([r["loaded"] for r in results]), want, "s3 round trip, stage 3 -> stage 2")

    (info,) = zc.list_checkpoints(run, s3["options"])
    assert (info.step, info.committed, info.world_size, info.stage) == (2, True, 2, 3)
    fs = s3fs.S3FileSystem(**s3["options"])
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{run}/checkpoint_2"))
    assert names == ["manifest.json", "rank-00000.bin", "rank-00001.bin"]
    for name in names:
        assert SECRET.encode() not in fs.cat_file(f"{run}/checkpoint_2/{name}")

    files = zc.export(info.url, str(tmp_path), storage_options=s3["options"])
    got = load_file(tmp_path / files[0])
    for name, t in want["weights"].items():
        assert torch.equal(got[name], t), name
