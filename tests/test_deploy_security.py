"""The shipped cluster files open no door: every Ray head they start asks for a token, and every KubeRay pod
meets the Kubernetes "restricted" Pod Security Standard.

- Launcher YAMLs (cluster/*.yaml): each ``ray start`` is run the way ``ray up`` runs it, through bash, with a
  ``ray`` on PATH that records its arguments and environment: head and workers run with
  ``RAY_AUTH_MODE=token``, the token file reaches every node through ``file_mounts``, the dashboard
  listens on localhost, and no security-group rule opens a Ray port to the world.
- A real head, started with what aws-gpu.yaml's command passes to ``ray start`` and a token made by
  ``ray get-auth-token --generate`` and copied as ``file_mounts`` copies it: the job-submission API
  answers 401 without the token, 403 with a wrong one, and runs a job with the right one; without the
  token file the head does not start.
- KubeRay (cluster/kuberay): ``authOptions.mode: token`` on every cluster, no Ray Client port on the head
  Service, storage credentials only in the containers that read them, a NetworkPolicy over every
  zeroray pod, and the restricted profile's checks over every pod as KubeRay creates it (with the
  autoscaler sidecar, the wait-gcs-ready init container and the RayJob submitter it adds).
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from tests.support.deploy import (
    LAUNCHER_YAMLS,
    MARKER,
    RAY,
    ROOT,
    STORAGE_SECRET,
    base_env,
    by_kind,
    cluster_specs,
    end_processes,
    flag,
    manifests,
    ray_start_calls,
)
from tests.support.dist import free_port

RAY_PORTS = {6379: "GCS", 8265: "dashboard", 10001: "Ray Client"}
TOKEN_PATH = "~/.ray/auth_token"  # where `ray get-auth-token --generate` writes it, and where Ray reads it
LOCALHOST = {"127.0.0.1", "localhost"}


# ----------------------------------------------------------------------------------------------------
# Launcher YAMLs


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def launcher_auth_problems(config: dict[str, Any], tmp: Path) -> list[str]:
    """What would let a node of this launcher config answer without the token (empty: nothing)."""
    problems = []
    token_targets = set()
    for role in ("head", "worker"):
        starts = [c for cmd in config[f"{role}_start_ray_commands"] for c in ray_start_calls(cmd, tmp)]
        if len(starts) != 1:
            problems.append(f"{role}: {len(starts)} `ray start` calls, expected 1")
            continue
        argv, env = starts[0]["argv"], starts[0]["env"]
        if env.get("RAY_AUTH_MODE") != "token":
            problems.append(f"{role}: ray start runs with RAY_AUTH_MODE={env.get('RAY_AUTH_MODE')!r}, not 'token'")
        if "RAY_AUTH_TOKEN" in env:
            problems.append(f"{role}: a token written into the YAML (RAY_AUTH_TOKEN)")
        token_targets.add(env.get("RAY_AUTH_TOKEN_PATH", TOKEN_PATH))
        if role == "head" and (flag(argv, "dashboard-host") or "localhost") not in LOCALHOST:
            problems.append(f"head: the dashboard listens on {flag(argv, 'dashboard-host')}, not localhost")
    for target in sorted(token_targets):
        if target not in config.get("file_mounts", {}):
            problems.append(f"the token file {target} is not copied to the nodes (file_mounts)")
    for rule in config["provider"].get("security_group", {}).get("IpPermissions", []):
        world = any(r.get("CidrIp") == "0.0.0.0/0" for r in rule.get("IpRanges", [])) or any(
            r.get("CidrIpv6") == "::/0" for r in rule.get("Ipv6Ranges", []))
        ports = [p for p in RAY_PORTS if rule.get("IpProtocol") == "-1" or rule.get("FromPort", 0) <= p <= rule.get("ToPort", -1)]
        if world and ports:
            problems.append(f"a security group rule opens {', '.join(RAY_PORTS[p] for p in ports)} to the world")
    return problems


@pytest.mark.parametrize("path", LAUNCHER_YAMLS, ids=lambda p: p.name)
def test_launcher_yaml_starts_every_node_with_token_auth(path: Path, tmp_path: Path) -> None:
    assert launcher_auth_problems(load(path), tmp_path) == []


@pytest.mark.parametrize(("change", "problem"), [
    (lambda c: c.update(head_start_ray_commands=[x.replace("RAY_AUTH_MODE=token", "") for x in c["head_start_ray_commands"]]),
     "head: ray start runs with RAY_AUTH_MODE=None"),
    (lambda c: c.update(worker_start_ray_commands=[x.replace("RAY_AUTH_MODE=token", "RAY_AUTH_MODE=disabled")
                                                   for x in c["worker_start_ray_commands"]]),
     "worker: ray start runs with RAY_AUTH_MODE='disabled'"),
    (lambda c: c.update(head_start_ray_commands=[x.replace("--dashboard-host=127.0.0.1", "--dashboard-host=0.0.0.0")
                                                 for x in c["head_start_ray_commands"]]),
     "head: the dashboard listens on 0.0.0.0"),
    (lambda c: c["file_mounts"].pop(TOKEN_PATH), "the token file ~/.ray/auth_token is not copied"),
    (lambda c: c["provider"].update(security_group={"IpPermissions": [
        {"IpProtocol": "tcp", "FromPort": 8000, "ToPort": 9000, "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}]}),
     "a security group rule opens dashboard to the world"),
])
def test_the_launcher_check_finds_an_open_door(change: Callable[[dict], None], problem: str, tmp_path: Path) -> None:
    """What the test above is worth: each way of opening aws-gpu.yaml's head is reported."""
    config = load(ROOT / "cluster" / "aws-gpu.yaml")
    change(config)
    assert any(p.startswith(problem) for p in launcher_auth_problems(config, tmp_path)), problem


