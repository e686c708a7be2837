"""Sharded checkpoints straight to any fsspec storage, loadable at any world size and stage.

Engine level (collectives, every rank calls them)::

    zeroray.checkpoint.save(engine, "s3://bucket/run/checkpoint_100", async_=True)
    zeroray.checkpoint.load(engine, zeroray.checkpoint.latest_committed("s3://bucket/run"))

See docs/checkpoints.md for the format and its guarantees.
"""

from zeroray.checkpoint.export import export
from zeroray.checkpoint.manifest import CheckpointError
from zeroray.checkpoint.reader import Checkpoint, load
from zeroray.checkpoint.storage import (
    CheckpointInfo,
    apply_retention,
    checkpoint_url,
    latest_committed,
    list_checkpoints,
)
from zeroray.checkpoint.writer import SaveHandle, save, wait

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointInfo",
    "SaveHandle",
    "apply_retention",
    "checkpoint_url",
    "export",
    "latest_committed",
    "list_checkpoints",
    "load",
    "save",
    "wait",
]
