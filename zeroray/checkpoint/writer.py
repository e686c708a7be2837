"""Saving: every rank writes its own file straight to storage; rank 0 commits the manifest last.

A save, on every rank:

1. all ranks agree that the directory set-up (and, for an :class:`AsyncSaver`, its previous save)
   went well;
2. pick its sections: its slice of every flat group ("weight" and each optimizer state, fp32), its
   RNG state, and on rank 0 the model's persistent buffers. At stage 0 every rank holds every group,
   so group ``i`` is written only by rank ``i % world_size``; under hybrid sharding the shard groups
   hold copies of each shard, and group ``i``'s is written by the shard group ``i % copies``. A section is a producer of its bytes
   (:meth:`ZeroEngine.stream_shard_state`): the live tensors when the states are in memory, bounded
   reads of the swap files through the engine's swap buffers with NVMe offload;
3. write ``rank-NNNNN.bin`` through fsspec, hashing 4 MiB chunks while writing, then its marker;
4. rank 0 commits (see :mod:`zeroray.checkpoint.commit`) and, if asked, applies retention.

:func:`save` runs 3-4 in the caller and ends with a collective, so every rank returns after the
commit. An :class:`AsyncSaver` — an object held by whoever saves (the trainer's checkpoint manager,
or a user's loop) — first copies the sections into its reusable host buffer (pinned on GPU), the
only stall, then runs 3-4 in a background thread; rank 0's thread polls storage for the markers, so
no collective runs off the main thread. ``saver.wait()`` (or its next save, every rank) decides
the save on the main thread, on every rank alike: each rank waits for its own file, the ranks agree
whether every write succeeded (a collective; a rank's failure ends rank 0's polling at once, even
where that rank's error marker could not reach storage), then rank 0 waits for its commit and tells
the others its outcome. So it returns on every rank once committed, or raises the same error on
every rank. With NVMe offload the states are in swap files, not in memory: copying them
into a host buffer would hold the whole state there, so the saver copies the swap files on their
disk (:meth:`ZeroEngine.copy_shard_state`) and the thread streams from that copy; where the disk
has no room for one, this rank's file is streamed before ``save`` returns and only rank 0's commit
runs in the background.
"""

from __future__ import annotations

import functools
import posixpath
import threading
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from fsspec import AbstractFileSystem

from zeroray.checkpoint import commit as protocol
from zeroray.checkpoint import fence
from zeroray.checkpoint.commit import agree, attempt
from zeroray.checkpoint.manifest import (
    ALGORITHM,
    CHUNK_BYTES,
    CheckpointError,
    ChunkHasher,
    FileEntry,
    GroupEntry,
    Manifest,
    SectionEntry,
    SlotEntry,
    aligned,
    file_digest,
    hf_config,
    rank_file,
)
from zeroray.checkpoint.storage import apply_retention, delete_checkpoint, open_url, parent_url
from zeroray.engine import Comm, ZeroEngine
from zeroray.engine import names as tensor_names
from zeroray.engine.shard_state import ShardStateCopy

_WRITE_STEP = 4 << 20  # bytes handed to f.write at a time, hashed meanwhile in another thread


class SaveHandle:
    """One save. ``wait()`` returns once the checkpoint is committed and raises what went wrong.

    For an async save (``comm`` given) ``wait()`` is a collective, run once: every rank returns only
    when the commit is decided, with the same outcome on every rank. Without a group to agree with
    (none given, or the engine's group was given up after a failure) it joins this rank's thread,
    as storage decides: rank 0's commit ends once every rank's marker, or an error marker, is there.
    ``error``: this rank's own failure (its write, or rank 0's commit), or None."""

    def __init__(self, url: str, thread: threading.Thread | None = None, *, comm: Comm | None = None):
        self.url = url
        self._thread = thread
        self._comm = comm
        self.error: BaseException | None = None
        self.write_error: BaseException | None = None  # this rank's file or marker could not be written
        self.written = threading.Event()  # this rank's write is over (done or failed)
        self.cancel = threading.Event()  # rank 0: stop waiting for markers, a rank's write failed
        self._outcome: str | None = None  # the agreed failure, the same line on every rank
        self._decided = False

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    @property
    def decided(self) -> bool:
        """``wait()`` ran to its end here: the outcome is known (a collective that failed leaves it open)."""
        return self._thread is None or self._decided

    def wait(self) -> None:
        if self._thread is not None and not self._decided:
            if self._comm is None or self._comm.aborted is not None:
                self._thread.join()
                self._outcome = None if self.error is None else f"{type(self.error).__name__}: {self.error}"
            else:
                self._outcome = self._decide(self._comm)
            self._decided = True
        if self._outcome is not None:
            raise CheckpointError(f"saving {self.url} failed: {self._outcome}") from self.error

    def _decide(self, comm: Comm) -> str | None:
        """Collective: agree on every rank's write, then on rank 0's commit; the failure, or None."""
        self.written.wait()
        mine = self.write_error
        writes = comm.all_gather_object(None if mine is None else f"{type(mine).__name__}: {mine}")
        failed = [f"rank {r}: {e}" for r, e in enumerate(writes) if e]
        if failed:
            self.cancel.set()  # rank 0's commit stops polling for a marker that may never come
            self._thread.join()
            return "; ".join(failed)
        self._thread.join()  # rank 0: the commit, every marker being written; elsewhere: done already
        error = self.error
        committed = comm.broadcast_object(None if error is None else f"{type(error).__name__}: {error}")
        return None if committed is None else f"rank 0: {committed}"