def _local_head(start: dict[str, Any], home: Path, temp_dir: str, marker: str) -> tuple[list[str], dict[str, str], str]:
    """The argv and environment of the YAML's head ``ray start`` on this machine: the YAML's environment and
    flags, with free ports instead of its fixed ones, a small object store, no autoscaler (it would call
    the cloud's API) and its own temp dir. The dashboard's host stays the YAML's."""
    replaced = {"port", "object-manager-port", "metrics-export-port", "object-store-memory", "autoscaling-config"}
    argv = [a for a in start["argv"] if a.split("=", 1)[0].removeprefix("--") not in replaced]
    assert all("=" in a or not a.startswith("--") or a == "--head" for a in argv), argv  # only --flag=value forms
    dashboard_port = free_port()
    argv += [f"--port={free_port()}", f"--object-manager-port={free_port()}", f"--metrics-export-port={free_port()}",
             f"--object-store-memory={100 * 2**20}", f"--temp-dir={temp_dir}", "--node-ip-address=127.0.0.1",
             "--include-dashboard=true", f"--dashboard-port={dashboard_port}",
             f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
             f"--runtime-env-agent-port={free_port()}", f"--ray-client-server-port={free_port()}", "--disable-usage-stats"]
    env = base_env(home)
    env.update({k: v for k, v in start["env"].items() if k.startswith("RAY_")})
    env.update({MARKER: marker, "RAY_USAGE_STATS_ENABLED": "0"})
    return [str(RAY), *argv], env, f"http://127.0.0.1:{dashboard_port}"


def _wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f}s"
        time.sleep(0.2)


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=5).status_code == 200
    except requests.RequestException:
        return False


