"""Checkpoint manager: which checkpoints the run has, which to keep, which to resume from.

Sharded saving is a later issue (zeroray.checkpoint). Its place is here: ``register`` is called by the
controller when ranks report ``checkpoint=True`` and the manifest is committed; ``latest`` is what a
restarted group loads; ``num_to_keep`` prunes older ones. Until saving lands nothing registers, and
``latest`` is None, so ``Result.checkpoint`` is None.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zeroray.train.config import CheckpointConfig


@dataclass(frozen=True)
class CheckpointRecord:
    """A committed checkpoint: where its manifest lives and the metrics reported with it."""

    path: str
    global_step: int
    metrics: dict[str, Any] = field(default_factory=dict)


class CheckpointManager:
    """Keeps the committed checkpoints of one run, oldest first."""

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config
        self.checkpoints: list[CheckpointRecord] = []

    def register(self, record: CheckpointRecord) -> list[CheckpointRecord]:
        """Add a committed checkpoint; returns the ones to delete under ``num_to_keep``."""
        self.checkpoints.append(record)
        keep = self.config.num_to_keep
        if keep is None or len(self.checkpoints) <= keep:
            return []
        dropped, self.checkpoints = self.checkpoints[:-keep], self.checkpoints[-keep:]
        return dropped

    @property
    def latest(self) -> CheckpointRecord | None:
        return self.checkpoints[-1] if self.checkpoints else None
