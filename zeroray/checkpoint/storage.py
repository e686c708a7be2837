"""Checkpoints of a run on any fsspec storage: naming, listing, the newest committed one, retention.

A run directory holds ``checkpoint_<step>/`` directories. One is *committed* when its
``manifest.json`` exists (the manifest is written last); anything else is incomplete — a save in
flight or one that died — and is never loaded. Storage options (credentials, endpoints) go to fsspec
only; they are never printed or written anywhere.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec import AbstractFileSystem

from zeroray.checkpoint.manifest import MANIFEST, CheckpointError, parse_manifest

_CKPT = re.compile(r"^checkpoint_(\d+)$")


def open_url(url: str, storage_options: dict[str, Any] | None = None) -> tuple[AbstractFileSystem, str]:
    """The filesystem and path of ``url`` (file://, memory://, s3://, gs://, a plain path)."""
    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except Exception as e:  # unknown protocol, missing driver package, bad options
        raise CheckpointError(f"cannot open storage URL {url!r}: {type(e).__name__}: {e}") from e


def join_url(url: str, name: str) -> str:
    return url.rstrip("/") + "/" + name


def parent_url(url: str) -> str:
    """The directory holding ``url`` (for a checkpoint: its run)."""
    head, sep, _ = url.rstrip("/").rpartition("/")
    return head if sep else "."


def checkpoint_url(run_url: str, step: int) -> str:
    """Where the trainer saves the checkpoint of ``step``: ``<run_url>/checkpoint_<step>``."""
    return join_url(run_url, f"checkpoint_{step}")


def read_manifest(fs: AbstractFileSystem, path: str, url: str) -> dict[str, Any]:
    """The checked manifest of the checkpoint at ``path``; a missing one means "not committed"."""
    mpath = posixpath.join(path, MANIFEST)
    try:
        raw = fs.cat_file(mpath)
    except FileNotFoundError:
        raise CheckpointError(
            f"{url} is not a committed checkpoint (no {MANIFEST}; the save did not finish)"
        ) from None
    return parse_manifest(raw, join_url(url, MANIFEST))


@dataclass(frozen=True)
class CheckpointInfo:
    """One ``checkpoint_<step>`` directory of a run, as ``zeroray ls`` shows it."""

    url: str
    step: int
    committed: bool
    size_bytes: int
    world_size: int | None = None
    stage: int | None = None
    global_step: int | None = None


def _scan(fs: AbstractFileSystem, run_path: str) -> dict[int, tuple[str, dict[str, int]]]:
    """step -> (directory path, {file name: size}) with one recursive listing."""
    fs.invalidate_cache(run_path)
    try:
        found = fs.find(run_path, maxdepth=2, detail=True)
    except FileNotFoundError:
        return {}
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


def list_checkpoints(
    run_url: str, storage_options: dict[str, Any] | None = None, *, read_manifests: bool = True
) -> list[CheckpointInfo]:
    """Every ``checkpoint_<step>`` of the run, oldest first (reads committed manifests for details)."""
    fs, run_path = open_url(run_url, storage_options)
    infos = []
    for step, (path, files) in _scan(fs, run_path).items():
        url = join_url(run_url, posixpath.basename(path))
        committed = MANIFEST in files
        info = CheckpointInfo(url, step, committed, sum(files.values()))
        if committed and read_manifests:
            m = read_manifest(fs, path, url)
            info = CheckpointInfo(
                url, step, True, info.size_bytes, m["world_size"], m["stage"], m["meta"].get("global_step")
            )
        infos.append(info)
    return infos


def latest_committed(run_url: str, storage_options: dict[str, Any] | None = None) -> str | None:
    """URL of the run's newest committed checkpoint, or None: what a (re)started run loads."""
    done = [c for c in list_checkpoints(run_url, storage_options, read_manifests=False) if c.committed]
    return done[-1].url if done else None


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
    ones older than the newest commit; newer incomplete ones may be saves in flight and stay.
    Returns the URLs deleted."""
    if num_to_keep is not None and num_to_keep < 1:
        raise ValueError(f"num_to_keep must be >= 1 or None, got {num_to_keep}")
    fs, run_path = open_url(run_url, storage_options)
    infos = list_checkpoints(run_url, storage_options, read_manifests=False)
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
