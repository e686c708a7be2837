"""Connecting to Ray: an embedded local cluster when none is connected, else the one at RAY_ADDRESS.

Also the up-front check that the cluster can hold the group at all, so a group that can never be
placed fails in the driver with the numbers instead of waiting forever, and the standing request to
the autoscaler for the nodes an elastic run could use (:class:`AutoscalerDemand`).
"""

from __future__ import annotations

import logging
import os
import socket

import ray

logger = logging.getLogger(__name__)


def ensure_ray(num_cpus: int | None = None) -> None:
    """``ray.init()`` if needed: it connects to RAY_ADDRESS (or a ``ray start`` cluster), else starts one
    (with ``num_cpus`` logical CPUs when given: more than the cores lets more ranks share them).

    The workers of a cluster started here inherit this process's environment; zeroray's own source
    root goes on their PYTHONPATH so a checkout that is not pip-installed works too.
    """
    if ray.is_initialized():
        return
    import zeroray

    root = os.path.dirname(os.path.dirname(os.path.abspath(zeroray.__file__)))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, root])
    address = os.environ.get("RAY_ADDRESS") or None
    if address is None and _stale_cluster_file():
        address = "local"  # ray.init() would wait for the dead cluster instead of starting one
    ray.init(address=address, num_cpus=num_cpus)


def _stale_cluster_file() -> bool:
    """Whether Ray's "last `ray start`" file names a cluster whose GCS no longer answers (a cluster
    that was killed, not stopped, leaves it behind)."""
    from ray._private.services import find_bootstrap_address

    found = find_bootstrap_address(None)
    if not found:
        return False
    host, _, port = found.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return False
    except (OSError, ValueError):
        logger.warning("zeroray: no Ray cluster answers at %s (named by a leftover ray_current_cluster file); "
                       "starting a local one", found)
        return True


def started_here() -> bool:
    """Whether this process started the cluster's head (an embedded cluster: no node can join it)."""
    node = getattr(ray._private.worker, "_global_node", None)
    return bool(getattr(node, "head", False))


def check_fits(num_workers: int, resources_per_worker: dict[str, float]) -> None:
    """Raise when the whole cluster has fewer resources than the group needs.

    On an embedded cluster nothing can join, so this is final; on a connected cluster an autoscaler may
    still add nodes, so it only warns.
    """
    total = ray.cluster_resources()
    missing = {
        k: (v * num_workers, total.get(k, 0.0))
        for k, v in resources_per_worker.items()
        if v * num_workers > total.get(k, 0.0) + 1e-9
    }
    if not missing:
        return
    what = ", ".join(f"{k}: need {need:g}, cluster has {have:g}" for k, (need, have) in missing.items())
    msg = f"ScalingConfig asks for {num_workers} workers x {resources_per_worker}, more than the cluster has ({what})"
    if started_here():
        raise ValueError(msg)
    logger.warning("%s; waiting for the autoscaler to add nodes", msg)


class AutoscalerDemand:
    """The standing request for ``workers`` bundles of ``resources_per_worker`` (a context manager).

    An elastic group grows only onto nodes that exist. On an autoscaling cluster nothing adds them
    unless something asks: the group's placement group asks only for its current size. As Ray Train V2
    does for elastic runs, the trainer asks for ``max`` workers' bundles with
    ``ray.autoscaler.sdk.request_resources`` while the run lasts, and withdraws the request when it ends
    (finished, failed or interrupted), so that the autoscaler gives idle nodes back. Without an
    autoscaler the request changes nothing. ``request_resources`` holds one request per cluster, the
    newest: a job that makes its own request replaces zeroray's, and the other way round.
    """

    def __init__(self, workers: int, resources_per_worker: dict[str, float]) -> None:
        self.bundles = [dict(resources_per_worker) for _ in range(workers)]

    def __enter__(self) -> AutoscalerDemand:
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=self.bundles)
        logger.info("zeroray: asked the autoscaler for room for %d workers of %s", len(self.bundles), self.bundles[0])
        return self

    def __exit__(self, *exc: object) -> None:
        from ray.autoscaler.sdk import request_resources

        try:
            request_resources(bundles=[])
        except Exception as e:  # the cluster may be gone (Ctrl-C during shutdown); the request dies with it
            logger.warning("zeroray: could not withdraw the autoscaler request: %s", e)
