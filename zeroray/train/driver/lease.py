"""The run lease: one ``fit()`` at a time per run directory, across drivers, clusters and machines.

Two fits with the same name and storage path would interleave their checkpoints and history, and one
could delete the other's checkpoint mid-commit (retention). So a fit holds ``<run>/lease.json``: its
owner id, when it started, and a heartbeat that a driver thread refreshes every quarter of
``RunConfig.lease_timeout_s``. A second fit finds a fresh lease and refuses; a lease whose heartbeat is
older than the timeout belongs to a driver that died, and is taken over with a warning. The lease is
deleted when the fit ends.

Taking the lease is atomic against a racing taker wherever the store has a conditional create. On a
local or network disk the file is created with ``os.link`` (fails if it exists) and a stale one is
first renamed away (only one renamer wins). Every read-then-write of the lease there (taking it, each
heartbeat, the release) holds an exclusive ``flock`` on ``<run>/lease.json.lock``, the protocol for
anything that writes the lease (:func:`exclusive`): without it, a takeover that landed between a
heartbeat's check of the owner and its write was overwritten, and the run that had lost the lease
never noticed. The release deletes the lock file too, under the lock; a taker that was waiting on
the deleted file sees it is no longer the one at that path and locks the new one. On S3 the lease is
created with ``If-None-Match: *`` (the PUT fails if the object exists, however slow it is), a stale
one is replaced with ``If-Match`` its ETag, and so is each heartbeat's write (the ETag is asked
before the owner is read), so two fits that start in the same instant, or behind slow PUTs, get one lease: the
other's PUT fails and it refuses. Other stores get fsspec's ``pipe_file(mode="create")``, as
atomic as their driver makes it, and a read-back: there a loser notices at its next heartbeat.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from zeroray.storage import atomic_write, protocols
from zeroray.train.driver.run_dir import LEASE, RunStorage
from zeroray.train.errors import RunLeaseError

logger = logging.getLogger(__name__)


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


@contextlib.contextmanager
def exclusive(lock_path: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path``, a file that its last holder may delete: once
    locked, the file open here must still be the one at that path, else the lock is taken again."""
    while True:
        fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                current = os.stat(lock_path).st_ino
            except FileNotFoundError:
                current = None
            if current == os.fstat(fd).st_ino:
                yield
                return
        finally:
            os.close(fd)  # releases the lock


