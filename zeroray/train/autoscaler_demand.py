"""Ask the Ray autoscaler for the nodes an elastic run could use.

An elastic group grows only onto nodes that exist. On an autoscaling cluster nothing adds them unless
something asks: the group's placement group asks only for its current size. As Ray Train V2 does for
elastic runs, the trainer asks for ``max`` workers' bundles with ``ray.autoscaler.sdk.request_resources``
while the run lasts, and withdraws the request when it ends (finished, failed or interrupted), so that
the autoscaler gives idle nodes back. Without an autoscaler the request changes nothing.

``request_resources`` holds one request per cluster, the newest: a job that makes its own request
replaces zeroray's, and the other way round.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class AutoscalerDemand:
    """The standing request for ``workers`` bundles of ``resources_per_worker`` (a context manager)."""

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
