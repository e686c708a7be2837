"""The Grafana dashboard "zeroray overview", generated from the declarative panel list below.

Every query is built from a :class:`~zeroray.monitoring.metrics.Metric` (``sel``), so a panel can
only name a metric zeroray exports; the tests regenerate the files and compare them with the
committed ones. Regenerate after editing::

    python -m zeroray.monitoring.dashboard          # writes dashboards/ and cluster/kuberay/grafana-dashboards.yaml
    python -m zeroray.monitoring.dashboard --check  # exit 1 when a committed file differs

Layout follows Ray's own generated dashboards: rows of panels, a data source variable and a
``run`` variable (``$run``) filled from the runs Prometheus has seen.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from zeroray.monitoring import metrics as M

TITLE = "zeroray overview"
UID = "zeroray-overview"
FILE_NAME = "zeroray-overview.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RUN = '=~"$run"'  # every query's run matcher


def sel(metric: M.Metric, **matchers: str) -> str:
    """A series selector for ``metric`` in the chosen runs; ``matchers`` values are PromQL matchers
    (``'="x"'``, ``'=~"a|b"'``)."""
    parts = [f"run{RUN}", *(f"{k}{v}" for k, v in matchers.items())]
    return f"{metric.prometheus}{{{', '.join(parts)}}}"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"  # or "stat"
    stacked: bool = False


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


def _q(expr: str, legend: str = "") -> tuple[Query, ...]:
    return (Query(expr, legend),)


PERSISTENT = '=~"params|grads|optimizer|buffers"'
COMM_WAIT = '="comm_wait"'
RSS = '="process_rss"'
PROCESS = '=~"process_rss|process_peak_rss|cuda_allocated|cuda_max_allocated"'

ROWS: tuple[Row, ...] = (
    Row("Training", (
        Panel("Loss", "The loss each rank last reported (metrics['loss']).",
              _q(sel(M.LOSS), "rank {{rank}}")),
        Panel("Optimizer step", "engine.global_step of the furthest rank.",
              _q(f"max by (run) ({sel(M.STEP)})", "{{run}}")),
        Panel("Step time by phase", "Mean seconds per optimizer step over the ranks: forward, backward, "
              "optimizer step, exposed communication wait, and the rest (data, the loop's own code, reports).",
              _q(f"avg by (phase) ({sel(M.PHASE_TIME)})", "{{phase}}"), unit="s", stacked=True),
        Panel("Step time per rank", "Wall time per optimizer step since each rank's previous report; a rank "
              "above the others is a straggler.", _q(sel(M.STEP_TIME), "rank {{rank}}"), unit="s"),
        Panel("Throughput", "Samples and tokens per second of the whole group (the ranks' shares summed). "
              "Tokens need the loop to report a running total 'tokens'.",
              (Query(f"sum by (run) ({sel(M.SAMPLES_PER_SECOND)})", "samples/s"),
               Query(f"sum by (run) ({sel(M.TOKENS_PER_SECOND)})", "tokens/s"))),
        Panel("MFU", "Model FLOPs utilization: model FLOPs per second over the device's peak, mean over the "
              "ranks. Needs a FLOPs count (zeroray's GPT, HF Llama-like, or 'flops_per_sample') and a peak "
              "(known GPUs, or 'peak_flops').", _q(f"avg by (run) ({sel(M.MFU)})", "{{run}}"), unit="percentunit"),
        Panel("Learning rate", "The optimizer's first param group.",
              _q(f"max by (run) ({sel(M.LEARNING_RATE)})", "{{run}}")),
        Panel("Gradient norm", "Global gradient norm before clipping (with gradient_clipping > 0).",
              _q(f"max by (run) ({sel(M.GRAD_NORM)})", "{{run}}")),
        Panel("Loss scale and skipped steps", "fp16 dynamic loss scale, and optimizer steps skipped on "
              "overflow in total (1 and 0 without fp16).",
              (Query(f"max by (run) ({sel(M.LOSS_SCALE)})", "loss scale"),
               Query(f"max by (run) ({sel(M.SKIPPED_STEPS)})", "skipped steps"))),
    )),
    Row("Memory", (
        Panel("Persistent memory by category", "What the engine holds between steps (memory_report()), "
              "summed over the ranks: parameters, gradients, optimizer (fp32 masters included), buffers.",
              _q(f"sum by (category) ({sel(M.MEMORY, category=PERSISTENT)})", "{{category}}"),
              unit="bytes", stacked=True),
        Panel("Persistent memory per rank", "memory_report()['total'] of each rank; ZeRO divides it by the "
              "world size as the stage rises.", _q(sel(M.MEMORY, category='="total"'), "rank {{rank}}"),
              unit="bytes"),
        Panel("Process memory per rank", "Resident set size and its peak; on GPUs the allocator's allocated "
              "bytes and their peak.", _q(sel(M.MEMORY, category=PROCESS), "rank {{rank}} {{category}}"),
              unit="bytes"),
    )),
    Row("Communication", (
        Panel("Bytes per collective kind", "Bytes moved since set-up per collective kind, summed over the "
              "ranks (comm_report(by_scope=True); an all-reduce counts twice its size). intra_node: kinds ran "
              "among ranks of one node, inter_node: kinds spanned nodes (hybrid sharding keeps only the "
              "gradient shards' all-reduce there).",
              _q(f"sum by (kind) ({sel(M.COMM_BYTES)})", "{{kind}}"), unit="bytes"),
        Panel("Traffic per collective kind", "Bytes per second each kind moved over the last report "
              "interval, summed over the ranks.",
              _q(f"sum by (kind) ({sel(M.COMM_BANDWIDTH)})", "{{kind}}"), unit="Bps", stacked=True),
        Panel("Exposed communication", "Share of the step each rank spent waiting for collectives it could "
              "not overlap with compute.",
              _q(f"{sel(M.PHASE_TIME, phase=COMM_WAIT)} / ignoring(phase) {sel(M.STEP_TIME)}",
                 "rank {{rank}}"), unit="percentunit"),
    )),
    Row("Checkpoints", (
        Panel("Checkpoint save", "Seconds of the last synchronous save, how long the last checkpointing "
              "report blocked the loop (an async save blocks only for its copy to host memory), and how long "
              "the last in-memory snapshot did (FailureConfig.snapshot_interval).",
              (Query(f"max by (run) ({sel(M.CHECKPOINT_SAVE_SECONDS)})", "save"),
               Query(f"max by (run) ({sel(M.CHECKPOINT_STALL_SECONDS)})", "step stall"),
               Query(f"max by (run) ({sel(M.SNAPSHOT_STALL_SECONDS)})", "snapshot stall")), unit="s"),
        Panel("Checkpoint size and count", "Bytes of the last checkpoint (every rank's shard summed) and the "
              "saves of the current attempt.",
              (Query(f"sum by (run) ({sel(M.CHECKPOINT_BYTES)})", "bytes"),
               Query(f"max by (run) ({sel(M.CHECKPOINT_SAVES)})", "saves")), unit="bytes"),
        Panel("Checkpoint load", "Seconds and bytes of the resume load in zt.prepare (after a restart, or a "
              "new fit() of the same run).",
              (Query(f"max by (run) ({sel(M.CHECKPOINT_LOAD_SECONDS)})", "seconds"),
               Query(f"sum by (run) ({sel(M.CHECKPOINT_LOAD_BYTES)})", "bytes"))),
    )),
    Row("Offload", (
        Panel("Offload I/O", "Bytes moved to and from the offload tier (CPU memory, NVMe) since set-up, "
              "summed over the ranks.",
              _q(f"sum by (tier, direction) ({sel(M.OFFLOAD_BYTES)})", "{{tier}} {{direction}}"), unit="bytes"),
        Panel("Offload bandwidth", "Offload traffic per second over the last report interval, summed over "
              "the ranks.",
              _q(f"sum by (tier, direction) ({sel(M.OFFLOAD_BANDWIDTH)})", "{{tier}} {{direction}}"), unit="Bps"),
    )),
    Row("Controller and cluster", (
        Panel("Controller state", "The driver's controller: SCHEDULING, RUNNING, RESTARTING, RESIZING, PREEMPTING, and "
              "at the end FINISHED, ERRORED or ABORTED.",
              _q(f"max by (state) ({sel(M.CONTROLLER_STATE)}) == 1", "{{state}}"), kind="stat"),
        Panel("World size", "Ranks in the current worker group.",
              _q(f"max by (run) ({sel(M.WORLD_SIZE)})", "{{run}}"), kind="stat"),
        Panel("Attempts, failures, resizes", "Worker groups started, group failures and resizes in this fit().",
              (Query(f"max by (run) ({sel(M.ATTEMPTS)})", "attempts"),
               Query(f"max by (run) ({sel(M.FAILURES)})", "failures"),
               Query(f"max by (run) ({sel(M.RESIZES)})", "resizes"))),
        Panel("Ranks per node", "How the placement group spread the ranks over the nodes (by node IP).",
              _q(f"count by (node) ({sel(M.STEP)})", "{{node}}"), kind="stat"),
        Panel("Resident memory per node", "The ranks' resident set sizes summed per node.",
              _q(f"sum by (node) ({sel(M.MEMORY, category=RSS)})", "{{node}}"), unit="bytes"),
    )),
)


def _panel_json(p: Panel, pid: int, x: int, y: int) -> dict:
    targets = [{"datasource": DATASOURCE, "expr": q.expr, "legendFormat": q.legend, "refId": chr(ord("A") + i)}
               for i, q in enumerate(p.queries)]
    out: dict = {"type": p.kind, "title": p.title, "description": p.description, "datasource": DATASOURCE,
                 "id": pid, "gridPos": {"h": 8, "w": 8, "x": x, "y": y}, "targets": targets}
    defaults: dict = {"unit": p.unit}
    if p.kind == "timeseries":
        custom: dict = {"fillOpacity": 10, "showPoints": "never"}
        if p.stacked:
            custom["stacking"] = {"group": "A", "mode": "normal"}
        defaults["custom"] = custom
        out["options"] = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                          "tooltip": {"mode": "multi", "sort": "none"}}
    else:
        out["options"] = {"colorMode": "value", "graphMode": "none", "justifyMode": "auto", "textMode": "auto",
                          "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}
    out["fieldConfig"] = {"defaults": defaults, "overrides": []}
    return out


def dashboard() -> dict:
    """The Grafana dashboard model (schemaVersion 39)."""
    panels: list[dict] = []
    y, pid = 0, 1
    for row in ROWS:
        panels.append({"type": "row", "title": row.title, "collapsed": False, "id": pid, "panels": [],
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        pid, y = pid + 1, y + 1
        for i, p in enumerate(row.panels):
            panels.append(_panel_json(p, pid, x=8 * (i % 3), y=y + 8 * (i // 3)))
            pid += 1
        y += 8 * ((len(row.panels) + 2) // 3)
    run_var = {
        "name": "run", "label": "run", "type": "query", "datasource": DATASOURCE,
        "query": {"query": f"label_values({M.STEP.prometheus}, run)", "refId": "run"},
        "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2, "sort": 1,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "options": [],
    }
    ds_var = {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
              "current": {}, "options": [], "refresh": 1, "hide": 0}
    return {
        "annotations": {"list": []},
        "description": "ZeRO training on Ray: time, throughput, memory, communication, checkpoints, offload, "
                       "controller. Generated by zeroray.monitoring.dashboard; do not edit by hand.",
        "editable": True,
        "graphTooltip": 1,
        "links": [],
        "panels": panels,
        "refresh": "10s",
        "schemaVersion": 39,
        "tags": ["zeroray", "ray"],
        "templating": {"list": [ds_var, run_var]},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": TITLE,
        "uid": UID,
        "version": 1,
    }


def expressions(model: dict) -> list[str]:
    """Every PromQL expression of a dashboard model: its panels' and its variables' queries."""
    exprs = [t["expr"] for p in model["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in model["templating"]["list"] if v["type"] == "query"]
    return exprs


def dashboard_json() -> str:
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"


PROVISION_DATASOURCE = """\
# Grafana provisioning: the Prometheus that scrapes the Ray nodes (change the URL to yours).
apiVersion: 1
datasources:
  - name: Prometheus
    type: prometheus
    uid: prometheus
    access: proxy
    url: http://localhost:9090
    isDefault: true
