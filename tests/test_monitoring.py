"""Monitoring without Prometheus: the engine's phase times, FLOPs counts, the generated dashboard, and
the controller's gauges on a real Ray node's metrics endpoint."""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path

import pytest
import torch

import zeroray
from tests.support.dist import run_ranks
from zeroray.engine.phase_timer import PhaseTimer
from zeroray.models.gpt import GPT, GPTConfig
from zeroray.monitoring import dashboard, flops
from zeroray.monitoring import metrics as M

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------- phase times


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_nested_phase_is_subtracted_from_the_outer_one() -> None:
    timer = PhaseTimer(torch.device("cpu"))
    t0 = time.perf_counter()
    timer.start("optimizer")
    _spin(0.01)
    i0 = time.perf_counter()
    with timer.phase("comm_wait"):
        _spin(0.01)
    i1 = time.perf_counter()
    timer.stop("optimizer")
    t1 = time.perf_counter()
    times = timer.report()
    assert times.steps == 1
    assert 0.01 <= times.comm_wait_s <= i1 - i0
    assert 0.01 <= times.optimizer_s <= (t1 - t0) - times.comm_wait_s
    assert times.forward_s == times.backward_s == 0.0


def test_times_carry_over_until_an_optimizer_step_and_are_per_step() -> None:
    timer = PhaseTimer(torch.device("cpu"))
    for _ in range(2):  # two micro-steps of one accumulation cycle, then its optimizer step
        with timer.phase("forward"):
            _spin(0.002)
        assert timer.report().steps == 0
    with timer.phase("optimizer"):
        pass
    first = timer.report()
    assert first.steps == 1 and first.forward_s >= 0.004
    outside = 0.0
    for _ in range(2):
        t0 = time.perf_counter()
        with timer.phase("forward"):
            _spin(0.002)
        outside += time.perf_counter() - t0
        with timer.phase("optimizer"):
            pass
    second = timer.report()
    assert second.steps == 2 and 0.002 <= second.forward_s <= outside / 2  # the mean over the two steps


def test_a_phase_left_open_by_an_exception_is_dropped() -> None:
    timer = PhaseTimer(torch.device("cpu"))
    timer.start("optimizer")
    with pytest.raises(ValueError), timer.phase("comm_wait"):
        raise ValueError("boom")
    timer.start("backward")  # never stopped: an exception inside backward
    timer.stop("optimizer")
    times = timer.report()
    assert times.steps == 1 and times.backward_s == 0.0 and times.comm_wait_s >= 0.0


def test_a_step_that_raised_does_not_swallow_later_steps() -> None:
    timer = PhaseTimer(torch.device("cpu"))
    timer.start("optimizer")  # the optimizer raised: never stopped
    with timer.phase("forward"):
        _spin(0.002)
    timer.start("optimizer")
    timer.stop("optimizer")
    with timer.phase("forward"):
        _spin(0.002)
    timer.start("optimizer")
    timer.stop("optimizer")
    times = timer.report()
    assert times.steps == 2 and times.forward_s >= 0.001


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_phase_times_are_read_without_waiting_for_the_device() -> None:
    timer = PhaseTimer(torch.device("cuda"))
    with timer.phase("forward"):
        torch.cuda._sleep(2_000_000_000)  # keeps the GPU busy for about a second
    with timer.phase("optimizer"):
        pass
    first = timer.report()  # a report that synchronized would have counted the forward
    assert first.steps == 1 and first.forward_s == 0.0
    torch.cuda.synchronize()
    with timer.phase("optimizer"):
        pass
    torch.cuda.synchronize()
    second = timer.report()
    assert second.steps == 1 and second.forward_s > 0.1


def _engine_phases(rank: int, world: int, stage: int) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    engine = zeroray.initialize(model, torch.optim.AdamW(model.parameters()),
                                {"zero_optimization": {"stage": stage}, "gradient_accumulation_steps": 2})
    g = torch.Generator().manual_seed(rank)
    start = time.perf_counter()
    for _ in range(6):  # 3 optimizer steps
        x = torch.randint(0, 64, (2, 16), generator=g)
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()
    wall = time.perf_counter() - start
    with torch.no_grad():
        engine(x, x)  # evaluation: not a step's time
    first, second = engine.phase_report(), engine.phase_report()
    engine.close()
    return {"first": first, "second": second, "wall": wall, "steps": engine.global_step}


@pytest.mark.parametrize("stage", [1, 3])
def test_engine_reports_its_time_by_phase(stage: int) -> None:
    for r in run_ranks(_engine_phases, 2, stage):
        first = r["first"]
        assert first.steps == r["steps"] == 3
        assert min(first.forward_s, first.backward_s, first.optimizer_s, first.comm_wait_s) > 0
        assert sum(first.as_dict().values()) * first.steps <= r["wall"]
        assert r["second"].steps == 0 and sum(r["second"].as_dict().values()) == 0.0


# ---------------------------------------------------------------------------------------------- FLOPs


