"""cluster/kuberay: every manifest validates strictly against its schema, offline.

- ray.io/v1 RayCluster and RayJob: the openAPIV3Schema of KubeRay's CRDs (vendored from its helm chart
  under tests/data/kuberay, with its LICENSE), and monitoring.coreos.com/v1 PodMonitor: the
  prometheus-operator CRD (vendored beside it).
- The core objects (Secret, ...): Kubernetes' own schemas, from the kubernetes-validate package.

"Strictly" is what the API server does under kubectl's default ``--validate=strict``: a CRD's schema
is structural, and a field it does not declare (in an object without additionalProperties and without
x-kubernetes-preserve-unknown-fields) is an error, not silently pruned. A JSON schema validator
accepts undeclared fields, so :func:`strict_schema` closes every such object first. The top-level
``metadata`` of a custom resource is validated by the server as ObjectMeta, so it is here too.
"""

from __future__ import annotations

import copy
import re
import shlex
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.support.deploy import HEALTH_CHECK, NVME_PATH, ROOT, by_kind, cluster_specs, manifests

CRDS = Path(__file__).resolve().parent / "data" / "kuberay"
K8S_VERSION = "1.33"  # the oldest Kubernetes minor that KubeRay 1.7 supports among kubernetes-validate's
CRD_FILES = {
    ("ray.io/v1", "RayCluster"): CRDS / "ray.io_rayclusters.yaml",
    ("ray.io/v1", "RayJob"): CRDS / "ray.io_rayjobs.yaml",
    ("monitoring.coreos.com/v1", "PodMonitor"): CRDS / "prometheus-operator" / "monitoring.coreos.com_podmonitors.yaml",
}


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of a CRD's structural schema in which every object rejects the fields it does not declare."""
    out = copy.deepcopy(schema)

    def close(node: dict[str, Any]) -> None:
        is_object = node.get("type") == "object" or "properties" in node
        if is_object and "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        if node.get("x-kubernetes-embedded-resource"):  # an embedded object's apiVersion/kind/metadata are implicit
            node.setdefault("properties", {}).update(
                {"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"}})
        for child in node.get("properties", {}).values():
            close(child)
        for key in ("items", "additionalProperties", "not"):
            if isinstance(node.get(key), dict):
                close(node[key])
        for key in ("allOf", "anyOf", "oneOf"):
            for child in node.get(key, []):
                close(child)

    metadata = out["properties"].pop("metadata")
    close(out)
    out["properties"]["metadata"] = metadata  # validated as ObjectMeta by validate_object_meta
    return out


@cache
def crd_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    crd = yaml.load(CRD_FILES[(api_version, kind)].read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert crd["spec"]["names"]["kind"] == kind
    version = api_version.split("/")[1]
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    return jsonschema.Draft7Validator(strict_schema(served["schema"]["openAPIV3Schema"]))


def validate_object_meta(meta: dict[str, Any]) -> None:
    """A custom resource's metadata, against Kubernetes' ObjectMeta (strict)."""
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta}, K8S_VERSION, strict=True)


