"""cluster/*.yaml, the Ray cluster launcher configs: each passes Ray's own validation, as ``ray up`` runs
it (``prepare_config`` merges the provider's defaults, ``validate_config`` checks ray-schema.json, whose
objects reject unknown keys), and each sets what zeroray wants the same way."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from tests.support.deploy import HEALTH_CHECK, LAUNCHER_YAMLS, NVME_PATH, ROOT, flag, ray_start_calls

CLOUD_YAMLS = [p for p in LAUNCHER_YAMLS if yaml.safe_load(p.read_text())["provider"]["type"] != "local"]


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def pins() -> dict[str, str]:
    """The versions constraints.txt pins, by lower-case name."""
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            out[name.strip().lower()] = version.strip()
    return out


def test_the_targets_are_there() -> None:
    assert [p.name for p in LAUNCHER_YAMLS] == ["aws-gpu.yaml", "gcp-gpu.yaml", "onprem.yaml"]
    assert sorted(load(p)["provider"]["type"] for p in LAUNCHER_YAMLS) == ["aws", "gcp", "local"]


@pytest.mark.parametrize("path", LAUNCHER_YAMLS, ids=lambda p: p.name)
def test_ray_validates_the_launcher_yaml(path: Path) -> None:
    config = prepare_config(load(path))
    validate_config(config)
    assert config["head_node_type"] in config["available_node_types"]


def test_ray_validation_rejects_an_unknown_key() -> None:
    """What the test above is worth: a misspelt key does not pass."""
    config = load(ROOT / "cluster" / "aws-gpu.yaml")
    config["available_node_types"]["ray.worker.gpu"]["max_worker"] = 2
    with pytest.raises(jsonschema.ValidationError, match="'max_worker' was unexpected"):
        validate_config(prepare_config(config))


@pytest.mark.parametrize("path", LAUNCHER_YAMLS, ids=lambda p: p.name)
def test_health_check_object_store_and_metrics_port(path: Path) -> None:
    config = load(path)
    (head_start,) = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    (worker_start,) = [c for c in config["worker_start_ray_commands"] if "ray start" in c]
    env = dict(w.split("=", 1) for w in head_start.split() if w.startswith("RAY_"))
    assert {k: v for k, v in env.items() if k != "RAY_AUTH_MODE"} == HEALTH_CHECK  # auth: test_deploy_security.py
    for start in (head_start, worker_start):
        assert "--metrics-export-port=8080" in start


@pytest.mark.parametrize("path", LAUNCHER_YAMLS, ids=lambda p: p.name)
def test_object_store_is_a_tenth_of_the_node_memory_as_its_shell_computes_it(path: Path, tmp_path: Path) -> None:
    """The start commands size the object store with awk on the node. mawk (Ubuntu's awk, and this
    machine's) prints ``%d`` of any number above 2**31 - 1 as 2147483647: every node with more than 20 GiB
    got a 2 GiB object store. The commands run through bash here, with this machine's awk."""
    mem_kib = int(re.search(r"^MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)[1])
    config = load(path)
    for role in ("head", "worker"):
        (start,) = [c for cmd in config[f"{role}_start_ray_commands"] for c in ray_start_calls(cmd, tmp_path)]
        assert int(flag(start["argv"], "object-store-memory")) == pytest.approx(mem_kib * 1024 * 0.10, abs=1), role


@pytest.mark.parametrize("path", LAUNCHER_YAMLS, ids=lambda p: p.name)
def test_installs_this_checkout_with_the_tested_versions(path: Path) -> None:
    config = load(path)
    (target,) = [t for t, src in config["file_mounts"].items() if src == "."]
    commands = " ".join(config["setup_commands"])
    assert f"-c {target}/constraints.txt" in commands.replace("~/zeroray", target)
    torch = re.search(r"torch==(\S+) --index-url https://download.pytorch.org/whl/(cu\d+)", commands)
    assert torch and torch[1] == pins()["torch"], commands
    assert NVME_PATH in " ".join(config["initialization_commands"] + config["setup_commands"])
    image = config.get("docker", {}).get("image")
    if image:  # Ray's image: the pinned Ray, and the CUDA that torch's wheel is built for
        assert image == f"rayproject/ray:{pins()['ray']}-py311-{torch[2]}"


def test_image_dockerfile_matches_the_launcher_images() -> None:
    dockerfile = (ROOT / "cluster" / "docker" / "Dockerfile").read_text()
    base = re.search(r"^FROM (\S+)", dockerfile, re.M)[1]
    assert {load(p)["docker"]["image"] for p in CLOUD_YAMLS} == {base}
    assert f"torch=={pins()['torch']} --index-url https://download.pytorch.org/whl/{base.rsplit('-', 1)[1]}" in dockerfile
    assert pins()["ray"] == ray.__version__


@pytest.mark.parametrize("path", CLOUD_YAMLS, ids=lambda p: p.name)
def test_cloud_head_runs_no_ranks_and_gpu_workers_scale_from_zero(path: Path) -> None:
    config = prepare_config(load(path))
    types = config["available_node_types"]
    assert types[config["head_node_type"]]["resources"] == {"CPU": 0}
    workers = {k: v for k, v in types.items() if k != config["head_node_type"]}
    assert set(workers) == {"ray.worker.gpu", "ray.worker.gpu.spot"}
    for node_type in workers.values():
        assert node_type["min_workers"] == 0 < node_type["max_workers"]
        assert node_type["resources"]["GPU"] > 0
    assert config["max_workers"] == sum(t["max_workers"] for t in workers.values())
    spot = workers["ray.worker.gpu.spot"]["node_config"]
    assert spot.get("InstanceMarketOptions", {}).get("MarketType") == "spot" or \
        spot.get("scheduling", {}).get("provisioningModel") == "SPOT"