"""

PROVISION_DASHBOARDS = """\
# Grafana provisioning: load the dashboards of this folder (mount dashboards/ at /etc/zeroray/dashboards).
apiVersion: 1
providers:
  - name: zeroray
    folder: zeroray
    type: file
    disableDeletion: false
    allowUiUpdates: false
    options:
      path: /etc/zeroray/dashboards
      foldersFromFilesStructure: false
"""


def configmap_yaml(dashboard_text: str) -> str:
    """A ConfigMap that Grafana's dashboard sidecar (kube-prometheus-stack) loads: label grafana_dashboard."""
    body = "".join(f"    {line}\n" if line else "\n" for line in dashboard_text.splitlines())
    return (
        "# Generated by `python -m zeroray.monitoring.dashboard` from zeroray/monitoring/dashboard.py; do not edit.\n"
        "# Grafana's dashboard sidecar (kube-prometheus-stack: sidecar.dashboards.enabled, the default) loads every\n"
        "# ConfigMap labelled grafana_dashboard=\"1\" in its namespace:\n"
        "#   kubectl apply -f cluster/kuberay/grafana-dashboards.yaml\n"
        "apiVersion: v1\n"
        "kind: ConfigMap\n"
        "metadata:\n"
        "  name: zeroray-dashboards\n"
        "  namespace: prometheus-system        # CHANGE: the namespace of your Grafana\n"
        "  labels:\n"
        "    grafana_dashboard: \"1\"\n"
        "data:\n"
        f"  {FILE_NAME}: |\n"
        f"{body}"
    )


def outputs(root: Path) -> dict[Path, str]:
    """Every generated file under the repository ``root``, with its content."""
    text = dashboard_json()
    return {
        root / "dashboards" / FILE_NAME: text,
        root / "dashboards" / "provisioning" / "datasources" / "prometheus.yaml": PROVISION_DATASOURCE,
        root / "dashboards" / "provisioning" / "dashboards" / "zeroray.yaml": PROVISION_DASHBOARDS,
        root / "cluster" / "kuberay" / "grafana-dashboards.yaml": configmap_yaml(text),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zeroray.monitoring.dashboard", description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the repository root (default: .)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a committed file differs")
    args = parser.parse_args(argv)
    stale = []
    for path, text in outputs(args.root).items():
        current = path.read_text() if path.exists() else None
        if current == text:
            continue
        stale.append(path)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    for path in stale:
        print(f"{'out of date' if args.check else 'wrote'}: {path}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
