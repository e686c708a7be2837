"""Loading, at any world size and stage: each rank reads only the byte ranges it owns.

For every flat group of *this* engine, :func:`zeroray.engine.layout.pieces` says which parameters
(and which elements of them) this rank's range covers; the manifest says where each parameter lies
in the group that *saved* it, and :func:`zeroray.engine.layout.owners` which saved rank's section
holds those elements. That gives byte ranges of the rank files; they are widened to whole 4 MiB
chunks, read with fsspec range reads (concurrent on object stores), checked against the manifest's
chunk checksums, and copied into place. Nothing is unpickled: the manifest is JSON, tensors are
raw little-endian numbers.
"""

from __future__ import annotations

import posixpath
from bisect import bisect_right
from collections import defaultdict, deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy as np
import torch

from zeroray.checkpoint.manifest import CheckpointError, verify_chunks
from zeroray.checkpoint.storage import join_url, open_url, read_manifest
from zeroray.checkpoint.writer import wait
from zeroray.engine import GroupShard, ZeroEngine, layout

_MAX_RUN = 64 << 20  # bytes per range read
_INFLIGHT = 4  # range reads in flight at once
DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
}


@dataclass(frozen=True)
class Request:
    """Copy ``dest.nbytes`` bytes at ``offset`` of the rank file ``file`` into the CPU tensor ``dest``."""

    file: str
    offset: int
    dest: torch.Tensor

    @property
    def end(self) -> int:
        return self.offset + self.dest.numel() * self.dest.element_size()


