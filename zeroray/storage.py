"""Storage through fsspec, shared by the trainer's run directory and the checkpoints.

One place opens URLs (local paths, file://, s3://, gs://, ...), writes small control files
atomically (manifests, commit markers, run leases, run.json) and refuses storage that the ranks of
a multi-process run cannot share. Storage options (credentials, endpoints) go to fsspec only; they
are never printed or written anywhere.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import fsspec
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

# Filesystems that live inside one process: another rank (another process) sees nothing of them.
_PROCESS_LOCAL = ("memory",)


class StorageError(ValueError):
    """A storage URL cannot be used (bad URL, missing driver, unreachable, not shareable)."""


def open_url(url: str, storage_options: dict[str, Any] | None = None) -> tuple[AbstractFileSystem, str]:
    """The filesystem and path of ``url``; a bad URL or missing driver is a :class:`StorageError`."""
    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except Exception as e:  # unknown protocol, missing driver package, bad options
        raise StorageError(f"cannot open storage URL {url!r}: {type(e).__name__}: {e}") from e


def join_url(url: str, name: str) -> str:
    return url.rstrip("/") + "/" + name


def parent_url(url: str) -> str:
    """The directory holding ``url``."""
    head, sep, _ = url.rstrip("/").rpartition("/")
    return head if sep else "."


def protocols(fs: AbstractFileSystem) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def require_shared(fs: AbstractFileSystem, url: str, what: str, processes: int) -> None:
    """Refuse a process-local filesystem (``memory://``) when ``processes`` > 1 must share it:
    each process would see only its own files, and a rank waiting for another's would wait forever."""
    if processes > 1 and any(p in _PROCESS_LOCAL for p in protocols(fs)):
        raise StorageError(
            f"{what} {url!r} is process-local storage: each of the {processes} processes of the run would see only its "
            "own files. Use storage all ranks share: a local or network path, or an object store (s3://, gs://)"
        )


def atomic_write(fs: AbstractFileSystem, path: str, data: bytes) -> None:
    """Write ``path`` so a reader sees either nothing (or the old file) or all of ``data``.

    On a local filesystem: a temporary name in the same directory, fsync, rename over the target. On
    object stores a PUT is already atomic; other filesystems write in one call. A failure (disk full)
    leaves the target untouched and removes the temporary file.
    """
    if isinstance(fs, LocalFileSystem):
        path = fs._strip_protocol(path)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
    else:
        fs.pipe_file(path, data)
