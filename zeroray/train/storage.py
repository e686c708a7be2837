"""The run's directory ``<storage_path>/<name>/`` through fsspec, so any URL works (local, s3://, ...).

The driver checks it is writable before any actor starts, and writes ``metrics.jsonl`` (one report a
line, appended) and ``run.json`` (status, world size, error) there. The ranks write the sharded
checkpoints under it (``checkpoint_<step>/``, see checkpoint_manager.py).
"""

from __future__ import annotations

import json
import posixpath
import uuid
from typing import Any

import fsspec


class StorageError(ValueError):
    """The storage path cannot be used (bad URL, unreachable, not writable)."""


class RunStorage:
    """One run's directory."""

    def __init__(self, storage_path: str, name: str, storage_options: dict[str, Any] | None = None) -> None:
        self.storage_path = storage_path
        self.name = name
        try:
            self.fs, root = fsspec.core.url_to_fs(storage_path, **(storage_options or {}))
        except Exception as e:  # unknown protocol, missing driver package, bad options
            raise StorageError(f"RunConfig.storage_path {storage_path!r} cannot be opened: {e}") from e
        self.dir = posixpath.join(root.rstrip("/") or "/", name)
        self.url = storage_path.rstrip("/") + "/" + name
        self._written = 0  # history entries already in metrics.jsonl

    def validate(self) -> None:
        """Create the run's directory and write, read and delete a probe file."""
        probe = posixpath.join(self.dir, f".zeroray-probe-{uuid.uuid4().hex}")
        try:
            self.fs.makedirs(self.dir, exist_ok=True)
            self.fs.pipe(probe, b"ok")
            if self.fs.cat(probe) != b"ok":
                raise OSError("read back something else than was written")
            self.fs.rm(probe)
        except Exception as e:
            raise StorageError(
                f"RunConfig.storage_path {self.storage_path!r} is not reachable or not writable "
                f"(tried {self.url!r}): {type(e).__name__}: {e}"
            ) from e

    def write_history(self, history: list[dict[str, Any]]) -> None:
        """Bring ``metrics.jsonl`` up to date: append the new entries (the first write truncates);
        where the filesystem cannot append, rewrite the whole file."""
        path = posixpath.join(self.dir, "metrics.jsonl")
        new = history[self._written :]
        if not new and self._written:
            return
        body = "".join(json.dumps(entry, default=str) + "\n" for entry in new).encode()
        try:
            with self.fs.open(path, "ab" if self._written else "wb") as f:
                f.write(body)
        except (NotImplementedError, ValueError, OSError):
            everything = "".join(json.dumps(entry, default=str) + "\n" for entry in history).encode()
            self.fs.pipe(path, everything)
        self._written = len(history)

    def write_run_info(self, info: dict[str, Any]) -> None:
        self.fs.pipe(posixpath.join(self.dir, "run.json"), json.dumps(info, indent=2, default=str).encode())
