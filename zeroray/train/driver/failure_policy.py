"""Failure policy: after a group failure, restart it or give up.

``FailureConfig.max_failures`` counts group failures over the whole run (-1 = no limit). A restart
starts a new group and runs the loop again from its start; ``zt.prepare`` loads the newest committed
checkpoint into the new group, so the loop resumes from ``engine.global_step``. Preemptions (a notice, or the
failure of the ranks a notice named) count apart, against ``FailureConfig.max_preemption_failures``.
"""

from __future__ import annotations

import enum

from zeroray.train.config import FailureConfig
from zeroray.train.errors import WorkerFailure


class FailureDecision(enum.Enum):
    RESTART = "restart"
    RAISE = "raise"


class FailurePolicy:
    """Counts failures and decides; errors in the user's code are retried like lost actors, as in Ray Train."""

    def __init__(self, failure_config: FailureConfig) -> None:
        self.max_failures = failure_config.max_failures
        self.heartbeat_timeout_s = failure_config.worker_heartbeat_timeout_s  # the worker group's watchdog
        self.max_preemptions = failure_config.max_preemption_failures
        self.num_failures = 0
        self.num_preemptions = 0

    def decide(self, failures: list[WorkerFailure]) -> FailureDecision:
        self.num_failures += 1
        if self.max_failures < 0 or self.num_failures <= self.max_failures:
            return FailureDecision.RESTART
        return FailureDecision.RAISE

    def decide_preemption(self) -> FailureDecision:
        """A preemption: counted apart from failures, against ``max_preemption_failures``."""
        self.num_preemptions += 1
        if self.max_preemptions < 0 or self.num_preemptions <= self.max_preemptions:
            return FailureDecision.RESTART
        return FailureDecision.RAISE
