"""The run's directory ``<storage_path>/<name>/`` through zeroray.storage, so any fsspec URL works.

The driver checks it is writable, and shareable by every rank, before any actor starts. It holds:
``metrics.jsonl`` (the history, one report a line, appended across every ``fit()`` of the run; whole
lines or nothing, even on a full disk), ``run.json`` (status, world size, error; written atomically),
``lease.json`` (which ``fit()`` runs the run now, see lease.py; on a disk, ``lease.json.lock`` beside it while a fit runs),
``epoch.json`` (the epoch fence: which attempt may commit, zeroray/checkpoint/fence.py; on a disk, ``epoch.json.lock``
beside it) and the ranks' sharded checkpoints
(``checkpoint_<step>/``, see worker/recovery.py).
"""

from __future__ import annotations

import json
import os
import posixpath
import uuid
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from zeroray.storage import StorageError, atomic_write, join_url, open_url, require_shared

__all__ = ["RunStorage", "StorageError"]

HISTORY = "metrics.jsonl"
RUN_INFO = "run.json"
LEASE = "lease.json"


class RunStorage:
    """One run's directory."""

    def __init__(self, storage_path: str, name: str, storage_options: dict[str, Any] | None = None) -> None:
        self.storage_path = storage_path
        self.name = name
        self.fs, root = open_url(storage_path, storage_options)
        self.dir = posixpath.join(root.rstrip("/") or "/", name)
        self.url = join_url(storage_path, name)
        self._local = isinstance(self.fs, LocalFileSystem)
        self._history: bytes = b""  # the file's content, kept only where the file is rewritten whole

    def path(self, file: str) -> str:
        return posixpath.join(self.dir, file)

    def validate(self, processes: int) -> None:
        """Refuse storage the driver and ``processes`` - 1 ranks cannot share; create the run's
        directory and write, read and delete a probe file."""
        what = "RunConfig.storage_path (written by the driver and by every rank)"
        require_shared(self.fs, self.storage_path, what, processes)
        probe = self.path(f".zeroray-probe-{uuid.uuid4().hex}")
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

    # ------------------------------------------------------------------ metrics.jsonl
    def open_history(self) -> int:
        """Before a ``fit()`` appends: the number of complete lines already in ``metrics.jsonl`` (earlier
        fits of the run). A torn last line (a writer that died mid-line) is cut off here."""
        path = self.path(HISTORY)
        try:
            raw = self.fs.cat_file(path)
        except FileNotFoundError:
            raw = b""
        whole = raw[: raw.rfind(b"\n") + 1]
        if whole != raw:
            if self._local:
                os.truncate(self.fs._strip_protocol(path), len(whole))
            else:
                atomic_write(self.fs, path, whole)
        if not self._local:
            self._history = whole
        return whole.count(b"\n")

    def append_history(self, entries: list[dict[str, Any]]) -> None:
        """Append ``entries`` to ``metrics.jsonl``, all of them or none: on a local disk an append that
        fails (disk full, quota) is cut back to where it started; elsewhere (object stores cannot
        append) the whole file is rewritten in one atomic PUT."""
        if not entries:
            return
        body = "".join(json.dumps(entry, default=str) + "\n" for entry in entries).encode()
        path = self.path(HISTORY)
        if not self._local:
            atomic_write(self.fs, path, self._history + body)
            self._history += body
            return
        fd = os.open(self.fs._strip_protocol(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            start = os.fstat(fd).st_size
            try:
                view = memoryview(body)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            except BaseException:
                os.ftruncate(fd, start)
                raise
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ run.json
    def write_run_info(self, info: dict[str, Any]) -> None:
        """Replace ``run.json`` atomically: a reader sees the old status or the new one, never a torn one."""
        atomic_write(self.fs, self.path(RUN_INFO), json.dumps(info, indent=2, default=str).encode())
