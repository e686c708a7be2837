"""The ranks of a checkpoint save or load decide together, on real gloo ranks (local disk and a moto S3
endpoint on loopback): an async save's ``wait`` returns on every rank only once the commit is decided;
``load`` refuses ranks that ask for different checkpoints; where one rank cannot reach the store (its
S3 endpoint refuses connections), a load, an async save and finding the newest checkpoint fail on every
rank within seconds, never in a collective's timeout; "the newest checkpoint" is one answer for all."""

from __future__ import annotations

import datetime
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import zeroray.checkpoint as zc
from tests.support.checkpoint import assemble, assert_same, make_engine, snapshot
from tests.support.dist import run_ranks
from tests.support.models import batches
from tests.support.recipe import train
from zeroray.checkpoint.manifest import MANIFEST

GROUP_TIMEOUT_S = 40  # the engines' group: a rank left waiting in a collective fails after this, not 30 min
PROMPT_S = 10  # "within seconds": every rank knows of a failure well before GROUP_TIMEOUT_S


@pytest.fixture
def refusing() -> Iterator[str]:
    """The endpoint URL of a second S3 store on loopback that refuses every connection: a port bound and
    never listened on (the kernel answers each connect with a reset), held for the test."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def _refused(options: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """The same bucket's options through ``endpoint``, one attempt per request (a client's own retries
    only delay the failure the ranks must agree on)."""
    return {**options, "endpoint_url": endpoint, "config_kwargs": {"retries": {"total_max_attempts": 1}}}


def _engine(stage: int, seed: int = 0) -> Any:
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    return make_engine(stage, seed=seed, process_group=group)


def _timed(fn: Callable[[], Any]) -> dict[str, Any]:
    """What ``fn`` raised (type, message) and after how many seconds; or what it returned."""
    start = time.monotonic()
    try:
        value = fn()
    except Exception as e:
        return {"s": time.monotonic() - start, "type": type(e).__name__, "error": str(e)}
    return {"s": time.monotonic() - start, "value": value}


# ---------------------------------------------------------------------------------------------- async wait
def _wait_then_list(rank: int, world: int, run: str) -> dict:
    engine = _engine(2)
    train(engine, batches(rank, 2))
    zc.save(engine, zc.checkpoint_url(run, 1))
    train(engine, batches(rank + 10, 1))
    saved = snapshot(engine)
    saver = zc.AsyncSaver(engine)
    saver.save(zc.checkpoint_url(run, 2))
    saver.wait()
    seen = zc.latest_committed(run)  # each rank looks for itself, right after its wait
    url = zc.latest_committed(run, engine=engine)  # the pattern: one answer for every rank
    engine.close()
    fresh = _engine(3, seed=1)
    zc.load(fresh, url)
    return {"seen": seen, "url": url, "saved": saved, "loaded": snapshot(fresh)}


def test_async_wait_returns_on_every_rank_once_the_commit_is_decided(tmp_path: Path) -> None:
    """The documented pattern on a local disk, no fault: ``wait`` returned on rank 1 once its file was
    written, so it listed the previous checkpoint while rank 0 had committed the new one."""
    run = str(tmp_path / "run")
    results = run_ranks(_wait_then_list, 2, run)
    want = zc.checkpoint_url(run, 2)
    assert [r["seen"] for r in results] == [want, want]
    assert [r["url"] for r in results] == [want, want]
    assert_same(assemble([r["loaded"] for r in results]), assemble([r["saved"] for r in results]), "step 2")


def _load_own(rank: int, world: int, run: str) -> dict:
    engine = _engine(2)
    for step in (1, 2):
        train(engine, batches(rank, 1))
        zc.save(engine, zc.checkpoint_url(run, step))
    engine.close()
    fresh = _engine(2, seed=1)
    out = _timed(lambda: zc.load(fresh, zc.checkpoint_url(run, rank + 1)))
    out["global_step"] = fresh.global_step
    return out


def test_load_refuses_ranks_that_ask_for_different_checkpoints(tmp_path: Path) -> None:
    """Rank 0 asks for checkpoint_1, rank 1 for checkpoint_2: every rank raises one line naming both,
    before reading anything (the engine keeps its state); before, each loaded its own, silently."""
    run = str(tmp_path / "run")
    results = run_ranks(_load_own, 2, run)
    for r in results:
        assert r.get("type") == "CheckpointError", r
        assert r["error"] == (
            f"the ranks asked to load different checkpoints (ranks [0]: {zc.checkpoint_url(run, 1)}; ranks [1]: "
            f"{zc.checkpoint_url(run, 2)}); every rank must load the same one: resolve it once with "
            "latest_committed(run_url, engine=engine)"
        )
        assert r["global_step"] == 0


# ---------------------------------------------------------------------------------------------- a store one rank cannot reach
def _load_unreachable(rank: int, world: int, run: str, good: dict, bad: dict) -> dict:
    engine = _engine(2)
    train(engine, batches(rank, 2))
    zc.save(engine, zc.checkpoint_url(run, 2), storage_options=good)
    engine.close()
    fresh = _engine(2, seed=1)
    before = snapshot(fresh)
    out = _timed(lambda: zc.load(fresh, zc.checkpoint_url(run, 2), storage_options=bad if rank == 1 else good))
    out["unchanged"] = fresh.global_step == 0
    out["before"], out["after"] = before, snapshot(fresh)
    return out


def test_load_fails_on_every_rank_at_once_when_one_rank_cannot_read_the_store(s3: dict, refusing: str) -> None:
    """Rank 1's store refuses its connections: it raised at once while rank 0 installed its part and
    waited in the parameters' all-gather until the group's timeout. Now every rank raises within
    seconds: rank 1 its own error, rank 0 one naming rank 1, and no engine changed."""
    run = f"{s3['bucket']}/load-unreachable"
    results = run_ranks(_load_unreachable, 2, run, s3["options"], _refused(s3["options"], refusing))
    url = zc.checkpoint_url(run, 2)
    own, other = results[1], results[0]
    assert own.get("type") == "CheckpointStorageError", own
    assert own["error"].startswith(f"cannot read {url}/{MANIFEST}: EndpointConnectionError: "), own
    assert other.get("type") == "CheckpointError", other
    assert other["error"].startswith(
        f"loading {url} failed: rank 1: CheckpointStorageError: cannot read {url}/{MANIFEST}"), other
    for r in results:
        assert r["s"] < PROMPT_S, r
        assert r["unchanged"]
    assert_same(assemble([r["after"] for r in results]), assemble([r["before"] for r in results]), "unchanged")


def _save_unreachable(rank: int, world: int, run: str, good: dict, bad: dict) -> dict:
    engine = _engine(2)
    train(engine, batches(rank, 1))
    zc.save(engine, zc.checkpoint_url(run, 1), storage_options=good)
    train(engine, batches(rank, 1))
    saver = zc.AsyncSaver(engine)
    mine = bad if rank == 1 else good

    def save_and_wait() -> None:
        saver.save(zc.checkpoint_url(run, 2), storage_options=mine, commit_timeout=3 * GROUP_TIMEOUT_S)
        saver.wait()

    out = _timed(save_and_wait)
    out["again"] = _timed(saver.wait)  # decided: nothing in flight any more
    out["latest"] = zc.latest_committed(run, good, engine=engine)
    engine.close()
    return out


def test_async_save_fails_on_every_rank_within_seconds_when_one_rank_cannot_reach_the_store(
    s3: dict, refusing: str
) -> None:
    """Rank 1's upload and its error marker both fail (its store refuses connections): rank 0 polled
    storage for the marker until the commit timeout (1800 s by default). Now the ranks' ``wait`` agrees
    on the writes: every rank raises the same error within seconds, and nothing is committed."""
    run = f"{s3['bucket']}/save-unreachable"
    results = run_ranks(_save_unreachable, 2, run, s3["options"], _refused(s3["options"], refusing))
    url = zc.checkpoint_url(run, 2)
    for r in results:
        assert r.get("type") == "CheckpointError", r
        assert r["error"].startswith(f"saving {url} failed: rank 1: EndpointConnectionError: "), r
        assert r["s"] < PROMPT_S, r
        assert "value" in r["again"], r["again"]
        assert r["latest"] == zc.checkpoint_url(run, 1)
    assert results[0]["error"] == results[1]["error"]


def _latest(rank: int, world: int, run: str, good: dict, bad: dict, refused_rank: int) -> dict:
    engine = _engine(2)
    train(engine, batches(rank, 1))
    zc.save(engine, zc.checkpoint_url(run, 1), storage_options=good)
    mine = bad if rank == refused_rank else good
    out = _timed(lambda: zc.latest_committed(run, mine, engine=engine))
    engine.close()
    return out


@pytest.mark.parametrize("refused_rank", [1, 0])
def test_latest_committed_with_the_engine_is_one_decision_for_every_rank(
    s3: dict, refusing: str, refused_rank: int
) -> None:
    """While a store comes back from an outage, one rank's listing failed and another's succeeded: the
    second went into ``load`` alone. With the engine, rank 0 lists for all: a rank whose store refuses
    gets rank 0's answer without listing; where rank 0 cannot list, every rank raises at once."""
    run = f"{s3['bucket']}/latest-{refused_rank}"
    results = run_ranks(_latest, 2, run, s3["options"], _refused(s3["options"], refusing), refused_rank)
    if refused_rank == 1:
        assert [r.get("value") for r in results] == [zc.checkpoint_url(run, 1)] * 2, results
        return
    assert results[0].get("type") == "CheckpointStorageError", results[0]
    assert results[0]["error"].startswith(f"cannot list {run}: EndpointConnectionError: ")
    assert results[1].get("type") == "CheckpointError", results[1]
    assert results[1]["error"].startswith(
        f"finding the newest checkpoint of {run} (on rank 0) failed: rank 0: CheckpointStorageError: cannot list")
    assert all(r["s"] < PROMPT_S for r in results), results