def validate_manifest(obj: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError when ``obj`` does not validate strictly."""
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key in CRD_FILES:
        crd_validator(*key).validate(obj)
        validate_object_meta(obj["metadata"])
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_manifests_are_there() -> None:
    kinds = sorted(d["kind"] for _, d in manifests())
    assert kinds == ["ConfigMap", "NetworkPolicy", "PodMonitor", "PodMonitor", "RayCluster", "RayJob", "RayJob", "Secret"]


@pytest.mark.parametrize(("name", "obj"), manifests(), ids=[n for n, _ in manifests()])
def test_manifest_validates_strictly(name: str, obj: dict[str, Any]) -> None:
    validate_manifest(obj)


def _set(obj: dict, path: str, value: Any) -> dict:
    """A copy of ``obj`` with ``value`` at ``path`` (dot-separated; integers index lists)."""
    out = copy.deepcopy(obj)
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node = out
    for p in parents:
        node = node[p]
    node[last] = value
    return out


@pytest.mark.parametrize(("kind", "path", "value", "error"), [
    ("RayCluster", "spec.workerGroupSpecs.0.maxReplica", 3, "'maxReplica' was unexpected"),
    ("RayCluster", "spec.headGroupSpec.template.spec.containers.0.imagePullPolice", "Always",
     "'imagePullPolice' was unexpected"),
    ("RayCluster", "spec.workerGroupSpecs.0.template.spec.volumes.0.emptyDir.medum", "Memory",
     "'medum' was unexpected"),
    ("RayCluster", "spec.workerGroupSpecs.0.maxReplicas", "four", "'four' is not of type 'integer'"),
    ("RayCluster", "metadata.labelz", {"a": "b"}, "'labelz' was unexpected"),
    ("RayJob", "spec.entrypoints", "python x.py", "'entrypoints' was unexpected"),
    ("RayJob", "spec.rayClusterSpec.headGroupSpec.template.spec.securityContext.runAsNonRot",
     True, "'runAsNonRot' was unexpected"),
    ("RayJob", "spec.rayClusterSpec.authOptions.mode", "tokens", "'tokens' is not one of"),
    ("NetworkPolicy", "spec.ingress.0.form", [], "'form' was unexpected"),
    ("PodMonitor", "spec.podMetricsEndpoints.0.prot", "metrics", "'prot' was unexpected"),
    ("Secret", "strinData", {"k": "v"}, "'strinData' was unexpected"),
])
def test_unknown_fields_and_wrong_types_are_rejected(kind: str, path: str, value: Any, error: str) -> None:
    obj = next(d for d in by_kind(kind) if d["metadata"]["name"] != "zeroray-finetune-hf")  # RayJob: train-gpt
    bad = _set(obj, path, value)
    with pytest.raises(jsonschema.ValidationError, match=re.escape(error)):
        validate_manifest(bad)


def test_strict_schema_keeps_open_maps_and_preserved_fields_open() -> None:
    schema = {"type": "object", "properties": {
        "metadata": {"type": "object"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        "closed": {"type": "object", "properties": {"a": {"type": "integer"}}},
    }}
    v = jsonschema.Draft7Validator(strict_schema(schema))
    assert v.is_valid({"metadata": {"anything": 1}, "labels": {"x": "y"}, "free": {"z": 1}, "closed": {"a": 1}})
    assert not v.is_valid({"closed": {"a": 1, "b": 2}})
    assert not v.is_valid({"labels": {"x": 1}})
    assert not v.is_valid({"other": 1})


def test_rayjob_train_gpt_runs_the_raycluster_spec() -> None:
    """One cluster definition: the batch job's own cluster is the long-running one's."""
    (cluster,) = by_kind("RayCluster")
    job = next(j for j in by_kind("RayJob") if j["metadata"]["name"] == "zeroray-train-gpt")
    assert job["spec"]["rayClusterSpec"] == cluster["spec"]


def test_entrypoints_run_examples_with_flags_they_take() -> None:
    for job in by_kind("RayJob"):
        argv = shlex.split(job["spec"]["entrypoint"])
        assert argv[0] == "python" and argv[1].startswith("/home/ray/zeroray/"), argv  # the image's checkout
        script = ROOT / argv[1].removeprefix("/home/ray/zeroray/")
        assert script.is_file(), script
        flags = set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", script.read_text()))
        used = {a for a in argv[2:] if a.startswith("--")}
        assert used <= flags, (script.name, used - flags)


def test_runtime_env_pip_packages_are_the_tested_versions() -> None:
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line)
    for job in by_kind("RayJob"):
        for req in (yaml.safe_load(job["spec"].get("runtimeEnvYAML", "")) or {}).get("pip", []):
            name, version = req.split("==")
            assert pins[name] == version, (job["metadata"]["name"], req)


def test_gpu_workers_scale_and_have_shared_memory_and_nvme() -> None:
    for name, spec in cluster_specs():
        for group in spec.get("workerGroupSpecs", []):
            assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], name
            pod = group["template"]["spec"]
            (container,) = pod["containers"]
            assert container["resources"]["limits"]["nvidia.com/gpu"] == container["resources"]["requests"]["nvidia.com/gpu"]
            volumes = {v["name"]: v for v in pod["volumes"]}
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory", name
            assert NVME_PATH in mounts and "emptyDir" in volumes[mounts[NVME_PATH]], name  # the pod's own, no hostPath
        if spec.get("workerGroupSpecs"):
            assert spec["enableInTreeAutoscaling"] is True, name


def test_heads_run_no_ranks_and_share_the_health_check() -> None:
    for name, spec in cluster_specs():
        head = spec["headGroupSpec"]
        env = {e["name"]: e.get("value") for e in head["template"]["spec"]["containers"][0]["env"]}
        assert {k: env.get(k) for k in HEALTH_CHECK} == HEALTH_CHECK, name
        if spec.get("workerGroupSpecs"):
            assert head["rayStartParams"]["num-cpus"] == "0", name


def test_pod_monitors_select_the_ray_pods_and_their_metrics_ports() -> None:
    ports: dict[str, set[str]] = {"head": set(), "worker": set()}
    for name, spec in cluster_specs():
        groups = [("head", spec["headGroupSpec"])] + [("worker", g) for g in spec.get("workerGroupSpecs", [])]
        for kind, group in groups:
            assert group["template"]["metadata"]["labels"]["app.kubernetes.io/part-of"] == "zeroray", name
            ports[kind] |= {p["name"] for c in group["template"]["spec"]["containers"] for p in c.get("ports", [])}
    for monitor in by_kind("PodMonitor"):
        labels = monitor["spec"]["selector"]["matchLabels"]
        assert labels["app.kubernetes.io/part-of"] == "zeroray"
        assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= ports[labels["ray.io/node-type"]]


def test_grafana_sidecar_config_map_holds_the_committed_dashboard() -> None:
    import json

    (cm,) = by_kind("ConfigMap")
    assert cm["metadata"]["labels"] == {"grafana_dashboard": "1"}
    (monitor,) = {m["metadata"]["namespace"] for m in by_kind("PodMonitor")}
    assert cm["metadata"]["namespace"] == monitor  # beside the Prometheus stack's Grafana
    committed = (ROOT / "dashboards" / "zeroray-overview.json").read_text()
    assert cm["data"] == {"zeroray-overview.json": committed}
    assert json.loads(committed)["title"] == "zeroray overview"
