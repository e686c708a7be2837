"""The emulated multi-node cluster (tests/support/netcluster.py): namespaces joined by real, shaped links.

What is checked is behaviour, never speed (benchmarks/netcluster_bench.py measures): where traffic goes,
that a cut link cuts and a healed one carries, what tc holds, that gloo and Ray run across the nodes,
and that nothing is left afterwards, also when a test fails."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.netcluster import (
    PREFIX,
    REPO_ROOT,
    LinkSpec,
    NetCluster,
    NetClusterError,
    Node,
    netem_unavailable,
    python_env,
    remove_stale,
    run_ranks,
    start_ray,
)

pytestmark = pytest.mark.usefixtures("needs_namespaces")

LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
PORT = 5000  # every node is a namespace of its own: no other process holds it

SERVE = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
while True:  # until the cluster's teardown kills it
    conn, peer = server.accept()
    received = 0
    while chunk := conn.recv(1 << 16):
        received += len(chunk)
    conn.sendall(f"{peer[0]} {received}".encode())
    conn.close()
"""

CONNECT = """
import socket, sys
host, port, size, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
with socket.create_connection((host, port), timeout=timeout) as conn:
    conn.sendall(b"x" * size)
    conn.shutdown(socket.SHUT_WR)
    print(conn.recv(100).decode())
"""


@pytest.fixture
def net() -> Iterator[NetCluster]:
    with NetCluster(2) as cluster:
        yield cluster


def _serve(net: NetCluster, node: Node) -> None:
    server = net.popen(node, [sys.executable, "-c", SERVE, node.ip, str(PORT)], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "listening"


def _connect(net: NetCluster, node: Node, to: Node, size: int = 1, timeout_s: float = 10.0) -> tuple[str, int]:
    """From ``node`` to ``to``'s server: (the address the server saw, the bytes it received)."""
    done = net.run(node, [sys.executable, "-c", CONNECT, to.ip, str(PORT), str(size), str(timeout_s)])
    peer, received = done.stdout.split()
    return peer, int(received)


def _addresses(netns: str) -> list[str]:
    shown = json.loads(subprocess.run(["ip", "-n", netns, "-j", "addr", "show"], capture_output=True, text=True,
                                      check=True).stdout)
    return [a["local"] for link in shown for a in link.get("addr_info", [])]


def _namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(proc.name))
        except OSError:
            pass
    return found


def test_nodes_have_their_own_loopback_range_addresses_and_talk_over_their_veths(net: NetCluster) -> None:
    a, b = net.nodes
    assert a.ip != b.ip
    for netns in [a.netns, b.netns, net.bridge_netns]:
        assert all(ipaddress.ip_address(ip) in LOOPBACK for ip in _addresses(netns)), _addresses(netns)
    assert sorted(_addresses(a.netns)) == ["127.0.0.1", a.ip]  # lo and the veth, nothing else (no IPv6)

    _serve(net, b)
    sent = 1 << 20
    before = net.link_bytes(a), net.link_bytes(b)
    assert _connect(net, a, b, size=sent) == (a.ip, sent)  # b saw a's address
    after = net.link_bytes(a), net.link_bytes(b)
    assert after[0]["tx"] - before[0]["tx"] >= sent  # out of a's veth ...
    assert after[1]["rx"] - before[1]["rx"] >= sent  # ... into b's


def test_a_partition_cuts_the_link_and_heal_restores_it(net: NetCluster) -> None:
    a, b = net.nodes
    _serve(net, b)
    assert _connect(net, a, b)[0] == a.ip
    net.partition(b)
    with pytest.raises(NetClusterError, match="timed out"):
        _connect(net, a, b, timeout_s=2.0)
    assert _connect(net, b, b)[0] == b.ip  # the cut node still reaches itself
    net.heal(b)
    assert _connect(net, a, b)[0] == a.ip


def test_links_get_the_tbf_qdiscs_they_were_given() -> None:
    with NetCluster([LinkSpec(rate="1gbit"), None]) as net:
        a, b = net.nodes
        for side in net.qdiscs(a).values():
            assert "qdisc tbf 1: root" in side and "rate 1Gbit" in side and "lat 50ms" in side
        assert all("tbf" not in side for side in net.qdiscs(b).values())
        net.shape(a, LinkSpec(rate="100mbit", burst="64kb"))
        net.shape(b, LinkSpec(rate="10mbit"))
        for node, rate in [(a, "rate 100Mbit"), (b, "rate 10Mbit")]:
            for side in net.qdiscs(node).values():
                assert side.count("qdisc tbf") == 1 and rate in side
        net.shape(a, None)
        assert all("tbf" not in side for side in net.qdiscs(a).values())


def test_links_get_netem_for_delay_and_loss() -> None:
    why = netem_unavailable()
    if why:
        pytest.skip(why)
    with NetCluster([LinkSpec(rate="1gbit", delay="5ms", loss=1.0)]) as net:
        for side in net.qdiscs(net.nodes[0]).values():
            assert "qdisc netem 1: root" in side and "delay 5ms" in side and "loss 1%" in side
            assert "qdisc tbf 10: parent 1:1" in side and "rate 1Gbit" in side


def test_delay_or_loss_without_netem_fails_and_says_why(net: NetCluster) -> None:
    if not netem_unavailable():
        pytest.skip("this kernel has netem")
    with pytest.raises(NetClusterError, match="CONFIG_NET_SCH_NETEM"):
        net.shape(net.nodes[0], LinkSpec(delay="5ms"))