class RunLease:
    """The lease of one run directory. :meth:`acquire` before any actor starts; :meth:`release` always."""

    def __init__(self, storage: RunStorage, timeout_s: float) -> None:
        self.storage = storage
        self.timeout_s = timeout_s
        self.interval_s = timeout_s / 4
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self.started_at = time.time()
        self.lost: str | None = None  # set by the heartbeat when another fit took the lease
        self._path = storage.path(LEASE)
        self._local = isinstance(storage.fs, LocalFileSystem)
        self._lock_path = storage.fs._strip_protocol(self._path) + ".lock" if self._local else None
        self._s3 = any(p in ("s3", "s3a") for p in protocols(storage.fs))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ file
    def _body(self) -> bytes:
        return json.dumps({"owner": self.owner, "started_at": self.started_at, "heartbeat": time.time(),
                           "run": self.storage.name}).encode()

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold the lease's lock file (local and network disks; object stores have no lock)."""
        if self._lock_path is None:
            yield
            return
        with exclusive(self._lock_path):
            yield

    def _read(self) -> dict[str, Any] | None:
        try:
            raw = self.storage.fs.cat_file(self._path)
        except FileNotFoundError:
            return None
        try:
            return json.loads(raw)
        except ValueError:  # not ours to interpret; treat as a lease with no heartbeat
            return {"owner": "unknown", "started_at": 0.0, "heartbeat": 0.0}

    def _running(self, held: dict[str, Any]) -> RunLeaseError:
        age = time.time() - float(held.get("heartbeat", 0.0))
        return RunLeaseError(
            f"run {self.storage.name!r} is running (since {_when(float(held.get('started_at', 0.0)))}, owner "
            f"{held.get('owner')}, last heartbeat {age:.0f}s ago) in {self.storage.url}: another fit() with this "
            f"name and storage path holds {LEASE}. Wait for it to end, or pick another RunConfig.name; a lease "
            f"with no heartbeat for RunConfig.lease_timeout_s={self.timeout_s:g}s is taken over"
        )

    def _etag_now(self) -> str | None:
        """S3: the ETag of the lease object now (None: there is none). Asked before the lease is read,
        so a write conditional on it fails if the lease changed after this."""
        self.storage.fs.invalidate_cache(self._path)
        try:
            return self.storage.fs.info(self._path).get("ETag")
        except FileNotFoundError:
            return None

    def _put(self, **condition: str) -> None:
        self.storage.fs.pipe_file(self._path, self._body(), **condition)

    def _create(self) -> None:
        """Create the lease file; a fit that got there first makes this a RunLeaseError."""
        if not self._local:
            try:
                self._put(mode="create")  # S3: If-None-Match: *, the store refuses a second creator
            except FileExistsError:
                raise self._running(self._read() or {}) from None
            return
        path = self.storage.fs._strip_protocol(self._path)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        atomic_write(self.storage.fs, tmp, self._body())
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise self._running(self._read() or {}) from None
        finally:
            os.unlink(tmp)

    def _take_over(self, etag: str | None) -> None:
        """Move a stale lease out of the way (one fit wins the rename), then create ours. On S3 replace
        it only if it is still the one read (``etag``), so of two takers one wins."""
        if self._s3 and etag is not None:
            try:
                self._put(IfMatch=etag)
            except FileNotFoundError:  # released in between: take it as new
                self._create()
            except OSError:  # 412: another fit took it over (or its owner beat) since it was read
                raise self._running(self._read() or {}) from None
            return
        if self._local:
            path = self.storage.fs._strip_protocol(self._path)
            aside = f"{path}.stale-{uuid.uuid4().hex}"
            try:
                os.rename(path, aside)
            except FileNotFoundError:  # another fit took it over (or it ended) in between
                held = self._read()
                if held is not None:
                    raise self._running(held) from None
            else:
                os.unlink(aside)
        self._create()

    # ------------------------------------------------------------------ life cycle
    def acquire(self) -> None:
        """Take the lease or raise RunLeaseError naming who holds it; then keep it fresh."""
        with self._exclusive():
            self._acquire()
        self._thread = threading.Thread(target=self._heartbeat, name="zeroray-lease", daemon=True)
        self._thread.start()

    def _acquire(self) -> None:
        etag = self._etag_now() if self._s3 else None
        held = self._read()
        if held is None:
            self._create()
        else:
            age = time.time() - float(held.get("heartbeat", 0.0))
            if age < self.timeout_s:
                raise self._running(held)
            logger.warning(
                "zeroray: taking over run %r from %s: its last heartbeat was %.0fs ago "
                "(RunConfig.lease_timeout_s=%g); its driver is presumed dead",
                self.storage.name, held.get("owner"), age, self.timeout_s,
            )
            self._take_over(etag)
        now = self._read()
        if now is None or now.get("owner") != self.owner:
            raise self._running(now or {})

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                with self._exclusive():
                    etag = self._etag_now() if self._s3 else None
                    held = self._read()
                    if held is not None and held.get("owner") != self.owner:
                        self.lost = (
                            f"lost the lease of run {self.storage.name!r} to {held.get('owner')}: another fit() took "
                            f"over {self.storage.url} (this driver's heartbeat was late by more than "
                            f"RunConfig.lease_timeout_s={self.timeout_s:g}s)"
                        )
                        return
                    if not self._s3:
                        atomic_write(self.storage.fs, self._path, self._body())
                    elif etag is None:
                        self._put(mode="create")
                    else:  # fails if another fit wrote it since it was read: seen at the next beat
                        self._put(IfMatch=etag)
            except Exception as e:  # a storage hiccup: try again at the next beat
                logger.warning("zeroray: could not refresh the lease %s: %s: %s", self._path, type(e).__name__, e)

    def release(self) -> None:
        """Stop the heartbeat and delete the lease if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            with self._exclusive():
                held = self._read()
                if held is not None and held.get("owner") == self.owner:
                    self.storage.fs.rm_file(self._path)
                    if self._lock_path is not None:  # nothing left behind; a waiter on it locks anew
                        os.unlink(self._lock_path)
        except Exception as e:
            logger.warning("zeroray: could not release the lease %s: %s: %s", self._path, type(e).__name__, e)
