"""Saving: every rank writes its own file straight to storage; rank 0 commits the manifest last.

A save, on every rank:

1. wait for this rank's previous async save (one in flight per rank, so a host buffer is never
   overwritten while it uploads); all ranks agree that it and the directory set-up went well;
2. pick its sections: its slice of every flat group ("weight" and each optimizer state, fp32), its
   RNG state, and on rank 0 the model's persistent buffers. At stage 0 every rank holds every group,
   so group ``i`` is written only by rank ``i % world_size``;
3. write ``rank-NNNNN.bin`` through fsspec, hashing 4 MiB chunks while writing, then its "done"
   marker ``rank-NNNNN.part.json`` (the file's section table and checksums);
4. rank 0 waits until every rank's marker is there, writes ``manifest.json`` — the commit — and
   deletes the markers (and, if asked, old checkpoints).

Sync saves run 3-4 in the caller and end with a collective, so every rank returns after the commit.
Async saves first copy the sections into a reusable host buffer (pinned on GPU) — the only stall —
then run 3-4 in a background thread; rank 0's thread polls storage for the markers, so no collective
runs off the main thread. ``wait(engine)`` (or the next save) joins it; on rank 0 that means
committed.
"""

from __future__ import annotations

import json
import posixpath
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from fsspec import AbstractFileSystem

from zeroray.checkpoint.manifest import (
    ALGORITHM,
    CHUNK_BYTES,
    MANIFEST,
    CheckpointError,
    ChunkHasher,
    aligned,
    dump_manifest,
    file_digest,
    part_file,
    rank_file,
)
from zeroray.checkpoint.storage import apply_retention, delete_checkpoint, open_url, parent_url
from zeroray.engine import ZeroEngine

_WRITE_STEP = 4 << 20  # bytes handed to f.write at a time, hashed meanwhile in another thread
_POLL_MAX_S = 1.0


class SaveHandle:
    """One rank's part of a save. ``wait()`` returns once this rank's file is written (rank 0: once
    the checkpoint is committed) and raises what went wrong."""

    def __init__(self, url: str, thread: threading.Thread | None = None):
        self.url = url
        self._thread = thread
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise CheckpointError(f"saving {self.url} failed: {self.error}") from self.error


@dataclass
class _RankSaver:
    """Per-engine async state: the reusable host buffer and the save in flight."""

    buffer: torch.Tensor | None = None
    inflight: SaveHandle | None = None


_savers: weakref.WeakKeyDictionary[ZeroEngine, _RankSaver] = weakref.WeakKeyDictionary()


@dataclass
class _Section:
    entry: dict[str, Any]  # its manifest entry; "offset" is set by _layout
    tensor: torch.Tensor = field(repr=False)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _plan(engine: ZeroEngine) -> tuple[list[dict[str, Any]], list[_Section]]:
    """The rank-independent group table and this rank's sections, laid out in file order."""
    rank, world = engine.rank, engine.world_size
    groups, sections = [], []
    for i, g in enumerate(engine.shard_state()):
        groups.append(
            {
                "name": g.name,
                "numel": g.numel,
                "shard_world": g.shard_world,
                "param_group": g.param_group,
                "dtype": "float32",
                "keys": sorted(g.tensors),
                "slots": [{"name": s.name, "shape": list(s.shape), "offset": s.offset} for s in g.slots],
            }
        )
        writer = i % world if g.shard_world == 1 else rank
        if writer != rank:
            continue
        for key in sorted(g.tensors):
            t = g.tensors[key].float()
            entry = {"kind": "shard", "group": g.name, "key": key, "shard": g.shard_rank, "dtype": "float32"}
            sections.append(_Section(entry, t))
    sections.append(_Section({"kind": "rng", "key": "cpu", "dtype": "uint8"}, torch.get_rng_state()))
    if engine.device.type == "cuda":
        rng = torch.cuda.get_rng_state(engine.device)
        sections.append(_Section({"kind": "rng", "key": "cuda", "dtype": "uint8"}, rng))
    if rank == 0:
        buffers = dict(engine.module.named_buffers())
        for name in engine.module.state_dict(keep_vars=True):
            if name in buffers:
                b = buffers[name]
                entry = {"kind": "buffer", "name": name, "shape": list(b.shape), "dtype": str(b.dtype).removeprefix("torch.")}
                sections.append(_Section(entry, b))
    pos = 0
    for s in sections:
        s.entry["offset"] = aligned(pos)
        s.entry["nbytes"] = s.tensor.numel() * s.tensor.element_size()
        pos = s.entry["offset"] + s.entry["nbytes"]
    return groups, sections


