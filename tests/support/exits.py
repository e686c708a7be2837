"""The exit status of a process that is not this one's child (a Ray worker: its raylet reaps it, and Ray does not
say what status it ended with): the kernel's process-events connector (netlink ``NETLINK_CONNECTOR``,
``CN_IDX_PROC``) tells every listener each process's exit status as it exits. Listening needs CAP_NET_ADMIN
(root); :func:`exit_watch` yields None where it hears nothing."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import threading
from collections.abc import Iterator

_NETLINK_CONNECTOR, _CN_IDX_PROC, _CN_VAL_PROC = 11, 1, 1
_LISTEN, _IGNORE = 1, 2
_PROC_EVENT_EXIT = 0x80000000
_NLMSG_DONE = 3
_NLMSGHDR, _CN_MSG, _EVENT_HEAD = "=IHHII", "=IIIIHH", "=IIQ"  # proc_event: what, cpu, timestamp, then its data
_EVENT_AT = struct.calcsize(_NLMSGHDR) + struct.calcsize(_CN_MSG)


class ExitWatch:
    """Collects the exit status of every process that ends while it listens; :meth:`wait` for one of them."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._statuses: dict[int, int] = {}
        self._changed = threading.Condition()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="exit-watch", daemon=True)
        self._thread.start()

    def wait(self, pid: int, timeout_s: float) -> int | None:
        """``pid``'s exit status as ``os.waitstatus_to_exitcode`` gives it (negative: a signal), once it has
        exited; None if it has not within ``timeout_s``."""
        with self._changed:
            if not self._changed.wait_for(lambda: pid in self._statuses, timeout_s):
                return None
            return os.waitstatus_to_exitcode(self._statuses[pid])

    def close(self) -> None:
        self._closed.set()
        self._thread.join()

    def _listen(self) -> None:
        self._sock.settimeout(0.2)  # to see close()
        while not self._closed.is_set():
            try:
                data = self._sock.recv(65536)
            except OSError:  # a timeout, or ENOBUFS (events dropped while the machine was busy)
                continue
            if len(data) < _EVENT_AT + 16 + 16:
                continue
            what = struct.unpack_from(_EVENT_HEAD, data, _EVENT_AT)[0]
            if what != _PROC_EVENT_EXIT:
                continue
            pid, tgid, status, _ = struct.unpack_from("=IIII", data, _EVENT_AT + 16)
            if pid == tgid:  # the process, not one of its threads
                with self._changed:
                    self._statuses[pid] = status
                    self._changed.notify_all()


def _control(sock: socket.socket, op: int) -> None:
    payload = struct.pack("=I", op)
    msg = struct.pack(_CN_MSG, _CN_IDX_PROC, _CN_VAL_PROC, 0, 0, len(payload), 0) + payload
    port = sock.getsockname()[0]
    sock.send(struct.pack(_NLMSGHDR, struct.calcsize(_NLMSGHDR) + len(msg), _NLMSG_DONE, 0, 0, port) + msg)


def _listening() -> tuple[socket.socket, ExitWatch | None] | None:
    """The connector's socket, listening, and its watch, or None where none can be made; the watch is None
    where it hears nothing (not root): checked with a child of this process first."""
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_CONNECTOR)
    except OSError:
        return None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        sock.bind((0, _CN_IDX_PROC))  # port 0: the kernel picks one
        _control(sock, _LISTEN)
    except OSError:
        sock.close()
        return None
    watch = ExitWatch(sock)
    probe = subprocess.Popen(["sh", "-c", "exit 3"])
    probe.wait()
    if watch.wait(probe.pid, timeout_s=5.0) == 3:
        return sock, watch
    watch.close()
    return sock, None


@contextlib.contextmanager
def exit_watch() -> Iterator[ExitWatch | None]:
    """Listen for process exits meanwhile; None where this process hears none (not root, no connector)."""
    listening = _listening()
    if listening is None:
        yield None
        return
    sock, watch = listening
    try:
        yield watch
    finally:
        if watch is not None:
            watch.close()
        with contextlib.suppress(OSError):
            _control(sock, _IGNORE)
        sock.close()
