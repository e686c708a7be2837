"""Loading, at any world size and stage: each rank reads only the byte ranges it owns.

For every flat group of *this* engine, :func:`zeroray.engine.layout.pieces` says which parameters
(and which elements of them) this rank's range covers; the manifest says where each parameter lies
in the group that *saved* it, and :func:`zeroray.engine.layout.owners` which saved rank's section
holds those elements. That gives byte ranges of the rank files; they are widened to whole 4 MiB
chunks (the unit of the checksums) and merged into runs of at most 64 MiB, four runs in flight at
once in threads. On a local disk a run is read with one ``os.preadv`` straight into the destination
tensors (bytes nobody asked for go to a scratch buffer), then its chunks are checksummed from those
same buffers — no intermediate copy; elsewhere (object stores) a run is one range request, verified,
then copied into place. Nothing is unpickled: the manifest is JSON, tensors are raw little-endian
numbers.

The destinations are the engine's (:meth:`ZeroEngine.load_shard_stream`): whole fresh tensors,
all read before anything is installed, when the optimizer states live in memory; with NVMe offload,
one sub-group's swap buffer at a time, each swap file written once.
"""

from __future__ import annotations

import os
import posixpath
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from typing import Any, TypeVar

import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem

from zeroray.checkpoint.commit import agree
from zeroray.checkpoint.manifest import (
    DTYPES,
    CheckpointError,
    FileEntry,
    GroupEntry,
    Manifest,
    SectionEntry,
    SlotEntry,
    check_chunk,
    checksum,
    itemsize,
    verify_chunks,
)
from zeroray.checkpoint.storage import join_url, open_url, read_checked_manifest
from zeroray.engine import Comm, ZeroEngine, layout
from zeroray.engine import names as tensor_names
from zeroray.engine.shard_state import GroupSource, ShardRange

_MAX_RUN = 64 << 20  # bytes per range read
_INFLIGHT = 4  # range reads in flight at once
_IOV_MAX = 1024  # buffers per preadv call (Linux's IOV_MAX)
T = TypeVar("T")


@dataclass(frozen=True)
class Request:
    """Copy ``dest.nbytes`` bytes at ``offset`` of the rank file ``file`` into the CPU tensor ``dest``."""

    file: str
    offset: int
    dest: torch.Tensor

    @property
    def end(self) -> int:
        return self.offset + self.dest.numel() * self.dest.element_size()


@dataclass(frozen=True)
class _Run:
    """Chunks ``[first, last)`` of a file and the requests that overlap them (sorted by offset)."""

    entry: FileEntry
    first: int
    last: int
    requests: tuple[Request, ...]

    @property
    def start(self) -> int:
        return self.first * self.entry.chunk_bytes

    @property
    def stop(self) -> int:
        return min(self.last * self.entry.chunk_bytes, self.entry.size)


