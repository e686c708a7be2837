"""Fencing: each attempt of a run writes under an *epoch*, and a rank of an older epoch commits nothing.

A network partition leaves ranks running that nobody can reach. The driver has already started a new
group (a new attempt) on the rest of the cluster, and the cut-off ranks may still write to storage: an
async upload that resumes, a commit thread that finds its markers. The run's storage holds the fence,
``<run>/epoch.json``, that decides what they may do:

- ``{"epoch": N, "accepted": {"<step>": E, ...}}``. The driver advances it (:func:`advance`, through
  ``zeroray.checkpoint.storage.advance_epoch``) before it starts each group, and hands N to the group's
  ranks; ``accepted`` lists the checkpoints of older epochs committed before epoch N began (listed just
  before the fence moved).
- Every save of epoch E names its files after E (``rank-00000.e7.bin``, markers alike), so a stale rank's
  write never lands on a newer checkpoint's file. Before it prepares (empties) a directory and before it
  writes its file, a rank reads the fence and stops if it is past E; rank 0 reads it again when it
  publishes ``manifest.json``, which names E.
- On a local or network disk that last read and the publish hold a shared ``flock`` on
  ``<run>/epoch.json.lock`` and :func:`advance` holds it exclusively: a commit either lands before the
  new epoch begins (and is in its ``accepted``) or is refused. On an object store there is no lock: the
  manifest is created with ``If-None-Match: *`` (it never replaces one), and a manifest of an older epoch
  that is not in ``accepted`` (its PUT landed after the fence moved) is never taken as committed
  (:func:`refusal`: listings show it as broken, loads refuse it).

Checkpoints without an epoch (saved before fencing, or by a loop that passes none) are outside it: they
load and list as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import posixpath
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from zeroray.checkpoint.manifest import CheckpointError
from zeroray.storage import atomic_write, protocols

FENCE = "epoch.json"
_S3 = ("s3", "s3a")


class StaleEpochError(CheckpointError):
    """A write of an epoch the run's fence has moved past: its ranks were cut off from a newer group."""


@dataclass(frozen=True)
class Fence:
    """The run's current epoch, and the older epochs' checkpoints committed before it began (step -> epoch)."""

    epoch: int
    accepted: dict[int, int] = field(default_factory=dict)


def run_path_of(checkpoint_path: str) -> str:
    """The run directory a checkpoint directory lies in (where its fence is)."""
    return posixpath.dirname(checkpoint_path.rstrip("/"))


def read(fs: AbstractFileSystem, run_path: str) -> Fence | None:
    """The run's fence, or None (a run that never had one). One that does not parse is an error: a
    fence that cannot be read cannot let a write through."""
    path = posixpath.join(run_path, FENCE)
    try:
        fs.invalidate_cache(path)
        raw = fs.cat_file(path)
    except FileNotFoundError:
        return None
    try:
        body = json.loads(raw)
        epoch = body["epoch"]
        accepted = {int(k): int(v) for k, v in body.get("accepted", {}).items()}
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 1:
            raise ValueError(f"epoch {epoch!r}")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path} is not a zeroray epoch fence ({type(e).__name__}: {e})") from None
    return Fence(epoch, accepted)


@contextlib.contextmanager
def _locked(fs: AbstractFileSystem, run_path: str, exclusive: bool) -> Iterator[None]:
    """A ``flock`` on ``<run>/epoch.json.lock`` (local and network disks; elsewhere nothing)."""
    if not isinstance(fs, LocalFileSystem):
        yield
        return
    lock = fs._strip_protocol(posixpath.join(run_path, FENCE)) + ".lock"
    os.makedirs(os.path.dirname(lock), exist_ok=True)
    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the lock


def _stale(fence: Fence | None, epoch: int, what: str) -> StaleEpochError | None:
    if fence is None or fence.epoch <= epoch:
        return None
    return StaleEpochError(
        f"refused {what}: this rank writes for epoch {epoch}, but the run is at epoch {fence.epoch} (a newer "
        f"group started; this rank was cut off from it), so nothing of epoch {epoch} may be committed"
    )


