"""Checkpoints of CUDA engines: save (sync and async through the pinned host buffer), load, reshard to
another world size and stage, export, and the CUDA RNG state, with two ranks sharing cuda:0 over gloo."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch.utils._pytree import tree_map

import zeroray.checkpoint as zc
from tests.support.checkpoint import assemble, assert_same, make_engine, snapshot
from tests.support.dist import run_ranks
from tests.support.models import batches
from tests.support.recipe import OPT_STEPS, train


def _cpu(obj: Any) -> Any:
    return tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, obj)


def _worker(rank: int, world: int, base: str) -> dict:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    out: dict[Any, Any] = {}
    for stage in (1, 2, 3):
        engine = make_engine(stage, 0, dev)
        train(engine, [(x.to(dev), y.to(dev)) for x, y in batches(rank, OPT_STEPS)])
        zc.save(engine, f"{base}/s{stage}/checkpoint_sync")
        saver = zc.AsyncSaver(engine)
        saver.save(f"{base}/s{stage}/checkpoint_async")
        pinned = saver._buffer is not None and saver._buffer.is_pinned()
        saver.wait()
        before = snapshot(engine)
        after_save = torch.rand(8, device=dev)  # the CUDA generator moved on from the saved state
        engine.close()

        loaded = {}
        for kind in ("sync", "async"):
            other = make_engine(4 - stage if stage != 2 else 2, 7, dev)  # another stage (2 stays 2)
            torch.cuda.manual_seed(12345)
            zc.load(other, f"{base}/s{stage}/checkpoint_{kind}")
            loaded[kind] = (snapshot(other), torch.rand(8, device=dev))
            other.close()
        out[stage] = _cpu({"before": before, "pinned": pinned, "after_save": after_save, "loaded": loaded})
    return out


def test_cuda_checkpoints_round_trip_reshard_and_export(tmp_path: Path) -> None:
    results = run_ranks(_worker, 2, str(tmp_path))
    for stage in (1, 2, 3):
        want = assemble([r[stage]["before"] for r in results])
        assert want["meta"]["global_step"] == OPT_STEPS
        for r in results:
            assert r[stage]["pinned"], "the async save's host buffer is pinned on CUDA"
        for kind in ("sync", "async"):
            got = assemble([r[stage]["loaded"][kind][0] for r in results])
            assert_same(got, want, f"stage {stage} {kind}")
            for r in results:  # each rank's CUDA RNG continues where it was when saved
                assert torch.equal(r[stage]["loaded"][kind][1], r[stage]["after_save"]), (stage, kind)

    # World 2 stage 3 into world 1 stage 1, in this process, on the GPU.
    dev = torch.device("cuda", 0)
    engine = make_engine(1, 9, dev)
    manifest = zc.load(engine, str(tmp_path / "s3" / "checkpoint_sync"))
    assert (manifest.world_size, manifest.stage) == (2, 3)
    want = assemble([r[3]["before"] for r in results])
    assert_same(_cpu(assemble([snapshot(engine)])), want, "w2s3 -> w1s1")
    assert all(p.is_cuda for p in engine.module.parameters())
    engine.close()

    files = zc.export(str(tmp_path / "s3" / "checkpoint_async"), str(tmp_path / "hf"))
    got = {}
    for f in files[:-1] if files[-1].endswith(".json") else files:
        got.update(load_file(tmp_path / "hf" / f))
    for name, t in want["weights"].items():
        assert torch.equal(got[name], t), name