@dataclass
class _Section:
    """A section of this rank's file and where its bytes come from: ``read()`` yields its tensors
    in order; ``in_memory``: they are live tensors (False: streamed from swap files through the
    engine's bounded buffers, each valid until the next is asked for)."""

    entry: SectionEntry  # "offset" and "nbytes" are set by _plan
    read: Callable[[], Iterable[torch.Tensor]] = field(repr=False)
    nbytes: int
    in_memory: bool = True

    @classmethod
    def of(cls, entry: SectionEntry, t: torch.Tensor) -> _Section:
        return cls(entry, lambda: (t,), t.numel() * t.element_size())


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _plan(engine: ZeroEngine) -> tuple[list[GroupEntry], list[_Section]]:
    """The rank-independent group table and this rank's sections, laid out in file order."""
    rank = engine.rank
    groups, sections = [], []
    for i, g in enumerate(engine.stream_shard_state()):
        slots = [SlotEntry(s.name, list(s.shape), s.offset) for s in g.slots]
        groups.append(GroupEntry(g.name, g.numel, g.shard_world, g.param_group, "float32", sorted(g.keys), slots))
        if i % g.copies != g.copy:  # another rank writes this copy of the shard
            continue
        for key in sorted(g.keys):
            entry = SectionEntry("shard", "float32", group=g.name, key=key, shard=g.shard_rank)
            sections.append(_Section(entry, functools.partial(g.read, key), 4 * (g.hi - g.lo), g.in_memory))
    sections.append(_Section.of(SectionEntry("rng", "uint8", key="cpu"), torch.get_rng_state()))
    if engine.device.type == "cuda":
        rng = torch.cuda.get_rng_state(engine.device)
        sections.append(_Section.of(SectionEntry("rng", "uint8", key="cuda"), rng))
    if rank == 0:
        buffers = dict(tensor_names.named_buffers(engine.module))
        for name in engine.module.state_dict(keep_vars=True):
            if name in buffers:
                b = buffers[name]
                entry = SectionEntry("buffer", _dtype_name(b), name=name, shape=list(b.shape))
                sections.append(_Section.of(entry, b))
    pos = 0
    for s in sections:
        s.entry.offset = aligned(pos)
        s.entry.nbytes = s.nbytes
        pos = s.entry.offset + s.entry.nbytes
    return groups, sections


def _file_size(sections: list[_Section]) -> int:
    return sections[-1].entry.offset + sections[-1].entry.nbytes


def _chunks(s: _Section) -> Iterator[torch.Tensor]:
    """The section's bytes as uint8 tensors, checked to add up to its size (a short stream is an error)."""
    done = 0
    parts = iter(s.read())
    try:
        for t in parts:
            cast = s.entry.kind == "shard" and t.dtype.is_floating_point and t.dtype != torch.float32
            raw = _raw(t.float() if cast else t)
            done += raw.numel()
            if done > s.nbytes:
                break
            yield raw
    finally:  # a stream abandoned half-way (a failed write) waits for its reads and frees its buffers
        if isinstance(parts, Generator):
            parts.close()
    if done != s.nbytes:
        raise CheckpointError(f"section {s.entry} produced {done} bytes, not {s.nbytes}")


def _views(sections: list[_Section]) -> Iterator[tuple[int, memoryview]]:
    """Sync save: write straight from the tensors (CPU ones without a copy), one piece at a time."""
    for s in sections:
        off = s.entry.offset
        for raw in _chunks(s):
            yield off, memoryview(raw.cpu().numpy())
            off += raw.numel()


