"""The sockets of a rank's process groups, so that a group that failed can be cut loose at once.

A gloo collective waiting on a peer that is alive but unreachable (a cut link, a partition, a stopped
process) waits for the collective timeout: the peer's connection never closes, and gloo cannot abort a
collective (``ProcessGroupGloo.abort()`` returns while the collective goes on waiting; measured with torch
2.13). So the rank actor records the sockets that appear while its process groups are created (the world
group and the report group in ``setup``, the engine's hybrid groups in ``zt.prepare``), and when the driver
ends a group whose loop still waits, it shuts them down: the waiting collective fails at once with gloo's
"Connection closed by peer", the loop ends as after any peer's failure (its state kept for the next group),
and the peers still waiting on this rank fail in turn.

Only connected TCP sockets are shut. A listening one is left alone: gloo's listener thread ends the process
when its socket is shut under it. A socket is shut only while its descriptor still names the same socket
(same inode), so a descriptor reused since is never touched.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

_FD_DIR = "/proc/self/fd"


def _sockets() -> dict[int, str]:
    """This process's socket descriptors and what each names (``socket:[inode]``)."""
    found: dict[int, str] = {}
    try:
        names = os.listdir(_FD_DIR)
    except OSError:  # no procfs: nothing to record, and groups fail at their collective timeout as before
        return found
    for name in names:
        try:
            link = os.readlink(f"{_FD_DIR}/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found[int(name)] = link
    return found


class GroupSockets:
    """The sockets this process's groups opened (recorded around their creation), and :meth:`sever`."""

    def __init__(self) -> None:
        self._opened: dict[int, str] = {}

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Record the sockets that appear while the body runs (it creates process groups)."""
        before = _sockets()
        try:
            yield
        finally:
            self._opened.update({fd: link for fd, link in _sockets().items() if before.get(fd) != link})

    def sever(self) -> int:
        """Shut down the recorded connections that are still open; how many were shut. Collectives waiting on
        them fail at once; the groups cannot be used afterwards (only destroyed)."""
        shut = 0
        for fd, link in self._opened.items():
            try:
                if os.readlink(f"{_FD_DIR}/{fd}") != link:
                    continue  # closed, and the descriptor reused
                s = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                    s.getpeername()  # raises for a listening socket: gloo's listener must stay
                    s.shutdown(socket.SHUT_RDWR)
                    shut += 1
            except OSError:
                pass
            finally:
                s.close()  # the duplicate only
        return shut

    def clear(self) -> None:
        """Forget the recorded sockets (the groups were left; their descriptors may be reused)."""
        self._opened.clear()