def _matmul_weights(model: torch.nn.Module) -> int:
    """Elements of every Linear weight: each does 2 FLOPs per element per token forward."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_gpt_flops_count_its_matmuls_and_attention() -> None:
    cfg = GPTConfig(vocab_size=100, block_size=32, n_layer=3, n_head=4, n_embd=64)
    model = GPT(cfg)
    expected = 6 * _matmul_weights(model) + 12 * cfg.n_layer * cfg.n_embd * 32
    assert flops.training_flops_per_token(model, 32) == expected


def test_llama_flops_count_its_matmuls_and_attention() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg)
    expected = 6 * _matmul_weights(model) + 12 * 2 * 64 * 48
    assert flops.training_flops_per_token(model, 48) == expected


def test_unknown_models_and_devices_give_none() -> None:
    assert flops.training_flops_per_token(torch.nn.Linear(3, 3), 8) is None
    assert flops.device_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert flops.device_peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert flops.device_peak_flops("NVIDIA H200", "bf16") == 989e12
    assert flops.device_peak_flops("NVIDIA GeForce GTX 1080", "bf16") is None


# ---------------------------------------------------------------------------------------------- dashboard


def test_committed_dashboard_files_are_what_the_description_generates() -> None:
    stale = [str(p.relative_to(ROOT)) for p, text in dashboard.outputs(ROOT).items()
             if not p.exists() or p.read_text() != text]
    assert not stale, f"regenerate with `python -m zeroray.monitoring.dashboard`: {stale}"
    assert dashboard.main(["--root", str(ROOT), "--check"]) == 0


def test_dashboard_has_its_rows_and_panels() -> None:
    model = dashboard.dashboard()
    rows = [p["title"] for p in model["panels"] if p["type"] == "row"]
    assert rows == ["Training", "Memory", "Communication", "Checkpoints", "Offload", "Controller and cluster"]
    panels = [p for p in model["panels"] if p["type"] != "row"]
    assert len(panels) >= 12
    assert len({p["id"] for p in model["panels"]}) == len(model["panels"])
    assert all(p["description"] and p["targets"] for p in panels)
    cells = [(p["gridPos"]["y"], p["gridPos"]["x"]) for p in model["panels"]]
    assert len(set(cells)) == len(cells)  # no two panels on one spot


def test_dashboard_is_a_grafana_dashboard_model() -> None:
    """Grafana's own model (grafana-foundation-sdk) reads every field the dashboard sets, with its value."""
    sdk = pytest.importorskip("grafana_foundation_sdk.models.dashboard")
    import json

    model = json.loads((ROOT / "dashboards" / dashboard.FILE_NAME).read_text())
    parsed = json.loads(json.dumps(sdk.Dashboard.from_json(model).to_json(),
                                   default=lambda o: o.to_json() if hasattr(o, "to_json") else str(o)))

    def lost(ours: object, theirs: object, path: str) -> list[str]:
        if isinstance(ours, dict):
            if not isinstance(theirs, dict):
                return [path]
            return [p for k, v in ours.items() for p in (lost(v, theirs[k], f"{path}/{k}") if k in theirs else [f"{path}/{k}"])]
        if isinstance(ours, list):
            if not isinstance(theirs, list) or len(ours) != len(theirs):
                return [path]
            return [p for i, (a, b) in enumerate(zip(ours, theirs)) for p in lost(a, b, f"{path}[{i}]")]
        return [] if ours == theirs else [path]

    assert lost(model, parsed, "") == []


def test_every_query_uses_only_metrics_zeroray_defines() -> None:
    defined = {m.prometheus for m in M.ALL}
    used: set[str] = set()
    for expr in dashboard.expressions(dashboard.dashboard()):
        # Every identifier followed by a selector or inside label_values() is a metric name.
        names = set(re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", expr)) | set(re.findall(r"label_values\((\w+)", expr))
        assert names and names <= defined, (expr, names - defined)
        used |= names
    assert defined - used == {M.REPORTS.prometheus}  # every other metric has a panel


# ---------------------------------------------------------------------------------------------- controller


def _scrape(url: str) -> dict[tuple[str, str], float]:
    """(metric name, label string) -> value for zeroray's series on a Ray node's endpoint."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"(ray_zeroray_\w+)\{(.*)\} (\S+)$", line)
        if m:
            out[(m.group(1), m.group(2))] = float(m.group(3))
    return out


def _value(scraped: dict, metric: M.Metric, **labels: str) -> float | None:
    for (name, label_text), v in scraped.items():
        if name == metric.prometheus and all(f'{k}="{val}"' in label_text for k, val in labels.items()):
            return v
    return None


def test_controller_gauges_count_attempts_failures_and_resizes(ray_cluster) -> None:
    from zeroray.train.driver import state as S
    from zeroray.train.driver.metrics import ControllerMetrics
    from zeroray.train.sizing import ScalingDecision

    run = "ctl-metrics"
    cb = ControllerMetrics(run)
    states = [S.Initializing(), S.Scheduling(ScalingDecision(2, {"CPU": 1})), S.Running(), S.Restarting([]),
              S.Scheduling(ScalingDecision(2, {"CPU": 1})), S.Running(), S.Resizing(ScalingDecision(3, {"CPU": 1})),
              S.Scheduling(ScalingDecision(3, {"CPU": 1})), S.Running()]
    previous = None
    for s in states:
        cb.after_state_change(previous, s)
        previous = s
    want = {M.ATTEMPTS: 3, M.FAILURES: 1, M.RESIZES: 1, M.WORLD_SIZE: 3}
    deadline = time.monotonic() + 30
    try:
        while True:
            got = _scrape(ray_cluster["metrics_url"])
            values = {m: _value(got, m, run=run) for m in want}
            state = {t.value: _value(got, M.CONTROLLER_STATE, run=run, state=t.value) for t in S.StateType}
            if values == want and state["RUNNING"] == 1 and sum(v or 0 for v in state.values()) == 1:
                break
            assert time.monotonic() < deadline, f"metrics endpoint shows {values}, states {state}"
            time.sleep(0.2)
    finally:
        cb.after_state_change(previous, S.Finished())  # stops the refresh thread
    assert cb.gauges._thread is None


def test_the_docs_describe_every_metric_and_panel() -> None:
    doc = (ROOT / "docs" / "monitoring.md").read_text()
    assert [m.prometheus for m in M.ALL if f"`{m.prometheus}`" not in doc] == []
    titles = [p.title for row in dashboard.ROWS for p in row.panels]
    assert [t for t in titles if f"| {t} |" not in doc] == []
