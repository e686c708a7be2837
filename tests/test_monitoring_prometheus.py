"""A real Prometheus (Debian's ``prometheus``) scrapes the local Ray cluster during a real 2-worker run.

Prometheus finds the Ray nodes' metrics endpoints through the service-discovery file Ray writes in its
session directory, with the scrape config Ray generates there (what ``ray metrics launch-prometheus``
runs), at a 1 s scrape interval. The run trains zeroray's GPT at stage 3 and keeps reporting until
the test has seen what it waits for; then each rank writes its final ``memory_report()`` and
``comm_report(by_scope=True)``, and the test checks Prometheus holds exactly those values. Every wait polls a
condition with a deadline; nothing sleeps a fixed time.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.processes import stop
from tests.support.ray import run_config
from zeroray.monitoring import dashboard
from zeroray.monitoring import metrics as M

RUN = "prom-run"
DASHBOARDS = Path(__file__).resolve().parent.parent / "dashboards"
DEADLINE_S = 60.0


def _loop(config: dict[str, Any]) -> None:
    """Train until rank 0 sees the stop file (agreed by every rank), then record the final reports."""
    import torch
    import torch.distributed as dist

    import zeroray.train as zt
    from zeroray.models.gpt import GPT, GPTConfig

    ctx = zt.get_context()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    engine = zt.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(ctx.get_world_rank())
    stop_file, out = Path(config["stop"]), Path(config["out"])
    tokens = 0
    deadline = time.monotonic() + config["max_s"]
    while True:
        x = torch.randint(0, 64, (2, 16), generator=g)
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        tokens += x.numel()
        stop = torch.tensor([float(stop_file.exists() or time.monotonic() > deadline)])
        dist.broadcast(stop, src=0)
        zt.report({"loss": loss.item(), "tokens": tokens, "peak_flops": 1e12},
                  checkpoint=engine.global_step == 2)
        failed_once = out / "failed-once"
        if engine.global_step == 3 and ctx.get_world_rank() == 0 and not failed_once.exists():
            failed_once.write_text("")  # one restart: the second group resumes (from the step-3 snapshots)
            raise RuntimeError("planned failure, for the resume metrics")
        if stop.item():
            break
    final = {"global_step": engine.global_step, "memory": engine.memory_report(), "comm": engine.comm_report(by_scope=True)}
    (out / f"final-{ctx.get_world_rank()}.json").write_text(json.dumps(final))
    release = out / "release"
    while not release.exists() and time.monotonic() < deadline + config["max_s"]:
        time.sleep(0.05)  # keep the actors (and their gauges) alive until the test has read them


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """A prometheus process on a free port, scraping what Ray's generated config points at."""

    def __init__(self, binary: str, ray_config: Path, workdir: Path) -> None:
        config = yaml.safe_load(ray_config.read_text())
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"}
        for job in config["scrape_configs"]:
            job["file_sd_configs"][0]["refresh_interval"] = "1s"
        workdir.mkdir()
        path = workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (workdir / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={path}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )

    def wait_ready(self) -> None:
        wait_for(lambda: self._get("/-/ready") is not None, "Prometheus to be ready")

    def _get(self, path: str) -> bytes | None:
        try:
            with urllib.request.urlopen(self.url + path, timeout=2) as r:
                return r.read()
        except OSError:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}") from None
            return None

    def query(self, expr: str) -> list[dict[str, Any]]:
        body = self._get("/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        if body is None:
            return []
        data = json.loads(body)
        assert data["status"] == "success", (expr, data)
        return data["data"]["result"]

    def close(self) -> None:
        stop(self.proc)
        self.log.close()


def wait_for(cond, what, timeout_s: float = DEADLINE_S) -> Any:
    """Poll ``cond`` until it returns something true; ``what`` (a string or a callable giving one)
    names it in the timeout's error."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what() if callable(what) else what}")
        time.sleep(0.2)


@pytest.fixture
def prometheus_binary() -> str:
    """The binary, or a skip that names it, before the Ray cluster starts (the fixture below asks for it first)."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus binary: `apt-get install -y prometheus` (.ci/run installs it when apt exists)")
    return binary


@pytest.fixture
def prometheus(prometheus_binary, ray_cluster, tmp_path):
    binary = prometheus_binary
    import ray

    session = Path(ray._private.worker.global_worker.node.get_session_dir_path())
    ray_config = session / "metrics" / "prometheus" / "prometheus.yml"
    wait_for(ray_config.exists, f"Ray's generated {ray_config}")
    for attempt in range(3):  # the free port may be taken between picking it and Prometheus binding it
        prom = Prometheus(binary, ray_config, tmp_path / f"prometheus-{attempt}")
        try:
            prom.wait_ready()
            break
        except RuntimeError:
            prom.close()
            if attempt == 2:
                raise
    try:
        yield prom
    finally:
        prom.close()


def _values(prom: Prometheus, expr: str, label: str) -> dict[str, float]:
    """{value of ``label``: sample value} of an instant query."""
    return {s["metric"].get(label, ""): float(s["value"][1]) for s in prom.query(expr)}


