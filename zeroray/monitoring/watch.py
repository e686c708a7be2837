"""``zeroray watch``: the latest report of every rank as a terminal table, for people without Grafana.

Everything comes from the run's directory (:mod:`zeroray.monitoring.run_history`), so it works from
any machine that can read the run's URL, during the run or after it. ``render`` builds one snapshot
(a rich renderable); ``follow`` polls the directory until run.json says the run ended. The command
(zeroray/cli.py) prints.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from zeroray.monitoring.run_history import HistoryReader, RunHistory, number

_STATUS_STYLE = {"RUNNING": "green", "FINISHED": "bold green", "ERRORED": "bold red", "ABORTED": "bold red",
                 "RESTARTING": "yellow", "RESIZING": "yellow"}
_PHASES = ("forward", "backward", "optimizer", "comm_wait")


def _bytes(n: Any) -> str:
    x = number(n)
    if x is None:
        return "-"
    units, i = ("B", "KiB", "MiB", "GiB", "TiB"), 0
    while abs(x) >= 1024 and i < len(units) - 1:
        x, i = x / 1024, i + 1
    return f"{x:.0f} B" if i == 0 else f"{x:.1f} {units[i]}"


def _seconds(s: Any) -> str:
    x = number(s)
    if x is None:
        return "-"
    return f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s"


def _value(v: float) -> str:
    return f"{v:.4g}" if v != int(v) or abs(v) >= 1e6 else str(int(v))


def _summary(history: RunHistory, now: float) -> Text:
    info, latest = history.info, history.latest or {}
    text = Text()
    text.append(f"run {history.name}  ", style="bold")
    text.append(history.status, style=_STATUS_STYLE.get(history.status, ""))
    world = len(latest.get("_ranks") or ()) or info.get("num_workers")
    parts = [f"attempt {info.get('attempts', '-')}", f"world size {world or '-'}",
             f"reports {len(history.reports)}"]
    if history.entries:
        parts += [f"step {history.steps()[-1]}", f"elapsed {history.elapsed_s()[-1]:.1f} s"]
    updated = number(info.get("updated_at"))
    if updated is not None:
        parts.append(f"run.json written {max(now - updated, 0.0):.0f} s ago")
    text.append("  " + "  ".join(parts))
    if info.get("error"):
        text.append(f"\nerror: {info['error']}", style="red")
    if info.get("metrics_error"):
        text.append(f"\nmetrics.jsonl not written: {info['metrics_error']}", style="red")
    return text


def _metrics_line(history: RunHistory) -> Text:
    """The loop's own metrics (rank 0's, as reported) and the group's throughput."""
    parts = [f"{k} {_value(v)}" for k, v in history.latest_metrics().items()]
    step_time = number((history.latest or {}).get("_step_time_s"))
    if step_time:
        parts.append(f"steps/s {1 / step_time:.3g}")
        if (per_step := history.samples_per_step()) is not None:
            parts.append(f"samples/s {per_step / step_time:.4g}")
    tokens = [r for r in history.tokens_per_second() if r is not None]
    if tokens:
        parts.append(f"tokens/s {tokens[-1]:.4g}")
    return Text("metrics (rank 0): " + ("  ".join(parts) if parts else "-"))


def _after_last_step(history: RunHistory) -> Text | None:
    """What the loop reported after its latest step without taking one (a text sample, a final
    evaluation): its numbers, and the names of the rest. Not a step: no step time, no throughput."""
    later = history.after_last_step()
    if not later:
        return None
    values: dict[str, str] = {}
    for entry in later:
        for k, v in entry.items():
            if not k.startswith("_"):
                x = number(v)
                values[k] = f"{k} {_value(x)}" if x is not None else k
    step = history.steps()[-1] if history.entries else "-"
    return Text(f"reported after step {step}, not a training step: " + ("  ".join(values.values()) or "-"))


def _rank_table(history: RunHistory) -> Table:
    """One row per rank of the latest report's group."""
    latest = history.latest or {}
    ranks = latest.get("_ranks") or []
    cuda = any("cuda_max_allocated" in (r.get("memory") or {}) for r in ranks)
    per_step = history.samples_per_step()
    table = Table(title=f"latest report per rank (report {latest.get('_report', '-')} of attempt "
                        f"{latest.get('_attempt', '-')})", title_justify="left")
    heads = ["rank", "step", "loss", "step time", *(["samples/s"] if per_step else []), "forward", "backward",
             "optimizer", "comm wait", "model states", "RSS", "peak RSS", *(["GPU peak"] if cuda else []),
             "comm bytes"]
    for head in heads:
        table.add_column(head, justify="right", no_wrap=True)
    loss = number(latest.get("loss"))
    for r in ranks:
        memory, phases = r.get("memory") or {}, r.get("phases") or {}
        step_time = number(r.get("step_time_s"))
        step = r.get("global_step")
        row = [str(r.get("rank")), str(step if step is not None else latest.get("_report", "-")),
               # only rank 0's metrics travel to the driver: other ranks' losses are not in the history
               _value(loss) if loss is not None and r.get("rank") == 0 else "-",
               _seconds(step_time)]
        if per_step:
            row.append(f"{per_step / len(ranks) / step_time:.4g}" if step_time else "-")
        row += [_seconds(phases.get(p)) for p in _PHASES]
        row += [_bytes(memory.get("total")), _bytes(memory.get("process_rss")), _bytes(memory.get("process_peak_rss"))]
        if cuda:
            row.append(_bytes(memory.get("cuda_max_allocated")))
        row.append(_bytes(sum(v for v in (r.get("comm_bytes") or {}).values() if number(v) is not None)))
        table.add_row(*row)
    return table


def render(history: RunHistory, now: float | None = None) -> RenderableType:
    """One snapshot: the run's status, the loop's latest metrics and a table of the ranks."""
    now = time.time() if now is None else now
    if not history.entries:
        return Group(_summary(history, now), Text("waiting for the first report ..."))
    after = _after_last_step(history)
    return Group(_summary(history, now), _metrics_line(history), *([after] if after else []), _rank_table(history))


def follow(reader: HistoryReader, interval_s: float) -> Iterator[RunHistory]:
    """The run's history every ``interval_s`` seconds, the last one once run.json says the run ended."""
    while True:
        history = reader.poll()
        yield history
        if history.ended:
            return
        time.sleep(interval_s)
