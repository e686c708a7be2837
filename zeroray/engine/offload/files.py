"""Swap files for NVMe offload: a rank's directory, aligned host buffers, and async whole-file I/O.

Each sub-group of the sharded optimizer owns one file in ``<nvme_path>/zeroray-swap/<run>-rank<r>/``
holding its fp32 master and its optimizer states, each a segment padded to 4 KiB, so every request
is page-aligned and can bypass the page cache (``O_DIRECT``); where the filesystem refuses
``O_DIRECT`` (tmpfs) the file is read and written through the cache and the cache is dropped behind
(``posix_fadvise(DONTNEED)``), so host memory stays bounded either way.

Requests go to a small thread pool: ``os.preadv`` / ``os.pwritev`` release the GIL, so reads of
the next sub-group and writes of the previous one run while the optimizer steps the current one.
A short read or write raises (never silent zeros). The directory is removed by :meth:`SwapDir.close`;
a directory left by a killed process is removed at the next start on that ``nvme_path`` when the
process that made it is gone (its pid is in the name).
"""

from __future__ import annotations

import mmap
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import psutil
import torch

from zeroray.engine.layout import SWAP_ALIGN as ALIGN  # O_DIRECT: offsets, lengths and memory page-aligned
from zeroray.engine.layout import swap_aligned as aligned

_HOST = socket.gethostname()


class AlignedBuffer:
    """Page-aligned host memory (an anonymous mmap) seen as a flat fp32 tensor."""

    def __init__(self, nbytes: int):
        self.nbytes = aligned(max(nbytes, 1))
        self._map = mmap.mmap(-1, self.nbytes)
        self.view = memoryview(self._map)
        self.tensor = torch.frombuffer(self._map, dtype=torch.float32)

    def close(self) -> None:
        """Drop this object's references; the memory goes when no tensor views it any more."""
        del self.view, self.tensor, self._map