def check(fs: AbstractFileSystem, run_path: str, epoch: int | None, what: str) -> None:
    """Raise :class:`StaleEpochError` when the fence is past ``epoch`` (None: an unfenced save, no check)."""
    if epoch is not None and (error := _stale(read(fs, run_path), epoch, what)) is not None:
        raise error


@contextlib.contextmanager
def fenced(fs: AbstractFileSystem, run_path: str, epoch: int | None, what: str) -> Iterator[None]:
    """Run the body only while the fence is at ``epoch`` (or below): on a disk, under the shared lock that
    :func:`advance` takes exclusively, so the epoch cannot move in between."""
    if epoch is None:
        yield
        return
    with _locked(fs, run_path, exclusive=False):
        check(fs, run_path, epoch, what)
        yield


def publish(fs: AbstractFileSystem, path: str, data: bytes, epoch: int | None, what: str) -> None:
    """Write ``path`` (a manifest: the commit) under the fence. On an object store it is created only if
    absent, and the fence is read again after the PUT: if it moved meanwhile, the write is taken back."""
    run_path = run_path_of(posixpath.dirname(path))
    with fenced(fs, run_path, epoch, what):
        if epoch is None or not any(p in _S3 for p in protocols(fs)):
            atomic_write(fs, path, data)
            return
        try:
            fs.pipe_file(path, data, mode="create")  # If-None-Match: *: never over another epoch's commit
        except FileExistsError:
            raise CheckpointError(f"refused {what}: a manifest is there already (another epoch's)") from None
    try:
        check(fs, run_path, epoch, what)
    except StaleEpochError:
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(path)  # readers never took it anyway: it is not in the new epoch's "accepted"
        raise


def refusal(fence: Fence | None, epoch: int | None, step: int) -> str | None:
    """Why the checkpoint of ``step`` committed under ``epoch`` is not taken as committed, or None."""
    if fence is None or epoch is None or epoch >= fence.epoch or fence.accepted.get(step) == epoch:
        return None
    return (f"committed by epoch {epoch} after epoch {fence.epoch} began (a cut-off rank's commit): never taken "
            "as committed")


def advance(fs: AbstractFileSystem, run_path: str, accepted: Callable[[], dict[int, int]]) -> int:
    """The driver, before it starts a group: move the fence to the next epoch and return it.

    ``accepted()``: the committed checkpoints (step -> epoch) valid under the old fence. It is listed
    before the new fence is written: a commit that lands after the listing (on a disk the lock rules
    that out) is not in it, and so is never taken as committed under the new epoch."""
    path = posixpath.join(run_path, FENCE)
    s3 = any(p in _S3 for p in protocols(fs))
    last: Exception | None = None
    with _locked(fs, run_path, exclusive=True):
        for _ in range(10):
            etag = _etag(fs, path) if s3 else None
            old = read(fs, run_path)
            epoch = (old.epoch if old is not None else 0) + 1
            try:
                _write(fs, path, Fence(epoch, accepted()), s3, etag)
            except OSError as e:  # S3: written by someone else since it was read (412): read again
                if not s3:
                    raise
                last = e
                time.sleep(0.05)
                continue
            return epoch
    raise CheckpointError(f"could not advance the epoch fence {path}: {type(last).__name__}: {last}")


def _etag(fs: AbstractFileSystem, path: str) -> str | None:
    fs.invalidate_cache(path)
    try:
        return fs.info(path).get("ETag")
    except FileNotFoundError:
        return None


def _write(fs: AbstractFileSystem, path: str, fence: Fence, s3: bool, etag: str | None) -> None:
    body = json.dumps({"epoch": fence.epoch, "accepted": {str(k): v for k, v in sorted(fence.accepted.items())},
                       "time": time.time()}, indent=1).encode()
    if not s3:
        atomic_write(fs, path, body)
    elif etag is None:
        fs.pipe_file(path, body, mode="create")
    else:
        fs.pipe_file(path, body, IfMatch=etag)
