"""Sharded checkpoints: exact round trips for every stage, resharding across world sizes and stages,
async saves, retention, corruption and planted pickles, export. Real processes with gloo on CPU.

The resharding matrix is :data:`CASES` below, built by module fixtures, each one spawn: world 2 saves
every stage, world 4 and world 3 save one more and load from the others, world 1 loads in-process.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import zeroray.checkpoint as zc
from tests.support.checkpoint import assemble, assert_same, make_engine, snapshot
from tests.support.dist import run_ranks
from tests.support.models import batches
from tests.support.recipe import OPT_STEPS, train

# (source world, source stage) -> (destination world, destination stage). A save loaded by the
# world that wrote it is a round trip; world 1 loads in this process.
CASES: list[tuple[tuple[int, int], tuple[int, int]]] = [
    # source   destination
    ((2, 0), (2, 0)),
    ((2, 1), (2, 1)),
    ((2, 2), (2, 2)),
    ((2, 3), (2, 3)),
    ((4, 3), (4, 3)),
    ((3, 1), (3, 1)),
    ((2, 0), (4, 3)),
    ((2, 1), (4, 2)),
    ((2, 2), (4, 1)),
    ((2, 3), (4, 0)),
    ((2, 3), (3, 3)),
    ((4, 3), (3, 2)),
    ((4, 3), (3, 1)),
    ((2, 0), (3, 0)),
    ((4, 3), (1, 0)),
    ((3, 1), (1, 3)),
    ((2, 2), (1, 2)),
]
SAVES = {world: sorted({s for (w, s), _ in CASES if w == world}) for world in (2, 4, 3)}

def _save_worker(rank: int, world: int, base: str, stages: list[int], loads: list[tuple[str, int]]) -> dict:
    """Train, save (async on odd stages), go on one step, save again, then load into a fresh engine
    and take the same step: same loss, same state. Then load each (checkpoint, stage) of ``loads``."""
    out: dict[Any, Any] = {}
    for stage in stages:
        run = f"{base}/w{world}s{stage}"
        engine = make_engine(stage)
        saver = zc.AsyncSaver(engine) if stage % 2 == 1 else None
        save = saver.save if saver else functools.partial(zc.save, engine)
        data = batches(rank, OPT_STEPS + 1)
        train(engine, data[:OPT_STEPS])
        before = snapshot(engine)
        save(zc.checkpoint_url(run, OPT_STEPS))
        loss = train(engine, data[OPT_STEPS:])[-1]  # overlaps the async upload
        save(zc.checkpoint_url(run, OPT_STEPS + 1))  # waits for the previous one
        if saver:
            saver.wait()
        after = snapshot(engine)
        engine.close()

        fresh = make_engine(stage, seed=1)
        zc.load(fresh, zc.checkpoint_url(run, OPT_STEPS))
        loaded = snapshot(fresh)
        loaded_loss = train(fresh, data[OPT_STEPS:])[-1]
        out[stage] = {
            "before": before,
            "after": after,
            "loaded": loaded,
            "losses": (loss, loaded_loss),
            "continued": snapshot(fresh),
        }
        fresh.close()
    for url, stage in loads:
        engine = make_engine(stage, seed=2)
        zc.load(engine, url)
        out[(url, stage)] = snapshot(engine)
        engine.close()
    return out


def _ckpt(base: Path, world: int, stage: int, step: int = OPT_STEPS) -> str:
    return zc.checkpoint_url(f"{base}/w{world}s{stage}", step)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


def _loads(base: Path, world: int) -> list[tuple[str, int]]:
    return [(_ckpt(base, *src), dst[1]) for src, dst in CASES if dst[0] == world and src[0] != world]


@pytest.fixture(scope="module")
def w2(base: Path) -> list[dict]:
    return run_ranks(_save_worker, 2, str(base), SAVES[2], _loads(base, 2))


@pytest.fixture(scope="module")
def w4(base: Path, w2: list[dict]) -> list[dict]:
    return run_ranks(_save_worker, 4, str(base), SAVES[4], _loads(base, 4))


@pytest.fixture(scope="module")
def w3(base: Path, w2: list[dict], w4: list[dict]) -> list[dict]:
    return run_ranks(_save_worker, 3, str(base), SAVES[3], _loads(base, 3))


def expected(results: list[dict], stage: int, when: str = "before") -> dict[str, Any]:
    return assemble([r[stage][when] for r in results])


def test_round_trip_every_stage(w2: list[dict]) -> None:
    for stage in range(4):
        want = expected(w2, stage)
        assert want["meta"]["global_step"] == OPT_STEPS and want["opt"], stage
        assert_same(assemble([r[stage]["loaded"] for r in w2]), want, f"stage {stage} loaded")
        # The loaded engine takes the next step exactly as the saved one did.
        for r in w2:
            assert r[stage]["losses"][0] == r[stage]["losses"][1], stage
        assert_same(assemble([r[stage]["continued"] for r in w2]), expected(w2, stage, "after"), f"stage {stage}")


@pytest.mark.parametrize(("src", "dst"), CASES, ids=[f"w{a}s{b}->w{c}s{d}" for (a, b), (c, d) in CASES])
def test_resharding_matrix(
    src: tuple[int, int], dst: tuple[int, int], base: Path, w2: list[dict], w4: list[dict], w3: list[dict]
) -> None:
    by_world = {2: w2, 4: w4, 3: w3}
    want = expected(by_world[src[0]], src[1])
    url = _ckpt(base, *src)
    if src == dst:  # the saving world's own round trip
        got = assemble([r[src[1]]["loaded"] for r in by_world[src[0]]])
    elif dst[0] == 1:  # in this process
        engine = make_engine(dst[1], seed=3)
        manifest = zc.load(engine, url)
        assert (manifest.world_size, manifest.stage) == src
        got = assemble([snapshot(engine)])
        engine.close()
    else:
        got = assemble([r[(url, dst[1])] for r in by_world[dst[0]]])
    assert_same(got, want, f"{src} -> {dst}")


def test_async_saves_in_a_row_and_listing(base: Path, w2: list[dict]) -> None:
    """The second async save waited for the first; both hold what was there when they were called."""
    engine = make_engine(1, seed=4)
    zc.load(engine, _ckpt(base, 2, 1, OPT_STEPS + 1))
    assert_same(assemble([snapshot(engine)]), expected(w2, 1, "after"), "second async save")
    engine.close()
    infos = zc.list_checkpoints(f"{base}/w2s1")
    assert [(i.step, i.committed, i.world_size, i.stage) for i in infos] == [(3, True, 2, 1), (4, True, 2, 1)]
    assert zc.latest_committed(f"{base}/w2s1") == _ckpt(base, 2, 1, OPT_STEPS + 1)
    assert not any(n.endswith(".part.json") for n in os.listdir(_ckpt(base, 2, 1)))


def test_export_matches_full_state_dict(base: Path, w2: list[dict], tmp_path: Path) -> None:
    want = expected(w2, 3)
    files = zc.export(_ckpt(base, 2, 3), str(tmp_path / "fp32"), max_shard_bytes=4000)
    assert files[-1] == "model.safetensors.index.json" and len(files) > 3
    index = json.loads((tmp_path / "fp32" / files[-1]).read_text())
    got: dict[str, torch.Tensor] = {}
    for f in files[:-1]:
        got.update(load_file(tmp_path / "fp32" / f))
    assert set(index["weight_map"]) == set(got)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    for name, t in want["weights"].items():
        assert torch.equal(got[name], t), name
    assert torch.equal(got["pos_scale"], want["buffers"]["pos_scale"])

    zc.export(_ckpt(base, 2, 3), str(tmp_path / "bf16"), dtype="bf16")
    half = load_file(tmp_path / "bf16" / "model-00001-of-00001.safetensors")
    for name, t in want["weights"].items():
        assert torch.equal(half[name], t.to(torch.bfloat16)), name


# ---------------------------------------------------------------------------- damage


def _flip(path: Path, pos: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[pos] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """A world-1, stage-2 checkpoint and the state it holds."""
    engine = make_engine(2)
    train(engine, batches(0, 2))
    url = str(tmp_path_factory.mktemp("small") / "checkpoint_2")
    zc.save(engine, url)
    state = snapshot(engine)
    engine.close()
    return url, state


def test_flipped_byte_in_any_file_is_named(small: tuple[str, dict], tmp_path: Path) -> None:
    url, _ = small
    for name in sorted(os.listdir(url)):
        size = (Path(url) / name).stat().st_size
        for pos in (0, size // 3, size // 2, size - 1):
            copy = tmp_path / f"{name}-{pos}"
            shutil.copytree(url, copy)
            _flip(copy / name, pos)
            engine = make_engine(2, seed=5)
            with pytest.raises(zc.CheckpointError, match=name.replace(".", r"\.")):
                zc.load(engine, str(copy))
            engine.close()


class _Planted:
    """Unpickling this touches a marker file: proof that a load ran code from storage."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def test_planted_pickle_is_rejected_without_running(small: tuple[str, dict], tmp_path: Path) -> None:
    url, _ = small
    marker = tmp_path / "ran"
    for name in ("rank-00000.bin", "manifest.json"):
        copy = tmp_path / name
        shutil.copytree(url, copy)
        (copy / name).write_bytes(pickle.dumps({"weight": _Planted(marker)}))
        engine = make_engine(2, seed=6)
        with pytest.raises(zc.CheckpointError, match=name.replace(".", r"\.")):
            zc.load(engine, str(copy))
        engine.close()
        torch_file = tmp_path / "planted.pt"
        torch.save({"weight": _Planted(marker)}, torch_file)
        shutil.copy(torch_file, copy / name)
        with pytest.raises(zc.CheckpointError, match=name.replace(".", r"\.")):
            zc.load(make_engine(2, seed=6), str(copy))
    assert not marker.exists()


