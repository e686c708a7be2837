"""Shared pytest fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Skipped tests say why in the default output (as ``-rs``): a skip for a missing tool (prometheus,
    chromium) names the tool and how to install it, so a quiet ``pytest -q`` does not hide a gap. ``-rN``
    (report nothing) is left alone.

    And torch's device context learns its factory functions now, before any test runs: torch caches them the
    first time a ``with torch.device(...)`` block makes a tensor, and transformers' ``from_pretrained`` (test_export_hf)
    swaps ``torch.linspace`` for a wrapper inside such a block. Were that the first, the cache would hold the
    wrapper, and ``torch.linspace`` under ``torch.device("meta")`` would make CPU tensors for the rest of the
    session (test_engine_meta after it would fail)."""
    import torch

    with torch.device("meta"):
        torch.empty(0)
    chars = config.option.reportchars or ""
    if "N" not in chars and not {"s", "a", "A"} & set(chars):
        config.option.reportchars = chars + "s"


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[dict[str, str]]:
    """One real local Ray cluster for the whole session (4 logical CPUs, dashboard on for the state API).

    Its workers get the repo root on PYTHONPATH so they import zeroray and the test modules (package
    ``tests``, with tests.support) whose loop functions they run. Yields {"address": GCS address, "metrics_url": the node's Prometheus endpoint}.
    """
    import ray

    os.environ["PYTHONPATH"] = os.pathsep.join(
        [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(REPO_ROOT)]
    )
    for attempt in range(3):
        try:
            ray.init(
                address="local",  # a new cluster even when a `ray start` one runs on this machine (ray.init would join it)
                num_cpus=4,
                include_dashboard=True,
                configure_logging=False,
                _system_config={"metrics_report_interval_ms": 1000},
            )
            break
        except Exception as e:  # Ray gives its raylet a fixed 30 s to register; a swamped machine can miss it
            ray.shutdown()
            if "timed out during startup" not in str(e) or attempt == 2:
                raise
    node = ray._private.worker.global_worker.node
    try:
        yield {
            "address": ray.get_runtime_context().gcs_address,
            "metrics_url": f"http://{node.node_ip_address}:{node.metrics_export_port}/metrics",
        }
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def s3() -> Iterator[dict[str, Any]]:
    """A real S3 endpoint on loopback for the session (tests.support.s3.moto_bucket), one bucket that each
    test uses under a prefix of its own. Yields {"bucket": the bucket's URL, "options": fsspec storage
    options for it}."""
    from tests.support.s3 import moto_bucket

    with moto_bucket() as bucket:
        yield bucket


@pytest.fixture
def needs_namespaces() -> None:
    """Skip, naming why, where the emulated multi-node cluster (tests/support/netcluster.py) cannot be made."""
    from tests.support.netcluster import unavailable

    why = unavailable()
    if why:
        pytest.skip(f"no emulated cluster here: {why}")