def _wait_values(prom: Prometheus, expr: str, label: str, want: dict[str, float], exact: bool = False) -> None:
    """Poll until the query's values by ``label`` include ``want`` (or equal it, ``exact``)."""
    got: dict[str, float] = {}

    def matches() -> bool:
        got.clear()
        got.update(_values(prom, expr, label))
        return got == want if exact else {k: got.get(k) for k in want} == want

    wait_for(matches, lambda: f"{expr} by {label} to be {want}; it is {got}")


def _expr_for(expr: str) -> str:
    """A dashboard query as Prometheus takes it: ``$run`` is this run; Grafana's ``label_values(m, l)``
    (a variable's query) asks which values of ``l`` series of ``m`` have."""
    expr = expr.replace("$run", RUN)
    return re.sub(r"^label_values\((\w+), (\w+)\)$", r"count by (\2) (\1)", expr)


def test_prometheus_scrapes_every_dashboard_query(prometheus, ray_cluster, tmp_path):
    from zeroray.train import FailureConfig, ScalingConfig, ZeroTrainer

    out, nvme = tmp_path / "out", tmp_path / "nvme"
    out.mkdir()
    nvme.mkdir()
    trainer = ZeroTrainer(
        _loop,
        train_loop_config={"stop": str(out / "stop"), "out": str(out), "max_s": DEADLINE_S},
        # NVMe offload of the optimizer states, so the offload panels have data too.
        zero_config={"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)}},
                     "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0},
        scaling_config=ScalingConfig(num_workers=2),
        # In-memory snapshots every step, so the snapshot panel has data (the restart then resumes from them).
        run_config=run_config(tmp_path, RUN, failure_config=FailureConfig(max_failures=1, snapshot_interval=1)),
    )
    result: dict[str, Any] = {}
    fit = threading.Thread(target=lambda: result.update(r=trainer.fit()), daemon=True)
    fit.start()
    try:
        exprs = [e for path in sorted(DASHBOARDS.glob("*.json"))
                 for e in dashboard.expressions(json.loads(path.read_text()))]
        assert len(exprs) >= 12
        # The checkpoint at step 2 and the rates need a few reports; wait until every panel has data.
        empty: list[str] = []

        def all_have_data() -> bool:
            empty[:] = [e for e in exprs if not prometheus.query(_expr_for(e))]
            return not empty

        wait_for(all_have_data, lambda: f"every dashboard query to return data; still empty: {empty}")

        # Tags on every rank series: run, rank, node, stage (polled: a loaded machine may delay a refresh).
        def tagged() -> bool:
            series = prometheus.query(f'{M.STEP.prometheus}{{run="{RUN}"}}')
            return (sorted(s["metric"]["rank"] for s in series) == ["0", "1"]
                    and all(s["metric"]["stage"] == "3" and s["metric"]["node"] for s in series))

        wait_for(tagged, "both ranks' series tagged with run, rank, node and stage")
        wait_for(lambda: _values(prometheus, f'{M.WORLD_SIZE.prometheus}{{run="{RUN}"}}', "run") == {RUN: 2.0},
                 "world size 2")
        wait_for(lambda: _values(prometheus, f'{M.CONTROLLER_STATE.prometheus}{{run="{RUN}"}} == 1', "state")
                 == {"RUNNING": 1.0}, "the RUNNING state")

        (out / "stop").write_text("")
        finals = wait_for(lambda: [json.loads(p.read_text()) for p in sorted(out.glob("final-*.json"))]
                          if len(list(out.glob("final-*.json"))) == 2 else None, "the ranks' final reports")
        want_steps = {str(r): float(f["global_step"]) for r, f in enumerate(finals)}
        wait_for(lambda: _values(prometheus, f'{M.STEP.prometheus}{{run="{RUN}"}}', "rank") == want_steps,
                 "Prometheus to hold the last report")
        for rank, final in enumerate(finals):
            memory = {c: float(final["memory"][c]) for c in ("params", "grads", "optimizer", "buffers", "total")}
            _wait_values(prometheus, f'{M.MEMORY.prometheus}{{run="{RUN}", rank="{rank}"}}', "category", memory)
            comm = {k: float(v) for k, v in final["comm"].items()}
            assert comm
            _wait_values(prometheus, f'{M.COMM_BYTES.prometheus}{{run="{RUN}", rank="{rank}"}}', "kind", comm,
                         exact=True)
    finally:
        (out / "stop").write_text("")
        (out / "release").write_text("")
        fit.join(timeout=2 * DEADLINE_S)
    assert "r" in result and result["r"].error is None
    assert [a["end"] for a in json.loads((tmp_path / "runs" / RUN / "run.json").read_text())["attempt_history"]] == [
        "failure", "finished"]
    # The driver's gauges are re-sent for 3 export intervals after the end (so that the final state meets a
    # scrape on a busy machine), then no more: the final state was scraped, and the refresh thread ends.
    wait_for(lambda: prometheus.query(
        f'max_over_time({M.CONTROLLER_STATE.prometheus}{{run="{RUN}", state="FINISHED"}}[5m]) == 1'),
        "the FINISHED state")
    wait_for(lambda: not [t for t in threading.enumerate() if t.name == "zeroray-metrics"], "the refresh thread to end")
