"""Shared pytest fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[dict[str, str]]:
    """One real local Ray cluster for the whole session (4 logical CPUs, dashboard on for the state API).

    Its workers get the repo root on PYTHONPATH so they import zeroray and the test modules (package
    ``tests``) whose loop functions they run. Yields {"address": GCS address, "metrics_url": the node's Prometheus endpoint}.
    """
    import ray

    os.environ["PYTHONPATH"] = os.pathsep.join(
        [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(REPO_ROOT)]
    )
    ray.init(
        address="local",  # a new cluster even when a `ray start` one runs on this machine (ray.init would join it)
        num_cpus=4,
        include_dashboard=True,
        configure_logging=False,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    node = ray._private.worker.global_worker.node
    try:
        yield {
            "address": ray.get_runtime_context().gcs_address,
            "metrics_url": f"http://{node.node_ip_address}:{node.metrics_export_port}/metrics",
        }
    finally:
        ray.shutdown()


# Ray's node health check, tightened for the multi-node tests: a node lost without warning is declared dead
# after about threshold x period (Ray's defaults: 5 x 3 s, plus a 10 s timeout per check).
HEALTH_CHECK_CONFIG = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}


@pytest.fixture(scope="module")
def ray_multinode() -> Iterator[object]:
    """A simulated multi-node Ray cluster (``ray.cluster_utils.Cluster``): a head with no CPUs and two worker
    nodes of 1 CPU each, with a fast health check. This process does not connect to it (it may already be
    connected to ``ray_cluster``); drivers connect to ``cluster.address`` from a subprocess, and the test
    adds and removes nodes. Ray's address file is left alone, so no other ``ray.init()`` on this machine
    connects to it by accident."""
    import ray._private.utils
    from ray.cluster_utils import Cluster

    os.environ["PYTHONPATH"] = os.pathsep.join(
        [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(REPO_ROOT)]
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ray._private.utils, "write_ray_address", lambda *a, **k: None)
        cluster = Cluster(
            initialize_head=True,
            connect=False,
            head_node_args={"num_cpus": 0, "include_dashboard": False, "_system_config": HEALTH_CHECK_CONFIG},
        )
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        yield cluster
    finally:
        # Not cluster.shutdown(): it also resets this process's internal KV and deletes Ray's address file.
        cluster.global_state.disconnect()  # no client of this process keeps calling a GCS that is gone
        for node in list(cluster.worker_nodes):
            cluster.remove_node(node, allow_graceful=False)
        cluster.remove_node(cluster.head_node, allow_graceful=False)
