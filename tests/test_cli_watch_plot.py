"""``zeroray watch`` and ``zeroray plot`` on the history of real ZeroTrainer runs (the local Ray cluster).

One finished 2-worker run (zeroray's GPT at stage 3) is read by ``watch --once`` (as a console
script, in a real process) and ``plot``, and copied to a real S3 endpoint (moto) to read it there. A
second run is followed live: it waits, between its reports, for a file the test writes, so watchers
start while it runs; one on a pipe follows it to its end by itself, one on a pseudo-terminal (rich's
Live view) is stopped with Ctrl-C. Every wait polls a condition with a deadline.
"""

from __future__ import annotations

import json
import os
import pty
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.ray import interruptible, run_config
from zeroray.cli import main
from zeroray.monitoring import run_history, watch

REPO = Path(__file__).resolve().parent.parent
STEPS = 6
DEADLINE_S = 120.0


def _loop(config: dict[str, Any]) -> None:
    """zeroray's GPT; reports loss, a running token count and an evaluation loss every 3 steps, saves a
    checkpoint at the last step, then reports a text sample and a final evaluation, which are no training
    step (as examples/train_gpt.py does). With ``gates`` ([step, file] pairs): at that step, wait for the
    file before going on (bounded)."""
    import torch

    import zeroray.train as zt
    from zeroray.models.gpt import GPT, GPTConfig

    ctx = zt.get_context()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    engine = zt.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(ctx.get_world_rank())
    tokens = 0
    while engine.global_step < config["steps"]:
        crash = config.get("crash_once")
        if crash and engine.global_step == 3 and ctx.get_world_rank() == 1 and not Path(crash).exists():
            Path(crash).write_text("crashed")
            raise RuntimeError("rank 1 fails once")
        for after, gate in config.get("gates", []):
            deadline = time.monotonic() + config["max_wait_s"]
            while engine.global_step == after and not Path(gate).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        x = torch.randint(0, 64, (2, 16), generator=g)
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        tokens += x.numel()
        metrics = {"loss": loss.item(), "tokens": tokens}
        if engine.global_step % 3 == 0:
            metrics["val_loss"] = loss.item() * 1.1
        zt.report(metrics, checkpoint=engine.global_step == config["steps"])
    with torch.no_grad():  # a sample: forward passes only, every rank (stage 3 gathers collectively)
        for _ in range(4):
            engine(torch.randint(0, 64, (1, 16), generator=g))
    zt.report({"sample": "text after the loop", "final_eval": 1.5})