def _all_reduce_and_connections(rank: int, world: int) -> dict:
    """A rank of the gloo test: the all_reduce's sum, and the two ends of each TCP connection it holds."""
    import psutil
    import torch
    import torch.distributed as dist

    x = torch.full((1000,), float(rank + 1))
    dist.all_reduce(x)
    connections = [c for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_ESTABLISHED]
    return {"sum": x[0].item(), "local": {_ipv4(c.laddr.ip) for c in connections},
            "remote": {_ipv4(c.raddr.ip) for c in connections}}


def _ipv4(ip: str) -> str:
    """The store's server socket is dual-stack: its peers show as ::ffff:127.x.y.z."""
    address = ipaddress.ip_address(ip)
    return str(getattr(address, "ipv4_mapped", None) or address)


def test_gloo_all_reduce_over_two_nodes_of_two_ranks(net: NetCluster) -> None:
    a, b = net.nodes
    placement = [a, a, b, b]
    results = run_ranks(net, placement, _all_reduce_and_connections, timeout_s=120)
    assert [r["sum"] for r in results] == [10.0] * 4
    for node, result in zip(placement, results):
        assert result["local"] == {node.ip}  # its own node's address, on both its gloo pairs and the store
        assert result["remote"] == {a.ip, b.ip}  # a rank on its own node and ranks across the link


def _fail_on_rank_1(rank: int, world: int) -> None:
    import time

    if rank == 1:
        raise ValueError("rank 1 gives up")
    time.sleep(600)  # a rank that would wait for ever: run_ranks must end it


def test_a_failed_rank_ends_the_others_and_is_named(net: NetCluster) -> None:
    a, b = net.nodes
    with pytest.raises(RuntimeError, match=r"(?s)^rank 1 exited with 1:.*ValueError: rank 1 gives up"):
        run_ranks(net, [a, b], _fail_on_rank_1, timeout_s=120)
    assert net.pids(a) == [] and net.pids(b) == []


DRIVER = """
import json, os, time
import ray

ray.init()
deadline = time.monotonic() + 60
while len([n for n in ray.nodes() if n["Alive"]]) < 2:
    assert time.monotonic() < deadline, ray.nodes()
    time.sleep(0.2)


@ray.remote(num_cpus=0)
class Where:
    def report(self):
        return ray.util.get_node_ip_address(), os.stat("/proc/self/ns/net").st_ino


ips = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
actors = [Where.options(resources={f"node:{ip}": 0.01}).remote() for ip in ips]
print(json.dumps({"nodes": ips, "actors": ray.get([a.report.remote() for a in actors])}))
"""


@pytest.mark.timeout(300)
def test_a_ray_cluster_over_two_namespaces() -> None:
    with NetCluster(2) as net:
        ray = start_ray(net, num_cpus=1)
        seen = json.loads(ray.run_driver(DRIVER).stdout.strip().splitlines()[-1])
        namespaces = {node.ip: os.stat(f"/run/netns/{node.netns}").st_ino for node in net.nodes}
        assert sorted(seen["nodes"]) == sorted(namespaces)
        assert sorted(ip for ip, _ in seen["actors"]) == sorted(namespaces)  # one actor on each node
        for ip, netns_inode in seen["actors"]:
            assert netns_inode == namespaces[ip]  # and it runs inside that node's namespace
        pids = [pid for node in net.nodes for pid in net.pids(node)]
        assert pids and _processes_mentioning(str(net.scratch))
    assert not [n for n in _namespaces() if n.startswith(net.prefix)]
    assert not [pid for pid in pids if _running(pid)]
    assert not [pid for pid in _processes_mentioning(str(net.scratch)) if _running(pid)]
    assert not net.scratch.exists()


def test_teardown_runs_when_the_body_raises() -> None:
    with pytest.raises(RuntimeError, match="the test failed"), NetCluster(2) as net:
        a, b = net.nodes
        started = net.popen(a, ["sleep", "600"]).pid
        # Started in the background by a process that has ended: the cluster holds no handle to it.
        orphan = int(net.run(b, ["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"]).stdout)
        assert _running(started) and _running(orphan)
        raise RuntimeError("the test failed")
    assert not [n for n in _namespaces() if n.startswith(net.prefix)]
    assert not _running(started) and not _running(orphan)
    assert not net.scratch.exists()


_KILLED_DRIVER = """
import json, sys, time
from tests.support.netcluster import NetCluster
with NetCluster(2) as net:
    rank = net.popen(net.nodes[1], ["sleep", "600"])
    print(json.dumps({"prefix": net.prefix, "scratch": str(net.scratch), "pid": rank.pid}), flush=True)
    time.sleep(600)
"""


def test_a_driver_stopped_by_sigterm_tears_its_cluster_down() -> None:
    driver = subprocess.Popen([sys.executable, "-c", _KILLED_DRIVER], stdout=subprocess.PIPE, text=True,
                              cwd=REPO_ROOT, env=python_env())
    try:
        made = json.loads(driver.stdout.readline())  # the cluster is up and its process runs
        assert made["prefix"] in " ".join(_namespaces()) and _running(made["pid"])
        driver.terminate()
        assert driver.wait(timeout=60) == 143  # SystemExit(128 + SIGTERM), after the teardown
    finally:
        if driver.poll() is None:
            driver.kill()
        driver.stdout.close()
    assert not [n for n in _namespaces() if n.startswith(made["prefix"])]
    assert not _running(made["pid"])
    assert not Path(made["scratch"]).exists()


def test_stale_leftovers_are_removed_only_when_their_owner_is_dead() -> None:
    ended = subprocess.Popen(["true"])
    ended.wait()
    dead, live = f"{PREFIX}-{ended.pid}-abcd-n0", f"{PREFIX}-{os.getpid()}-abcd-n0"
    for name in (dead, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert dead in remove_stale()
        assert dead not in _namespaces() and live in _namespaces()
    finally:
        for name in set(_namespaces()) & {dead, live}:
            subprocess.run(["ip", "netns", "del", name], check=True)