class SwapDir:
    """This rank's swap directory, and the thread pool that reads and writes its files."""

    ROOT = "zeroray-swap"

    def __init__(self, nvme_path: str, rank: int, threads: int, direct: bool = True, block_size: int = 8 << 20):
        root = os.path.join(nvme_path, self.ROOT)
        os.makedirs(root, exist_ok=True)
        remove_stale(root)
        self.path = os.path.join(root, f"{_HOST}-pid{os.getpid()}-rank{rank}-{uuid.uuid4().hex[:8]}")
        os.makedirs(self.path)
        self._direct = direct and hasattr(os, "O_DIRECT") and _supports_direct(self.path)
        self.block_size = block_size
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="zeroray-swap")
        self._fds: dict[str, int] = {}
        self.bytes_read = 0
        self.bytes_written = 0

    @property
    def direct(self) -> bool:
        return self._direct

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if self._direct else 0)
            fd = self._fds[name] = os.open(os.path.join(self.path, name), flags, 0o600)
        return fd

    def write(self, name: str, buf: AlignedBuffer, nbytes: int, offset: int = 0) -> list[Future]:
        """Write the first ``nbytes`` (aligned up) of ``buf`` into the file ``name`` at ``offset``
        (page-aligned) (async)."""
        n = aligned(nbytes)
        self.bytes_written += n
        return self._submit(os.pwritev, self._fd(name), buf, n, offset)

    def read(self, name: str, buf: AlignedBuffer, nbytes: int, offset: int = 0) -> list[Future]:
        """Read ``nbytes`` (aligned up) of the file ``name`` from ``offset`` (page-aligned) into the
        start of ``buf`` (async)."""
        n = aligned(nbytes)
        self.bytes_read += n
        return self._submit(os.preadv, self._fd(name), buf, n, offset)

    def _submit(self, op, fd: int, buf: AlignedBuffer, n: int, offset: int) -> list[Future]:  # noqa: ANN001
        if n > buf.nbytes:
            raise ValueError(f"swap request of {n} bytes exceeds its buffer ({buf.nbytes} bytes)")
        if offset % ALIGN:
            raise ValueError(f"swap request at byte {offset} is not {ALIGN}-aligned")
        return [
            self._pool.submit(self._io, op, fd, buf.view[off : min(off + self.block_size, n)], offset + off)
            for off in range(0, n, self.block_size)
        ]

    def _io(self, op, fd: int, view: memoryview, offset: int) -> None:  # noqa: ANN001
        done = 0
        while done < len(view):
            got = op(fd, [view[done:]], offset + done)
            if got <= 0:
                kind = "read" if op is os.preadv else "write"
                raise OSError(
                    f"zeroray swap: short {kind} in {self.path} at byte {offset + done} "
                    f"({done} of {len(view)} bytes): the file is truncated or the disk is full"
                )
            done += got
        if not self._direct:  # keep host memory bounded: the page cache must not hold the swap
            os.posix_fadvise(fd, offset, len(view), os.POSIX_FADV_DONTNEED)

    def forget(self, prefix: str) -> None:
        """Close the files whose names start with ``prefix`` (requests on them done)."""
        for name in [n for n in self._fds if n.startswith(prefix)]:
            os.close(self._fds.pop(name))

    def close(self) -> None:
        """Wait for requests in flight, close the files, remove the directory."""
        self._pool.shutdown(wait=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        shutil.rmtree(self.path, ignore_errors=True)


def read_exact(path: str, buf: AlignedBuffer, nbytes: int, offset: int, direct: bool) -> None:
    """Read ``nbytes`` (aligned) of ``path`` at ``offset`` (aligned) into the start of ``buf``, in
    the calling thread; a short read raises."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        view, done = buf.view[:nbytes], 0
        while done < nbytes:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"zeroray swap: short read of {path} at byte {offset + done} ({done} of {nbytes} bytes)")
            done += got
        if not direct:
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def wait_all(futures: Sequence[Future]) -> None:
    for f in futures:
        f.result()


def settle_all(futures: Sequence[Future]) -> None:
    """Wait for every request without raising its error: for a caller already failing or abandoning
    the transfer, so that no request still lands in a buffer that is reused."""
    for f in futures:
        f.exception()


def _supports_direct(path: str) -> bool:
    probe = os.path.join(path, ".direct-probe")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        buf = AlignedBuffer(ALIGN)
        try:
            os.pwritev(fd, [buf.view], 0)
        except OSError:
            return False
        finally:
            buf.close()
        return True
    finally:
        os.close(fd)
        os.unlink(probe)


def remove_stale(root: str) -> list[str]:
    """Remove swap directories under ``root`` left by dead processes of this host (a killed rank
    cannot clean up after itself); returns what was removed."""
    removed = []
    for name in os.listdir(root):
        parts = name.split("-pid", 1)
        if len(parts) != 2 or parts[0] != _HOST:
            continue
        pid = parts[1].split("-", 1)[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(name)
    return removed


def check_nvme_path(path: str | None, field: str, need_bytes: int) -> None:
    """Refuse, before any work starts, an ``nvme_path`` that is missing, not a writable directory,
    or on a filesystem with less free space than ``need_bytes``."""
    from zeroray.config import ConfigError

    if not path:
        raise ConfigError(field, "device 'nvme' needs nvme_path, a local directory on each worker node")
    if not os.path.isdir(path):
        raise ConfigError(field, f"{path!r} is not an existing directory")
    try:  # os.access says yes to root on a read-only mode; a real file says the truth
        fd, probe = tempfile.mkstemp(prefix=".zeroray-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(field, f"{path!r} is not writable by this process ({e.strerror})") from None
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if free < need_bytes:
        raise ConfigError(
            field,
            f"{path!r} has {free / 2**30:.2f} GiB free, but this rank's swap files need {need_bytes / 2**30:.2f} GiB",
        )