def _trainer(tmp_path: Path, name: str, max_failures: int = 0, **config: Any):
    from zeroray.train import FailureConfig, ScalingConfig, ZeroTrainer

    return ZeroTrainer(
        _loop,
        train_loop_config={"steps": STEPS, **config},
        zero_config={"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 2},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=run_config(tmp_path, name, failure_config=FailureConfig(max_failures=max_failures)),
    )


@pytest.fixture(scope="module")
def finished_run(ray_cluster, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("watch")
    result = _trainer(tmp, "watched").fit()
    assert result.error is None
    return tmp / "runs" / "watched"


def _lines(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _entries(run: Path) -> list[dict[str, Any]]:
    """The reports that took a training step (all but the sample after the loop)."""
    return [e for e in _lines(run) if e["_steps"] != 0]


def _rows(out: str) -> dict[str, list[str]]:
    """The rank table's rows of a rich snapshot: {rank: cells}."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃]", line)[1:-1]]
        if cells and cells[0].isdigit():
            rows[cells[0]] = cells
    return rows


def _check_snapshot(out: str, entries: list[dict[str, Any]], status: str, name: str = "watched") -> None:
    """The snapshot shows the run, its status and every rank's latest step; rank 0 its latest loss."""
    last = entries[-1]
    assert f"run {name}" in out, out
    assert status in out, out
    assert f"loss {last['loss']:.4g}" in out, out
    assert f"val_loss {[e for e in entries if 'val_loss' in e][-1]['val_loss']:.4g}" in out, out
    assert f"reports {len(entries) + 1}  step {STEPS}  " in out, out
    assert f"reported after step {STEPS}, not a training step: sample  final_eval 1.5" in out, out
    rows = _rows(out)
    assert sorted(rows) == [str(r["rank"]) for r in last["_ranks"]], out
    for r in last["_ranks"]:
        cells = rows[str(r["rank"])]
        assert cells[1] == str(r["global_step"]) == str(STEPS), out
        assert cells[2] == (f"{last['loss']:.4g}" if r["rank"] == 0 else "-"), out
        assert cells[3] == watch._seconds(r["step_time_s"]), out


# ---------------------------------------------------------------------------------------- watch --once


def test_watch_once_shows_every_ranks_latest_step_and_loss(finished_run):
    done = subprocess.run(
        [sys.executable, "-m", "zeroray.cli", "watch", "--once", str(finished_run)],
        capture_output=True, text=True, timeout=DEADLINE_S, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    _check_snapshot(done.stdout, _entries(finished_run), "FINISHED")
    heads = next(line for line in done.stdout.splitlines() if "step time" in line)
    for head in ("forward", "backward", "optimizer", "comm wait", "model states", "RSS", "comm bytes"):
        assert head in heads


def test_watch_once_shows_memory_and_samples_per_second(finished_run, tmp_path, capsys):
    """With the batch per step in run.json (the trainer writes it), samples/s per rank is the batch's
    share over the step time."""
    run = tmp_path / "watched"
    shutil.copytree(finished_run, run)
    assert json.loads((run / "run.json").read_text())["samples_per_step"] == 4
    assert main(["watch", "--once", str(run)]) == 0
    out = capsys.readouterr().out
    last = _entries(run)[-1]
    rows = _rows(out)
    for r in last["_ranks"]:
        cells = rows[str(r["rank"])]
        assert cells[4] == f"{4 / 2 / r['step_time_s']:.4g}", out
        mib = r["memory"]["total"] / 1024**2
        assert f"{mib:.1f} MiB" in cells or f"{mib * 1024:.1f} KiB" in cells, (cells, r["memory"])
    assert f"samples/s {4 / last['_step_time_s']:.4g}" in out
    for entry in _lines(run):  # the peak is never below the RSS measured with it
        assert all(r["memory"]["process_peak_rss"] >= r["memory"]["process_rss"] for r in entry["_ranks"]), entry


def test_watch_and_plot_read_a_run_on_s3(finished_run, s3, tmp_path, capsys):
    import s3fs

    url = f"{s3['bucket']}/runs/watched"
    fs = s3fs.S3FileSystem(**s3["options"])
    for name in ("run.json", "metrics.jsonl"):
        fs.put_file(str(finished_run / name), f"{url}/{name}")
    endpoint = f"endpoint_url={s3['options']['endpoint_url']}"
    assert main(["watch", "--once", url, "-o", endpoint]) == 0
    _check_snapshot(capsys.readouterr().out, _entries(finished_run), "FINISHED")
    assert main(["plot", url, "-o", endpoint, "--out", f"{s3['bucket']}/plots"]) == 0
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{s3['bucket']}/plots")) == sorted(
        ["loss.png", "memory.png", "throughput.png", "world_size.png"])


# ---------------------------------------------------------------------------------------- plot


def test_plot_writes_decodable_pngs_of_the_history(finished_run, tmp_path, capsys):
    import matplotlib.image

    from zeroray.monitoring import plot

    out = tmp_path / "plots"
    assert main(["plot", str(finished_run), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert sorted(Path(p).name for p in printed) == sorted(plot.FILES)
    for name in plot.FILES:
        path = out / name
        assert path.stat().st_size > 1000
        pixels = matplotlib.image.imread(path)
        assert pixels.shape == (450, 800, 4), (name, pixels.shape)
        assert pixels[..., :3].std() > 0.01, f"{name} is blank"

    # What is drawn is the history's values.
    history = run_history.HistoryReader(str(finished_run)).read()
    entries = _entries(finished_run)
    loss_ax = plot._loss(history).axes[0]
    lines = {line.get_label(): line for line in loss_ax.get_lines()}
    assert list(lines["loss"].get_ydata()) == [e["loss"] for e in entries]
    assert list(lines["val_loss"].get_xdata()) == [3, 6]
    memory_lines = {line.get_label(): line for line in plot._memory(history).axes[0].get_lines()}
    for rank in (0, 1):
        want = [e["_ranks"][rank]["memory"]["total"] / 1024**2 for e in entries]
        assert list(memory_lines[f"rank {rank} model states"].get_ydata()) == want
    world = plot._world_size(history).axes[0].get_lines()[0]
    assert set(world.get_ydata()) == {2}
    throughput = plot._throughput(history).axes
    # run.json records the batch per step (micro-batch 2 x 2 ranks): samples/s, not steps/s.
    assert json.loads((finished_run / "run.json").read_text())["samples_per_step"] == 4
    assert [line.get_label() for ax in throughput for line in ax.get_lines()] == ["samples/s", "tokens/s"]


def test_a_report_after_the_loop_is_not_read_as_a_step(finished_run, tmp_path, capsys):
    """The sample after the loop took no optimizer step: it is marked so (``_steps`` 0, no step time),
    and watch and plot take the steps, step times and throughput from the training steps only."""
    from zeroray.monitoring import plot

    lines = _lines(finished_run)
    sample = lines[-1]
    assert sample["sample"] == "text after the loop" and len(lines) == STEPS + 1
    assert (sample["_global_step"], sample["_steps"], sample["_step_time_s"]) == (STEPS, 0, None)
    assert [(r["steps"], r["step_time_s"]) for r in sample["_ranks"]] == [(0, None), (0, None)]
    assert [e["_steps"] for e in lines[:-1]] == [1] * STEPS
    assert all(e["_step_time_s"] > 0 for e in lines[1:-1])

    history = run_history.HistoryReader(str(finished_run)).read()
    assert (history.reports, history.entries) == (lines, lines[:-1])
    assert history.steps() == list(range(1, STEPS + 1)) and history.after_last_step() == [sample]
    # The throughput line ends at the last step, at its own rate (the first report has no step time yet).
    line = plot._throughput(history).axes[0].get_lines()[0]
    assert list(line.get_xdata()) == list(range(2, STEPS + 1))
    assert list(line.get_ydata()) == [4 / e["_step_time_s"] for e in lines[1:-1]]

    run = tmp_path / "watched"
    shutil.copytree(finished_run, run)
    assert main(["watch", "--once", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"samples/s {4 / lines[-2]['_step_time_s']:.4g}" in out, out


def test_a_resume_with_no_step_left_appends_nothing(finished_run, tmp_path):
    """A new fit() of the finished run resumes from its checkpoint at the last step, trains no step and
    reports only the sample: metrics.jsonl stays as it was; the Result has the sample."""
    run = tmp_path / "runs" / "watched"
    shutil.copytree(finished_run, run)
    before = (run / "metrics.jsonl").read_bytes()
    result = _trainer(tmp_path, "watched").fit()
    assert result.error is None
    assert [(h["_global_step"], h["_steps"], h["sample"]) for h in result.metrics_history] == [
        (STEPS, 0, "text after the loop")]
    assert (run / "metrics.jsonl").read_bytes() == before


def test_a_restarted_run_shows_its_second_attempt(ray_cluster, tmp_path, capsys):
    """Rank 1 fails once at step 3; the group restarts (from scratch: no checkpoint) and finishes.
    watch shows the second attempt's reports; the world-size plot marks where the new group started."""
    from zeroray.monitoring import plot

    result = _trainer(tmp_path, "restarted", max_failures=1, crash_once=str(tmp_path / "crashed")).fit()
    assert result.error is None
    run = tmp_path / "runs" / "restarted"
    entries = _entries(run)
    assert [e["_attempt"] for e in entries] == [1] * 3 + [2] * STEPS
    assert main(["watch", "--once", str(run)]) == 0
    out = capsys.readouterr().out
    _check_snapshot(out, entries, "FINISHED", name="restarted")
    assert "attempt 2" in out and f"report {STEPS} of attempt 2" in out
    history = run_history.HistoryReader(str(run)).read()
    ax = plot._world_size(history).axes[0]
    marks = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert len(marks) == 1 and marks[0].get_xdata()[0] == history.elapsed_s()[3]
    assert [t.get_text() for t in ax.texts] == ["attempt 2"]


def test_plot_default_out_is_named_after_the_run(finished_run, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["plot", str(finished_run)]) == 0
    assert sorted(p.name for p in (tmp_path / "watched-plots").iterdir()) == sorted(
        ["loss.png", "memory.png", "throughput.png", "world_size.png"])


def test_plot_without_matplotlib_names_the_extra(finished_run, tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; from zeroray.cli import main; "
            f"sys.exit(main(['plot', {str(finished_run)!r}, '--out', {str(tmp_path / 'p')!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=DEADLINE_S,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "pip install 'zeroray[plot]'" in done.stderr, done.stderr
    assert not (tmp_path / "p").exists()


# ---------------------------------------------------------------------------------------- bad input


def _one_line(capsys: pytest.CaptureFixture, *words: str) -> None:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err


@pytest.mark.parametrize("command", ["watch", "plot"])
def test_a_url_with_no_run_fails_early(command, tmp_path, capsys):
    assert main([command, str(tmp_path / "nope")]) == 2
    _one_line(capsys, "no zeroray run at", "does not exist")
    assert main([command, str(tmp_path)]) == 2
    _one_line(capsys, "no zeroray run at", "has no run.json", "<storage_path>/<name>")


@pytest.mark.parametrize("argv", [["watch", "--once"], ["watch"], ["plot"]])
def test_a_run_with_no_history_fails_early(argv, finished_run, tmp_path, monkeypatch, capsys):
    """An ended run (or --once of any run) without a report; a live watch would wait for the first."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "silent"
    run.mkdir()
    shutil.copy(finished_run / "run.json", run / "run.json")
    assert main([*argv, str(run)]) == 2
    _one_line(capsys, "run 'watched'", "has no history yet", "metrics.jsonl", "FINISHED")
    assert not list(tmp_path.glob("*-plots"))


@pytest.mark.parametrize("interval", ["0", "-1", "nan", "soon"])
def test_bad_interval_is_a_usage_error(interval, capsys):
    with pytest.raises(SystemExit) as e:
        main(["watch", "run", "--interval", interval])
    assert e.value.code == 2
    _one_line(capsys, "--interval")


def test_file_names_match_the_trainers():
    from zeroray.train.driver import run_dir as storage

    assert (run_history.RUN_INFO, run_history.HISTORY) == (storage.RUN_INFO, storage.HISTORY)


# ---------------------------------------------------------------------------------------- following a live run


class _Output:
    """A process's output read by a thread into a queue, so the test waits on it with a deadline."""

    def __init__(self, stream: Any) -> None:
        self.text = ""
        self._q: queue.Queue[str | None] = queue.Queue()
        self._t = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._t.start()

    def _pump(self, stream: Any) -> None:
        try:
            for chunk in iter(lambda: os.read(stream, 4096), b""):
                self._q.put(chunk.decode(errors="replace"))
        except OSError:  # a pty's reader gets EIO once the child closed it
            pass
        self._q.put(None)

    def wait_for(self, pattern: str, what: str) -> str:
        deadline = time.monotonic() + DEADLINE_S
        while not re.search(pattern, self.text):
            try:
                chunk = self._q.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"timed out waiting for {what}; output so far:\n{self.text}") from None
            if chunk is None:
                raise AssertionError(f"output ended before {what}:\n{self.text}")
            self.text += chunk
        return self.text

    def rest(self) -> str:
        self._t.join(timeout=DEADLINE_S)
        while not self._q.empty():
            self.text += self._q.get() or ""
        return self.text


def _wait_file(path: Path, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not (path.exists() and path.stat().st_size):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_watch_follows_a_live_run_to_its_end(ray_cluster, tmp_path):
    """Started before the run's first report, a piped watch waits for it, follows the run and ends
    with it; a watch on a terminal (rich's Live view) stops cleanly on Ctrl-C."""
    first_gate, second_gate = tmp_path / "first", tmp_path / "second"
    trainer = _trainer(tmp_path, "followed", gates=[[0, str(first_gate)], [2, str(second_gate)]],
                       max_wait_s=DEADLINE_S)
    run = tmp_path / "runs" / "followed"
    result: dict[str, Any] = {}
    fit = threading.Thread(target=lambda: result.update(r=trainer.fit()), daemon=True)
    fit.start()
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", "LINES": "50"}
    argv = [sys.executable, "-m", "zeroray.cli", "watch", str(run), "--interval", "0.2"]
    procs: list[subprocess.Popen] = []
    try:
        _wait_file(run / "run.json", "the run's run.json")  # no report before the first gate opens
        piped = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, env=env)
        procs.append(piped)
        piped_out = _Output(piped.stdout.fileno())
        piped_out.wait_for("waiting for the first report", "the watch to wait for the first report")
        assert not (run / "metrics.jsonl").exists()

        first_gate.write_text("go")  # two reports (the first written at once), then a wait at the second gate
        first = piped_out.wait_for(r"RUNNING.*\n(.|\n)*│ +1 │ +[12] │", "a snapshot of the running run")
        assert "FINISHED" not in first
        assert first.count("run followed") <= 3, first  # a snapshot when the history changed, not every poll

        primary, replica = pty.openpty()
        tty = subprocess.Popen(argv, stdout=replica, stderr=replica, stdin=replica, cwd=REPO, env=env,
                               preexec_fn=interruptible)
        procs.append(tty)
        os.close(replica)
        tty_out = _Output(primary)
        tty_out.wait_for("comm wait", "the Live view on the terminal")
        tty.send_signal(signal.SIGINT)  # Ctrl-C: a clean stop
        assert tty.wait(timeout=DEADLINE_S) == 130
        assert "Traceback" not in tty_out.rest()

        second_gate.write_text("go")
        assert piped.wait(timeout=DEADLINE_S) == 0, piped.stderr.read().decode()
        out = piped_out.rest()
        assert "Traceback" not in piped.stderr.read().decode()
    finally:
        first_gate.write_text("go")
        second_gate.write_text("go")
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        fit.join(timeout=2 * DEADLINE_S)
    assert "r" in result and result["r"].error is None
    last_snapshot = out[out.rindex("run followed"):]
    _check_snapshot(last_snapshot, _entries(run), "FINISHED", name="followed")
