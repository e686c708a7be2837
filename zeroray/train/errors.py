"""Errors that cross from the rank actors to the driver, carrying which rank failed and its traceback."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zeroray.train.result import Result


@dataclass(frozen=True)
class WorkerFailure:
    """One rank's failure: the loop raised (``traceback`` is the worker's) or the actor died."""

    rank: int
    message: str
    traceback: str
    actor_died: bool = False
    # Raised by a collective because a peer went away: a consequence of another rank's failure.
    secondary: bool = False

    def __str__(self) -> str:
        what = "actor died" if self.actor_died else "train loop raised"
        if self.secondary:
            what += " in a collective (likely because another rank failed)"
        return f"[rank {self.rank}] {what}: {self.message}\n{self.traceback}".rstrip()


class TrainingFailedError(RuntimeError):
    """The run failed and the failure policy gave up. ``failures`` holds each failed rank's traceback;
    ``result`` is the Result up to the failure (its ``error`` is this exception)."""

    def __init__(self, failures: list[WorkerFailure], attempts: int = 1) -> None:
        self.failures = sorted(failures, key=lambda f: (f.secondary, f.rank))
        self.attempts = attempts
        self.result: Result | None = None
        ranks = ", ".join(str(f.rank) for f in self.failures if not f.secondary) or ", ".join(
            str(f.rank) for f in self.failures
        )
        header = f"zeroray training failed (rank {ranks}"
        header += f", after {attempts} attempts)" if attempts > 1 else ")"
        super().__init__(header + "\n" + "\n".join(str(f) for f in self.failures))

    @property
    def rank(self) -> int:
        """The rank that failed first-hand (lowest such), else the lowest failed rank."""
        return self.failures[0].rank


class ReportMismatchError(RuntimeError):
    """Ranks called ``zt.report`` a different number of times (it is a barrier, like Ray Train's)."""


_COLLECTIVE_MARKERS = ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "NCCL error",
                       "ProcessGroupNCCL", "ProcessGroupGloo", "Broken pipe")


def is_collective_error(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a collective that failed because a peer died (not the root cause)."""
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistNetworkError", ())) or isinstance(exc, getattr(dist, "DistBackendError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(m in text for m in _COLLECTIVE_MARKERS)
