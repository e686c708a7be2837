"""What the deployment files must agree on, shared by the KubeRay, launcher and security tests, and the
teardown of a test's own local Ray cluster (the autoscaling and security tests), found by a marker."""

from __future__ import annotations

import copy
import json
import os
import signal
import stat
import subprocess
import sys
import time
import uuid
from functools import cache
from pathlib import Path
from typing import Any

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBERAY = ROOT / "cluster" / "kuberay"
LAUNCHER_YAMLS = sorted((ROOT / "cluster").glob("*.yaml"))
RAY = Path(sys.executable).parent / "ray"

# Ray's health check, set on every head (the KubeRay manifests and the launcher YAMLs alike).
HEALTH_CHECK = {"RAY_health_check_period_ms": "5000", "RAY_health_check_timeout_ms": "10000",
                "RAY_health_check_failure_threshold": "6"}
NVME_PATH = "/mnt/nvme/zeroray"  # where the worker nodes' NVMe is mounted, for offload_*.nvme_path
STORAGE_SECRET = "zeroray-storage"  # the object-storage credentials (cluster/kuberay/storage-secret.yaml)
MARKER = "ZERORAY_DEPLOY_TEST_CLUSTER"  # in the environment of a test cluster's processes: its token


def manifests() -> list[tuple[str, dict[str, Any]]]:
    """Every object of every file in cluster/kuberay, named ``<file>:<kind>/<name>``: a fresh copy for each
    caller, which may change it."""
    return copy.deepcopy(_parsed_manifests())


@cache
def _parsed_manifests() -> list[tuple[str, dict[str, Any]]]:
    """Parsed once per session: the Grafana ConfigMap alone takes a pure-Python YAML parser most of a second."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    out = []
    for path in sorted(KUBERAY.glob("*.yaml")):
        out += [(f"{path.name}:{d['kind']}/{d['metadata']['name']}", d)
                for d in yaml.load_all(path.read_text(), Loader=loader) if d]
    return out


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [d for _, d in manifests() if d["kind"] == kind]


def cluster_specs() -> list[tuple[str, dict[str, Any]]]:
    """Every RayClusterSpec: the RayClusters' and the RayJobs' own."""
    return ([(d["metadata"]["name"], d["spec"]) for d in by_kind("RayCluster")]
            + [(d["metadata"]["name"], d["spec"]["rayClusterSpec"]) for d in by_kind("RayJob")])


def pod_specs(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [spec["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in spec.get("workerGroupSpecs", [])]


# Launcher YAMLs: what their start commands hand `ray start`. The shim stands in for `ray` on PATH and
# records every call of one command, as {"argv": [...], "env": {...}} lines.
SHIM = """#!/bin/sh
exec "{python}" -c 'import json, os, sys
with open(os.environ["ZR_CAPTURE"], "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "env": dict(os.environ)}}) + "\\n")' "$@"
"""


def base_env(home: Path) -> dict[str, str]:
    """This process's environment without anything that would choose a cluster or a token for Ray."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("RAY_AUTH")}
    env["HOME"] = str(home)
    return env


def ray_start_calls(command: str, tmp: Path) -> list[dict[str, Any]]:
    """The ``ray start`` calls that ``command`` (one of a YAML's start commands) makes when bash runs it as the
    node updater does, each as {"argv", "env"}: bash's own expansion, not a parse of the text."""
    shim_dir, home = tmp / "shim", tmp / "home"
    shim_dir.mkdir(exist_ok=True)
    home.mkdir(exist_ok=True)
    shim = shim_dir / "ray"
    shim.write_text(SHIM.format(python=sys.executable))
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    capture = tmp / f"capture-{uuid.uuid4().hex}.jsonl"
    env = base_env(home)
    env.update(PATH=f"{shim_dir}{os.pathsep}{env['PATH']}", ZR_CAPTURE=str(capture), RAY_HEAD_IP="10.0.0.10")
    subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=60, cwd=tmp)
    calls = [json.loads(line) for line in capture.read_text().splitlines()] if capture.exists() else []
    return [c for c in calls if c["argv"][:1] == ["start"]]


def flag(argv: list[str], name: str) -> str | None:
    """The value of ``--name=value`` or ``--name value`` in ``argv``."""
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return None


# A local cluster a test started: its processes, and their end.
def cluster_processes(token: str, temp_dir: str) -> list[psutil.Process]:
    """Every live process of this cluster: its environment carries the marker, or it writes under the
    cluster's temp dir (each Ray process sends its output to the session's log files there). Both,
    because Ray's renamed processes (``ray::DashboardAgent``, ``ray::IDLE``) overwrite the memory that
    /proc shows as their environment."""
    prefix = temp_dir.rstrip("/") + "/"
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            ours = proc.environ().get(MARKER) == token or any(
                prefix in arg for arg in proc.cmdline()) or any(
                os.readlink(f"/proc/{proc.pid}/fd/{fd}").startswith(prefix)
                for fd in os.listdir(f"/proc/{proc.pid}/fd"))
        except (psutil.Error, OSError):
            continue
        if ours:
            found.append(proc)
    return found


def end_processes(token: str, temp_dir: str, grace_s: float = 10.0, timeout_s: float = 60.0) -> None:
    """SIGTERM each process of the cluster, SIGKILL what still runs ``grace_s`` later; again for any
    process started meanwhile, until none is left or ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    first_seen: dict[int, float] = {}
    while time.monotonic() < deadline:
        procs = cluster_processes(token, temp_dir)
        if not procs:
            return
        now = time.monotonic()
        for p in procs:
            late = now - first_seen.setdefault(p.pid, now) >= grace_s
            try:
                p.send_signal(signal.SIGKILL if late else signal.SIGTERM)
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=1.0)
