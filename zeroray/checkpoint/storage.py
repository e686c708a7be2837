"""Checkpoints of a run on any fsspec storage: naming, listing, the newest valid one, retention.

A run directory holds ``checkpoint_<step>/`` directories. One is *committed* when its
``manifest.json`` exists (the manifest is written last, atomically) and parses; anything else is
incomplete — a save in flight or one that died — or broken (a manifest that does not parse, or a
rank file it names that is missing or of the wrong size), and is never loaded. URLs are opened
through :mod:`zeroray.storage`, shared with the trainer; its :class:`~zeroray.storage.StorageError`
is re-raised as :class:`CheckpointStorageError`, which is both a ``CheckpointError`` and a
``StorageError``. Storage options (credentials, endpoints) go to fsspec only; they are never printed
or written anywhere.
"""

from __future__ import annotations

import logging
import posixpath
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fsspec import AbstractFileSystem

from zeroray import storage
from zeroray.checkpoint import fence
from zeroray.checkpoint.commit import agree
from zeroray.checkpoint.manifest import (
    MANIFEST,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointStorageError,
    Manifest,
    parse_manifest,
)

if TYPE_CHECKING:
    from zeroray.engine import ZeroEngine

logger = logging.getLogger(__name__)

_CKPT = re.compile(r"^checkpoint_(\d+)$")
_RANK_FILE = re.compile(r"^rank-\d+(\.e\d+)?\.(bin|part\.json)$")
join_url = storage.join_url
parent_url = storage.parent_url


def open_url(url: str, storage_options: dict[str, Any] | None = None) -> tuple[AbstractFileSystem, str]:
    """:func:`zeroray.storage.open_url`, raising :class:`CheckpointStorageError`."""
    try:
        return storage.open_url(url, storage_options)
    except storage.StorageError as e:
        raise CheckpointStorageError(str(e)) from e


def checkpoint_url(run_url: str, step: int) -> str:
    """Where the trainer saves the checkpoint of ``step``: ``<run_url>/checkpoint_<step>``."""
    return join_url(run_url, f"checkpoint_{step}")


def read_manifest(fs: AbstractFileSystem, path: str, url: str) -> Manifest:
    """The checked manifest of the checkpoint at ``path``; a missing one means "not committed", a
    missing directory :class:`CheckpointNotFoundError`."""
    mpath = posixpath.join(path, MANIFEST)
    try:
        raw = fs.cat_file(mpath)
    except FileNotFoundError:
        if not _exists(fs, path, url):
            raise CheckpointNotFoundError(f"{url} does not exist") from None
        raise CheckpointError(
            f"{url} is not a committed checkpoint (no {MANIFEST}; the save did not finish)"
        ) from None
    except Exception as e:  # no credentials, unreachable endpoint, permission denied
        raise CheckpointStorageError(f"cannot read {join_url(url, MANIFEST)}: {type(e).__name__}: {e}") from e
    return parse_manifest(raw, join_url(url, MANIFEST))


def _exists(fs: AbstractFileSystem, path: str, url: str) -> bool:
    try:
        fs.invalidate_cache(path)
        return bool(fs.exists(path))
    except Exception as e:  # no credentials, unreachable endpoint, permission denied
        raise CheckpointStorageError(f"cannot read {url}: {type(e).__name__}: {e}") from e


def read_checked_manifest(fs: AbstractFileSystem, path: str, url: str) -> Manifest:
    """The manifest, and every file it names listed at its size (one listing) before anything is read
    or allocated from it: a manifest claiming more bytes than its files hold is refused here, and so is
    one that a cut-off rank of an older epoch committed (fence.py)."""
    manifest = read_manifest(fs, path, url)
    _check_fence(fs, path, url, manifest, _read_fence(fs, fence.run_path_of(path), url))
    try:
        fs.invalidate_cache(path)
        listing = fs.ls(path, detail=True)
    except Exception as e:  # no credentials, unreachable endpoint, permission denied
        raise CheckpointStorageError(f"cannot list {url}: {type(e).__name__}: {e}") from e
    sizes = {posixpath.basename(e["name"].rstrip("/")): int(e.get("size") or 0) for e in listing if e.get("type") == "file"}
    check_files(manifest, sizes, url)
    return manifest