@pytest.mark.timeout(300)  # about 45 s on a busy 2-core machine
def test_the_aws_head_refuses_jobs_without_the_token(tmp_path: Path) -> None:
    config = load(ROOT / "cluster" / "aws-gpu.yaml")
    (start,) = [c for cmd in config["head_start_ray_commands"] for c in ray_start_calls(cmd, tmp_path)]
    laptop, node = tmp_path / "laptop", tmp_path / "node"
    laptop.mkdir()
    made = subprocess.run([str(RAY), "get-auth-token", "--generate"], env=base_env(laptop), capture_output=True,
                          text=True, timeout=120)
    assert made.returncode == 0, made.stderr[-2000:]
    token = made.stdout.strip()
    source = Path(config["file_mounts"][TOKEN_PATH].replace("~", str(laptop), 1))
    target = Path(TOKEN_PATH.replace("~", str(node), 1))
    assert source.read_text().strip() == token
    target.parent.mkdir(parents=True)
    shutil.copy(source, target)  # what `ray up`'s file_mounts does

    marker, temp_dir = uuid.uuid4().hex, tempfile.mkdtemp(prefix="zrauth", dir="/tmp")  # short: Ray's sockets live there
    argv, env, url = _local_head(start, node, temp_dir, marker)
    assert env["RAY_AUTH_MODE"] == "token" and flag(argv, "dashboard-host") == "127.0.0.1"
    try:
        started = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
        assert started.returncode == 0, f"ray start failed: {started.stdout[-2000:]}{started.stderr[-2000:]}"
        _wait_until(lambda: _answers(f"{url}/api/gcs_healthz"), 90, "the dashboard")
        job = {"entrypoint": "python -c \"print('zeroray-token-ok')\""}
        assert requests.post(f"{url}/api/jobs/", json=job, timeout=30).status_code == 401
        assert requests.get(f"{url}/api/jobs/", timeout=30).status_code == 401
        wrong = {"Authorization": f"Bearer {uuid.uuid4().hex}"}
        assert requests.post(f"{url}/api/jobs/", json=job, headers=wrong, timeout=30).status_code == 403
        auth = {"Authorization": f"Bearer {token}"}
        listed = requests.get(f"{url}/api/jobs/", headers=auth, timeout=30)
        assert listed.status_code == 200 and listed.json() == []  # the refused submissions ran nothing
        submitted = requests.post(f"{url}/api/jobs/", json=job, headers=auth, timeout=60)
        assert submitted.status_code == 200, submitted.text
        job_url = f"{url}/api/jobs/{submitted.json()['submission_id']}"

        def finished() -> bool:
            return requests.get(job_url, headers=auth, timeout=30).json()["status"] in ("SUCCEEDED", "FAILED", "STOPPED")

        _wait_until(finished, 180, "the job")
        assert requests.get(job_url, headers=auth, timeout=30).json()["status"] == "SUCCEEDED"
        assert "zeroray-token-ok" in requests.get(f"{job_url}/logs", headers=auth, timeout=30).json()["logs"]
    finally:
        end_processes(marker, temp_dir, grace_s=3.0)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_the_aws_head_does_not_start_without_the_token_file(tmp_path: Path) -> None:
    """A node the token did not reach fails at ``ray start`` instead of running open."""
    config = load(ROOT / "cluster" / "aws-gpu.yaml")
    (start,) = [c for cmd in config["head_start_ray_commands"] for c in ray_start_calls(cmd, tmp_path)]
    node = tmp_path / "node"
    node.mkdir()
    marker, temp_dir = uuid.uuid4().hex, tempfile.mkdtemp(prefix="zrauth", dir="/tmp")
    argv, env, _ = _local_head(start, node, temp_dir, marker)
    try:
        started = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
        assert started.returncode != 0
        assert "Token authentication is enabled but no authentication token was found" in started.stdout + started.stderr
    finally:
        end_processes(marker, temp_dir, grace_s=3.0)
        shutil.rmtree(temp_dir, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------
# KubeRay: authentication and exposure


def kuberay_auth_problems(spec: dict[str, Any]) -> list[str]:
    """What would let this RayClusterSpec's cluster answer without the token, or expose more than
    ``ray job submit`` needs (empty: nothing)."""
    problems = []
    if spec.get("authOptions", {}).get("mode") != "token":
        problems.append(f"authOptions.mode is {spec.get('authOptions', {}).get('mode')!r}, not 'token'")
    if spec.get("authOptions", {}).get("enableK8sTokenAuth"):
        problems.append("enableK8sTokenAuth: KubeRay does not support it for RayJobs")
    templates = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec.get("workerGroupSpecs", [])]
    for template in templates:
        for c in template["spec"].get("containers", []) + template["spec"].get("initContainers", []):
            env = {e["name"]: e for e in c.get("env", [])}
            if "RAY_AUTH_MODE" in env and env["RAY_AUTH_MODE"].get("value") != "token":
                problems.append(f"{c['name']}: RAY_AUTH_MODE={env['RAY_AUTH_MODE'].get('value')!r}")
            if "value" in env.get("RAY_AUTH_TOKEN", {}):
                problems.append(f"{c['name']}: a token written into the manifest (RAY_AUTH_TOKEN)")
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    ports = {p["containerPort"]: p.get("name") for p in head.get("ports", [])}
    if not ports:
        problems.append("the head lists no ports: KubeRay's Service then exposes Ray Client (10001)")
    if 10001 in ports or "client" in ports.values():
        problems.append("the head Service exposes Ray Client (10001)")
    return problems


