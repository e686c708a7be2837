"""What ``zeroray ls`` and ``zeroray export`` do; zeroray/cli.py only wires their arguments."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from typing import Any

from zeroray.checkpoint.export import export
from zeroray.checkpoint.manifest import CheckpointError
from zeroray.checkpoint.reader import Checkpoint
from zeroray.checkpoint.storage import list_checkpoints

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str) -> int:
    """``5GB``, ``500MiB`` or ``123456`` as bytes, the way Hugging Face writes shard sizes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 5GB, 500MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_storage_options(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs for fsspec (values as JSON when they parse, else strings)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"storage option {pair!r} is not KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _human(n: int) -> str:
    units, x, i = ("B", "KiB", "MiB", "GiB", "TiB"), float(n), 0
    while x >= 1024 and i < len(units) - 1:
        x, i = x / 1024, i + 1
    return f"{x:.1f} {units[i]}" if i else f"{n} B"


def _reported(fn: Callable[[], int]) -> int:
    """Run a command; a CheckpointError becomes one line on stderr and exit status 1."""
    try:
        return fn()
    except CheckpointError as e:
        print(f"zeroray: {e}", file=sys.stderr)
        return 1


def ls(run_url: str, *, verify: bool = False, storage_options: dict[str, Any] | None = None) -> int:
    """Print the run's checkpoints; with ``verify``, read and check every committed one (1 if any is bad)."""
    return _reported(lambda: _ls(run_url, verify, storage_options))


def _ls(run_url: str, verify: bool, storage_options: dict[str, Any] | None) -> int:
    rows = [("step", "committed", "world", "stage", "size", *(("check",) if verify else ()), "url")]
    bad = 0
    for c in list_checkpoints(run_url, storage_options):
        row = [str(c.step), "yes" if c.committed else "no", str(c.world_size or "-"), str(c.stage if c.committed else "-")]
        row.append(_human(c.size_bytes))
        if verify:
            status = "-"
            if c.committed:
                try:
                    Checkpoint(c.url, storage_options).verify()
                    status = "ok"
                except CheckpointError as e:
                    status, bad = f"BAD: {e}", bad + 1
            row.append(status)
        rows.append((*row, c.url))
    if len(rows) == 1:
        print(f"no checkpoints under {run_url}")
        return 0
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(f"{v:<{w}}" for v, w in zip(r, widths)) + "  " + r[-1])
    return 1 if bad else 0


def export_command(
    checkpoint_url: str,
    out_dir: str,
    *,
    dtype: str | None,
    max_shard_size: str,
    storage_options: dict[str, Any] | None = None,
) -> int:
    """Export and print the files written."""

    def run() -> int:
        max_bytes = parse_size(max_shard_size)
        for name in export(checkpoint_url, out_dir, dtype=dtype, max_shard_bytes=max_bytes, storage_options=storage_options):
            print(name)
        return 0

    return _reported(run)
