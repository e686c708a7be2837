"""Ray metrics exported by each rank actor, so the Ray dashboard / Prometheus / Grafana show the run.

Every metric is declared in :mod:`zeroray.monitoring.metrics` (Ray serves ``zeroray_x`` as
``ray_zeroray_x``), tagged with the run, the rank, the node's IP and the ZeRO stage. The values are
what the report already holds (:class:`RankStats`: memory, phase times, bytes per collective) and
what the engine already computed (learning rate, gradient norm, loss scale): exporting them adds no
synchronization to the step.

Throughput and MFU come from the loop's metrics when it gives them: ``tokens`` (a running total of
the tokens this rank trained on), ``flops_per_sample`` (training FLOPs per sample, when zeroray
cannot count them: it counts zeroray's GPT and Hugging Face Llama-like models from their config) and
``peak_flops`` (the device's peak FLOP/s; known for common GPUs, never assumed on a CPU).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from zeroray.monitoring import flops
from zeroray.monitoring import metrics as M
from zeroray.monitoring.gauges import GaugeSet
from zeroray.train.report import RankStats, finite_or_none
from zeroray.train.worker.context import ReportCallback

logger = logging.getLogger(__name__)

RANK_METRICS = (
    M.STEP, M.REPORTS, M.LOSS, M.LEARNING_RATE, M.GRAD_NORM, M.LOSS_SCALE, M.SKIPPED_STEPS, M.STEP_TIME,
    M.PHASE_TIME, M.SAMPLES_PER_SECOND, M.TOKENS_PER_SECOND, M.MFU, M.MEMORY, M.COMM_BYTES, M.COMM_BANDWIDTH,
    M.CHECKPOINT_SAVE_SECONDS, M.CHECKPOINT_STALL_SECONDS, M.CHECKPOINT_BYTES, M.CHECKPOINT_SAVES,
    M.CHECKPOINT_LOAD_SECONDS, M.CHECKPOINT_LOAD_BYTES, M.SNAPSHOT_STALL_SECONDS, M.OFFLOAD_BYTES, M.OFFLOAD_BANDWIDTH,
)


def _rate(total: int, before: int | None, interval: float | None) -> float | None:
    """Bytes per second between two cumulative counts (None at the first or after a reset)."""
    if not interval or before is None or total < before:
        return None
    return (total - before) / interval


class _Interval:
    """The previous report's wall time and counters, for rates over one report interval."""

    def __init__(self) -> None:
        self.time: float | None = None
        self.comm: dict[str, int] = {}
        self.offload: dict[str, int] = {}
        self.tokens: float | None = None


