"""Where a step's time goes: forward, backward, optimizer step and exposed communication wait.

The engine marks each phase's start and end (:meth:`PhaseTimer.start` / :meth:`PhaseTimer.stop`);
nothing here ever waits for the device. On the CPU a mark is the wall clock. On CUDA a mark is an
event recorded on the current stream, and the time between two events is read only later, in
:meth:`PhaseTimer.report`, and only once the end event has completed (``Event.query()`` does not
block): a phase whose events are still queued is counted at a later report. So timing adds no
synchronization to the step, which matters because a ``cuda.synchronize`` per phase would serialize
the very overlap of compute and communication that ZeRO depends on.

Phases nest: a phase measured inside another (the parameter all-gather wait inside the optimizer
step) is subtracted from the outer one, so the four times add up to the time the engine spent.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

PHASES = ("forward", "backward", "optimizer", "comm_wait")

# Completed CUDA records are folded into the totals when this many wait, so a loop that never
# asks for a report does not grow a list of events.
_FOLD_AT = 256


@dataclass(frozen=True)
class StepTimes:
    """Mean seconds per optimizer step in each phase, over the ``steps`` optimizer steps since the
    previous report. ``comm_wait_s`` is the time the rank sat waiting for collectives it could not
    overlap (the end of backward's gradient reductions, the optimizer's parameter all-gathers); the
    stage-3 gathers that forward and backward wait for count in those phases."""

    steps: int
    forward_s: float
    backward_s: float
    optimizer_s: float
    comm_wait_s: float

    def as_dict(self) -> dict[str, float]:
        return {p: getattr(self, f"{p}_s") for p in PHASES}


@dataclass
class _Record:
    phase: str
    begin: Any  # a float (perf_counter) on the CPU, a torch.cuda.Event on CUDA
    end: Any = None
    children: list[_Record] = field(default_factory=list)


class PhaseTimer:
    """Accumulates exclusive time per phase between reports; one per engine, used from one thread."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._stack: list[_Record] = []
        self._done: list[_Record] = []  # finished top-level records not yet folded (CUDA only)
        self._totals = dict.fromkeys(PHASES, 0.0)
        self._steps = 0  # optimizer phases ended since the last report: one per optimizer step

    def _mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self, phase: str) -> None:
        """Begin ``phase`` (one of :data:`PHASES`), nested in the phase currently open, if any.

        A phase never nests in itself: finding ``phase`` open already means an exception left it
        (and what opened inside it) unfinished, so those are dropped."""
        for i, rec in enumerate(self._stack):
            if rec.phase == phase:
                del self._stack[i:]
                break
        self._stack.append(_Record(phase, self._mark()))

    def stop(self, phase: str) -> None:
        """End the innermost open ``phase``; phases opened inside it and never ended (an exception
        left them) are dropped."""
        while self._stack and self._stack[-1].phase != phase:
            self._stack.pop()
        if not self._stack:
            return
        rec = self._stack.pop()
        rec.end = self._mark()
        if phase == "optimizer":
            self._steps += 1
        if self._stack:
            self._stack[-1].children.append(rec)
        elif self.cuda:
            self._done.append(rec)
            if len(self._done) >= _FOLD_AT:
                self._fold()
        else:
            self._add(rec)

    @contextlib.contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        """``start`` and ``stop`` around a block."""
        self.start(phase)
        try:
            yield
        finally:
            self.stop(phase)

    def _elapsed(self, rec: _Record) -> float:
        if self.cuda:
            return rec.begin.elapsed_time(rec.end) / 1e3
        return rec.end - rec.begin

    def _add(self, rec: _Record) -> float:
        """Add ``rec``'s exclusive time (and its children's) to the totals; returns its full time."""
        total = self._elapsed(rec)
        inner = sum(self._add(c) for c in rec.children)
        self._totals[rec.phase] += max(total - inner, 0.0)
        return total

    def _fold(self) -> None:
        """Fold the CUDA records whose end event completed, oldest first, without blocking."""
        pending = []
        for rec in self._done:
            if pending or not rec.end.query():
                pending.append(rec)  # keep order: a later record can only complete after this one
            else:
                self._add(rec)
        self._done = pending

    def report(self) -> StepTimes:
        """Mean time per optimizer step in each phase since the previous report (the first one
        counts from the engine's start); resets the totals. With no optimizer step in between, the
        totals carry over to the next report (micro-steps of one accumulation cycle)."""
        self._fold()
        steps, self._steps = self._steps, 0
        if steps == 0:
            return StepTimes(0, 0.0, 0.0, 0.0, 0.0)
        times = {p: t / steps for p, t in self._totals.items()}
        self._totals = dict.fromkeys(PHASES, 0.0)
        return StepTimes(steps, times["forward"], times["backward"], times["optimizer"], times["comm_wait"])
