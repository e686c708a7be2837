"""The ``zeroray`` command. Each subcommand is a pair: ``_add_<name>(subparsers)`` declares its
arguments, ``cmd_<name>(args)`` runs it and returns the exit status. All printing of the command
lives here; the library packages only return values and raise.

Exit status: 0 success; 1 a checkpoint is bad (not committed, damaged, fails ``--verify``), or the
run ``watch`` followed ended ERRORED or ABORTED; 130 ``watch`` stopped by Ctrl-C;
2 a usage error — a bad argument value, a path that does not exist or is the wrong kind (``ls`` of
a checkpoint folder or of a folder of runs), storage that cannot be opened or read (no credentials,
unreachable) — reported as one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import posixpath
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from zeroray import __version__

_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_GIB = 1024**3
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_count(text: str) -> float:
    """``70e9``, ``7B``, ``125M`` or ``350k`` as a positive finite number, so sizes read as people write them."""
    s = text.strip().lower()
    try:
        n = float(s[:-1]) * _SUFFIXES[s[-1]] if s and s[-1] in _SUFFIXES else float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (e.g. 70e9, 7B, 125M)") from None
    if not math.isfinite(n) or n < 1:
        raise argparse.ArgumentTypeError(f"parameter count must be a finite number >= 1, got {text!r}")
    return n


def int_at_least(lowest: int):
    """An argparse type: an integer >= ``lowest`` (world sizes >= 1, bytes per parameter >= 0)."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if n < lowest:
            raise argparse.ArgumentTypeError(f"must be >= {lowest}, got {n}")
        return n

    return parse


