"""``zeroray plot``: PNG plots of a run's history, for people without Grafana.

Four figures from metrics.jsonl and run.json (:mod:`zeroray.monitoring.run_history`): the loop's
losses, throughput, memory per rank (against the optimizer step) and the world size over wall time.
Drawn with matplotlib's object API on the Agg canvas (no pyplot: no global backend switch, no
window), written to any fsspec URL. matplotlib is the ``plot`` extra.
"""

from __future__ import annotations

import io
import os
import posixpath
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from zeroray.monitoring.run_history import RunHistory, number
from zeroray.storage import join_url, open_url

WIDTH_IN, HEIGHT_IN, DPI = 8.0, 4.5, 100  # every PNG is 800 x 450 pixels
FILES = ("loss.png", "throughput.png", "memory.png", "world_size.png")
_MIB = 1024**2


class PlotDependencyError(ImportError):
    """matplotlib is not installed."""


def require_matplotlib() -> None:
    """Fail before any work when matplotlib is missing, naming the extra that installs it."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError as e:
        raise PlotDependencyError(
            "zeroray plot needs matplotlib, which is not installed: pip install 'zeroray[plot]'"
        ) from e


def _figure() -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI, layout="constrained")


def _empty(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, what, ha="center", va="center", transform=ax.transAxes)


def _step_axis(ax: Any) -> None:
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)


def _loss(history: RunHistory) -> Any:
    """Every numeric metric of the loop named like a loss (loss, val_loss, ...), as rank 0 reported it."""
    fig = _figure()
    ax = fig.add_subplot()
    steps = history.steps()
    keys = [k for k in history.latest_metrics() if "loss" in k.lower()]
    for key in keys:
        points = [(s, number(e.get(key))) for s, e in zip(steps, history.entries)]
        xs, ys = zip(*[(s, v) for s, v in points if v is not None])
        ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=key)
    if keys:
        ax.legend()
    else:
        _empty(ax, "the loop reported no loss")
    ax.set(title=f"{history.name}: loss (rank 0)", xlabel="optimizer step", ylabel="loss")
    _step_axis(ax)
    return fig


def _throughput(history: RunHistory) -> Any:
    """The group's samples/s (steps/s when the batch is unknown) from the slowest rank's step time,
    and tokens/s on a second axis when the loop reports a running ``tokens`` total."""
    fig = _figure()
    ax = fig.add_subplot()
    per_step = history.samples_per_step()
    label = "samples/s" if per_step else "steps/s"
    points = [(s, (per_step or 1.0) / t) for s, e in zip(history.steps(), history.entries)
              if (t := number(e.get("_step_time_s")))]
    if points:
        ax.plot(*zip(*points), color="C0", label=label)
    else:
        _empty(ax, "no step time yet (it needs two reports)")
    ax.set(title=f"{history.name}: throughput (group)", xlabel="optimizer step", ylabel=label)
    tokens = [(s, r) for s, r in zip(history.steps(), history.tokens_per_second()) if r is not None]
    if tokens:
        tx = ax.twinx()
        tx.plot(*zip(*tokens), color="C1", label="tokens/s")
        tx.set_ylabel("tokens/s")
        fig.legend(loc="outside lower center", ncols=2)
    _step_axis(ax)
    return fig


def _memory(history: RunHistory) -> Any:
    """Per rank, side by side (their scales differ by orders of magnitude on small models): the
    engine's persistent model states (``memory_report()['total']``), and the process's RSS and on
    GPUs the allocator's peak (activations and temporaries on top)."""
    fig = _figure()
    states, process = fig.subplots(1, 2)
    series: dict[tuple[int, str], list[tuple[int, float]]] = {}
    for step, entry in zip(history.steps(), history.entries):
        for r in entry.get("_ranks") or []:
            for key in ("total", "process_rss", "cuda_max_allocated"):
                if (v := number((r.get("memory") or {}).get(key))) is not None:
                    series.setdefault((int(r.get("rank", 0)), key), []).append((step, v / _MIB))
    names = {"total": "model states", "process_rss": "RSS", "cuda_max_allocated": "GPU peak"}
    styles = {"total": "-", "process_rss": "-", "cuda_max_allocated": ":"}
    for (rank, key), points in sorted(series.items()):
        ax = states if key == "total" else process
        ax.plot(*zip(*points), styles[key], color=f"C{rank % 10}", label=f"rank {rank} {names[key]}")
    for ax, title in ((states, "model states (memory_report)"), (process, "process")):
        if ax.get_lines():
            ax.legend(fontsize="small")
        else:
            _empty(ax, "not reported")
        ax.set(title=title, xlabel="optimizer step", ylabel="MiB")
        _step_axis(ax)
    fig.suptitle(f"{history.name}: memory per rank")
    return fig


def _world_size(history: RunHistory) -> Any:
    """Ranks in the group at each report against seconds since ``fit()`` started (continued across
    the run's fits); a dashed line where a new worker group starts (a restart, a resize)."""
    fig = _figure()
    ax = fig.add_subplot()
    sizes = [len(e.get("_ranks") or ()) for e in history.entries]
    elapsed = history.elapsed_s()
    ax.step(elapsed, sizes, where="post", marker=".")
    for i, (t, entry) in enumerate(zip(elapsed, history.entries)):
        if i and entry.get("_report") == 1:  # a group's first report: a restart, a resize or the next fit()
            ax.axvline(t, color="grey", linestyle="--")
            ax.annotate(f"attempt {entry.get('_attempt')}", (t, 0.5), rotation=90, ha="right", fontsize="small")
    ax.set_ylim(0, max(sizes) + 1)
    ax.set_xlim(left=0)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set(title=f"{history.name}: world size", xlabel="seconds since fit() started", ylabel="ranks")
    ax.grid(alpha=0.3)
    return fig


def default_out(run_url: str, storage_options: dict[str, Any] | None = None) -> str:
    """``./<name>-plots``, ``<name>`` the last part of the run's URL as the user gave it (resolved):
    never run.json's ``name``, which comes from storage and could be absolute, hold ``../`` or name
    another bucket."""
    fs, path = open_url(run_url, storage_options)
    if isinstance(fs, LocalFileSystem):
        path = os.path.abspath(path)
    name = posixpath.basename(path.rstrip("/"))
    return f"{name if name not in ('', '.', '..') else 'run'}-plots"


def plot_run(history: RunHistory, out_url: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Write the four PNGs under ``out_url`` (created if needed); returns their URLs."""
    require_matplotlib()
    figures = [_loss(history), _throughput(history), _memory(history), _world_size(history)]
    fs, out = open_url(out_url, storage_options)
    fs.makedirs(out, exist_ok=True)
    written = []
    for name, fig in zip(FILES, figures):
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=DPI)
        fs.pipe_file(posixpath.join(out, name), buf.getvalue())
        written.append(join_url(out_url, name))
    return written