def _write_file(fs: AbstractFileSystem, path: str, pieces: Iterable[tuple[int, memoryview]]) -> list[str]:
    """Stream ``pieces`` (file offset, bytes) to ``path``, zero-filling gaps; returns chunk checksums."""
    hasher = ChunkHasher(CHUNK_BYTES, ALGORITHM)
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
    fs: AbstractFileSystem, path: str, rank: int, sections: list[_Section], pieces: Iterable[tuple[int, memoryview]],
    epoch: int | None = None,
) -> None:
    """This rank's file, then its marker carrying the file's manifest entry; neither when the run's fence
    has moved past ``epoch`` (a cut-off rank: its upload stops here)."""
    name = rank_file(rank, epoch)
    fence.check(fs, fence.run_path_of(path), epoch, f"writing {posixpath.join(path, name)}")
    chunks = _write_file(fs, posixpath.join(path, name), pieces)
    entry = FileEntry(
        name, rank, _file_size(sections), ALGORITHM, CHUNK_BYTES, chunks, file_digest(chunks),
        [s.entry for s in sections],
    )
    protocol.write_marker(fs, path, rank, entry, epoch)


@dataclass
class _Commit:
    """What rank 0 needs to commit: the manifest minus the files, and retention."""

    manifest: Manifest
    run_url: str
    num_to_keep: int | None
    storage_options: dict[str, Any] | None
    timeout: float

    def run(self, fs: AbstractFileSystem, path: str, url: str, cancel: threading.Event | None = None) -> None:
        protocol.commit(fs, path, url, self.manifest, self.timeout, cancel)
        if self.num_to_keep is not None:
            apply_retention(self.run_url, self.num_to_keep, self.storage_options)


def _prepare_dir(fs: AbstractFileSystem, path: str, epoch: int | None = None) -> None:
    """Rank 0: start from an empty directory (a save to an existing checkpoint replaces it); never one a
    newer epoch may hold (the fence is checked under its lock)."""
    with fence.fenced(fs, fence.run_path_of(path), epoch, f"preparing {path}"):
        if fs.exists(path):
            delete_checkpoint(fs, path)
    fs.makedirs(path, exist_ok=True)


def _start(
    engine: ZeroEngine, url: str, storage_options: dict[str, Any] | None, num_to_keep: int | None,
    commit_timeout: float, epoch: int | None = None,
) -> tuple[AbstractFileSystem, str, list[_Section], _Commit | None]:
    """Collective: open and prepare the directory, agree, and plan this rank's file."""
    fs, path = open_url(url, storage_options)
    ready = attempt(lambda: _prepare_dir(fs, path, epoch)) if engine.rank == 0 else None
    agree(engine.comm, ready, f"preparing the save to {url}")
    groups, sections = _plan(engine)
    commit = None
    if engine.rank == 0:
        manifest = Manifest(engine.world_size, engine.stage, groups, engine.state_meta(), hf_config=hf_config(engine.module),
                            epoch=epoch)
        commit = _Commit(manifest, parent_url(url), num_to_keep, storage_options, commit_timeout)
    return fs, path, sections, commit


def save(
    engine: ZeroEngine,
    url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    num_to_keep: int | None = None,
    commit_timeout: float = 1800.0,
    epoch: int | None = None,
) -> SaveHandle:
    """Collective: save ``engine`` to the directory ``url`` (any fsspec URL), every rank in parallel;
    returns on every rank once the checkpoint is committed. (For a save that overlaps training, use
    an :class:`AsyncSaver`.)

    ``num_to_keep``: after the commit, rank 0 applies :func:`apply_retention` to the parent
    directory (the run). ``commit_timeout``: how long rank 0 waits for the other ranks' files.
    ``epoch``: the attempt's fencing epoch (the trainer passes it; see fence.py): the save's files
    and manifest name it, and nothing is written or committed once the run's fence is past it.
    """
    rank = engine.rank
    fs, path, sections, commit = _start(engine, url, storage_options, num_to_keep, commit_timeout, epoch)
    agree(engine.comm, attempt(lambda: _write_rank(fs, path, rank, sections, _views(sections), epoch)),
          f"writing {url}")
    agree(engine.comm, attempt(lambda: commit.run(fs, path, url)) if commit else None, f"committing {url}")
    return SaveHandle(url)


