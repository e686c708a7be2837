"""The run lease: one ``fit()`` at a time per run directory, across drivers, clusters and machines.

Two fits with the same name and storage path would interleave their checkpoints and history, and one
could delete the other's checkpoint mid-commit (retention). So a fit holds ``<run>/lease.json``: its
owner id, when it started, and a heartbeat that a driver thread refreshes every quarter of
``RunConfig.lease_timeout_s``. A second fit finds a fresh lease and refuses; a lease whose heartbeat is
older than the timeout belongs to a driver that died, and is taken over with a warning. The lease is
deleted when the fit ends.

On a local or network disk taking the lease is race-free: the file is created with ``os.link``
(fails if it exists) and a stale one is first renamed away (only one renamer wins). Every read-then-write
of the lease there (taking it, each heartbeat, the release) holds an exclusive ``flock`` on
``<run>/lease.json.lock``, the protocol for anything that writes the lease: without it, a takeover
that landed between a heartbeat's check of the owner and its write was overwritten, and the run
that had lost the lease never noticed. Object stores
have no such primitive here: the lease is written, then read back, and every heartbeat checks the
owner, so of two fits that start in the same instant the one that lost notices at its next heartbeat
and stops.
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

from zeroray.storage import atomic_write
from zeroray.train.errors import RunLeaseError
from zeroray.train.storage import LEASE, RunStorage

logger = logging.getLogger(__name__)


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


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
        fd = os.open(self._lock_path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

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

    def _create(self) -> None:
        """Create the lease file; a fit that got there first makes this a RunLeaseError."""
        if not self._local:
            atomic_write(self.storage.fs, self._path, self._body())
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

    def _take_over(self) -> None:
        """Move a stale lease out of the way (one fit wins the rename), then create ours."""
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
            self._take_over()
        now = self._read()
        if now is None or now.get("owner") != self.owner:
            raise self._running(now or {})

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                with self._exclusive():
                    held = self._read()
                    if held is not None and held.get("owner") != self.owner:
                        self.lost = (
                            f"lost the lease of run {self.storage.name!r} to {held.get('owner')}: another fit() took "
                            f"over {self.storage.url} (this driver's heartbeat was late by more than "
                            f"RunConfig.lease_timeout_s={self.timeout_s:g}s)"
                        )
                        return
                    atomic_write(self.storage.fs, self._path, self._body())
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
        except Exception as e:
            logger.warning("zeroray: could not release the lease %s: %s: %s", self._path, type(e).__name__, e)
