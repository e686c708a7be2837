"""Errors that cross from the rank actors to the driver, carrying which rank failed and its traceback."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zeroray.train.result import Result


@dataclass(frozen=True)
class WorkerFailure:
    """One rank's failure: the loop raised (``traceback`` is the worker's) or the actor died.

    ``num_reports``: the ``zt.report`` calls the rank had completed; ``waiting_in``: "report" when it
    failed inside the barrier of one more, "end" in the closing exchange after its loop returned,
    None in the loop itself; ``timed_out``: a collective gave up waiting for its peers
    (``FailureConfig.collective_timeout_s``).
    """

    rank: int
    message: str
    traceback: str
    actor_died: bool = False
    # Raised by a collective because a peer went away: a consequence of another rank's failure.
    secondary: bool = False
    num_reports: int | None = None
    waiting_in: str | None = None
    timed_out: bool = False
    # The rank's actor stopped answering polls (FailureConfig.worker_heartbeat_timeout_s).
    hung: bool = False

    @property
    def where(self) -> str:
        """Where the rank was, in the user's terms: its report count and whether it was inside one."""
        if self.num_reports is None:
            return ""
        if self.waiting_in == "report":
            return f"waiting in zt.report call {self.num_reports + 1} ({self.num_reports} completed)"
        if self.waiting_in == "end":
            return f"waiting at the end of its loop after {self.num_reports} report(s)"
        return f"outside zt.report (in the loop's own code or collectives) after {self.num_reports} report(s)"

    def __str__(self) -> str:
        what = "actor died" if self.actor_died else "rank hung" if self.hung else "train loop raised"
        if self.timed_out:
            what += " after a collective timed out"
        elif self.secondary:
            what += " in a collective (likely because another rank failed)"
        where = f" ({self.where})" if self.where else ""
        return f"[rank {self.rank}] {what}{where}: {self.message}\n{self.traceback}".rstrip()


@dataclass(frozen=True)
class StartFailure:
    """The group could not start for a reason that belongs to no rank: ``what`` names what failed
    (e.g. the placement of the bundles), ``message`` what could not be done."""

    what: str
    message: str
    traceback: str = ""

    secondary = False

    def __str__(self) -> str:
        return f"[{self.what}] {self.message}\n{self.traceback}".rstrip()


Failure = WorkerFailure | StartFailure


def out_of_step_summary(failures: list[Failure]) -> str | None:
    """When a collective timed out, say which rank was where: the usual cause is a rank that called
    ``zt.report`` (or any collective, e.g. ``engine.full_state_dict()``) a different number of times."""
    ranks = sorted((f for f in failures if isinstance(f, WorkerFailure)), key=lambda f: f.rank)
    if not any(f.timed_out for f in ranks):
        return None
    places = "; ".join(f"rank {f.rank} {f.where or 'position unknown'}" for f in ranks)
    counts = {f.num_reports for f in ranks if f.num_reports is not None}
    cause = (
        "the ranks reported different numbers of times"
        if len(counts) > 1 or len({f.waiting_in for f in ranks}) > 1
        else "the ranks waited in different collectives"
    )
    return (
        f"ranks out of step: a collective timed out ({cause}): {places}. Every rank must call zt.report, "
        "and any collective such as engine.full_state_dict(), the same number of times "
        "(FailureConfig.collective_timeout_s sets how long a rank waits)"
    )


class TrainingFailedError(RuntimeError):
    """The run failed and the failure policy gave up. ``failures`` holds each failed rank's traceback
    (or what could not be started); ``result`` is the Result up to the failure (its ``error`` is this
    exception)."""

    def __init__(self, failures: list[Failure], attempts: int = 1) -> None:
        self.failures = sorted(failures, key=_order)
        self.attempts = attempts
        self.result: Result | None = None
        ranked = [f for f in self.failures if isinstance(f, WorkerFailure)]
        first_hand = [f for f in ranked if not f.secondary] or ranked
        after = f", after {attempts} attempts" if attempts > 1 else ""
        if ranked:
            header = f"zeroray training failed (rank {', '.join(str(f.rank) for f in first_hand)}{after})"
        else:
            header = f"zeroray training failed ({', '.join(f.what for f in self.failures)}{after})"
        summary = out_of_step_summary(self.failures)
        lines = [header, *([summary] if summary else []), *(str(f) for f in self.failures)]
        super().__init__("\n".join(lines))

    @property
    def rank(self) -> int | None:
        """The rank that failed first-hand (lowest such), else the lowest failed rank; None when no
        rank failed (the group could not start)."""
        ranked = [f for f in self.failures if isinstance(f, WorkerFailure)]
        return ranked[0].rank if ranked else None


def _order(f: Failure) -> tuple[int, int, int]:
    if isinstance(f, WorkerFailure):
        return (0, int(f.secondary), f.rank)
    return (1, 0, 0)


class CallbackError(RuntimeError):
    """A callback's hook raised (``RunConfig.callbacks`` or a built-in): the run failed. ``callback`` is the
    callback object, ``hook`` the hook's name, ``__cause__`` the hook's exception; ``result`` is the Result
    up to the failure (its ``error`` is this exception). The failure policy does not restart such a run."""

    def __init__(self, callback: object, hook: str, error: BaseException) -> None:
        self.callback, self.hook = callback, hook
        self.result: Result | None = None
        super().__init__(
            f"zeroray training failed (callback): {type(callback).__name__}.{hook} raised "
            f"{type(error).__name__}: {error} (an exception out of a callback's hook fails the run; catch inside "
            f"the hook what should not)"
        )


class ReportMismatchError(RuntimeError):
    """Ranks called ``zt.report`` a different number of times (it is a barrier, like Ray Train's)."""


class RunLeaseError(RuntimeError):
    """Another ``fit()`` holds the run directory (same name and storage path), or took it over."""


_COLLECTIVE_MARKERS = ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "NCCL error",
                       "ProcessGroupNCCL", "ProcessGroupGloo", "Broken pipe",
                       "timeout caused pair closure")  # gloo, on the rank whose own wait timed out
_TIMEOUT_MARKERS = ("Timed out waiting", "timed out", "Timeout", "timeout")


def is_collective_error(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a collective that failed because a peer died (not the root cause)."""
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistNetworkError", ())) or isinstance(exc, getattr(dist, "DistBackendError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(m in text for m in _COLLECTIVE_MARKERS)


def is_collective_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that gave up waiting for its peers (the process group timeout)."""
    return is_collective_error(exc) and any(m in str(exc) for m in _TIMEOUT_MARKERS)