def test_checkpoint_that_does_not_fit_the_model(small: tuple[str, dict]) -> None:
    url, _ = small
    engine = make_engine(2, d=14)
    with pytest.raises(zc.CheckpointError, match="shape mismatch"):
        zc.load(engine, url)
    with pytest.raises(zc.CheckpointError, match="checkpoint_9 does not exist"):
        zc.load(engine, str(Path(url).parent / "checkpoint_9"))
    engine.close()


def test_cli_ls_and_export(base: Path, w2: list[dict], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from zeroray.cli import main

    run = tmp_path / "run"
    shutil.copytree(f"{base}/w2s2", run)
    assert main(["ls", str(run), "--verify"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:6] == ["step", "committed", "world", "stage", "size", "check"]
    assert [line.split()[:4] for line in lines[1:]] == [["3", "yes", "2", "2"], ["4", "yes", "2", "2"]]
    assert all(" ok " in line for line in lines[1:])

    _flip(run / "checkpoint_4" / "rank-00001.bin", 100)
    assert main(["ls", str(run), "--verify"]) == 1
    assert "checkpoint_4/rank-00001.bin" in capsys.readouterr().out

    out = tmp_path / "hf"
    assert main(["export", str(run / "checkpoint_3"), str(out), "--dtype", "bf16", "--max-shard-size", "2KB"]) == 0
    files = capsys.readouterr().out.split()
    got: dict[str, torch.Tensor] = {}
    for f in files[:-1]:
        got.update(load_file(out / f))
    for name, t in expected(w2, 2)["weights"].items():
        assert torch.equal(got[name], t.to(torch.bfloat16)), name
    assert main(["export", str(run / "checkpoint_9"), str(out)]) == 2
    assert "checkpoint_9 does not exist" in capsys.readouterr().err

    empty = tmp_path / "empty-run"
    empty.mkdir()
    assert main(["ls", str(empty)]) == 0
    assert capsys.readouterr().out.strip() == f"no checkpoints under {empty}"
