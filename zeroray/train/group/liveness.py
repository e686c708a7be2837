"""Proof that a node's Ray is gone, before Ray says so.

Ray declares a node dead only after its health check missed ``health_check_failure_threshold`` beats, and
a call to an actor on it fails only after ``timeout_ms_task_wait_for_death_info`` (1 s) without that news.
Meanwhile the driver already knows the group has failed: the survivors' collectives fail at once when the
lost ranks' sockets close. What it lacks is which ranks are gone, and whether their node can hold a rank.

A node's raylet holds its node manager port (``ray.nodes()``: ``NodeManagerAddress``/``NodeManagerPort``)
until it exits, and a node without a raylet is gone for good (a raylet that comes back is a new node). So
when the node's address refuses a TCP connection on that port (the host is up and says nothing listens),
the node is lost now. Only a refusal counts: a connection that is accepted, or not answered within the
timeout (a cut link, a host that lost power), proves nothing, and the caller waits for Ray as before.
"""

from __future__ import annotations

import errno
import select
import socket
import time
from collections.abc import Collection, Iterable

PROBE_TIMEOUT_S = 0.2  # a refusal from a host that is up comes back in one round trip


def refusing(addresses: Iterable[tuple[str, int]], timeout_s: float = PROBE_TIMEOUT_S) -> set[tuple[str, int]]:
    """The ``(host, port)`` addresses that refuse a TCP connection within ``timeout_s`` (all probed at once):
    nothing listens there. One that accepts, or does not answer in time, is not in the result."""
    pending: dict[socket.socket, tuple[str, int]] = {}
    refused: set[tuple[str, int]] = set()
    try:
        for address in set(addresses):
            s = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            rc = s.connect_ex(address)
            if rc == errno.ECONNREFUSED:
                refused.add(address)
                s.close()
            elif rc in (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
                pending[s] = address
            else:  # connected at once, or unreachable: no proof either way
                s.close()
        deadline = time.monotonic() + timeout_s
        while pending and (left := deadline - time.monotonic()) > 0:
            _, done, _ = select.select([], list(pending), [], left)
            for s in done:
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == errno.ECONNREFUSED:
                    refused.add(pending[s])
                s.close()
                del pending[s]
    finally:
        for s in pending:
            s.close()
    return refused


def lost_nodes(node_ids: Collection[str], timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, str]:
    """Which of the Ray nodes ``node_ids`` are gone, and why: Ray lists them dead (or not at all), or their
    raylet's port refuses connections (:func:`refusing`). Nodes that may be alive are left out."""
    import ray

    listed = {n["NodeID"]: n for n in ray.nodes() if n["NodeID"] in node_ids}
    lost = {n: "Ray does not list it" for n in node_ids if n not in listed}
    lost |= {n: "Ray lists it dead" for n, info in listed.items() if not info["Alive"]}
    raylets = {n: (info["NodeManagerAddress"], int(info["NodeManagerPort"])) for n, info in listed.items()
               if info["Alive"] and n not in lost}
    gone = refusing(raylets.values(), timeout_s)
    lost |= {n: f"its raylet at {address[0]}:{address[1]} refuses connections (Ray has not reported the node dead "
                "yet)" for n, address in raylets.items() if address in gone}
    return lost
