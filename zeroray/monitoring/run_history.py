"""A run's history read back from its directory, for ``zeroray watch`` and ``zeroray plot``.

The driver writes ``run.json`` (status, attempts, world size; replaced atomically) and appends
``metrics.jsonl`` (one report a line: rank 0's metrics, ``_``-prefixed fields and every rank's stats
under ``_ranks``) to ``<storage_path>/<name>/`` at any fsspec URL (zeroray/train/driver/run_dir.py). This
module reads them with fsspec only: it imports neither Ray nor torch, so the commands start fast on a
laptop that only has the run's URL.

A report that took no optimizer step since the previous one (``_steps`` 0: a text sample or a final
evaluation after the loop) is no training step: the steps, step times and throughput come from the
other reports only, and it is kept aside (:attr:`RunHistory.reports` holds every line).
"""

from __future__ import annotations

import json
import math
import numbers
import posixpath
from dataclasses import dataclass, field
from typing import Any

from zeroray.storage import StorageError, open_url

# The file names zeroray.train.driver.run_dir writes (importing it would import Ray; a test keeps them equal).
RUN_INFO = "run.json"
HISTORY = "metrics.jsonl"
TERMINAL = ("FINISHED", "ERRORED", "ABORTED")


class NoRunError(StorageError):
    """The URL holds no zeroray run (no ``run.json``)."""


class NoHistoryError(StorageError):
    """The run has not reported yet (no line in ``metrics.jsonl``)."""


def is_step(entry: dict[str, Any]) -> bool:
    """Whether a report of the history took an optimizer step (a line without ``_steps``, written
    before zeroray recorded it, counts as one)."""
    return entry.get("_steps") != 0


