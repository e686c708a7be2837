"""How the rank actors find each other: rank 0 publishes its address and a free port, all ranks call
``torch.distributed.init_process_group`` on ``tcp://addr:port``.

The port is picked by binding port 0 and releasing it, as Ray Train does; the tiny race with another
process taking it in between surfaces as an init error and counts as a group failure.

Gloo binds to the address the host name resolves to, which on many machines is a loopback address
(Debian's 127.0.1.1; inside a network namespace 127.0.0.1) that other nodes cannot reach: their
connections are refused. Unless the user chose one, each rank's gloo uses the interface that holds its
node's Ray address (``GLOO_SOCKET_IFNAME``), the address the other nodes reach it at.
"""

from __future__ import annotations

import datetime
import os
import socket

import psutil
import torch.distributed as dist

from zeroray.engine import import_before_group
from zeroray.train.run_spec import RankInfo


def node_address() -> str:
    """The address other nodes reach this process at (Ray's view of the node IP)."""
    import ray

    return ray.util.get_node_ip_address()


def interface_of(address: str) -> str | None:
    """The network interface that holds the IPv4 ``address`` (None if none here does)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    return None


def free_port() -> int:
    """A TCP port that was free a moment ago on this node."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", 0))
        return int(s.getsockname()[1])


def init_process_group(
    master_addr: str, master_port: int, info: RankInfo, backend: str, timeout_s: float
) -> dist.ProcessGroup | None:
    """Join the group and set the env vars torch code expects (RANK, LOCAL_RANK, MASTER_ADDR, ...).

    Returns a gloo side group for the report barrier (None for a single rank).
    """
    os.environ.update(
        {
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            "RANK": str(info.world_rank),
            "WORLD_SIZE": str(info.world_size),
            "LOCAL_RANK": str(info.local_rank),
            "LOCAL_WORLD_SIZE": str(info.local_world_size),
            "GROUP_RANK": str(info.node_rank),
        }
    )
    if "GLOO_SOCKET_IFNAME" not in os.environ:  # see the module doc
        nic = interface_of(node_address())
        if nic is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = nic
    import_before_group()  # so that leaving a failed group closes its connections (a kept actor lives on)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=info.world_rank,
        world_size=info.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    # A separate gloo group keeps report barriers off the engine's group and streams (NCCL or gloo). It
    # gets the same timeout: new_group would otherwise fall back to torch's 30-minute default.
    if info.world_size == 1:
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def destroy_process_group() -> None:
    """Leave the group if we joined one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