@pytest.mark.parametrize(("name", "spec"), cluster_specs(), ids=[n for n, _ in cluster_specs()])
def test_kuberay_cluster_requires_the_token_and_exposes_no_ray_client(name: str, spec: dict[str, Any]) -> None:
    assert kuberay_auth_problems(spec) == []
    assert tuple(int(x) for x in spec["rayVersion"].split(".")) >= (2, 52, 0)  # KubeRay's minimum for token auth


@pytest.mark.parametrize(("change", "problem"), [
    (lambda s: s.pop("authOptions"), "authOptions.mode is None"),
    (lambda s: s["authOptions"].update(mode="disabled"), "authOptions.mode is 'disabled'"),
    (lambda s: s["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"].append(
        {"containerPort": 10001, "name": "client"}), "the head Service exposes Ray Client"),
    (lambda s: s["headGroupSpec"]["template"]["spec"]["containers"][0]["env"].append(
        {"name": "RAY_AUTH_TOKEN", "value": "secret"}), "ray-head: a token written into the manifest"),
])
def test_the_kuberay_check_finds_an_open_door(change: Callable[[dict], None], problem: str) -> None:
    (cluster,) = by_kind("RayCluster")
    spec = copy.deepcopy(cluster["spec"])
    change(spec)
    assert any(p.startswith(problem) for p in kuberay_auth_problems(spec)), problem


def kuberay_pods() -> list[tuple[str, dict[str, Any]]]:
    """Every pod template as KubeRay 1.7 creates the pod (controllers/ray/common/pod.go, rayjob_controller.go):
    the head with the autoscaler sidecar (securityContext from autoscalerOptions), each worker with the
    wait-gcs-ready init container (the Ray container's securityContext, env and mounts), and each RayJob's
    submitter (submitterPodTemplate, or KubeRay's default: the head's image, no securityContext)."""
    out = []
    for name, spec in cluster_specs():
        head = copy.deepcopy(spec["headGroupSpec"]["template"])
        if spec.get("enableInTreeAutoscaling"):
            sidecar = {"name": "autoscaler", "image": head["spec"]["containers"][0]["image"]}
            if "securityContext" in spec.get("autoscalerOptions", {}):
                sidecar["securityContext"] = spec["autoscalerOptions"]["securityContext"]
            head["spec"]["containers"].append(sidecar)
        out.append((f"{name}/head", head))
        for group in spec.get("workerGroupSpecs", []):
            worker = copy.deepcopy(group["template"])
            ray_container = worker["spec"]["containers"][0]
            wait = {k: copy.deepcopy(ray_container[k]) for k in ("image", "securityContext", "env", "volumeMounts")
                    if k in ray_container}
            worker["spec"].setdefault("initContainers", []).insert(0, {"name": "wait-gcs-ready", **wait})
            out.append((f"{name}/{group['groupName']}", worker))
    out += [(f"{job['metadata']['name']}/submitter", submitter_template(job)) for job in by_kind("RayJob")]
    return out


def submitter_template(job: dict[str, Any]) -> dict[str, Any]:
    """The pod template of a RayJob's submitter: its submitterPodTemplate, or the one KubeRay makes without it
    (common/job.go GetSubmitterTemplate: the head's image, resources, no securityContext)."""
    if "submitterPodTemplate" in job["spec"]:
        return copy.deepcopy(job["spec"]["submitterPodTemplate"])
    image = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    return {"spec": {"restartPolicy": "Never", "containers": [{"name": "ray-job-submitter", "image": image}]}}


def test_network_policy_admits_only_zeroray_pods_the_operator_and_prometheus() -> None:
    (policy,) = by_kind("NetworkPolicy")
    selector = policy["spec"]["podSelector"]["matchLabels"]
    for name, template in kuberay_pods():
        labels = template.get("metadata", {}).get("labels", {})
        assert selector.items() <= labels.items(), f"{name} is not covered by the NetworkPolicy"
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    scraped = {e["port"] for m in by_kind("PodMonitor") for e in m["spec"]["podMetricsEndpoints"]}
    named = {p["name"]: p["containerPort"] for _, t in kuberay_pods() for c in t["spec"]["containers"] for p in c.get("ports", [])}
    for rule in policy["spec"]["ingress"]:
        peers = rule["from"]
        if peers == [{"podSelector": {"matchLabels": selector}}]:
            continue  # zeroray's own pods: Ray's and NCCL's ports, some chosen at random
        ports = {p["port"] for p in rule["ports"]}  # every other rule names its ports
        assert ports in ({8265}, {named[n] for n in scraped}), rule
        assert not ports & {6379, 10001}


