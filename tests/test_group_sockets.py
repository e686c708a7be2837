"""GroupSockets (zeroray/train/group/group_sockets.py) on real gloo processes: a collective waiting on a peer that
is alive but never joins (a cut-off node: its connections stay open, so gloo waits for the group timeout) fails
at once when the waiting rank severs its group's connections, as the rank actor's release does; the process
lives on (gloo's listener is left alone), the error is one the driver counts as a peer's failure, and the rank
can join a new group afterwards."""

from __future__ import annotations

import datetime
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tests.support.dist import run_ranks
from zeroray.train.errors import is_collective_error
from zeroray.train.group.group_sockets import GroupSockets

GROUP_TIMEOUT_S = 300.0  # what the waiting collective would otherwise wait


def _wait_for(path: Path) -> None:
    while not path.exists():
        time.sleep(0.02)


def _case(rank: int, world: int, tmp: str) -> dict:
    tmp_dir = Path(tmp)
    sockets = GroupSockets()
    with sockets.recording():
        group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    t = torch.ones(1000)
    dist.all_reduce(t, group=group)  # every connection of the group is up
    if rank == world - 1:  # the cut-off peer: alive, its connections open, in no further collective
        _wait_for(tmp_dir / "released-0")
        _wait_for(tmp_dir / "released-1")
        return {}
    (tmp_dir / f"waiting-{rank}").write_text("")

    def release() -> None:  # the driver's release, once both ranks are about to wait
        _wait_for(tmp_dir / "waiting-0")
        _wait_for(tmp_dir / "waiting-1")
        time.sleep(0.2)  # let the collective start waiting (if it has not, it fails as it starts: same outcome)
        shut.append(sockets.sever())

    shut: list[int] = []
    threading.Thread(target=release, daemon=True).start()
    start = time.monotonic()
    try:
        dist.all_reduce(t, group=group)
        error = None
    except Exception as e:
        error = e
    waited = time.monotonic() - start
    (tmp_dir / f"released-{rank}").write_text("")
    dist.destroy_process_group(group)
    # A new group of the two, on its own store: the process is fit for the next one.
    store = dist.FileStore(str(tmp_dir / "next-store"), 2)
    fresh = dist.ProcessGroupGloo(dist.PrefixStore("next", store), rank, 2)
    u = torch.full((4,), float(rank + 1))
    fresh.allreduce([u]).wait()
    return {"error": None if error is None else f"{type(error).__name__}: {error}",
            "secondary": error is not None and is_collective_error(error), "waited": waited, "shut": shut,
            "next": u.tolist(), "pid": os.getpid()}


def test_sever_fails_a_collective_waiting_on_a_live_peer_at_once(tmp_path: Path) -> None:
    results = run_ranks(_case, 3, str(tmp_path))
    for rank in (0, 1):
        r = results[rank]
        assert r["error"] is not None and "Connection closed by peer" in r["error"], r
        assert r["secondary"], r  # counted as a peer's failure: the rank is kept for the next group
        assert r["shut"] and r["shut"][0] > 0, r
        assert r["waited"] < GROUP_TIMEOUT_S / 5, r  # not the group timeout
        assert r["next"] == [3.0] * 4, r  # 1 + 2: the next group works


def test_sever_shuts_only_the_connections_recorded_and_keeps_listeners() -> None:
    """A connection opened inside ``recording`` is shut (its peer reads end-of-stream); a listener opened there
    still accepts; a connection opened outside stays up."""
    import socket

    outside_server = socket.create_server(("127.0.0.1", 0))
    sockets = GroupSockets()
    with sockets.recording():
        listener = socket.create_server(("127.0.0.1", 0))
        inside = socket.create_connection(outside_server.getsockname())
    inside_peer, _ = outside_server.accept()
    outside = socket.create_connection(outside_server.getsockname())
    outside_peer, _ = outside_server.accept()
    try:
        assert sockets.sever() == 1
        assert inside_peer.recv(1) == b""  # shut
        outside.sendall(b"x")
        assert outside_peer.recv(1) == b"x"  # untouched
        late = socket.create_connection(listener.getsockname())  # the listener still listens
        accepted, _ = listener.accept()
        for s in (late, accepted):
            s.close()
    finally:
        for s in (inside, inside_peer, outside, outside_peer, listener, outside_server):
            s.close()