class RankMetrics(ReportCallback):
    """Gauges for one rank, updated on every ``zt.report`` (a callback of the rank's reports: each
    rank exports its own values from its own process)."""

    def __init__(self, run: str, rank: int) -> None:
        from ray.util import get_node_ip_address

        self.run, self.rank = run, rank
        self.node = get_node_ip_address()
        self.gauges = GaugeSet(RANK_METRICS)  # tagged at the first report, once the stage is known
        self._last = _Interval()
        self._saves = 0
        self._flops_per_sample: float | None = None
        self._peak: float | None = None
        self._warned = False

    def _set(self, metric: M.Metric, value: float | None, **extra: str) -> None:
        self.gauges.set(metric, value, **extra)

    def close(self) -> None:
        """Stop re-sending this rank's series (the rank leaves its group; a kept actor reports anew as
        another rank of the next group)."""
        self.gauges.close()

    def after_report(self, metrics: dict[str, Any], stats: RankStats, num_reports: int) -> None:
        """Push one report's values; never raises into the user's loop."""
        try:
            self._export(metrics, stats, num_reports)
        except Exception:  # metrics are best effort; training goes on
            if not self._warned:
                self._warned = True
                logger.warning("zeroray: rank %d could not export its Ray metrics", self.rank, exc_info=True)

    def _export(self, metrics: dict[str, Any], stats: RankStats, num_reports: int) -> None:
        from zeroray.train.worker.context import get_session

        session = get_session("report()")
        engine = session.engine
        if not self.gauges.tags:
            from zeroray.config.load import load_config

            stage = engine.stage if engine is not None else load_config(session.zero_config, defer=True).stage
            self.gauges.tags = {"run": self.run, "rank": str(self.rank), "node": self.node, "stage": str(stage)}
            self.gauges.start()  # the actor's process ends with the group: the thread is a daemon
        now = time.time()
        interval = now - self._last.time if self._last.time is not None else None

        self._set(M.STEP, stats.global_step if stats.global_step is not None else num_reports)
        self._set(M.REPORTS, num_reports)
        self._set(M.LOSS, finite_or_none(metrics.get("loss")))
        if engine is not None:
            self._set(M.LEARNING_RATE, finite_or_none(engine.optimizer.param_groups[0].get("lr")))
            self._set(M.GRAD_NORM, engine.last_grad_norm)
            self._set(M.LOSS_SCALE, engine.loss_scaler.scale)
            self._set(M.SKIPPED_STEPS, engine.skipped_steps)

        step_time = stats.step_time_s
        self._set(M.STEP_TIME, step_time)
        if stats.phases and step_time is not None:
            for phase, seconds in stats.phases.items():
                self._set(M.PHASE_TIME, seconds, phase=phase)
            self._set(M.PHASE_TIME, max(step_time - sum(stats.phases.values()), 0.0), phase="other")

        world = session.context.get_world_size()
        per_step = session.spec.samples_per_step  # None when the config gives no batch sizes
        samples_per_s = per_step / world / step_time if step_time and per_step else None
        self._set(M.SAMPLES_PER_SECOND, samples_per_s)
        tokens_per_s = self._tokens_per_second(metrics, interval)
        self._set(M.TOKENS_PER_SECOND, tokens_per_s)
        self._set(M.MFU, self._mfu(metrics, session, samples_per_s, tokens_per_s))

        for category, nbytes in stats.memory.items():
            self._set(M.MEMORY, nbytes, category=category)
        for kind, nbytes in stats.comm_bytes.items():
            self._set(M.COMM_BYTES, nbytes, kind=kind)
            self._set(M.COMM_BANDWIDTH, _rate(nbytes, self._last.comm.get(kind), interval), kind=kind)
        self._last.comm = dict(stats.comm_bytes)
        for key, nbytes in stats.offload_bytes.items():
            tier, _, direction = key.partition(":")
            self._set(M.OFFLOAD_BYTES, nbytes, tier=tier, direction=direction)
            self._set(M.OFFLOAD_BANDWIDTH, _rate(nbytes, self._last.offload.get(key), interval),
                      tier=tier, direction=direction)
        self._last.offload = dict(stats.offload_bytes)

        if stats.checkpoint_s is not None:
            self._saves += 1
            self._set(M.CHECKPOINT_STALL_SECONDS, stats.checkpoint_s)
            if not session.checkpoint_config.async_save:
                self._set(M.CHECKPOINT_SAVE_SECONDS, stats.checkpoint_s)
            self._set(M.CHECKPOINT_BYTES, stats.checkpoint_bytes)
            self._set(M.CHECKPOINT_SAVES, self._saves)
        if stats.snapshot_s is not None:
            self._set(M.SNAPSHOT_STALL_SECONDS, stats.snapshot_s)
        loaded = getattr(session, "checkpoint_load", None)  # (seconds, bytes) of zt.prepare's resume load
        if loaded is not None:
            self._set(M.CHECKPOINT_LOAD_SECONDS, loaded[0])
            self._set(M.CHECKPOINT_LOAD_BYTES, loaded[1])
        self._last.time = now

    def _tokens_per_second(self, metrics: dict[str, Any], interval: float | None) -> float | None:
        """From the loop's running total ``tokens`` (a total that went down, a restarted count, gives none)."""
        tokens = finite_or_none(metrics.get("tokens"))
        before, self._last.tokens = self._last.tokens, tokens
        if tokens is None or before is None or not interval or tokens < before:
            return None
        return (tokens - before) / interval

    def _mfu(self, metrics: dict[str, Any], session: Any, samples_per_s: float | None,
             tokens_per_s: float | None) -> float | None:
        """Model FLOPs per second over the device's peak, when both are known."""
        given = finite_or_none(metrics.get("flops_per_sample"))
        self._flops_per_sample = given if given is not None else self._flops_per_sample
        peak = finite_or_none(metrics.get("peak_flops"))
        self._peak = peak if peak is not None else self._peak
        if self._peak is None:
            device = session.context.device
            if device.type != "cuda" or session.engine is None:
                return None
            import torch

            self._peak = flops.device_peak_flops(torch.cuda.get_device_name(device),
                                                 session.engine.config.precision.name)
            if self._peak is None:
                return None
        if self._flops_per_sample is not None and samples_per_s:
            return self._flops_per_sample * samples_per_s / self._peak
        if session.engine is not None and tokens_per_s and samples_per_s:
            per_token = flops.training_flops_per_token(session.engine.module, seq_len=tokens_per_s / samples_per_s)
            if per_token is not None:
                return per_token * tokens_per_s / self._peak
        return None
