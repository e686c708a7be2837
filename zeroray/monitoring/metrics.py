"""Every metric zeroray exports, declared once.

Ray's metrics agent serves a metric named ``zeroray_x`` on each node's Prometheus endpoint as
``ray_zeroray_x``. Rank metrics carry the tags ``run``, ``rank``, ``node`` (the node's IP) and
``stage``; the controller's carry ``run``. All are gauges: each report sets the latest value, and
cumulative ones (bytes moved) keep growing, so PromQL's ``rate()`` applies to them as to counters.
"""

from __future__ import annotations

from dataclasses import dataclass

RANK_TAGS = ("run", "rank", "node", "stage")
CONTROLLER_TAGS = ("run",)
PREFIX = "ray_"  # what Ray's Prometheus endpoint prepends


@dataclass(frozen=True)
class Metric:
    """One gauge: its Ray name, what it means, its tag keys (``tags`` plus ``extra``)."""

    name: str
    description: str
    tags: tuple[str, ...] = RANK_TAGS
    extra: tuple[str, ...] = ()

    @property
    def prometheus(self) -> str:
        """The series name Prometheus stores."""
        return PREFIX + self.name

    @property
    def tag_keys(self) -> tuple[str, ...]:
        return (*self.tags, *self.extra)


# ---- training
STEP = Metric("zeroray_step", "Optimizer steps taken (engine.global_step; reports without an engine)")
REPORTS = Metric("zeroray_reports", "zt.report calls of this rank")
LOSS = Metric("zeroray_loss", "Last loss this rank reported (metrics['loss'])")
LEARNING_RATE = Metric("zeroray_learning_rate", "Learning rate of the optimizer's first param group")
GRAD_NORM = Metric("zeroray_grad_norm", "Global gradient norm before clipping (with gradient_clipping > 0)")
LOSS_SCALE = Metric("zeroray_loss_scale", "fp16 dynamic loss scale (1 without fp16)")
SKIPPED_STEPS = Metric("zeroray_skipped_steps", "Optimizer steps skipped on fp16 overflow, in total")
STEP_TIME = Metric("zeroray_step_time_seconds", "Wall time per optimizer step since the previous report")
PHASE_TIME = Metric(
    "zeroray_phase_seconds",
    "Seconds per optimizer step by phase: forward, backward, optimizer, comm_wait (exposed collective "
    "wait), other (the rest of the step: data, the loop's own code, reports)",
    extra=("phase",),
)
SAMPLES_PER_SECOND = Metric("zeroray_samples_per_second", "Samples per second this rank trains (its share of the batch)")
TOKENS_PER_SECOND = Metric("zeroray_tokens_per_second", "Tokens per second this rank trains (when the loop reports 'tokens')")
MFU = Metric("zeroray_mfu", "Model FLOPs utilization: model FLOPs per second / the device's peak (0-1)")

# ---- memory
MEMORY = Metric(
    "zeroray_memory_bytes",
    "Rank memory by category: memory_report()'s (params, grads, optimizer, ...), process_rss, "
    "process_peak_rss, snapshots (in-memory snapshots held), and on CUDA cuda_allocated, cuda_max_allocated",
    extra=("category",),
)

# ---- communication
COMM_BYTES = Metric("zeroray_comm_bytes", "Bytes moved per collective kind since set-up (comm_report())", extra=("kind",))
COMM_BANDWIDTH = Metric(
    "zeroray_comm_bytes_per_second",
    "Collective traffic per kind over the last report interval (bytes / wall time)",
    extra=("kind",),
)

# ---- checkpoints
CHECKPOINT_SAVE_SECONDS = Metric("zeroray_checkpoint_save_seconds", "Seconds the last synchronous checkpoint save took")
CHECKPOINT_STALL_SECONDS = Metric(
    "zeroray_checkpoint_stall_seconds", "Seconds the last checkpointing zt.report blocked the loop (sync or async)"
)
CHECKPOINT_BYTES = Metric("zeroray_checkpoint_bytes", "Bytes of this rank's shard in the last checkpoint saved")
CHECKPOINT_SAVES = Metric("zeroray_checkpoint_saves", "Checkpoints this rank saved in this attempt")
CHECKPOINT_LOAD_SECONDS = Metric("zeroray_checkpoint_load_seconds", "Seconds the resume load in zt.prepare took")
CHECKPOINT_LOAD_BYTES = Metric("zeroray_checkpoint_load_bytes", "Bytes this rank read at the resume load")
SNAPSHOT_STALL_SECONDS = Metric(
    "zeroray_snapshot_stall_seconds",
    "Seconds the last in-memory snapshot (host copy, and the copy sent to the buddy rank) blocked the loop",
)

# ---- offload (reported by the offload engine once it exists)
OFFLOAD_BYTES = Metric(
    "zeroray_offload_bytes", "Bytes moved to and from the offload tier since set-up", extra=("tier", "direction")
)
OFFLOAD_BANDWIDTH = Metric(
    "zeroray_offload_bytes_per_second", "Offload traffic over the last report interval", extra=("tier", "direction")
)

# ---- controller (the driver)
CONTROLLER_STATE = Metric(
    "zeroray_controller_state", "1 for the controller's current state, 0 for the others", CONTROLLER_TAGS, ("state",)
)
WORLD_SIZE = Metric("zeroray_world_size", "Ranks in the current (or last) worker group", CONTROLLER_TAGS)
ATTEMPTS = Metric("zeroray_attempts", "Worker groups started in this fit()", CONTROLLER_TAGS)
FAILURES = Metric("zeroray_failures", "Worker group failures in this fit()", CONTROLLER_TAGS)
RESIZES = Metric("zeroray_resizes", "Worker group resizes in this fit()", CONTROLLER_TAGS)

ALL: tuple[Metric, ...] = tuple(v for v in dict(globals()).values() if isinstance(v, Metric))

# Metrics that stay empty in a run that does not produce them, and why (the dashboard shows them anyway).
KNOWN_EMPTY = {
    OFFLOAD_BYTES.prometheus: "no offload configured (offload reports it once it lands)",
    OFFLOAD_BANDWIDTH.prometheus: "no offload configured",
    CHECKPOINT_LOAD_BYTES.prometheus: "the run did not resume from a checkpoint",
    CHECKPOINT_LOAD_SECONDS.prometheus: "the run did not resume from a checkpoint",
    GRAD_NORM.prometheus: "gradient_clipping is 0",
    MFU.prometheus: "no FLOPs count or no known device peak (CPU without a given peak)",
    TOKENS_PER_SECOND.prometheus: "the loop reports no 'tokens'",
}