def parse_size(text: str) -> int:
    """``5GB``, ``500MiB`` or ``123456`` as a positive number of bytes, the way Hugging Face writes shard sizes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MiB)")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 1:
        raise argparse.ArgumentTypeError(f"size must be at least 1 byte, got {text!r}")
    return n


def parse_storage_option(pair: str) -> tuple[str, Any]:
    """``KEY=VALUE`` for fsspec (the value as JSON when it parses, else a string)."""
    key, sep, value = pair.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"storage option {pair!r} is not KEY=VALUE")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line on stderr (exit 2) instead of usage plus message."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _fail(message: str) -> int:
    print(f"zeroray: error: {message}", file=sys.stderr)
    return 2


def _reported(fn: Callable[[], int]) -> int:
    """Run a command: a bad argument or unusable storage is exit 2, a bad checkpoint exit 1, one line each."""
    from zeroray.checkpoint import CheckpointError
    from zeroray.storage import StorageError

    try:
        return fn()
    except StorageError as e:  # CheckpointStorageError included
        return _fail(str(e))
    except CheckpointError as e:
        print(f"zeroray: {e}", file=sys.stderr)
        return 1


def whole_count(text: str) -> int:
    """A whole number >= 1 written as ``parse_count`` reads it: ``30M`` or ``1e9`` elements."""
    try:
        n = parse_count(text)
    except argparse.ArgumentTypeError:
        n = math.nan
    if not math.isfinite(n) or n != int(n):
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1 (e.g. 30M, 1e9), got {text!r}")
    return int(n)


def _add_estimate(sub: argparse._SubParsersAction) -> None:
    from zeroray.config import OffloadConfig, ZeroConfig  # no torch: --help stays fast

    sub_group_size, buffer_count = ZeroConfig().sub_group_size, OffloadConfig().buffer_count
    p = sub.add_parser(
        "estimate",
        help="per-rank memory of model states for each ZeRO stage",
        description="Per-rank bytes of parameters, gradients and optimizer states (ZeRO paper formulas), "
        "and of optimizer offload to host memory or NVMe files as the engine lays it out.",
    )
    p.add_argument("--params", type=parse_count, required=True, help="parameter count, e.g. 70e9 or 7B")
    p.add_argument("--world-size", type=int_at_least(1), required=True, help="data-parallel ranks")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="one stage (default: all)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument(
        "--offload",
        choices=("none", "cpu", "nvme"),
        default="none",
        help="move optimizer states and master weights off the device (stages 1-3)",
    )
    p.add_argument(
        "--offload-param",
        choices=("none", "cpu", "nvme"),
        default="none",
        help="move the stage-3 parameter shards off the device (stage 3 only)",
    )
    p.add_argument(
        "--shard-group-size",
        type=int_at_least(1),
        default=None,
        help="hybrid sharding (stages 1-3): shard over groups of this many ranks, replicate across them "
        "(e.g. the GPUs of one node; DeepSpeed's mics_shard_size)",
    )
    p.add_argument(
        "--hpz-partition-size",
        type=int_at_least(1),
        default=None,
        help="ZeRO++ hpZ (stage 3): a secondary copy of the parameters over this many ranks (a node), "
        "read by backward's gathers; adds the column params_secondary",
    )
    p.add_argument(
        "--largest-unit",
        type=whole_count,
        default=0,
        help="elements of the largest stage-3 unit (e.g. 12*d*d for a transformer block): sizes the parameter "
        "read buffers of --offload-param nvme (default 0: not counted)",
    )
    p.add_argument(
        "--optimizer-bytes",
        type=int_at_least(0),
        default=None,
        help="optimizer bytes per parameter (default: Adam, 8 in fp32, 12 mixed)",
    )
    p.add_argument(
        "--sub-group-size",
        type=whole_count,
        default=sub_group_size,
        help=f"elements the optimizer steps at once; sizes the NVMe swap buffers (default {sub_group_size:.0e})",
    )
    p.add_argument(
        "--buffer-count",
        type=int_at_least(1),
        default=buffer_count,
        help=f"NVMe swap buffers in host memory, one sub-group each (default {buffer_count})",
    )
    p.set_defaults(func=cmd_estimate)


def cmd_estimate(args: argparse.Namespace) -> int:
    """Print the estimate as a table in GiB."""
    from zeroray.estimate import estimate

    try:
        result = estimate(
            args.params, args.world_size, args.stage, args.precision, args.offload, args.optimizer_bytes,
            sub_group_size=args.sub_group_size, buffer_count=args.buffer_count,
            offload_param=args.offload_param, largest_unit=args.largest_unit, param_buffer_count=args.buffer_count,
            shard_group_size=args.shard_group_size, hpz_partition_size=args.hpz_partition_size,
        )
    except ValueError as e:
        return _fail(str(e))
    per_stage = result if args.stage is None else {args.stage: result}
    offloads = args.offload != "none" or args.offload_param != "none"
    hpz = args.hpz_partition_size not in (None, 1)
    cols = ["params", "grads", "optimizer"] + (["params_secondary"] if hpz else []) + ["total"]
    cols += ["host", "nvme"] if offloads else []
    heads = {"total": "device total"}
    settings = ""
    if args.offload == "nvme":
        settings = f" (sub_group_size {args.sub_group_size:.4g}, buffer_count {args.buffer_count})"
    print(
        f"Model states per rank: {args.params:.4g} parameters, world size {args.world_size}"
        f"{'' if args.shard_group_size is None else f' (shards over groups of {args.shard_group_size})'}, "
        f"{args.precision}, offload {args.offload}{settings}, offload_param {args.offload_param} (GiB)"
    )
    widths = [max(12, len(heads.get(c, c))) for c in cols]
    print(f"{'stage':>5}  " + "  ".join(f"{heads.get(c, c):>{w}}" for c, w in zip(cols, widths)))
    for stage, row in per_stage.items():
        print(f"{stage:>5}  " + "  ".join(f"{row[c] / _GIB:>{w}.3f}" for c, w in zip(cols, widths)))
    return 0


def _add_storage_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-o",
        "--storage-option",
        action="append",
        type=parse_storage_option,
        default=[],
        metavar="KEY=VALUE",
        help="fsspec storage option, e.g. endpoint_url=http://... (credentials: from the environment)",
    )


def _add_ls(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ls",
        help="list a run's checkpoints",
        description="List a run's checkpoints: step, committed or not, world size and stage that wrote it, size.",
    )
    p.add_argument("run_url", help="the run directory (any fsspec URL)")
    p.add_argument("--verify", action="store_true", help="read every committed checkpoint and check its checksums")
    _add_storage_options(p)
    p.set_defaults(func=cmd_ls)


def _human(n: int) -> str:
    units, x, i = ("B", "KiB", "MiB", "GiB", "TiB"), float(n), 0
    while x >= 1024 and i < len(units) - 1:
        x, i = x / 1024, i + 1
    return f"{x:.1f} {units[i]}" if i else f"{n} B"


def cmd_ls(args: argparse.Namespace) -> int:
    """Print the run's checkpoints; a broken one (torn manifest, missing or short rank file) is shown
    as such with its reason and the rest are listed. With ``--verify`` every committed one is read
    and checked. Exit 1 if any is broken or fails the check."""
    return _reported(lambda: _ls(args.run_url, args.verify, dict(args.storage_option)))


def _ls(run_url: str, verify: bool, options: dict[str, Any]) -> int:
    from zeroray.checkpoint import list_checkpoints
    from zeroray.checkpoint.storage import open_url

    fs, path = open_url(run_url, options)
    try:
        exists = fs.exists(path)
    except Exception as e:  # no credentials, unreachable endpoint
        return _fail(f"cannot read {run_url}: {type(e).__name__}: {e}")
    if not exists:
        return _fail(f"{run_url} does not exist")
    rows = [("step", "committed", "world", "stage", "size", *(("check",) if verify else ()), "url")]
    bad = 0
    for c in list_checkpoints(run_url, options):
        state = "yes" if c.committed else "broken" if c.broken else "no"
        row = [str(c.step), state, str(c.world_size or "-"), str(c.stage if c.committed else "-"), _human(c.size_bytes)]
        if verify:
            status = _verify(c.url, options) if c.committed else "-"
            if status is None:  # deleted since the listing (retention by a run saving now): gone
                continue
            bad += status.startswith("BAD")
            row.append(status)
        url = c.url
        if c.broken:
            url, bad = f"{c.url}  ({c.broken})", bad + 1
        rows.append((*row, url))
    if len(rows) == 1:
        return _no_checkpoints(run_url, options)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(f"{v:<{w}}" for v, w in zip(r, widths)) + "  " + r[-1])
    return 1 if bad else 0


def _verify(url: str, options: dict[str, Any]) -> str | None:
    """``ok``, ``BAD: <why>``, or None for a checkpoint deleted since it was listed."""
    from zeroray.checkpoint import CheckpointError, CheckpointReader
    from zeroray.checkpoint.storage import vanished

    try:
        CheckpointReader(url, options).verify()
    except CheckpointError as e:
        return None if vanished(url, options) else f"BAD: {e}"
    return "ok"


def _no_checkpoints(run_url: str, options: dict[str, Any]) -> int:
    """An empty run is exit 0; a checkpoint folder or a folder of runs given instead is a usage error
    that names the folder to list."""
    from zeroray.checkpoint.storage import is_checkpoint, parent_url, runs_under

    if is_checkpoint(run_url, options):
        return _fail(f"{run_url} is a checkpoint, not a run: list the run folder that holds it, "
                     f"zeroray ls {parent_url(run_url)}")
    runs = runs_under(run_url, options)
    if runs:
        names = ", ".join(posixpath.basename(r) for r in runs[:3]) + (", ..." if len(runs) > 3 else "")
        return _fail(f"no checkpoints directly under {run_url}, which holds {len(runs)} runs ({names}): "
                     f"list one of them, e.g. zeroray ls {runs[0]}")
    print(f"no checkpoints under {run_url}")
    return 0


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a checkpoint as consolidated safetensors files (the Hugging Face layout)",
        description="Write a checkpoint's weights as safetensors files cut by size plus an index JSON, and "
        "the model's config.json when it has a Hugging Face config (the Hugging Face layout: "
        "from_pretrained and zeroray.load_pretrained read the directory), streaming, with no process group.",
    )
    p.add_argument("checkpoint_url", help="a committed checkpoint directory (any fsspec URL)")
    p.add_argument("out_dir", help="where to write the files")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None, help="cast floating tensors (default: as saved)")
    p.add_argument("--max-shard-size", type=parse_size, default="5GB", help="largest output file, e.g. 5GB or 500MiB")
    _add_storage_options(p)
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    """Export and print the files written."""
    from zeroray.checkpoint import export

    def run() -> int:
        options = dict(args.storage_option)
        files = export(
            args.checkpoint_url, args.out_dir, dtype=args.dtype, max_shard_bytes=args.max_shard_size,
            storage_options=options,
        )
        for name in files:
            print(name)
        return 0

    return _reported(run)


def positive_float(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(x) or x <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return x


def _add_watch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "watch",
        help="a live terminal view of a run's latest metrics per rank",
        description="Show the run's status, the loop's latest metrics and each rank's latest step, step time "
        "by phase, memory and bytes moved, read from the run's history (run.json, metrics.jsonl), refreshed "
        "until the run ends. Exit 1 when it ended ERRORED or ABORTED.",
    )
    p.add_argument("run_url", help="the run directory, <storage_path>/<name> (any fsspec URL)")
    p.add_argument("--interval", type=positive_float, default=2.0, help="seconds between refreshes (default 2)")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    _add_storage_options(p)
    p.set_defaults(func=cmd_watch)


def cmd_watch(args: argparse.Namespace) -> int:
    """On a terminal a rich Live view; otherwise (a pipe, a log file) a new snapshot whenever the
    history changed. A run still starting (no report yet) is waited for; ``--once`` of it and a run
    that ended without reporting are errors."""
    try:
        return _reported(lambda: _watch(args.run_url, args.interval, args.once, dict(args.storage_option)))
    except KeyboardInterrupt:  # Ctrl-C: the Live view has restored the terminal on its way out
        return 130


def _watch(run_url: str, interval_s: float, once: bool, options: dict[str, Any]) -> int:
    from rich.console import Console
    from rich.live import Live

    from zeroray.monitoring.run_history import HistoryReader
    from zeroray.monitoring.watch import follow, render

    reader = HistoryReader(run_url, options)
    history = reader.poll()
    if once or history.ended:
        history.require_reports()
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 200))  # a pipe: no wrapping of the rank table
    if once:
        console.print(render(history))
        return 0
    if console.is_terminal:
        with Live(render(history), console=console, auto_refresh=False) as live:
            for history in follow(reader, interval_s):
                live.update(render(history), refresh=True)
    else:
        shown = None
        for history in follow(reader, interval_s):
            version = (len(history.reports), history.status, history.info.get("attempts"))
            if version != shown:  # not on every rewrite of run.json: the driver rewrites it every poll
                shown = version
                console.print(render(history))
                console.file.flush()
    return 0 if history.status == "FINISHED" else 1


def _add_plot(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plot",
        help="PNG plots of a run's loss, throughput, memory per rank and world size",
        description="Write loss.png, throughput.png, memory.png and world_size.png from the run's history "
        "(needs matplotlib: pip install 'zeroray[plot]').",
    )
    p.add_argument("run_url", help="the run directory, <storage_path>/<name> (any fsspec URL)")
    p.add_argument("--out", default=None,
                   help="directory for the PNGs, any fsspec URL (default: ./<last part of run_url>-plots)")
    _add_storage_options(p)
    p.set_defaults(func=cmd_plot)


def cmd_plot(args: argparse.Namespace) -> int:
    """Write the plots and print their URLs."""
    from zeroray.monitoring.plot import PlotDependencyError, default_out, plot_run, require_matplotlib
    from zeroray.monitoring.run_history import HistoryReader

    def run() -> int:
        options = dict(args.storage_option)
        history = HistoryReader(args.run_url, options).read()
        for url in plot_run(history, args.out or default_out(args.run_url, options), options):
            print(url)
        return 0

    try:
        require_matplotlib()
    except PlotDependencyError as e:
        return _fail(str(e))
    return _reported(run)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = _Parser(
        prog="zeroray", description="ZeRO stages 0-3 for PyTorch, native to Ray."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_estimate(sub)
    _add_ls(sub)
    _add_export(sub)
    _add_watch(sub)
    _add_plot(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``zeroray`` console script."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