def _file_size(sections: list[_Section]) -> int:
    return sections[-1].entry["offset"] + sections[-1].entry["nbytes"]


def _views(sections: list[_Section]) -> list[tuple[int, memoryview]]:
    """Sync save: write straight from the tensors (CPU ones without a copy)."""
    return [(s.entry["offset"], memoryview(_raw(s.tensor).cpu().numpy())) for s in sections]


def _snapshot(saver: _RankSaver, sections: list[_Section], device: torch.device) -> list[tuple[int, memoryview]]:
    """Async save: copy every section into the host buffer, laid out exactly as the file."""
    total = _file_size(sections)
    if saver.buffer is None or saver.buffer.numel() < total:
        saver.buffer = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    buf = saver.buffer[:total]
    pos = 0
    for s in sections:
        off = s.entry["offset"]
        buf[pos:off].zero_()
        buf[off : off + s.entry["nbytes"]].copy_(_raw(s.tensor), non_blocking=True)
        pos = off + s.entry["nbytes"]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return [(0, memoryview(buf.numpy()))]


def _write_file(fs: AbstractFileSystem, path: str, pieces: list[tuple[int, memoryview]]) -> list[str]:
    """Stream ``pieces`` (file offset, bytes) to ``path``, zero-filling gaps; returns chunk checksums."""
    hasher = ChunkHasher(CHUNK_BYTES)
    pos = 0
    with ThreadPoolExecutor(1) as pool, fs.open(path, "wb") as f:
        for off, data in pieces:
            if off > pos:
                pad = bytes(off - pos)
                hasher.update(pad)
                f.write(pad)
            for i in range(0, len(data), _WRITE_STEP):
                part = data[i : i + _WRITE_STEP]
                hashed = pool.submit(hasher.update, part)
                f.write(part)
                hashed.result()
            pos = off + len(data)
    return hasher.finish()


def _write_rank(
    fs: AbstractFileSystem, path: str, rank: int, sections: list[_Section], pieces: list[tuple[int, memoryview]]
) -> None:
    """This rank's file, then its "done" marker carrying the file's manifest entry."""
    name = rank_file(rank)
    chunks = _write_file(fs, posixpath.join(path, name), pieces)
    entry = {
        "path": name,
        "rank": rank,
        "size": _file_size(sections),
        "algorithm": ALGORITHM,
        "chunk_bytes": CHUNK_BYTES,
        "chunks": chunks,
        "sha256": file_digest(chunks),
        "sections": [s.entry for s in sections],
    }
    fs.pipe_file(posixpath.join(path, part_file(rank)), json.dumps({"file": entry}).encode())


def _await_parts(fs: AbstractFileSystem, path: str, url: str, world: int, timeout: float) -> list[dict[str, Any]]:
    """Rank 0: poll storage until every rank's marker is there; fail on a rank's error marker."""
    names = [part_file(r) for r in range(world)]
    deadline, delay = time.monotonic() + timeout, 0.01
    while True:
        fs.invalidate_cache(path)
        try:
            present = {posixpath.basename(p) for p in fs.ls(path, detail=False)}
        except FileNotFoundError:  # object stores: no "directory" before its first file
            present = set()
        if all(n in present for n in names):
            break
        if time.monotonic() > deadline:
            missing = [r for r, n in enumerate(names) if n not in present]
            raise CheckpointError(f"ranks {missing} did not finish writing {url} within {timeout:.0f} s")
        time.sleep(delay)
        delay = min(2 * delay, _POLL_MAX_S)
    parts = [json.loads(fs.cat_file(posixpath.join(path, n))) for n in names]
    failed = [f"rank {r}: {p['error']}" for r, p in enumerate(parts) if "error" in p]
    if failed:
        raise CheckpointError("; ".join(failed))
    return [p["file"] for p in parts]


