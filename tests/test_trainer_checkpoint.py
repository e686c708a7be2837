"""Sharded checkpoints through ZeroTrainer on a real local Ray cluster: zt.report(checkpoint=True)
saves, retention keeps num_to_keep, a restart after a real process kill resumes from the last
committed checkpoint with the numerics of an uninterrupted run, and a new fit() resumes the run at
another world size and stage. Every test checks that nothing is left behind."""

from __future__ import annotations

import json
import logging
import os
import signal

import pytest
import torch

import zeroray.checkpoint as zc
import zeroray.train as zt
from tests.support.ray import assert_nothing_left, run_config
from zeroray.train import (
    CheckpointConfig,
    FailureConfig,
    ReportMismatchError,
    ScalingConfig,
    TrainingFailedError,
    ZeroTrainer,
)


def _stage(stage: int) -> dict:
    return {"zero_optimization": {"stage": stage}}




def _loop(config):
    """Regression toward a fixed linear map. A step's batch depends only on the step and the rank, so a
    resumed run sees the data an uninterrupted one sees. Saves every ``every`` optimizer steps. "eval" is
    the loss on one fixed batch after the step; "start_eval" the same right after zt.prepare."""
    rank = zt.get_context().get_world_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    engine = zt.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.03))
    w_true = torch.linspace(-1.0, 1.0, 6).unsqueeze(1)
    eval_x = torch.randn(32, 6, generator=torch.Generator().manual_seed(7))

    def evaluate() -> float:
        with torch.no_grad():
            return ((engine(eval_x) - eval_x @ w_true) ** 2).mean().item()

    start, start_eval = engine.global_step, evaluate()
    for step in range(start, config["steps"]):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1000 * step + rank))
        loss = ((engine(x) - x @ w_true) ** 2).mean()
        engine.backward(loss)
        engine.step()
        if rank == 1 and engine.global_step == config.get("kill_at") and not os.path.exists(config["marker"]):
            open(config["marker"], "w").close()  # the first attempt only
            os.kill(os.getpid(), signal.SIGKILL)
        metrics = {"loss": loss.item(), "eval": evaluate(), "step": engine.global_step, "start": start,
                   "start_eval": start_eval, "pid": os.getpid()}
        zt.report(metrics, checkpoint=engine.global_step % config["every"] == 0)
    if config.get("weights"):
        zt.report({"weights": {k: v.tolist() for k, v in engine.full_state_dict().items()}})


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_checkpoints_are_saved_and_the_newest_num_to_keep_stay(ray_cluster, tmp_path, async_save):
    name = f"keep-two-{'async' if async_save else 'sync'}"
    result = ZeroTrainer(
        _loop,
        train_loop_config={"steps": 8, "every": 2},
        zero_config=_stage(2),
        scaling_config=ScalingConfig(num_workers=2),
        run_config=run_config(tmp_path, name, checkpoint_config=CheckpointConfig(num_to_keep=2,
                                                                                  async_save=async_save)),
    ).fit()

    # Saved at steps 2, 4, 6, 8; retention kept the newest two, and (async too) the last is committed by
    # the time fit() returns: the end of the loop joins the save in flight.
    infos = zc.list_checkpoints(result.path)
    assert [(c.step, c.committed, c.world_size, c.stage, c.global_step) for c in infos] == [
        (6, True, 2, 2, 6), (8, True, 2, 2, 8)
    ]
    run_dir = tmp_path / "runs" / name
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoint_6", "checkpoint_8", "epoch.json", "epoch.json.lock",
                                                         "metrics.jsonl", "run.json"]
    assert [c.epoch for c in infos] == [1, 1]  # the one attempt's fencing epoch
    assert result.checkpoint == zt.Checkpoint(path=infos[-1].url, step=8)
    zc.CheckpointReader(result.checkpoint.path).verify()
    assert [h["step"] for h in result.metrics_history] == list(range(1, 9))
    assert_nothing_left(name, [result.metrics["pid"]])