class Checkpoint:
    """A committed checkpoint with a checked manifest, and verified range reads of its files."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        self.url = url
        self.fs, self.path = open_url(url, storage_options)
        self.manifest = read_manifest(self.fs, self.path, url)
        self.files = {f["path"]: f for f in self.manifest["files"]}
        self.params: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
            s["name"]: (g, s) for g in self.manifest["groups"] for s in g["slots"]
        }
        self._where = {
            (s["group"], s["key"], s["shard"]): (f["path"], s["offset"])
            for f in self.manifest["files"]
            for s in f["sections"]
            if s["kind"] == "shard"
        }

    def sections(self, kind: str) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
        """(file entry, section entry) of every section of ``kind`` ("rng", "buffer")."""
        for f in self.manifest["files"]:
            for s in f["sections"]:
                if s["kind"] == kind:
                    yield f, s

    def flat_requests(self, group: dict[str, Any], key: str, lo: int, hi: int, dest: torch.Tensor) -> list[Request]:
        """Reads that fill ``dest`` (fp32, ``hi - lo`` elements) with ``[lo, hi)`` of a saved group."""
        out = []
        for rank, llo, lhi in layout.owners(group["numel"], group["shard_world"], lo, hi):
            start = layout.shard_range(group["numel"], group["shard_world"], rank)[0] + llo
            file, offset = self._where[(group["name"], key, rank)]
            out.append(Request(file, offset + 4 * llo, dest[start - lo : start - lo + lhi - llo]))
        return out

    def read(self, requests: list[Request]) -> None:
        """Serve ``requests``: whole chunks are read, verified, then copied into place."""
        by_file: dict[str, list[Request]] = defaultdict(list)
        for r in requests:
            by_file[r.file].append(r)
        runs = []
        for name, reqs in by_file.items():
            reqs.sort(key=lambda r: r.offset)
            c = self.files[name]["chunk_bytes"]
            runs += _runs(self.files[name], sorted({k for r in reqs for k in range(r.offset // c, -(-r.end // c))}))
        ends = {name: [r.end for r in reqs] for name, reqs in by_file.items()}
        for entry, start, data in self._verified_runs(runs):
            reqs, stop = by_file[entry["path"]], start + len(data)
            for r in reqs[bisect_right(ends[entry["path"]], start) :]:
                if r.offset >= stop:
                    break
                a, b = max(r.offset, start), min(r.end, stop)
                dest = r.dest.view(torch.uint8).numpy()
                dest[a - r.offset : b - r.offset] = np.frombuffer(data, np.uint8, b - a, a - start)

    def verify(self) -> None:
        """Read every file whole and check every chunk (``zeroray ls --verify``)."""
        runs = [run for e in self.manifest["files"] for run in _runs(e, range(-(-e["size"] // e["chunk_bytes"])))]
        for _ in self._verified_runs(runs):
            pass

    def _fetch(self, entry: dict[str, Any], first: int, last: int) -> tuple[dict[str, Any], int, bytes]:
        """Chunks ``[first, last)`` of a file, checked against the manifest."""
        c, furl = entry["chunk_bytes"], join_url(self.url, entry["path"])
        start, stop = first * c, min(last * c, entry["size"])
        try:
            data = self.fs.cat_file(posixpath.join(self.path, entry["path"]), start=start, end=stop)
        except Exception as e:
            raise CheckpointError(f"cannot read {furl}: {type(e).__name__}: {e}") from e
        if len(data) != stop - start:
            raise CheckpointError(f"{furl} is shorter than the manifest says ({entry['size']} bytes)")
        verify_chunks(data, entry, first, furl)
        return entry, start, data

    def _verified_runs(self, runs: list[tuple[dict[str, Any], int, int]]) -> Iterator[tuple[dict[str, Any], int, bytes]]:
        """(file entry, offset, bytes) of each run, in order; up to _INFLIGHT runs are read and
        verified ahead in threads (fsspec range reads; concurrent requests on object stores)."""
        with ThreadPoolExecutor(_INFLIGHT) as pool:
            todo = iter(runs)
            pending = deque(pool.submit(self._fetch, *run) for run in islice(todo, _INFLIGHT))
            while pending:
                done = pending.popleft().result()
                for run in islice(todo, 1):
                    pending.append(pool.submit(self._fetch, *run))
                yield done


def _runs(entry: dict[str, Any], chunks: Iterable[int]) -> list[tuple[dict[str, Any], int, int]]:
    """Sorted chunk numbers as (entry, first, last) runs of consecutive chunks, each <= _MAX_RUN bytes."""
    runs: list[list[int]] = []
    for k in chunks:
        if runs and k == runs[-1][1] and (k - runs[-1][0]) * entry["chunk_bytes"] < _MAX_RUN:
            runs[-1][1] = k + 1
        else:
            runs.append([k, k + 1])
    return [(entry, a, b) for a, b in runs]


def _keys(ckpt: Checkpoint, slots: list[layout.TensorSlot], trainable: bool) -> list[str]:
    """The tensors to load for one of the engine's groups: the weights and, if it trains, the
    optimizer states its parameters were saved with (which must agree across its parameters)."""
    if not trainable:
        return ["weight"]
    found = {tuple(ckpt.params[s.name][0]["keys"]) for s in slots}
    if len(found) > 1:
        raise CheckpointError(
            f"{ckpt.url}: parameters {[s.name for s in slots]} were saved with different optimizer states "
            f"{sorted(found)}; they cannot share one optimizer group now"
        )
    return list(found.pop())


def _check_names(ckpt: Checkpoint, states: list[GroupShard]) -> None:
    names = {s.name: s.shape for g in states for s in g.slots}
    missing = sorted(names.keys() - ckpt.params.keys())
    unexpected = sorted(ckpt.params.keys() - names.keys())
    wrong = [
        f"{n}: saved {tuple(ckpt.params[n][1]['shape'])}, model {shape}"
        for n, shape in names.items()
        if n in ckpt.params and tuple(ckpt.params[n][1]["shape"]) != shape
    ]
    if missing or unexpected or wrong:
        raise CheckpointError(
            f"{ckpt.url} does not fit this model: missing {missing}, unexpected {unexpected}, shape mismatch {wrong}"
        )


def _raw_section(f: dict[str, Any], s: dict[str, Any]) -> tuple[Request, torch.Tensor]:
    buf = torch.empty(s["nbytes"], dtype=torch.uint8)
    return Request(f["path"], s["offset"], buf), buf


def load(engine: ZeroEngine, url: str, *, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Collective: load the checkpoint at ``url`` into ``engine``, whatever world size and stage wrote it.

    Restores weights, optimizer states, counters, loss scale, LR scheduler and the model's buffers.
    Per-rank RNG state is restored at the world size that saved it; at another world size each rank
    is reseeded with ``(global_step << 16) + rank`` instead. Returns the manifest.
    """
    wait(engine)
    ckpt = Checkpoint(url, storage_options)
    states = engine.shard_state()
    _check_names(ckpt, states)
    requests: list[Request] = []
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for gs in states:
        keys = _keys(ckpt, gs.slots, gs.param_group is not None)
        out = {k: torch.empty(gs.hi - gs.lo, dtype=torch.float32) for k in keys}
        for t in out.values():  # every element up to numel belongs to a tensor; the rest is padding
            t[max(0, gs.numel - gs.lo) :].zero_()
        for p in layout.pieces(gs.slots, gs.lo, gs.hi):
            group, slot = ckpt.params[p.name]
            lo = slot["offset"] + p.t_lo
            for k in keys:
                dest = out[k][p.f_lo - gs.lo : p.f_hi - gs.lo]
                requests += ckpt.flat_requests(group, k, lo, lo + p.numel, dest)
        tensors[gs.name] = out

    same_world = ckpt.manifest["world_size"] == engine.world_size
    rng: dict[str, torch.Tensor] = {}
    for f, s in ckpt.sections("rng"):
        if same_world and f["rank"] == engine.rank:
            req, rng[s["key"]] = _raw_section(f, s)
            requests.append(req)
    buffers = dict(engine.module.named_buffers())
    saved_buffers = []
    for f, s in ckpt.sections("buffer"):
        if s["name"] not in buffers or s["dtype"] not in DTYPES:
            raise CheckpointError(f"{url}: buffer {s['name']!r} ({s['dtype']}) does not fit this model")
        req, buf = _raw_section(f, s)
        requests.append(req)
        saved_buffers.append((s, buf))

    ckpt.read(requests)

    with torch.no_grad():
        for s, buf in saved_buffers:
            buffers[s["name"]].copy_(buf.view(DTYPES[s["dtype"]]).reshape(s["shape"]))
    meta = ckpt.manifest["meta"]
    engine.load_shard_state(tensors, meta)
    if same_world:
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and engine.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], engine.device)
    else:
        torch.manual_seed((int(meta["global_step"]) << 16) + engine.rank)
    return ckpt.manifest