class CheckpointReader:
    """A committed checkpoint with a checked manifest, and verified range reads of its files.

    (Named apart from ``zeroray.train.Checkpoint``, the trainer's handle on a checkpoint's URL.)"""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        self.url = url
        self.fs, self.path = open_url(url, storage_options)
        self.manifest: Manifest = read_checked_manifest(self.fs, self.path, url)
        self.files = {f.path: f for f in self.manifest.files}
        self.params: dict[str, tuple[GroupEntry, SlotEntry]] = {
            s.name: (g, s) for g in self.manifest.groups for s in g.slots
        }
        self._where = {
            (s.group, s.key, s.shard): (f.path, s.offset) for f, s in self.manifest.sections("shard")
        }
        self._local = isinstance(self.fs, LocalFileSystem)

    def sections(self, kind: str) -> Iterator[tuple[FileEntry, SectionEntry]]:
        """(file entry, section entry) of every section of ``kind`` ("rng", "buffer")."""
        return self.manifest.sections(kind)

    def flat_requests(self, group: GroupEntry, key: str, lo: int, hi: int, dest: torch.Tensor) -> list[Request]:
        """Reads that fill ``dest`` (``hi - lo`` elements of the group's dtype) with ``[lo, hi)`` of a saved group."""
        if dest.dtype != DTYPES[group.dtype]:
            raise CheckpointError(f"{self.url}: group {group.name} was saved as {group.dtype}, not {dest.dtype}")
        size, out = itemsize(group.dtype), []
        for rank, llo, lhi in layout.owners(group.numel, group.shard_world, lo, hi):
            start = layout.shard_range(group.numel, group.shard_world, rank)[0] + llo
            file, offset = self._where[(group.name, key, rank)]
            out.append(Request(file, offset + size * llo, dest[start - lo : start - lo + lhi - llo]))
        return out

    def read(self, requests: list[Request]) -> None:
        """Serve ``requests``: the whole chunks they touch are read, verified and put in place."""
        by_file: dict[str, list[Request]] = defaultdict(list)
        for r in requests:
            by_file[r.file].append(r)
        runs = []
        for name, reqs in by_file.items():
            reqs.sort(key=lambda r: r.offset)
            entry = self.files[name]
            c = entry.chunk_bytes
            chunks = sorted({k for r in reqs for k in range(r.offset // c, -(-r.end // c))})
            runs += _runs(entry, chunks, reqs)
        for _ in self._done(runs):
            pass

    def verify(self) -> None:
        """Read every file whole and check every chunk (``zeroray ls --verify``)."""
        runs = [run for e in self.manifest.files for run in _runs(e, range(e.num_chunks), [])]
        for _ in self._done(runs):
            pass

    def _done(self, runs: list[_Run]) -> Iterator[_Run]:
        """Serve each run in a thread, up to _INFLIGHT at once (reading one overlaps checking another)."""
        with ThreadPoolExecutor(_INFLIGHT) as pool:
            todo = iter(runs)
            pending = deque(pool.submit(self._serve, run) for run in islice(todo, _INFLIGHT))
            while pending:
                done = pending.popleft().result()
                for run in islice(todo, 1):
                    pending.append(pool.submit(self._serve, run))
                yield done

    def _serve(self, run: _Run) -> _Run:
        furl = join_url(self.url, run.entry.path)
        try:
            if self._local:
                self._preadv(run, furl)
            else:
                self._cat(run, furl)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"cannot read {furl}: {type(e).__name__}: {e}") from e
        return run

    def _cat(self, run: _Run, furl: str) -> None:
        """Object stores: one range request, verified, then copied into the destinations."""
        data = self.fs.cat_file(posixpath.join(self.path, run.entry.path), start=run.start, end=run.stop)
        if len(data) != run.stop - run.start:
            raise CheckpointError(f"{furl} is shorter than the manifest says ({run.entry.size} bytes)")
        verify_chunks(data, run.entry, run.first, furl)
        src = memoryview(data)
        for lo, hi, dest in _segments(run):
            dest[:] = src[lo - run.start : hi - run.start]

    def _preadv(self, run: _Run, furl: str) -> None:
        """Local disk: read the run straight into the destinations (gaps into scratch), then check
        its chunks from those buffers."""
        segments = _segments(run)
        if any(a[1] > b[0] for a, b in zip(segments, segments[1:])):  # requests sharing bytes
            return self._cat(run, furl)
        gaps, pos = [], run.start
        for lo, hi, _ in segments:
            if lo > pos:
                gaps.append((pos, lo))
            pos = hi
        if pos < run.stop:
            gaps.append((pos, run.stop))
        scratch = np.empty(sum(hi - lo for lo, hi in gaps), np.uint8)
        s = 0
        for lo, hi in gaps:
            segments.append((lo, hi, memoryview(scratch[s : s + hi - lo])))
            s += hi - lo
        segments.sort(key=lambda seg: seg[0])
        fd = os.open(self.fs._strip_protocol(posixpath.join(self.path, run.entry.path)), os.O_RDONLY)
        try:
            for i in range(0, len(segments), _IOV_MAX):
                batch = segments[i : i + _IOV_MAX]
                want = batch[-1][1] - batch[0][0]
                if os.preadv(fd, [seg[2] for seg in batch], batch[0][0]) != want:
                    raise CheckpointError(f"{furl} is shorter than the manifest says ({run.entry.size} bytes)")
        finally:
            os.close(fd)
        _check(run, segments, furl)


def _segments(run: _Run) -> list[tuple[int, int, memoryview]]:
    """(file lo, file hi, destination bytes) of every request's part inside the run, in file order."""
    out = []
    for r in run.requests:
        lo, hi = max(r.offset, run.start), min(r.end, run.stop)
        if lo < hi:
            dest = memoryview(r.dest.view(torch.uint8).numpy())
            out.append((lo, hi, dest[lo - r.offset : hi - r.offset]))
    return out


def _check(run: _Run, segments: list[tuple[int, int, memoryview]], furl: str) -> None:
    """Checksum each chunk of the run over the (file-ordered, gap-free) buffers that hold it."""
    fn, c, entry = checksum(run.entry, furl), run.entry.chunk_bytes, run.entry
    i = 0
    for k in range(run.first, run.last):
        lo, hi, crc = k * c, min((k + 1) * c, entry.size), 0
        while i < len(segments) and segments[i][0] < hi:
            slo, shi, buf = segments[i]
            a, b = max(slo, lo), min(shi, hi)
            crc = fn(buf[a - slo : b - slo], crc)
            if shi <= hi:
                i += 1
            else:
                break
        check_chunk(crc, entry, k, furl)


def _runs(entry: FileEntry, chunks: Iterable[int], requests: list[Request]) -> list[_Run]:
    """Sorted chunk numbers as runs of consecutive chunks, each <= _MAX_RUN bytes, with the
    (offset-sorted) requests that overlap each."""
    spans: list[list[int]] = []
    for k in chunks:
        if spans and k == spans[-1][1] and (k - spans[-1][0]) * entry.chunk_bytes < _MAX_RUN:
            spans[-1][1] = k + 1
        else:
            spans.append([k, k + 1])
    out, j, c = [], 0, entry.chunk_bytes
    for a, b in spans:
        start, stop = a * c, b * c
        while j < len(requests) and requests[j].end <= start:
            j += 1
        mine, i = [], j
        while i < len(requests) and requests[i].offset < stop:
            if requests[i].end > start:
                mine.append(requests[i])
            i += 1
        out.append(_Run(entry, a, b, tuple(mine)))
    return out


def _keys(ckpt: CheckpointReader, slots: list[layout.TensorSlot], trainable: bool) -> list[str]:
    """The tensors to load for one of the engine's groups: the weights and, if it trains, the
    optimizer states its parameters were saved with (which must agree across its parameters)."""
    if not trainable:
        return ["weight"]
    found = {tuple(ckpt.params[s.name][0].keys) for s in slots}
    if len(found) > 1:
        raise CheckpointError(
            f"{ckpt.url}: parameters {[s.name for s in slots]} were saved with different optimizer states "
            f"{sorted(found)}; they cannot share one optimizer group now"
        )
    return list(found.pop())


def _check_names(ckpt: CheckpointReader, states: list[GroupSource]) -> None:
    names = {s.name: s.shape for g in states for s in g.slots}
    missing = sorted(names.keys() - ckpt.params.keys())
    unexpected = sorted(ckpt.params.keys() - names.keys())
    wrong = [
        f"{n}: saved {tuple(ckpt.params[n][1].shape)}, model {shape}"
        for n, shape in names.items()
        if n in ckpt.params and tuple(ckpt.params[n][1].shape) != shape
    ]
    if missing or unexpected or wrong:
        raise CheckpointError(
            f"{ckpt.url} does not fit this model: missing {missing}, unexpected {unexpected}, shape mismatch {wrong}"
        )


def _check_rng(url: str, f: FileEntry, s: SectionEntry, device: torch.device) -> None:
    """An RNG section is a generator state of this torch's size, checked before any read: a wrong one would
    fail ``set_rng_state`` only after the weights were loaded. A CUDA state is sized where the engine is."""
    where = f"{url}: rank {f.rank}'s RNG state {s.key!r}"
    if s.key not in ("cpu", "cuda"):
        raise CheckpointError(f"{where} is not one of ['cpu', 'cuda']")
    if s.dtype != "uint8":
        raise CheckpointError(f"{where} is {s.dtype}, not uint8")
    if s.key == "cpu" or device.type == "cuda":
        want = (torch.get_rng_state() if s.key == "cpu" else torch.cuda.get_rng_state(device)).numel()
        if s.nbytes != want:
            raise CheckpointError(f"{where} has {s.nbytes} bytes; this torch's is {want}")


def _raw_section(f: FileEntry, s: SectionEntry) -> tuple[Request, torch.Tensor]:
    """A request for a whole section into a fresh byte buffer (view it as ``s.dtype`` afterwards)."""
    buf = torch.empty(s.nbytes, dtype=torch.uint8)
    return Request(f.path, s.offset, buf), buf


def load(engine: ZeroEngine, url: str, *, storage_options: dict[str, Any] | None = None) -> Manifest:
    """Collective: load the checkpoint at ``url`` into ``engine``, whatever world size and stage wrote it.

    Restores weights, optimizer states, counters, loss scale, LR scheduler and the model's buffers.
    Per-rank RNG state is restored at the world size that saved it; at another world size each rank
    is reseeded with ``(global_step << 16) + rank`` instead. Returns the manifest. (Wait for your
    :class:`~zeroray.checkpoint.AsyncSaver` first if it may still be writing this checkpoint.)

    Every rank must ask for the same ``url`` (checked first; resolve "the newest" once for all with
    ``latest_committed(run, engine=engine)``). The ranks agree after the manifest and after every
    read: where one rank fails (its store unreachable), it raises its error and every other rank a
    :class:`CheckpointError` naming it, at once, rather than waiting in a collective.

    The shards are read into destinations the engine hands out (:meth:`ZeroEngine.load_shard_stream`):
    whole tensors when its states live in memory, one sub-group's swap buffer at a time with NVMe
    offload, so a load never holds the whole state in host memory there.
    """
    comm = engine.comm
    asked = comm.all_gather_object(url)
    if len(set(asked)) > 1:
        by_url: dict[str, list[int]] = defaultdict(list)
        for r, u in enumerate(asked):
            by_url[str(u)].append(r)
        named = "; ".join(f"ranks {ranks}: {u}" for u, ranks in by_url.items())
        raise CheckpointError(f"the ranks asked to load different checkpoints ({named}); every rank must load the "
                              "same one: resolve it once with latest_committed(run_url, engine=engine)")
    what = f"loading {url}"
    groups = {gs.name: gs for gs in engine.stream_shard_state()}
    rng: dict[str, torch.Tensor] = {}
    saved_buffers: list[tuple[SectionEntry, torch.Tensor]] = []

    def first() -> tuple[CheckpointReader, dict[str, list[str]]]:
        """The manifest, checked against the model, and the small sections (RNG, buffers), read."""
        ckpt = CheckpointReader(url, storage_options)
        _check_names(ckpt, list(groups.values()))
        keys = {name: _keys(ckpt, gs.slots, gs.param_group is not None) for name, gs in groups.items()}
        requests: list[Request] = []
        for f, s in ckpt.sections("rng"):
            _check_rng(url, f, s, engine.device)
            if ckpt.manifest.world_size == engine.world_size and f.rank == engine.rank:
                req, rng[s.key] = _raw_section(f, s)
                requests.append(req)
        buffers = dict(tensor_names.named_buffers(engine.module))
        for f, s in ckpt.sections("buffer"):
            if s.name not in buffers or s.dtype not in DTYPES:
                raise CheckpointError(f"{url}: buffer {s.name!r} ({s.dtype}) does not fit this model")
            req, buf = _raw_section(f, s)
            requests.append(req)
            saved_buffers.append((s, buf))
        ckpt.read(requests)
        return ckpt, keys

    ckpt, keys = _agreed(comm, what, first)
    same_world = ckpt.manifest.world_size == engine.world_size

    def read(ranges: list[ShardRange]) -> None:
        ckpt.read([req for r in ranges for req in _shard_requests(ckpt, groups[r.group], r)])

    def fill(ranges: list[ShardRange]) -> None:  # the engine calls it as often on every rank
        _agreed(comm, what, lambda: read(ranges))

    saved = {s.name: buf.view(DTYPES[s.dtype]).reshape(s.shape) for s, buf in saved_buffers}
    engine.load_shard_stream(keys, fill, ckpt.manifest.meta)  # in memory: a failed read changes nothing
    _install_buffers(engine, saved)
    _set_rng(engine, ckpt.manifest.meta, rng if same_world else None)
    return ckpt.manifest


def _agreed(comm: Comm, what: str, fn: Callable[[], T]) -> T:
    """Collective: ``fn()``, then agree (:func:`~zeroray.checkpoint.commit.agree`) that it worked on every rank."""
    result, error = None, None
    try:
        result = fn()
    except Exception as e:  # every rank must reach the agreement, or the others wait in a collective
        error = e
    agree(comm, error, what)
    return result


def _shard_requests(ckpt: CheckpointReader, gs: GroupSource, r: ShardRange) -> list[Request]:
    """Reads that fill ``r.dest`` with elements ``[r.lo, r.hi)`` of this rank's shard of ``gs``
    (zeros past the group's end: padding belongs to no tensor)."""
    a, b = gs.lo + r.lo, gs.lo + r.hi
    r.dest[max(0, min(b, gs.numel) - a) :].zero_()
    out = []
    for p in layout.pieces(gs.slots, a, b):
        group, slot = ckpt.params[p.name]
        lo = slot.offset + p.t_lo
        out += ckpt.flat_requests(group, r.key, lo, lo + p.numel, r.dest[p.f_lo - a : p.f_hi - a])
    return out


def install(
    engine: ZeroEngine,
    tensors: dict[str, dict[str, torch.Tensor]],
    meta: dict[str, Any],
    buffers: dict[str, torch.Tensor],
    rng: dict[str, torch.Tensor] | None,
) -> None:
    """Put state read from a checkpoint or gathered from in-memory snapshots into ``engine`` (collective):
    shards and ``meta`` (:meth:`ZeroEngine.load_shard_state`), the module's buffers, and this rank's RNG
    state. ``rng`` None (state saved at another world size, where no rank's stream continues this one's):
    the rank is reseeded with ``(global_step << 16) + rank`` instead."""
    _install_buffers(engine, buffers)
    engine.load_shard_state(tensors, meta)
    _set_rng(engine, meta, rng)


def _install_buffers(engine: ZeroEngine, buffers: dict[str, torch.Tensor]) -> None:
    live = dict(tensor_names.named_buffers(engine.module))
    with torch.no_grad():
        for name, value in buffers.items():
            live[name].copy_(value)


def _set_rng(engine: ZeroEngine, meta: dict[str, Any], rng: dict[str, torch.Tensor] | None) -> None:
    if rng is not None:
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and engine.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], engine.device)
    else:
        torch.manual_seed((int(meta["global_step"]) << 16) + engine.rank)