@dataclass
class _Commit:
    """What rank 0 needs to commit: the manifest body minus the files, and retention."""

    body: dict[str, Any]
    run_url: str
    num_to_keep: int | None
    storage_options: dict[str, Any] | None
    timeout: float


def _commit(fs: AbstractFileSystem, path: str, url: str, c: _Commit) -> None:
    files = _await_parts(fs, path, url, c.body["world_size"], c.timeout)
    fs.pipe_file(posixpath.join(path, MANIFEST), dump_manifest({**c.body, "files": files}))
    fs.rm([posixpath.join(path, part_file(r)) for r in range(c.body["world_size"])])
    if c.num_to_keep is not None:
        apply_retention(c.run_url, c.num_to_keep, c.storage_options)


def _agree(engine: ZeroEngine, error: str | None, what: str) -> None:
    """Collective: raise on every rank if ``what`` failed on any rank."""
    errors = [error]
    if engine.process_group is not None:
        errors = [None] * engine.world_size
        dist.all_gather_object(errors, error, group=engine.process_group)
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if failed:
        raise CheckpointError(f"{what} failed: " + "; ".join(failed))


def _attempt(fn: Callable[[], None]) -> str | None:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def _prepare_dir(fs: AbstractFileSystem, path: str) -> None:
    """Rank 0: start from an empty directory (a save to an existing checkpoint replaces it)."""
    if fs.exists(path):
        delete_checkpoint(fs, path)
    fs.makedirs(path, exist_ok=True)


def wait(engine: ZeroEngine) -> None:
    """Block until this rank's in-flight async save is done (on rank 0: committed); raise its error."""
    saver = _savers.get(engine)
    if saver is not None and saver.inflight is not None:
        handle, saver.inflight = saver.inflight, None
        handle.wait()


def save(
    engine: ZeroEngine,
    url: str,
    *,
    async_: bool = False,
    storage_options: dict[str, Any] | None = None,
    num_to_keep: int | None = None,
    commit_timeout: float = 1800.0,
) -> SaveHandle:
    """Collective: save ``engine`` to the directory ``url`` (any fsspec URL), every rank in parallel.

    ``async_``: return after copying into a host buffer; upload and commit go on in the background
    (join with :func:`wait`). ``num_to_keep``: after the commit, rank 0 applies
    :func:`apply_retention` to the parent directory (the run). ``commit_timeout``: how long rank 0
    waits for the other ranks' files before giving the save up.
    """
    saver = _savers.setdefault(engine, _RankSaver())
    rank = engine.rank
    previous = _attempt(lambda: wait(engine))
    fs, path = open_url(url, storage_options)
    ready = previous or (_attempt(lambda: _prepare_dir(fs, path)) if rank == 0 else None)
    _agree(engine, ready, f"preparing the save to {url} (or the previous async save)")

    groups, sections = _plan(engine)
    commit = None
    if rank == 0:
        meta = engine.state_meta()
        body = {"world_size": engine.world_size, "stage": engine.stage, "groups": groups, "meta": meta}
        commit = _Commit(body, parent_url(url), num_to_keep, storage_options, commit_timeout)

    if not async_:
        _agree(engine, _attempt(lambda: _write_rank(fs, path, rank, sections, _views(sections))), f"writing {url}")
        _agree(engine, _attempt(lambda: _commit(fs, path, url, commit)) if commit else None, f"committing {url}")
        return SaveHandle(url)

    pieces = _snapshot(saver, sections, engine.device)
    handle = SaveHandle(url)

    def upload() -> None:
        try:
            _write_rank(fs, path, rank, sections, pieces)
        except Exception as e:
            handle.error = e
            msg = json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()
            _attempt(lambda: fs.pipe_file(posixpath.join(path, part_file(rank)), msg))
            return
        if commit is not None:
            try:
                _commit(fs, path, url, commit)
            except Exception as e:
                handle.error = e

    handle._thread = threading.Thread(target=upload, name=f"zeroray-save-rank{rank}", daemon=True)
    handle._thread.start()
    saver.inflight = handle
    return handle