def number(value: Any) -> float | None:
    """A finite float, or None for anything else (bools, strings, NaN, a missing value)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


@dataclass
class RunHistory:
    """What has been read of one run: ``info`` is run.json, ``entries`` the reports that took a
    training step, in order (what the steps, step times and plots read), ``reports`` every report."""

    url: str
    info: dict[str, Any]
    entries: list[dict[str, Any]] = field(default_factory=list)
    reports: list[dict[str, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return str(self.info.get("name") or posixpath.basename(self.url.rstrip("/")))

    @property
    def status(self) -> str:
        return str(self.info.get("status") or "UNKNOWN")

    @property
    def ended(self) -> bool:
        return self.status in TERMINAL

    @property
    def latest(self) -> dict[str, Any] | None:
        """The latest report that took a training step."""
        return self.entries[-1] if self.entries else None

    def after_last_step(self) -> list[dict[str, Any]]:
        """The reports since the latest training step that took none (a sample after the loop)."""
        out: list[dict[str, Any]] = []
        for entry in reversed(self.reports):
            if is_step(entry):
                break
            out.append(entry)
        return out[::-1]

    def require_reports(self) -> RunHistory:
        """This history, or a :class:`NoHistoryError` when the run has not reported a step yet."""
        if not self.entries:
            raise NoHistoryError(
                f"run {self.name!r} at {self.url} has no history yet: no training step reported in {HISTORY} "
                f"(status {self.status})"
            )
        return self

    def elapsed_s(self) -> list[float]:
        """Seconds since ``fit()`` started at each report, continued across the run's ``fit()`` calls
        (each counts ``_time_s`` from its own start, so a drop starts the next one)."""
        out: list[float] = []
        offset, last = 0.0, 0.0
        for entry in self.entries:
            t = number(entry.get("_time_s")) or 0.0
            if t < last:
                offset += last
            last = t
            out.append(offset + t)
        return out

    def steps(self) -> list[int]:
        """The optimizer step of each report (the report's number when the loop has no engine)."""
        out: list[int] = []
        for i, entry in enumerate(self.entries):
            step = entry.get("_global_step")
            out.append(int(step) if isinstance(step, int) else i + 1)
        return out

    def samples_per_step(self) -> float | None:
        """The group's batch per optimizer step, when run.json records it."""
        return number(self.info.get("samples_per_step"))

    def latest_metrics(self) -> dict[str, float]:
        """The last value of each of the loop's numeric metrics (rank 0's), in the order they first
        appear (``val_loss`` reported every N steps keeps its last value between evaluations)."""
        out: dict[str, float] = {}
        for entry in self.entries:
            for k, v in entry.items():
                if not k.startswith("_") and (x := number(v)) is not None:
                    out[k] = x
        return out

    def tokens_per_second(self) -> list[float | None]:
        """The group's tokens/s at each report, from the loop's running total ``tokens`` (rank 0's)
        times the world size (every rank trains the same micro-batch); None where unknown or where the
        total went down (a restart)."""
        out: list[float | None] = []
        before: tuple[float, float] | None = None
        for entry, t in zip(self.entries, self.elapsed_s()):
            tokens = number(entry.get("tokens"))
            rate = None
            if tokens is not None and before is not None and t > before[1] and tokens >= before[0]:
                rate = (tokens - before[0]) / (t - before[1]) * max(len(entry.get("_ranks") or ()), 1)
            before = (tokens, t) if tokens is not None else before
            out.append(rate)
        return out


class HistoryReader:
    """Reads a run's directory, and on later calls only what was appended since."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.fs, root = open_url(url, storage_options)
        self.dir = root.rstrip("/") or "/"
        self._offset = 0  # bytes of metrics.jsonl already parsed: whole lines only
        self.history: RunHistory | None = None

    def _path(self, name: str) -> str:
        return posixpath.join(self.dir, name)

    def _cat(self, name: str, start: int = 0) -> bytes | None:
        """The file's bytes from ``start`` (b"" when it has no more: object stores refuse a range
        that starts at the end); None when the file does not exist."""
        path = self._path(name)
        try:
            if start and self.fs.size(path) <= start:
                return b""
            return self.fs.cat_file(path, start=start or None)
        except FileNotFoundError:
            return None
        except Exception as e:  # no credentials, unreachable endpoint
            raise StorageError(f"cannot read {self.url}/{name}: {type(e).__name__}: {e}") from e

    def _info(self) -> dict[str, Any]:
        raw = self._cat(RUN_INFO)
        if raw is None:
            what = "does not exist" if not self._exists() else f"has no {RUN_INFO}"
            raise NoRunError(f"no zeroray run at {self.url}: it {what} (give the run's directory, "
                             f"<storage_path>/<name>)")
        try:
            info = json.loads(raw)
        except json.JSONDecodeError as e:
            raise StorageError(f"{self.url}/{RUN_INFO} is not JSON: {e}") from e
        if not isinstance(info, dict):
            raise StorageError(f"{self.url}/{RUN_INFO} is not a JSON object")
        return info

    def _exists(self) -> bool:
        try:
            return bool(self.fs.exists(self.dir))
        except Exception as e:
            raise StorageError(f"cannot read {self.url}: {type(e).__name__}: {e}") from e

    def poll(self) -> RunHistory:
        """run.json now, then the reports appended since the last call. run.json is read first: the
        driver flushes metrics.jsonl before it writes a final status, so a run seen ended has all its
        reports here. A torn last line (a writer mid-append) waits for the next call."""
        info = self._info()
        if self.history is None:
            self.history = RunHistory(self.url, info)
        self.history.info = info
        raw = self._cat(HISTORY, self._offset)
        if raw:
            whole = raw[: raw.rfind(b"\n") + 1]
            for line in whole.splitlines():
                if line.strip():
                    try:
                        entry = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise StorageError(f"{self.url}/{HISTORY}: a line is not JSON: {e}") from e
                    self.history.reports.append(entry)
                    if is_step(entry):
                        self.history.entries.append(entry)
            self._offset += len(whole)
        return self.history

    def read(self) -> RunHistory:
        """The whole history; a run with no report yet is a :class:`NoHistoryError`."""
        return self.poll().require_reports()