# ----------------------------------------------------------------------------------------------------
# KubeRay: credentials only where they are read


def test_storage_credentials_only_in_the_containers_that_read_them() -> None:
    """The Ray containers of the clusters whose runs go to object storage read the Secret's keys, each by
    name; nothing takes a whole Secret (envFrom), and no other container gets a key."""
    (secret,) = by_kind("Secret")
    assert secret["metadata"]["name"] == STORAGE_SECRET
    s3_clusters = {j["metadata"]["name"] for j in by_kind("RayJob") if "s3://" in j["spec"]["entrypoint"]}
    s3_clusters |= {c["metadata"]["name"] for c in by_kind("RayCluster")}  # a long-running cluster takes any job
    readers = set()
    for name, template in kuberay_pods():
        spec = template["spec"]
        for c in spec["containers"] + spec.get("initContainers", []):
            assert not c.get("envFrom"), f"{name}/{c['name']} takes a whole Secret or ConfigMap (envFrom)"
            refs = {e["valueFrom"]["secretKeyRef"]["key"]: e["valueFrom"]["secretKeyRef"] for e in c.get("env", [])
                    if "secretKeyRef" in e.get("valueFrom", {})}
            if refs:
                assert {r["name"] for r in refs.values()} == {STORAGE_SECRET}, (name, c["name"])
                assert all(r.get("optional") is True for r in refs.values())  # workload identity: no keys at all
                assert set(secret["stringData"]) <= set(refs), (name, c["name"])
                readers.add((name.split("/")[0], c["name"]))
    expected = {(n, c) for n in s3_clusters for c in ("ray-head", "ray-worker", "wait-gcs-ready")}
    assert readers == expected  # wait-gcs-ready: KubeRay copies the worker container's env into it


# ----------------------------------------------------------------------------------------------------
# KubeRay: the "restricted" Pod Security Standard
#
# The checks of https://kubernetes.io/docs/concepts/security/pod-security-standards/ (Kubernetes 1.33),
# "restricted" = "baseline" + its own, over a pod template (metadata + spec): each returns what it forbids.

BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
                         "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
                      "secret"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def _containers(template: dict[str, Any]) -> list[dict[str, Any]]:
    spec = template["spec"]
    return spec.get("containers", []) + spec.get("initContainers", []) + spec.get("ephemeralContainers", [])


