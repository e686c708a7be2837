"""The controller's Ray metrics: its state, the group's world size, attempts, failures and resizes.

A :class:`ControllerCallback` in the driver, next to the history and run.json callbacks, so the
controller itself stays free of side effects. The state is exported as Ray's dashboards export
enums: one series per state, 1 for the current one and 0 for the others.
"""

from __future__ import annotations

import logging

from zeroray.monitoring import metrics as M
from zeroray.monitoring.gauges import GaugeSet, export_interval_s
from zeroray.train.driver import state as S
from zeroray.train.driver.callbacks import ControllerCallback

logger = logging.getLogger(__name__)

CONTROLLER_METRICS = (M.CONTROLLER_STATE, M.WORLD_SIZE, M.ATTEMPTS, M.FAILURES, M.RESIZES)


class ControllerMetrics(ControllerCallback):
    """Gauges of one ``fit()``'s controller, tagged with the run's name."""

    def __init__(self, run: str) -> None:
        self.attempts = self.failures = self.resizes = 0
        self._warned = False
        try:
            self.gauges: GaugeSet | None = GaugeSet(CONTROLLER_METRICS, {"run": run})
        except Exception:  # no metrics in this Ray connection: the run goes on without them
            self.gauges = None
            self._warn()

    def after_state_change(self, previous: S.ControllerState | None, current: S.ControllerState) -> None:
        """Count what the new state means, then export; never raises into the controller."""
        if isinstance(current, S.Scheduling):
            self.attempts += 1
        elif isinstance(current, S.Restarting):
            self.failures += 1
        elif isinstance(current, S.Errored) and isinstance(previous, S.Running | S.Scheduling):
            self.failures += 1  # the failure the policy did not restart from
        elif isinstance(current, S.Resizing):
            self.resizes += 1
        if self.gauges is None:
            return
        if isinstance(current, S.Scheduling):
            self._set(M.WORLD_SIZE, current.decision.num_workers)
        self._set(M.ATTEMPTS, self.attempts)
        self._set(M.FAILURES, self.failures)
        self._set(M.RESIZES, self.resizes)
        for t in S.StateType:
            self._set(M.CONTROLLER_STATE, 1.0 if t is current.type else 0.0, state=t.value)
        if current.is_terminal:  # the final values are re-sent for 3 export intervals, then age out
            self.gauges.close(linger_s=3 * export_interval_s())
        else:
            self.gauges.start()

    def _set(self, metric: M.Metric, value: float, **extra: str) -> None:
        try:
            self.gauges.set(metric, value, **extra)
        except Exception:  # metrics are best effort; the run goes on
            self._warn()

    def _warn(self) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("zeroray: could not export the controller's Ray metrics", exc_info=True)
