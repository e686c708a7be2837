"""The commit protocol: how the ranks of a save agree and how rank 0 commits.

1. every rank writes its file, then its *marker* ``rank-NNNNN.part.json`` (its :class:`FileEntry`,
   or ``{"error": ...}`` when its write failed), atomically: on a local filesystem a temporary name
   renamed into place, on an object store one PUT. A marker that does not parse (a foreign writer,
   a torn file from an older zeroray) counts as not there yet;
2. rank 0 polls storage (bounded by a timeout, backing off) until every rank's marker parses;
3. rank 0 writes ``manifest.json`` atomically — the commit — then deletes the markers.

A fenced save (the trainer's: ``epoch`` given) names its markers and files after its epoch, and rank 0
publishes the manifest only while the run's fence is still at that epoch (:mod:`zeroray.checkpoint.fence`).

Collective agreement (:func:`agree`) is used by sync saves and before every save; async saves need
none off the main thread, because rank 0 learns everything from storage.
"""

from __future__ import annotations

import json
import posixpath
import threading
import time
from collections.abc import Callable
from typing import Any

from fsspec import AbstractFileSystem

from zeroray.checkpoint import fence
from zeroray.checkpoint.manifest import (
    MANIFEST,
    CheckpointError,
    FileEntry,
    Manifest,
    dump_manifest,
    part_file,
)
from zeroray.engine import Comm
from zeroray.storage import atomic_write

_POLL_MAX_S = 1.0


def write_marker(fs: AbstractFileSystem, path: str, rank: int, entry: FileEntry, epoch: int | None = None) -> None:
    """This rank's file is complete: publish its entry."""
    atomic_write(fs, posixpath.join(path, part_file(rank, epoch)), json.dumps({"file": entry.to_json()}).encode())


def write_error_marker(fs: AbstractFileSystem, path: str, rank: int, error: str, epoch: int | None = None) -> None:
    """This rank's write failed: tell rank 0, so it stops waiting."""
    atomic_write(fs, posixpath.join(path, part_file(rank, epoch)), json.dumps({"error": error}).encode())


def _read_marker(fs: AbstractFileSystem, mpath: str) -> dict[str, Any] | None:
    """A marker's content, or None while it is absent or does not parse."""
    try:
        marker = json.loads(fs.cat_file(mpath))
    except (FileNotFoundError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return marker if isinstance(marker, dict) and ("file" in marker or "error" in marker) else None


def await_markers(
    fs: AbstractFileSystem, path: str, url: str, world: int, timeout: float, cancel: threading.Event | None = None,
    epoch: int | None = None,
) -> list[FileEntry]:
    """Rank 0: poll storage until every rank's marker (of ``epoch``) parses; raise on a rank's error
    marker, or once ``cancel`` is set (the ranks agreed that one failed)."""
    names = [part_file(r, epoch) for r in range(world)]
    markers: dict[int, dict[str, Any]] = {}
    deadline, delay = time.monotonic() + timeout, 0.01
    stop = cancel or threading.Event()
    while True:
        fs.invalidate_cache(path)
        try:
            present = {posixpath.basename(p) for p in fs.ls(path, detail=False)}
        except FileNotFoundError:  # object stores: no "directory" before its first file
            present = set()
        for r, n in enumerate(names):
            if r not in markers and n in present:
                m = _read_marker(fs, posixpath.join(path, n))
                if m is not None:
                    markers[r] = m
        if len(markers) == world:
            break
        if time.monotonic() > deadline:
            missing = [r for r in range(world) if r not in markers]
            raise CheckpointError(f"ranks {missing} did not finish writing {url} within {timeout:.0f} s")
        if stop.wait(delay):
            raise CheckpointError(f"gave up committing {url}: another rank's write failed")
        delay = min(2 * delay, _POLL_MAX_S)
    failed = [f"rank {r}: {markers[r]['error']}" for r in range(world) if "error" in markers[r]]
    if failed:
        raise CheckpointError("; ".join(failed))
    return [FileEntry.from_json(markers[r]["file"]) for r in range(world)]


def commit(
    fs: AbstractFileSystem, path: str, url: str, manifest: Manifest, timeout: float,
    cancel: threading.Event | None = None,
) -> None:
    """Rank 0: wait for every rank's marker, write the manifest atomically (under the fence of the
    manifest's epoch), delete the markers."""
    epoch = manifest.epoch
    manifest.files = await_markers(fs, path, url, manifest.world_size, timeout, cancel, epoch)
    fence.publish(fs, posixpath.join(path, MANIFEST), dump_manifest(manifest), epoch, f"committing {url}")
    fs.rm([posixpath.join(path, part_file(r, epoch)) for r in range(manifest.world_size)])


def attempt(fn: Callable[[], None]) -> str | None:
    """Run ``fn``; its error as one line, or None."""
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def agree(comm: Comm, error: str | BaseException | None, what: str) -> None:
    """Collective: raise on every rank if ``what`` failed on any rank, so no rank goes on into a
    collective the others never reach. ``error``: this rank's failure as one line, or the exception
    itself, which this rank then re-raises as it is (the others name it in a CheckpointError)."""
    line = error if error is None or isinstance(error, str) else f"{type(error).__name__}: {error}"
    errors = comm.all_gather_object(line)
    if isinstance(error, BaseException):
        raise error
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if failed:
        raise CheckpointError(f"{what} failed: " + "; ".join(failed))
