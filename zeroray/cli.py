"""The ``zeroray`` command. Each subcommand is a pair: ``_add_<name>(subparsers)`` declares its
arguments, ``cmd_<name>(args)`` runs it and returns the exit status."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_GIB = 1024**3


def parse_count(text: str) -> float:
    """``70e9``, ``7B``, ``125M`` or ``350k`` as a number, so sizes read as people write them."""
    s = text.strip().lower()
    try:
        if s and s[-1] in _SUFFIXES:
            return float(s[:-1]) * _SUFFIXES[s[-1]]
        return float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (e.g. 70e9, 7B, 125M)") from None


def _add_estimate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "estimate",
        help="per-rank memory of model states for each ZeRO stage",
        description="Per-rank bytes of parameters, gradients and optimizer states (ZeRO paper formulas).",
    )
    p.add_argument("--params", type=parse_count, required=True, help="parameter count, e.g. 70e9 or 7B")
    p.add_argument("--world-size", type=int, required=True, help="data-parallel ranks")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="one stage (default: all)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument(
        "--offload",
        choices=("none", "cpu", "nvme"),
        default="none",
        help="move optimizer states and master weights off the device",
    )
    p.add_argument(
        "--optimizer-bytes",
        type=int,
        default=None,
        help="optimizer bytes per parameter (default: Adam, 8 in fp32, 12 mixed)",
    )
    p.set_defaults(func=cmd_estimate)


def cmd_estimate(args: argparse.Namespace) -> int:
    """Print the estimate as a table in GiB."""
    from zeroray.estimate import estimate

    result = estimate(
        args.params, args.world_size, args.stage, args.precision, args.offload, args.optimizer_bytes
    )
    per_stage = result if args.stage is None else {args.stage: result}
    cols = ["params", "grads", "optimizer", "total"] + (["offloaded"] if args.offload != "none" else [])
    heads = {"total": "device total", "offloaded": f"offloaded ({args.offload})"}
    print(
        f"Model states per rank: {args.params:.4g} parameters, world size {args.world_size}, "
        f"{args.precision}, offload {args.offload} (GiB)"
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


def cmd_ls(args: argparse.Namespace) -> int:
    from zeroray.checkpoint.commands import ls, parse_storage_options

    return ls(args.run_url, verify=args.verify, storage_options=parse_storage_options(args.storage_option))


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a checkpoint as consolidated safetensors files",
        description="Write a checkpoint's weights as safetensors files cut by size plus an index JSON "
        "(the Hugging Face layout), streaming, with no process group.",
    )
    p.add_argument("checkpoint_url", help="a committed checkpoint directory (any fsspec URL)")
    p.add_argument("out_dir", help="where to write the files")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None, help="cast floating tensors (default: as saved)")
    p.add_argument("--max-shard-size", default="5GB", help="largest output file, e.g. 5GB or 500MiB")
    _add_storage_options(p)
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from zeroray.checkpoint.commands import export_command, parse_storage_options

    return export_command(
        args.checkpoint_url,
        args.out_dir,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        storage_options=parse_storage_options(args.storage_option),
    )


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="zeroray", description="ZeRO stages 0-3 for PyTorch, native to Ray."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_estimate(sub)
    _add_ls(sub)
    _add_export(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``zeroray`` console script."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