def test_a_killed_rank_restarts_the_group_from_the_last_committed_checkpoint(ray_cluster, tmp_path):
    common = {"zero_config": _stage(3), "scaling_config": ScalingConfig(num_workers=2)}
    config = {"steps": 8, "every": 2, "weights": True}
    reference = ZeroTrainer(_loop, train_loop_config=config, run_config=run_config(tmp_path, "uninterrupted"),
                            **common).fit()
    marker = tmp_path / "killed"
    result = ZeroTrainer(
        _loop,
        train_loop_config={**config, "kill_at": 5, "marker": str(marker)},
        run_config=run_config(tmp_path, "killed", failure_config=FailureConfig(max_failures=1)),
        **common,
    ).fit()

    # Rank 1 died after step 5; checkpoint_4 was committed (a sync save returns after the commit), so
    # the second group resumed there: its first report is step 5 of a loop that started at 4.
    assert marker.exists() and result.attempts == 2
    history = [h for h in result.metrics_history if "step" in h]
    first = [h["step"] for h in history if h["_attempt"] == 1]
    second = [h for h in history if h["_attempt"] == 2]
    assert first == list(range(1, len(first) + 1)) and len(first) <= 4
    assert (second[0]["start"], second[0]["step"]) == (4, 5)
    assert [h["step"] for h in second] == [5, 6, 7, 8]

    # Same losses and final weights, bit for bit, as the run that was never interrupted.
    ref_losses = {h["step"]: h["loss"] for h in reference.metrics_history if "step" in h}
    assert [h["loss"] for h in second] == [ref_losses[s] for s in (5, 6, 7, 8)]
    weights, ref_weights = result.metrics["weights"], reference.metrics["weights"]
    assert weights.keys() == ref_weights.keys()
    for k in weights:
        assert torch.equal(torch.tensor(weights[k]), torch.tensor(ref_weights[k])), k
    assert result.checkpoint.step == 8
    assert_nothing_left("uninterrupted", [reference.metrics_history[0]["pid"]])
    assert_nothing_left("killed", list({h["pid"] for h in history}))


def test_a_new_fit_resumes_the_run_at_another_world_size_and_stage(ray_cluster, tmp_path, caplog):
    rc = run_config(tmp_path, "resized")
    first = ZeroTrainer(_loop, train_loop_config={"steps": 4, "every": 4}, zero_config=_stage(3),
                        scaling_config=ScalingConfig(num_workers=2), run_config=rc).fit()
    assert first.checkpoint.step == 4
    with caplog.at_level(logging.INFO, logger="zeroray.train"):
        second = ZeroTrainer(_loop, train_loop_config={"steps": 8, "every": 4}, zero_config=_stage(1),
                             scaling_config=ScalingConfig(num_workers=3), run_config=rc).fit()
    assert "run 'resized': resuming from checkpoint_4 (written at world 2, stage 3)" in caplog.text
    # The run's history on storage holds both fits, the second appended after the first.
    lines = [json.loads(line) for line in (tmp_path / "runs" / "resized" / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in lines] == [1, 2, 3, 4, 5, 6, 7, 8]

    h1, h2 = first.metrics_history, second.metrics_history
    assert [h["step"] for h in h2] == [5, 6, 7, 8] and {h["start"] for h in h2} == {4}
    # The second fit starts from the first one's weights (the loss on a fixed batch right after
    # zt.prepare is the first fit's last one), not from the untrained model's, and keeps improving.
    assert h2[0]["start_eval"] == pytest.approx(h1[-1]["eval"], rel=1e-6)
    assert h2[0]["start_eval"] < 0.5 * h1[0]["start_eval"]
    assert h2[-1]["eval"] < h2[0]["start_eval"]
    infos = zc.list_checkpoints(first.path)
    assert [(c.step, c.world_size, c.stage) for c in infos] == [(4, 2, 3), (8, 3, 1)]
    assert second.checkpoint == zt.Checkpoint(infos[-1].url, 8)
    assert_nothing_left("resized", [first.metrics["pid"], second.metrics["pid"]])


def _report_before_prepare():
    zt.report({"x": 1}, checkpoint=True)


def test_checkpoint_report_before_prepare_is_a_clear_error(ray_cluster, tmp_path):
    with pytest.raises(TrainingFailedError, match=r"zt\.prepare\(\) has not been called") as info:
        ZeroTrainer(_report_before_prepare, run_config=run_config(tmp_path, "no-engine")).fit()
    assert "RuntimeError" in str(info.value) and info.value.result.checkpoint is None
    assert zc.list_checkpoints(str(tmp_path / "runs" / "no-engine")) == []
    assert_nothing_left("no-engine")


def _rank0_checkpoints_alone():
    model = torch.nn.Linear(2, 1)
    zt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    zt.report({"x": 1}, checkpoint=zt.get_context().get_world_rank() == 0)


def test_ranks_that_disagree_on_checkpoint_fail_instead_of_hanging(ray_cluster, tmp_path):
    with pytest.raises(TrainingFailedError, match="checkpoint=True.* must be called by every rank") as info:
        ZeroTrainer(_rank0_checkpoints_alone, scaling_config=ScalingConfig(num_workers=2),
                    run_config=run_config(tmp_path, "disagree")).fit()
    assert ReportMismatchError.__name__ in str(info.value)
    assert zc.list_checkpoints(str(tmp_path / "runs" / "disagree")) == []
    assert_nothing_left("disagree")
