"""An emulated multi-node cluster on one machine, with real links: one network namespace per node.

Each node's namespace holds one end of a veth pair (the node's "NIC"); the other end is a port of a
bridge (the "switch") in a namespace of its own. Every address is in 127.0.0.0/8 (node i has
127.100.0.<i+1>/24; ``route_localnet`` lets the kernel route them over the veth), so nothing outside
the loopback range is ever used. A node's link is shaped with ``tc`` the same way on both of its
ends: ``tbf`` for the rate, ``netem`` for delay and loss. A partition sets the link's switch port
down (the cable is cut; the node keeps its address and routes), ``heal`` sets it up again.

Processes start inside a node with ``ip netns exec``: ranks on one node talk over that namespace's
own stack, ranks on different nodes over the shaped links. ``run_ranks`` runs a function on torch.distributed
gloo ranks placed on nodes; ``start_ray`` makes a real multi-node Ray cluster, one Ray node per
namespace. Nothing is changed in the machine's own (root) namespace.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN for ``ip netns``), ``ip`` and ``tc``: ``unavailable()``
says why not where they are missing. ``NetCluster`` is a context manager: on exit, also after an
error or a SIGTERM to the process that made it, it kills every process in its namespaces, deletes the
namespaces (and so the bridge and veths) and its scratch directory. Its names carry the creating process's pid and a random tag
(``zrn-<pid>-<tag>``), so parallel runs never share one, and ``remove_stale`` deletes what a dead
run left behind.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pickle
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

REPO_ROOT = Path(__file__).resolve().parents[2]
PREFIX = "zrn"  # every name this module makes starts with it: zrn-<pid>-<tag>
_NAME = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]{{4}}(?:-|$)")
_SUBNET = "127.100.0"  # node i is 127.100.0.<i+1>/24
RAY_GCS_PORT = 6379  # each node is a namespace of its own: Ray's default ports cannot collide with another run's
_FIRST_MASTER_PORT = 29500


class NetClusterError(RuntimeError):
    """A command that builds or changes the emulated network failed; the message has its stderr."""


def _check(argv: Sequence[str], timeout_s: float = 30.0, env: Mapping[str, str] | None = None,
           ) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, env=env)
    except FileNotFoundError as e:
        raise NetClusterError(f"`{argv[0]}` is not installed: {e}") from e
    except subprocess.TimeoutExpired as e:
        raise NetClusterError(f"`{' '.join(argv)}` did not finish within {timeout_s:.0f} s") from e
    if done.returncode != 0:
        raise NetClusterError(f"`{' '.join(argv)}` failed ({done.returncode}): {(done.stderr or done.stdout).strip()[-2000:]}")
    return done


@functools.cache
def unavailable() -> str | None:
    """Why the test bed cannot run here (for a skip), or None: it needs ``ip``, ``tc`` and the right to make
    network namespaces and veth pairs."""
    for tool in ("ip", "tc", "sysctl"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install iproute2 procps)"
    try:
        with _probe_netns():
            pass
    except NetClusterError as e:
        return f"cannot make a network namespace with a veth pair (needs root, or CAP_NET_ADMIN and CAP_SYS_ADMIN): {e}"
    return None


@functools.cache
def netem_unavailable() -> str | None:
    """Why links cannot get delay or loss here, or None: the kernel must have the netem qdisc
    (CONFIG_NET_SCH_NETEM); rate shaping (tbf) does not need it."""
    why = unavailable()
    if why:
        return why
    with _probe_netns() as (netns, dev):
        try:
            _check(["tc", "-n", netns, "qdisc", "add", "dev", dev, "root", "netem", "delay", "1ms"])
        except NetClusterError as e:
            return f"this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so no delay or loss: {e}"
    return None


@contextlib.contextmanager
def _probe_netns() -> Iterator[tuple[str, str]]:
    """A throwaway namespace with a veth pair in it: (namespace, one end)."""
    netns = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(2)}-probe"
    _check(["ip", "netns", "add", netns])
    try:
        _check(["ip", "-n", netns, "link", "add", "name", "a", "type", "veth", "peer", "name", "b"])
        yield netns, "a"
    finally:
        _check(["ip", "netns", "del", netns])


def _netns_pids(netns: str) -> list[int]:
    return [int(p) for p in _check(["ip", "netns", "pids", netns]).stdout.split()]


def _kill_netns_processes(netns: str, timeout_s: float = 10.0) -> None:
    """SIGKILL every process in ``netns`` until none is left (one may start another while it dies): a
    machine that loses power, and a teardown that nothing inside can delay."""
    deadline = time.monotonic() + timeout_s
    while pids := _netns_pids(netns):
        if time.monotonic() > deadline:
            raise NetClusterError(f"processes {pids} in {netns} outlived SIGKILL for {timeout_s:.0f} s")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _exit_on_sigterm() -> Callable[[], None]:
    """Make SIGTERM raise SystemExit(143) in the main thread, so a driver stopped with ``kill`` unwinds through its
    ``with NetCluster(...)`` and tears it down, as it does on an error; returns what puts the old handler back.
    Left alone where a handler is already set (the program's own) or off the main thread (Python allows none)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return lambda: None

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    def restore() -> None:  # unless something set a handler of its own since
        if signal.getsignal(signal.SIGTERM) is stop:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    signal.signal(signal.SIGTERM, stop)
    return restore


def _delete_netns(netns: str) -> None:
    """Its processes first: a namespace with processes in it outlives ``ip netns del``, veths and all."""
    _kill_netns_processes(netns)
    _check(["ip", "netns", "del", netns])


def remove_stale() -> list[str]:
    """Delete the namespaces (with their processes) and scratch directories of earlier runs whose creating
    process is dead, e.g. killed before its teardown ran. A live owner's are left alone. Returns their names."""
    removed = []
    for line in _check(["ip", "netns", "list"]).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        owner = _NAME.match(name)
        if owner and not psutil.pid_exists(int(owner.group(1))):
            try:
                _delete_netns(name)
            except NetClusterError:
                if Path("/run/netns", name).exists():
                    raise
                continue  # a parallel run removed it first
            removed.append(name)
    for path in Path("/tmp").glob(f"{PREFIX}-*"):
        owner = _NAME.match(path.name)
        if owner and path.is_dir() and not psutil.pid_exists(int(owner.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


@dataclass(frozen=True)
class LinkSpec:
    """How a node's link is shaped, the same each way (the node's egress and its switch port's egress).

    A packet between two nodes crosses both nodes' links: its one-way delay is the sum of the two
    ``delay``s, its rate the smaller ``rate``. ``rate``, ``burst``, ``latency`` and ``delay`` are in
    tc's units ("1gbit", "256kb", "50ms"); ``loss`` is a percentage. None/0 leaves that part out."""

    rate: str | None = None
    delay: str | None = None
    loss: float = 0.0
    burst: str = "256kb"
    latency: str = "50ms"
    limit: int = 10000  # netem's queue in packets: a 1000-packet default drops at Gbit rates with delay

    def qdiscs(self) -> list[list[str]]:
        """The ``tc qdisc add dev <if>`` argument lists, root first: netem (delay, loss) with tbf (rate)
        under it, or either alone."""
        tbf = ["tbf", "rate", self.rate, "burst", self.burst, "latency", self.latency] if self.rate else None
        netem = ["netem"] + (["delay", self.delay] if self.delay else []) + (["loss", f"{self.loss}%"] if self.loss else [])
        if len(netem) == 1:
            return [["root", "handle", "1:", *tbf]] if tbf else []
        netem += ["limit", str(self.limit)]
        return [["root", "handle", "1:", *netem]] + ([["parent", "1:1", "handle", "10:", *tbf]] if tbf else [])


@dataclass(frozen=True)
class Node:
    """One emulated machine: its namespace, its NIC (``ifname``, the GLOO_SOCKET_IFNAME of its ranks), its
    address, and the switch port its cable ends in (``port``, in the bridge's namespace)."""

    index: int
    netns: str
    ifname: str
    ip: str
    port: str


class NetCluster:
    """Nodes in network namespaces joined by one bridge; use as ``with NetCluster(...) as net:``.

    ``links`` is the number of nodes (unshaped links) or one LinkSpec (None: unshaped) per node."""

    def __init__(self, links: int | Sequence[LinkSpec | None]) -> None:
        specs = [None] * links if isinstance(links, int) else list(links)
        if not 1 <= len(specs) <= 254:
            raise ValueError(f"1 to 254 nodes, not {len(specs)}")
        self.prefix = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(2)}"
        self.bridge_netns = f"{self.prefix}-br"
        self.nodes = [Node(i, f"{self.prefix}-n{i}", f"veth{i}", f"{_SUBNET}.{i + 1}", f"port{i}")
                      for i in range(len(specs))]
        self.scratch = Path("/tmp") / self.prefix  # short: Ray's socket paths under it must stay < 108 chars
        self._specs = specs
        self._shaped: dict[int, LinkSpec | None] = {}
        self._procs: list[subprocess.Popen] = []
        self._next_port = _FIRST_MASTER_PORT
        self._restore_sigterm: Callable[[], None] = lambda: None

    def __enter__(self) -> NetCluster:
        remove_stale()
        self._restore_sigterm = _exit_on_sigterm()
        self.scratch.mkdir()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _sysctl(self, netns: str, *settings: str) -> None:
        _check(["ip", "netns", "exec", netns, "sysctl", "-qw", *settings])

    def _build(self) -> None:
        no_ipv6 = ["net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"] \
            if Path("/proc/sys/net/ipv6").exists() else []  # no link-local fe80:: addresses: only 127/8
        br = self.bridge_netns
        _check(["ip", "netns", "add", br])
        if no_ipv6:
            self._sysctl(br, *no_ipv6)
        _check(["ip", "-n", br, "link", "add", "br0", "type", "bridge"])
        _check(["ip", "-n", br, "link", "set", "br0", "up"])
        for node, spec in zip(self.nodes, self._specs):
            _check(["ip", "netns", "add", node.netns])
            # Both ends are made inside their namespaces: their names cannot meet another run's.
            _check(["ip", "link", "add", "name", node.ifname, "netns", node.netns, "type", "veth",
                    "peer", "name", node.port, "netns", br])
            self._sysctl(node.netns, "net.ipv4.conf.all.route_localnet=1",
                         f"net.ipv4.conf.{node.ifname}.route_localnet=1", *no_ipv6)
            _check(["ip", "-n", node.netns, "addr", "add", f"{node.ip}/24", "dev", node.ifname])
            _check(["ip", "-n", node.netns, "link", "set", node.ifname, "up"])
            _check(["ip", "-n", node.netns, "link", "set", "lo", "up"])  # 127.0.0.1 for what binds it
            _check(["ip", "-n", br, "link", "set", node.port, "master", "br0", "up"])
            self.shape(node, spec)

    def close(self) -> None:
        """Kill every process in the cluster's namespaces, delete them and the scratch directory. Safe to
        call twice and on a half-built cluster; raises at the end if anything could not be removed. A second
        SIGTERM during it ends the process at once (``remove_stale`` clears up after it)."""
        self._restore_sigterm()
        self._restore_sigterm = lambda: None
        errors = []
        for proc in self._procs:
            with proc:  # closes its pipes, waits
                if proc.poll() is None:
                    proc.kill()
        existing = set(_check(["ip", "netns", "list"]).stdout.split())
        for netns in [n.netns for n in self.nodes] + [self.bridge_netns]:
            if netns in existing:
                try:
                    _delete_netns(netns)
                except NetClusterError as e:
                    errors.append(str(e))
        shutil.rmtree(self.scratch, ignore_errors=True)
        if errors:
            raise NetClusterError("teardown left things behind: " + "; ".join(errors))

    def shape(self, node: Node, link: LinkSpec | None) -> None:
        """Replace the qdiscs on both ends of ``node``'s link with ``link``'s (None: unshaped)."""
        if link and (link.delay or link.loss) and netem_unavailable():
            raise NetClusterError(f"{link}: {netem_unavailable()}")
        old = self._shaped.get(node.index)
        for netns, dev in ((node.netns, node.ifname), (self.bridge_netns, node.port)):
            if old is not None and old.qdiscs():
                _check(["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"])
            for qdisc in (link.qdiscs() if link else []):
                _check(["tc", "-n", netns, "qdisc", "add", "dev", dev, *qdisc])
        self._shaped[node.index] = link

    def qdiscs(self, node: Node) -> dict[str, str]:
        """``tc qdisc show`` of ``node``'s link: {"node": its NIC's, "switch": its switch port's}."""
        return {"node": _check(["tc", "-n", node.netns, "qdisc", "show", "dev", node.ifname]).stdout,
                "switch": _check(["tc", "-n", self.bridge_netns, "qdisc", "show", "dev", node.port]).stdout}

    def link_bytes(self, node: Node) -> dict[str, int]:
        """Bytes ``node``'s NIC has received and sent: what tells traffic over the link from local traffic."""
        (link,) = json.loads(_check(["ip", "-n", node.netns, "-j", "-s", "link", "show", "dev", node.ifname]).stdout)
        return {"rx": link["stats64"]["rx"]["bytes"], "tx": link["stats64"]["tx"]["bytes"]}

    def partition(self, node: Node) -> None:
        """Cut ``node``'s cable: its switch port goes down, so nothing passes to or from the other nodes."""
        _check(["ip", "-n", self.bridge_netns, "link", "set", node.port, "down"])

    def heal(self, node: Node) -> None:
        """Reconnect a partitioned node."""
        _check(["ip", "-n", self.bridge_netns, "link", "set", node.port, "up"])

    def popen(self, node: Node, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside ``node`` (``ip netns exec`` replaces itself with it: the pid is the command's).
        The cluster kills it at teardown if it still runs."""
        proc = subprocess.Popen(["ip", "netns", "exec", node.netns, *argv], env=env, **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, node: Node, argv: Sequence[str], env: Mapping[str, str] | None = None,
            timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside ``node`` to its end; raises NetClusterError (with its stderr) if it fails."""
        return _check(["ip", "netns", "exec", node.netns, *argv], timeout_s=timeout_s, env=env)

    def pids(self, node: Node) -> list[int]:
        """The processes running inside ``node``."""
        return _netns_pids(node.netns)

    def kill(self, node: Node) -> None:
        """Kill every process inside ``node`` (SIGKILL), as a machine that loses power; its link stays up."""
        _kill_netns_processes(node.netns)

    def free_port(self) -> int:
        """A TCP port not handed out before by this cluster. Each namespace is new and private, so none of
        another run's (or the machine's) processes hold it."""
        self._next_port += 1
        return self._next_port - 1


def python_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment with the repository first on PYTHONPATH, so processes started in a node
    import this checkout's zeroray and tests."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(extra or {})
    return env


# --- gloo ranks -----------------------------------------------------------------------------------------------

_RANK_MAIN = "import sys; from tests.support.netcluster import _rank_main; _rank_main(sys.argv[1])"


def _function_ref(fn: Callable[..., Any]) -> tuple[str, str, str]:
    """How a rank finds ``fn``: (module, file of a script run as __main__ or "", qualified name)."""
    if "<locals>" in fn.__qualname__ or "<lambda>" in fn.__qualname__:
        raise ValueError(f"{fn.__qualname__}: ranks import the function by name; define it at a module's top level")
    if fn.__module__ == "__main__":
        return "__main__", os.path.abspath(sys.modules["__main__"].__file__), fn.__qualname__
    return fn.__module__, "", fn.__qualname__


def _rank_main(job_dir: str) -> None:
    """A rank's entry: join the gloo group (env:// from MASTER_ADDR/PORT, RANK, WORLD_SIZE), run the function,
    write its result to ``rank<r>.pkl``."""
    import importlib
    import runpy

    import torch
    import torch.distributed as dist

    job = Path(job_dir)
    (module, script, qualname), args = pickle.loads((job / "call.pkl").read_bytes())
    if script:  # a script's function: run the script as multiprocessing does, without its __main__ block
        fn = runpy.run_path(script, run_name="__mp_main__")[qualname]
    else:
        fn = importlib.import_module(module)
        for part in qualname.split("."):
            fn = getattr(fn, part)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        (job / f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()


def run_ranks(net: NetCluster, placement: Sequence[Node], fn: Callable[..., Any], *args: Any,
              timeout_s: float = 180.0, env: Mapping[str, str] | None = None) -> list[Any]:
    """``fn(rank, world, *args)`` on one gloo rank per entry of ``placement`` (rank r inside node
    ``placement[r]``); returns each rank's result.

    Each rank is a new interpreter started with ``ip netns exec`` and GLOO_SOCKET_IFNAME set to its node's
    NIC; MASTER_ADDR is rank 0's node. ``fn`` must be importable by name (a module's top level, or the
    running script's). If a rank fails or the time runs out, all are killed; the error names the failed
    ranks, each with the end of its output."""
    job = net.scratch / f"ranks-{secrets.token_hex(4)}"
    job.mkdir()
    (job / "call.pkl").write_bytes(pickle.dumps((_function_ref(fn), args)))
    base = python_env({"MASTER_ADDR": placement[0].ip, "MASTER_PORT": str(net.free_port()),
                       "WORLD_SIZE": str(len(placement)), "OMP_NUM_THREADS": "1", **(env or {})})
    procs = []
    try:
        for rank, node in enumerate(placement):
            with open(job / f"rank{rank}.log", "wb") as log:
                procs.append(net.popen(node, [sys.executable, "-c", _RANK_MAIN, str(job)],
                                       env={**base, "RANK": str(rank), "GLOO_SOCKET_IFNAME": node.ifname},
                                       stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        while not all(p.poll() == 0 for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:  # all that failed by now: the first to fail may not have the lowest rank
                raise RuntimeError("\n".join(f"rank {r} exited with {procs[r].returncode}:\n"
                                             + (job / f"rank{r}.log").read_text(errors="replace")[-2000:]
                                             for r in failed))
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {[r for r, p in enumerate(procs) if p.poll() is None]} still run "
                                   f"after {timeout_s:.0f} s")
            time.sleep(0.05)
        return [pickle.loads((job / f"rank{r}.pkl").read_bytes()) for r in range(len(placement))]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        shutil.rmtree(job, ignore_errors=True)


# --- Ray ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RayCluster:
    """Ray nodes started with ``ray start`` inside a NetCluster's namespaces; the first is the head.

    The driver runs inside the head's namespace (``run_driver``), as on a real cluster's head machine:
    the root namespace has no address on the emulated network. The NetCluster's teardown stops it all."""

    net: NetCluster
    nodes: tuple[Node, ...]
    address: str  # the GCS, <head ip>:<port>
    env: Mapping[str, str]

    def run_driver(self, code: str, timeout_s: float = 180.0) -> subprocess.CompletedProcess[str]:
        """Run Python ``code`` inside the head's namespace with RAY_ADDRESS set (``ray.init()`` joins the
        cluster); raises NetClusterError with its stderr if it fails."""
        return self.net.run(self.nodes[0], [sys.executable, "-c", code], env={**self.env, "RAY_ADDRESS": self.address},
                            timeout_s=timeout_s)


def _ray_env(env: Mapping[str, str] | None) -> dict[str, str]:
    # Nothing of the machine's own Ray set-up: no RAY_ADDRESS, no token (a ~/.ray/auth_token would turn
    # token auth on for the head alone). The emulated network is private to this run.
    ray_env = {k: v for k, v in python_env().items() if k != "RAY_ADDRESS" and not k.startswith("RAY_AUTH")}
    ray_env.update({"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", **(env or {})})
    return ray_env


def _ray_start(node: Node, num_cpus: int, object_store_mb: int) -> list[str]:
    ray = str(Path(sys.executable).with_name("ray"))
    return [ray, "start", f"--node-ip-address={node.ip}", f"--num-cpus={num_cpus}", "--num-gpus=0",
            f"--object-store-memory={object_store_mb * 2**20}", "--disable-usage-stats"]


def start_ray(net: NetCluster, nodes: Sequence[Node] | None = None, *, num_cpus: int = 1,
              object_store_mb: int = 100, env: Mapping[str, str] | None = None,
              timeout_s: float = 180.0) -> RayCluster:
    """Start a Ray node in each of ``nodes`` (default: all), the first as the head; each node's Ray IP is its
    namespace's address. Small on purpose: ``num_cpus`` logical CPUs, a ``object_store_mb`` MB object store
    and no dashboard per node. ``env`` (e.g. RAY_health_check_* settings) is added to every node's.
    ``ray start`` may return before a worker node has registered: a driver waits until ``ray.nodes()``
    lists them all."""
    nodes = tuple(nodes or net.nodes)
    ray_env = _ray_env(env)
    address = f"{nodes[0].ip}:{RAY_GCS_PORT}"
    _start_node(net, nodes[0], _ray_start(nodes[0], num_cpus, object_store_mb)
                + ["--head", f"--port={RAY_GCS_PORT}", "--include-dashboard=false", f"--temp-dir={net.scratch / 'ray'}"],
                ray_env, timeout_s)
    cluster = RayCluster(net, nodes, address, ray_env)
    for node in nodes[1:]:
        join_ray(cluster, node, num_cpus=num_cpus, object_store_mb=object_store_mb, timeout_s=timeout_s)
    return cluster


def join_ray(cluster: RayCluster, node: Node, *, num_cpus: int = 1, object_store_mb: int = 100,
             timeout_s: float = 180.0) -> None:
    """Start a Ray worker node inside ``node``, joined to ``cluster``'s head with the cluster's environment: a
    node added later, or a lost one coming back as a new Ray node (kill what is left in its namespace first,
    ``net.kill(node)``: an old raylet there would hold its ports)."""
    _start_node(cluster.net, node, _ray_start(node, num_cpus, object_store_mb) + [f"--address={cluster.address}"],
                cluster.env, timeout_s)


# What `ray start` prints when its node missed Ray's fixed startup window (the raylet or the GCS did not answer
# in time), which a swamped 2-core machine hits now and then; nothing of the test's set-up is wrong then.
_START_WINDOW_MISSED = ("timed out during startup", "Deadline Exceeded")


def _start_node(net: NetCluster, node: Node, argv: list[str], env: Mapping[str, str], timeout_s: float,
                tries: int = 3) -> None:
    """``ray start`` in ``node``; a start that missed Ray's startup window is tried again from a clean namespace
    (its half-started processes killed), as a node supervisor would."""
    for attempt in range(tries):
        try:
            net.run(node, argv, env=env, timeout_s=timeout_s)
            return
        except NetClusterError as e:
            if attempt == tries - 1 or not any(m in str(e) for m in _START_WINDOW_MISSED):
                raise
            net.kill(node)