def _read_fence(fs: AbstractFileSystem, run_path: str, url: str) -> fence.Fence | None:
    try:
        return fence.read(fs, run_path)
    except CheckpointError:
        raise
    except Exception as e:  # no credentials, unreachable endpoint, permission denied
        raise CheckpointStorageError(f"cannot read the epoch fence of {url}: {type(e).__name__}: {e}") from e


def _check_fence(fs: AbstractFileSystem, path: str, url: str, manifest: Manifest, current: fence.Fence | None) -> None:
    """Refuse a checkpoint committed by an older epoch after the run's fence moved past it."""
    m = _CKPT.match(posixpath.basename(path.rstrip("/")))
    why = fence.refusal(current, manifest.epoch, int(m.group(1)) if m else -1)
    if why is not None:
        raise CheckpointError(f"{url} was {why}")


def check_files(manifest: Manifest, sizes: dict[str, int], url: str) -> None:
    """Every rank file the manifest names is listed with its size (a listing, no reads)."""
    for f in manifest.files:
        if f.path not in sizes:
            raise CheckpointError(f"{join_url(url, f.path)} is missing")
        if sizes[f.path] != f.size:
            raise CheckpointError(
                f"{join_url(url, f.path)} has {sizes[f.path]} bytes, the manifest says {f.size}"
            )


@dataclass(frozen=True)
class CheckpointInfo:
    """One ``checkpoint_<step>`` directory of a run, as ``zeroray ls`` shows it.

    ``committed``: it has a manifest that parses and (when manifests were read) every file it names,
    at its size. ``broken``: why a checkpoint with a manifest is not committed, else None."""

    url: str
    step: int
    committed: bool
    size_bytes: int
    world_size: int | None = None
    stage: int | None = None
    global_step: int | None = None
    broken: str | None = None
    epoch: int | None = None  # the fencing epoch that committed it (None: unfenced)


def _scan(fs: AbstractFileSystem, run_path: str, run_url: str) -> dict[int, tuple[str, dict[str, int]]]:
    """step -> (directory path, {file name: size}) with one recursive listing."""
    try:
        fs.invalidate_cache(run_path)
        found = fs.find(run_path, maxdepth=2, detail=True)
    except FileNotFoundError:
        return {}
    except Exception as e:  # no credentials, unreachable endpoint, permission denied
        raise CheckpointStorageError(f"cannot list {run_url}: {type(e).__name__}: {e}") from e
    out: dict[int, tuple[str, dict[str, int]]] = {}
    root = run_path.rstrip("/")
    for path, info in found.items():
        rel = posixpath.relpath(path, root)
        parts = rel.split("/")
        m = _CKPT.match(parts[0])
        if m is None or len(parts) != 2:
            continue
        step = int(m.group(1))
        out.setdefault(step, (posixpath.join(root, parts[0]), {}))[1][parts[1]] = int(info.get("size") or 0)
    return dict(sorted(out.items()))


def _info(fs: AbstractFileSystem, url: str, path: str, step: int, files: dict[str, int],
          current: fence.Fence | None = None) -> CheckpointInfo | None:
    """Read and check one checkpoint's manifest (listed in ``files``) against the run's fence ``current``;
    damage or a stale epoch makes it broken, not an error. None: it was deleted since the listing
    (retention, by a run saving now), so it is gone."""
    size = sum(files.values())
    try:
        m = read_manifest(fs, path, url)
        check_files(m, files, url)
        _check_fence(fs, path, url, m, current)
    except CheckpointNotFoundError:
        return None
    except CheckpointStorageError:
        raise
    except CheckpointError as e:
        if _vanished(fs, path, url):
            return None
        return CheckpointInfo(url, step, False, size, broken=str(e))
    return CheckpointInfo(url, step, True, size, m.world_size, m.stage, m.meta.get("global_step"), epoch=m.epoch)