def _contexts(template: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The pod's securityContext and each container's, by name."""
    return [("pod", template["spec"].get("securityContext") or {})] + [
        (c["name"], c.get("securityContext") or {}) for c in _containers(template)]


def _sc(container: dict[str, Any], key: str) -> Any:
    return (container.get("securityContext") or {}).get(key)


def check_host_process(t: dict) -> list[str]:
    return [f"{n}: windowsOptions.hostProcess" for n, sc in _contexts(t) if (sc.get("windowsOptions") or {}).get("hostProcess")]


def check_host_namespaces(t: dict) -> list[str]:
    return [k for k in ("hostNetwork", "hostPID", "hostIPC") if t["spec"].get(k)]


def check_privileged(t: dict) -> list[str]:
    return [f"{c['name']}: privileged" for c in _containers(t) if _sc(c, "privileged")]


def check_baseline_capabilities(t: dict) -> list[str]:
    return [f"{c['name']}: adds {cap}" for c in _containers(t)
            for cap in ((_sc(c, "capabilities") or {}).get("add") or []) if cap not in BASELINE_CAPABILITIES]


def check_host_path_volumes(t: dict) -> list[str]:
    return [f"volume {v['name']}: hostPath" for v in t["spec"].get("volumes", []) if "hostPath" in v]


def check_host_ports(t: dict) -> list[str]:
    return [f"{c['name']}: hostPort {p['hostPort']}" for c in _containers(t) for p in c.get("ports", []) if p.get("hostPort")]


def check_apparmor(t: dict) -> list[str]:
    bad = [f"{n}: appArmorProfile {sc['appArmorProfile'].get('type')}" for n, sc in _contexts(t)
           if (sc.get("appArmorProfile") or {}).get("type") not in (None, "RuntimeDefault", "Localhost")]
    return bad + [f"annotation {k}={v}" for k, v in (t.get("metadata", {}).get("annotations") or {}).items()
                  if k.startswith("container.apparmor.security.beta.kubernetes.io/")
                  and v != "runtime/default" and not v.startswith("localhost/")]


def check_selinux(t: dict) -> list[str]:
    bad = []
    for n, sc in _contexts(t):
        options = sc.get("seLinuxOptions") or {}
        if options.get("type", "") not in SELINUX_TYPES or options.get("user") or options.get("role"):
            bad.append(f"{n}: seLinuxOptions {options}")
    return bad


def check_proc_mount(t: dict) -> list[str]:
    return [f"{c['name']}: procMount {_sc(c, 'procMount')}" for c in _containers(t)
            if _sc(c, "procMount") not in (None, "Default")]


def check_seccomp_not_unconfined(t: dict) -> list[str]:
    return [f"{n}: seccompProfile Unconfined" for n, sc in _contexts(t)
            if (sc.get("seccompProfile") or {}).get("type") == "Unconfined"]


def check_sysctls(t: dict) -> list[str]:
    return [f"sysctl {s['name']}" for s in (t["spec"].get("securityContext") or {}).get("sysctls", [])
            if s["name"] not in SAFE_SYSCTLS]


def check_volume_types(t: dict) -> list[str]:
    return [f"volume {v['name']}: {sorted(set(v) - {'name'})}" for v in t["spec"].get("volumes", [])
            if not set(v) - {"name"} <= RESTRICTED_VOLUMES]


def check_privilege_escalation(t: dict) -> list[str]:
    return [f"{c['name']}: allowPrivilegeEscalation is not false" for c in _containers(t)
            if _sc(c, "allowPrivilegeEscalation") is not False]


def check_run_as_non_root(t: dict) -> list[str]:
    pod = (t["spec"].get("securityContext") or {}).get("runAsNonRoot")
    return [f"{c['name']}: runAsNonRoot is not true" for c in _containers(t)
            if _sc(c, "runAsNonRoot") is False or (_sc(c, "runAsNonRoot") is None and pod is not True)]


def check_run_as_user(t: dict) -> list[str]:
    return [f"{n}: runAsUser 0" for n, sc in _contexts(t) if sc.get("runAsUser") == 0]


def check_seccomp_set(t: dict) -> list[str]:
    pod = ((t["spec"].get("securityContext") or {}).get("seccompProfile") or {}).get("type")
    allowed = ("RuntimeDefault", "Localhost")
    return [f"{c['name']}: no RuntimeDefault or Localhost seccomp profile" for c in _containers(t)
            if ((_sc(c, "seccompProfile") or {}).get("type") or pod) not in allowed]


def check_restricted_capabilities(t: dict) -> list[str]:
    bad = []
    for c in _containers(t):
        caps = _sc(c, "capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            bad.append(f"{c['name']}: does not drop ALL capabilities")
        bad += [f"{c['name']}: adds {cap}" for cap in caps.get("add") or [] if cap != "NET_BIND_SERVICE"]
    return bad


RESTRICTED_CHECKS: dict[str, Callable[[dict], list[str]]] = {
    # baseline
    "HostProcess": check_host_process,
    "Host Namespaces": check_host_namespaces,
    "Privileged Containers": check_privileged,
    "Capabilities (baseline)": check_baseline_capabilities,
    "HostPath Volumes": check_host_path_volumes,
    "Host Ports": check_host_ports,
    "AppArmor": check_apparmor,
    "SELinux": check_selinux,
    "/proc Mount Type": check_proc_mount,
    "Seccomp (baseline)": check_seccomp_not_unconfined,
    "Sysctls": check_sysctls,
    # restricted
    "Volume Types": check_volume_types,
    "Privilege Escalation": check_privilege_escalation,
    "Running as Non-root": check_run_as_non_root,
    "Running as Non-root user": check_run_as_user,
    "Seccomp (restricted)": check_seccomp_set,
    "Capabilities (restricted)": check_restricted_capabilities,
}


@pytest.mark.parametrize(("pod", "check"), [(p, c) for p, _ in kuberay_pods() for c in RESTRICTED_CHECKS],
                         ids=[f"{p}-{c}" for p, _ in kuberay_pods() for c in RESTRICTED_CHECKS])
def test_pod_meets_the_restricted_pod_security_standard(pod: str, check: str) -> None:
    template = dict(kuberay_pods())[pod]
    assert RESTRICTED_CHECKS[check](template) == []


def _worker() -> dict[str, Any]:
    return copy.deepcopy(dict(kuberay_pods())["zeroray/gpu"])


def _ray(t: dict) -> dict:
    return t["spec"]["containers"][0]


def _set_sc(t: dict, key: str, value: Any) -> None:
    _ray(t)["securityContext"][key] = value


# One change per check that breaks exactly the rule it names, applied to the GPU worker pod: what the
# checks above are worth. Every check has one.
BREAKS: dict[str, Callable[[dict], None]] = {
    "HostProcess": lambda t: _set_sc(t, "windowsOptions", {"hostProcess": True}),
    "Host Namespaces": lambda t: t["spec"].update(hostNetwork=True),
    "Privileged Containers": lambda t: _set_sc(t, "privileged", True),
    "Capabilities (baseline)": lambda t: _ray(t)["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]),
    "HostPath Volumes": lambda t: t["spec"]["volumes"].append({"name": "h", "hostPath": {"path": "/mnt/nvme/zeroray"}}),
    "Host Ports": lambda t: _ray(t)["ports"].append({"containerPort": 8265, "hostPort": 8265}),
    "AppArmor": lambda t: t.setdefault("metadata", {}).setdefault("annotations", {}).update(
        {"container.apparmor.security.beta.kubernetes.io/ray-worker": "unconfined"}),
    "SELinux": lambda t: _set_sc(t, "seLinuxOptions", {"type": "spc_t"}),
    "/proc Mount Type": lambda t: _set_sc(t, "procMount", "Unmasked"),
    "Seccomp (baseline)": lambda t: _set_sc(t, "seccompProfile", {"type": "Unconfined"}),
    "Sysctls": lambda t: t["spec"]["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
    "Volume Types": lambda t: t["spec"]["volumes"].append({"name": "n", "nfs": {"server": "x", "path": "/"}}),
    "Privilege Escalation": lambda t: _ray(t)["securityContext"].pop("allowPrivilegeEscalation"),
    "Running as Non-root": lambda t: t["spec"]["initContainers"].append(
        {"name": "nvme-permissions", "securityContext": {**_ray(t)["securityContext"], "runAsNonRoot": False}}),
    "Running as Non-root user": lambda t: t["spec"]["initContainers"].append(
        {"name": "nvme-permissions", "securityContext": {**_ray(t)["securityContext"], "runAsUser": 0}}),
    "Seccomp (restricted)": lambda t: t["spec"]["securityContext"].pop("seccompProfile"),
    "Capabilities (restricted)": lambda t: _ray(t)["securityContext"]["capabilities"].update(drop=["NET_RAW"]),
}


@pytest.mark.parametrize("check", list(RESTRICTED_CHECKS))
def test_each_restricted_check_finds_what_it_forbids(check: str) -> None:
    pod = _worker()
    BREAKS[check](pod)
    assert RESTRICTED_CHECKS[check](pod), f"{check} did not see the change"


def test_kuberay_default_submitter_would_not_meet_the_standard() -> None:
    """Why every RayJob sets submitterPodTemplate: the pod KubeRay makes otherwise sets no securityContext."""
    (job,) = [copy.deepcopy(j) for j in by_kind("RayJob") if j["metadata"]["name"] == "zeroray-train-gpt"]
    job["spec"].pop("submitterPodTemplate")
    default = submitter_template(job)
    failing = {name for name, check in RESTRICTED_CHECKS.items() if check(default)}
    assert failing == {"Privilege Escalation", "Running as Non-root", "Seccomp (restricted)", "Capabilities (restricted)"}


def test_every_manifest_pod_is_checked() -> None:
    """kuberay_pods() covers every pod template of every manifest (a new kind with pods must be added)."""
    kinds = {d["kind"] for _, d in manifests()}
    assert kinds <= {"RayCluster", "RayJob", "Secret", "PodMonitor", "ConfigMap", "NetworkPolicy"}, kinds
    heads = {n.split("/")[0] for n, _ in kuberay_pods() if n.endswith("/head")}
    assert heads == {n for n, _ in cluster_specs()}
