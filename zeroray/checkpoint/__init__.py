"""Sharded checkpoints straight to any fsspec storage, loadable at any world size and stage.

Engine level (collectives, every rank calls them)::

    zeroray.checkpoint.save(engine, "s3://bucket/run/checkpoint_100")          # sync
    saver = zeroray.checkpoint.AsyncSaver(engine)                               # async: keep it
    saver.save("s3://bucket/run/checkpoint_200"); ...; saver.wait()                # every rank: committed
    url = zeroray.checkpoint.latest_committed("s3://bucket/run", engine=engine)     # one answer for all ranks
    zeroray.checkpoint.load(engine, url)

See docs/checkpoints.md for the format and its guarantees.
"""

from zeroray.checkpoint.export import export
from zeroray.checkpoint.manifest import CheckpointError, CheckpointStorageError, Manifest
from zeroray.checkpoint.reader import CheckpointReader, load
from zeroray.checkpoint.storage import (
    CheckpointInfo,
    apply_retention,
    checkpoint_url,
    latest_committed,
    latest_valid,
    list_checkpoints,
)
from zeroray.checkpoint.writer import AsyncSaver, SaveHandle, save

__all__ = [
    "AsyncSaver",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointReader",
    "CheckpointStorageError",
    "Manifest",
    "SaveHandle",
    "apply_retention",
    "checkpoint_url",
    "export",
    "latest_committed",
    "latest_valid",
    "list_checkpoints",
    "load",
    "save",
]
