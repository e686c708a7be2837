"""Ray gauges that keep their latest values exported while the process lives.

Ray's metrics agent forgets a gauge series that was not set again within about two export intervals
(``metrics_report_interval_ms``, 10 s by default): a core worker sends only the values recorded since
its last export. A rank reports when its loop says so (maybe once a minute) and the controller changes
state rarely, so their series would blink out of Prometheus between updates. A :class:`GaugeSet`
remembers the latest value of each series and a daemon thread sets them again four times an
interval (a busy machine may delay a round), off the training thread.
"""

from __future__ import annotations

import threading
import time

from zeroray.monitoring.metrics import Metric

_FALLBACK_INTERVAL_S = 5.0


def _refresh_interval_s() -> float:
    """A quarter of Ray's export interval (never below 0.25 s)."""
    try:
        import ray

        return max(ray._config.metrics_report_interval_ms() / 4000.0, 0.25)
    except Exception:  # a Ray without that (private) accessor
        return _FALLBACK_INTERVAL_S


def export_interval_s() -> float:
    """Ray's metrics export interval (as far as this process knows it)."""
    return 4 * _refresh_interval_s()


class GaugeSet:
    """``metrics`` as Ray gauges with common ``tags``; :meth:`set` records a value, which the refresh
    thread (started by :meth:`start`, stopped by :meth:`close`) keeps re-sending."""

    def __init__(self, metrics: tuple[Metric, ...], tags: dict[str, str] | None = None) -> None:
        from ray.util.metrics import Gauge

        self.gauges = {m.name: Gauge(m.name, m.description, m.tag_keys) for m in metrics}
        self.tags = dict(tags or {})
        self._latest: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._until: float | None = None  # set by close(linger_s=): when the refresh thread ends

    def set(self, metric: Metric, value: float | None, **extra: str) -> None:
        """Set one series (``tags`` plus ``extra``); None leaves it as it was."""
        if value is None:
            return
        tags = {**self.tags, **extra}
        with self._lock:
            self._latest[(metric.name, tuple(sorted(tags.items())))] = float(value)
        self.gauges[metric.name].set(float(value), tags)

    def refresh(self) -> None:
        """Set every series again to its latest value."""
        with self._lock:
            latest = list(self._latest.items())
        for (name, tags), value in latest:
            self.gauges[name].set(value, dict(tags))

    def start(self) -> None:
        if self._thread is None:
            interval = _refresh_interval_s()
            self._thread = threading.Thread(target=self._run, args=(interval,), name="zeroray-metrics", daemon=True)
            self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.refresh()
            except Exception:  # best effort, as every metric: the next round tries again
                pass
            if self._until is not None and time.monotonic() >= self._until:
                return

    def close(self, linger_s: float = 0.0) -> None:
        """Stop refreshing (the series age out of Ray's agent within two export intervals).

        ``linger_s``: keep re-sending the last values that long first, in the background (a final
        state set just now must live through a few exports to meet a scrape on a busy machine)."""
        if linger_s > 0 and self._thread is not None:
            self._until = time.monotonic() + linger_s  # the (daemon) thread ends by itself then
            self._thread = None
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