def _vanished(fs: AbstractFileSystem, path: str, url: str) -> bool:
    return not _exists(fs, posixpath.join(path, MANIFEST), url)


def vanished(url: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether the checkpoint at ``url``, listed with a manifest, has lost it since: a deletion in
    progress (:func:`delete_checkpoint` drops the manifest first, e.g. retention by a run saving
    now), so a failure to read it means it is gone, not damaged."""
    fs, path = open_url(url, storage_options)
    return _vanished(fs, path, url)


def is_checkpoint(url: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``url`` is itself a checkpoint folder (named ``checkpoint_<step>``, or holding a
    manifest or rank files), not a run: what ``zeroray ls`` given the wrong folder hints at."""
    fs, path = open_url(url, storage_options)
    if _CKPT.match(posixpath.basename(path.rstrip("/"))):
        return True
    try:
        names = {posixpath.basename(p.rstrip("/")) for p in fs.ls(path, detail=False)}
    except FileNotFoundError:
        return False
    except Exception as e:  # no credentials, unreachable endpoint, permission denied
        raise CheckpointStorageError(f"cannot list {url}: {type(e).__name__}: {e}") from e
    return MANIFEST in names or any(_RANK_FILE.match(n) for n in names)


def runs_under(url: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """URLs of the folders directly under ``url`` that hold checkpoints (``url`` is then a results
    root holding runs, not a run)."""
    fs, path = open_url(url, storage_options)
    root = path.rstrip("/")
    try:
        fs.invalidate_cache(root)
        found = fs.find(root, maxdepth=2, withdirs=True, detail=False)
    except FileNotFoundError:
        return []
    except Exception as e:  # no credentials, unreachable endpoint, permission denied
        raise CheckpointStorageError(f"cannot list {url}: {type(e).__name__}: {e}") from e
    runs = set()
    for p in found:
        parts = posixpath.relpath(p.rstrip("/"), root).split("/")
        if len(parts) == 2 and _CKPT.match(parts[1]):
            runs.add(parts[0])
    return [join_url(url, r) for r in sorted(runs)]


def list_checkpoints(
    run_url: str, storage_options: dict[str, Any] | None = None, *, read_manifests: bool = True
) -> list[CheckpointInfo]:
    """Every ``checkpoint_<step>`` of the run, oldest first. With ``read_manifests`` each manifest is
    read and checked against the listing (a broken one is listed with ``broken`` set); without,
    ``committed`` only means a manifest file exists."""
    fs, run_path = open_url(run_url, storage_options)
    infos = []
    found = _scan(fs, run_path, run_url)
    current = _read_fence(fs, run_path, run_url) if read_manifests and found else None
    for step, (path, files) in found.items():
        url = join_url(run_url, posixpath.basename(path))
        if MANIFEST in files and read_manifests:
            info = _info(fs, url, path, step, files, current)
            if info is not None:  # else deleted since the listing: gone, not broken
                infos.append(info)
        else:
            infos.append(CheckpointInfo(url, step, MANIFEST in files, sum(files.values())))
    return infos


def latest_valid(
    run_url: str, storage_options: dict[str, Any] | None = None, *, engine: ZeroEngine | None = None
) -> CheckpointInfo | None:
    """The run's newest checkpoint whose manifest parses and whose files are all there, or None.

    Manifests are read newest first and only until one is valid, so a broken newest checkpoint
    (torn manifest, lost rank file) falls back to the one before it.

    With ``engine`` it is a collective of the engine's ranks, the one to call before a collective
    ``load``: rank 0 looks, and every rank gets its answer or raises its error. Each rank looking for
    itself could see another answer (a save committing, a store coming back from an outage) and
    load another checkpoint, or go into the load alone."""
    if engine is None:
        return _latest_valid(run_url, storage_options)
    info, error = None, None
    if engine.rank == 0:
        try:
            info = _latest_valid(run_url, storage_options)
        except Exception as e:
            error = e
    agree(engine.comm, error, f"finding the newest checkpoint of {run_url} (on rank 0)")
    return engine.comm.broadcast_object(info)


def _latest_valid(run_url: str, storage_options: dict[str, Any] | None) -> CheckpointInfo | None:
    fs, run_path = open_url(run_url, storage_options)
    found = _scan(fs, run_path, run_url)
    current = _read_fence(fs, run_path, run_url) if found else None
    passed: list[CheckpointInfo] = []  # newer checkpoints with a manifest that is not valid
    for step, (path, files) in reversed(found.items()):
        if MANIFEST in files:
            info = _info(fs, join_url(run_url, posixpath.basename(path)), path, step, files, current)
            if info is not None and info.committed:
                _warn_passed(passed, info.url)
                return info
            if info is not None and info.broken:
                passed.append(info)
    _warn_passed(passed, None)
    return None


def _warn_passed(passed: list[CheckpointInfo], taken: str | None) -> None:
    """Say which broken checkpoints the newest valid one was found behind: a resume from it loses their steps."""
    for info in passed:
        logger.warning("zeroray: %s is not a valid checkpoint (%s): %s", info.url, info.broken,
                       f"the newest valid one is {taken}" if taken is not None else "no valid checkpoint is left")


def latest_committed(
    run_url: str, storage_options: dict[str, Any] | None = None, *, engine: ZeroEngine | None = None
) -> str | None:
    """URL of the run's newest valid committed checkpoint, or None: what a (re)started run loads.
    Pass the ``engine`` you load into (every rank calls it): one answer for every rank, see
    :func:`latest_valid`."""
    info = latest_valid(run_url, storage_options, engine=engine)
    return info.url if info is not None else None


def delete_checkpoint(fs: AbstractFileSystem, path: str) -> None:
    """Drop the manifest first, so a half-deleted checkpoint is never taken as committed."""
    try:
        fs.rm_file(posixpath.join(path, MANIFEST))
    except FileNotFoundError:
        pass
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass


def apply_retention(
    run_url: str, num_to_keep: int | None, storage_options: dict[str, Any] | None = None
) -> list[str]:
    """Delete committed checkpoints beyond the newest ``num_to_keep`` (None: keep all) and incomplete
    or broken ones older than the newest commit; newer incomplete ones may be saves in flight and
    stay. Returns the URLs deleted."""
    if num_to_keep is not None and num_to_keep < 1:
        raise ValueError(f"num_to_keep must be >= 1 or None, got {num_to_keep}")
    fs, run_path = open_url(run_url, storage_options)
    infos = list_checkpoints(run_url, storage_options)
    committed = [c for c in infos if c.committed]
    if not committed:
        return []
    newest = committed[-1].step
    doomed = [c for c in infos if not c.committed and c.step < newest]
    if num_to_keep is not None:
        doomed += committed[:-num_to_keep]
    for c in doomed:
        delete_checkpoint(fs, posixpath.join(run_path, posixpath.basename(c.url)))
    return [c.url for c in doomed]


def advance_epoch(run_url: str, storage_options: dict[str, Any] | None = None) -> int:
    """The driver, before it starts a group: move the run's fence to the next epoch (1 for a run without
    one) and return it; the group's saves carry it. Checkpoints committed until now stay valid; a rank of
    an older epoch commits nothing from here on (fence.py)."""
    fs, run_path = open_url(run_url, storage_options)

    def accepted() -> dict[int, int]:
        return {c.step: c.epoch for c in list_checkpoints(run_url, storage_options)
                if c.committed and c.epoch is not None}

    try:
        return fence.advance(fs, run_path, accepted)
    except CheckpointError:
        raise
    except Exception as e:  # no credentials, unreachable endpoint, permission denied
        raise CheckpointStorageError(f"cannot advance the epoch fence of {run_url}: {type(e).__name__}: {e}") from e
