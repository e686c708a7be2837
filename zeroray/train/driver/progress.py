"""The driver's progress display: a tqdm bar on a terminal, a log line every few seconds otherwise.

The lines go to the ``zeroray.train.driver.progress`` logger at INFO, so the application decides where they
appear (``logging.basicConfig(level=logging.INFO)`` shows them on stderr); the library never prints.
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
from typing import Any

from zeroray.train.report import Report, finite_or_none

logger = logging.getLogger(__name__)


class Progress:
    """Shows step, loss and samples/s as reports stream in."""

    def __init__(self, enabled: bool | None, samples_per_step: int | None, log_every_s: float = 5.0) -> None:
        self.samples_per_step = samples_per_step
        self.log_every_s = log_every_s
        tty = sys.stderr.isatty() and shutil.get_terminal_size((0, 0)).columns > 0
        self.bar = None
        self.lines = enabled is not False and not tty
        if enabled is not False and tty:
            from tqdm.auto import tqdm

            self.bar = tqdm(desc="zeroray", unit="step", dynamic_ncols=True)
        self._last_log = float("-inf")
        self._first: tuple[float, int] | None = None
        self._step = 0

    def update(self, report: Report) -> None:
        step = report.global_step or report.index
        now = report.time
        if self._first is None:
            self._first = (now, step)
        parts: dict[str, Any] = {"step": step}
        loss = finite_or_none(report.metrics.get("loss"))
        if loss is not None:
            parts["loss"] = f"{loss:.4f}"
        t0, s0 = self._first
        if self.samples_per_step and step > s0 and now > t0:
            parts["samples/s"] = f"{self.samples_per_step * (step - s0) / (now - t0):.1f}"
        if self.bar is not None:
            parts.pop("step")  # the bar counts steps itself
            self.bar.set_postfix(parts, refresh=False)
            self.bar.update(max(step - self._step, 0))
        elif self.lines and time.monotonic() - self._last_log >= self.log_every_s:
            self._last_log = time.monotonic()
            logger.info("zeroray: %s", "  ".join(f"{k}={v}" for k, v in parts.items()))
        self._step = step

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