def _copy_of(engine: ZeroEngine, sections: list[_Section]) -> ShardStateCopy | None:
    """Point the streamed sections at a copy of the engine's swap files (None: no room for one)."""
    try:
        copy = engine.copy_shard_state()
    except OSError:  # the copy failed: stream from the swap files instead, where a broken disk shows
        return None
    if copy is not None:
        by_name = {g.name: g for g in copy.groups}
        for s in sections:
            if not s.in_memory:
                s.read = functools.partial(by_name[s.entry.group].read, s.entry.key)
    return copy


class AsyncSaver:
    """Background saves of one engine, one in flight at a time, through a reusable host buffer.

    Held by whoever saves (the trainer's checkpoint manager keeps one per rank; a user's loop can
    keep its own). Every rank calls ``save`` and ``wait`` (collectives); ``wait`` returns on every
    rank once the save in flight is committed, or raises the same error on every rank; the next
    ``save`` waits first, so a host buffer is never overwritten while it uploads.
    """

    def __init__(self, engine: ZeroEngine):
        self.engine = engine
        self._buffer: torch.Tensor | None = None
        self._inflight: SaveHandle | None = None

    def wait(self) -> None:
        """Collective: return once the save in flight is committed, on every rank, or raise its error
        on every rank (see :class:`SaveHandle`); a later ``latest_committed`` then sees it everywhere."""
        handle = self._inflight
        if handle is not None:
            try:
                handle.wait()
            finally:
                if handle.decided:  # else still in flight: a later wait (teardown) joins it
                    self._inflight = None

    def save(
        self,
        url: str,
        *,
        storage_options: dict[str, Any] | None = None,
        num_to_keep: int | None = None,
        commit_timeout: float = 1800.0,
        epoch: int | None = None,
    ) -> SaveHandle:
        """Collective: copy the engine's state into the host buffer and upload/commit it in the
        background; arguments as :func:`save`."""
        engine, rank = self.engine, self.engine.rank
        self.wait()
        fs, path, sections, commit = _start(engine, url, storage_options, num_to_keep, commit_timeout, epoch)
        handle = SaveHandle(url, comm=engine.comm)

        def write(pieces: Iterable[tuple[int, memoryview]]) -> None:
            try:
                _write_rank(fs, path, rank, sections, pieces, epoch)
            except Exception as e:
                handle.error = handle.write_error = e
                msg = f"{type(e).__name__}: {e}"
                attempt(lambda: protocol.write_error_marker(fs, path, rank, msg, epoch))  # for a join without a group
            finally:
                handle.written.set()

        copy = None
        if not all(s.in_memory for s in sections):
            # NVMe offload: the states are in swap files, not in memory, and a snapshot of them in host
            # memory would hold the whole state. They are copied on their disk instead, through the
            # swap buffers, and the file is streamed from that copy in the background.
            copy = _copy_of(engine, sections)
            if copy is None:
                # No room on the disk for a copy: this rank's file is streamed now, from the swap files
                # (the next step rewrites them), and only rank 0's commit runs in the background.
                write(_views(sections))
        pieces = None if handle.written.is_set() else _views(self._snapshot(sections, engine.device))

        def upload() -> None:
            try:
                if pieces is not None:
                    write(pieces)
                if handle.write_error is None and commit is not None:
                    commit.run(fs, path, url, handle.cancel)
            except Exception as e:
                handle.error = e
            finally:
                handle.written.set()
                if copy is not None:
                    copy.close()

        handle._thread = threading.Thread(target=upload, name=f"zeroray-save-rank{rank}", daemon=True)
        handle._thread.start()
        self._inflight = handle
        return handle

    def _snapshot(self, sections: list[_Section], device: torch.device) -> list[_Section]:
        """Copy the sections held in memory into the host buffer, back to back; the sections that
        stream (from a copy of the swap files) are left as they are."""
        held = [s for s in sections if s.in_memory]
        starts, total = [], 0
        for s in held:
            starts.append(total)
            total = aligned(total + s.nbytes)
        if self._buffer is None or self._buffer.numel() < total:
            self._buffer = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
        out, copied = [], dict(zip(map(id, held), starts))
        for s in sections:
            if not s.in_memory:
                out.append(s)
                continue
            pos = start = copied[id(s)]
            for raw in _chunks(s):
                self._buffer[pos : pos + raw.numel()].copy_(raw, non_blocking=True)
                pos += raw.numel()
            view = self._buffer[start : start + s.nbytes]
            out.append(_Section(s.entry, lambda v=view: (v,), s.nbytes))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out
