"""The engine under ZeroTrainer gives what the same loop gives under torch multiprocessing.

One loop body, two launchers: Ray actors formed by ZeroTrainer (zt.prepare) and processes spawned by
torch.multiprocessing (zeroray.initialize on a gloo group). Same seeds, same data per rank, one thread
per rank in both, so the losses and final weights must agree.
"""

from __future__ import annotations

import torch

import zeroray
import zeroray.train as zt
from tests.support.dist import run_ranks
from tests.support.models import TinyLM, batches
from tests.support.ray import assert_nothing_left
from tests.support.recipe import train
from zeroray.train import RunConfig, ScalingConfig, ZeroTrainer

STEPS = 4
DS_CONFIG = {"zero_optimization": {"stage": 3}, "gradient_clipping": 1.0}


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyLM()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(engine, rank: int, on_step) -> dict[str, torch.Tensor]:
    """The loop body both launchers run; returns the full (gathered) weights."""
    train(engine, batches(rank, STEPS)[engine.global_step:], on_step=on_step)
    return {k: v.detach().clone() for k, v in engine.full_state_dict().items()}


def _trainer_loop():
    model, opt = _model_and_optimizer()
    engine = zt.prepare(model, opt)
    rank = zt.get_context().get_world_rank()
    weights = _train(engine, rank, lambda loss: zt.report({"loss": loss}))
    zt.report({"weights": {k: v.tolist() for k, v in weights.items()}})


def _mp_worker(rank: int, world: int) -> dict:
    model, opt = _model_and_optimizer()
    engine = zeroray.initialize(model, opt, config=DS_CONFIG)
    losses: list[float] = []
    weights = _train(engine, rank, losses.append)
    return {"losses": losses, "weights": weights}


def _fit(loop, name: str, tmp_path):
    """``loop`` under ZeroTrainer: 2 ranks, DS_CONFIG, run ``name`` under ``tmp_path``."""
    return ZeroTrainer(
        loop,
        zero_config=DS_CONFIG,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=name, storage_path=str(tmp_path), progress_bar=False),
    ).fit()


def test_trainer_run_matches_torch_multiprocessing(ray_cluster, tmp_path):
    result = _fit(_trainer_loop, "engine-parity", tmp_path)
    reference = run_ranks(_mp_worker, 2)[0]

    history = result.metrics_history
    losses = [h["loss"] for h in history[:STEPS]]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference["losses"]), rtol=1e-6, atol=1e-7)
    weights = result.metrics["weights"]
    assert weights.keys() == reference["weights"].keys()
    for name, ref in reference["weights"].items():
        torch.testing.assert_close(torch.tensor(weights[name]), ref, rtol=1e-5, atol=1e-6, msg=name)

    # The engine's step count and every rank's memory by category travel with each report.
    assert [h["_global_step"] for h in history[:STEPS]] == list(range(1, STEPS + 1))
    for h in history[:STEPS]:
        assert [r["rank"] for r in h["_ranks"]] == [0, 1]
        for r in h["_ranks"]:
            assert r["global_step"] == h["_global_step"]
            assert r["memory"]["params"] > 0 and r["memory"]["optimizer"] > 0
    n_params = sum(p.numel() for p in TinyLM().parameters())
    # Stage 3: a rank persistently holds about half of the fp32 parameters, not all of them.
    assert result.memory_by_rank[0]["params"] < 0.75 * n_params * 4
    assert_nothing_left("engine-parity")


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"].get("unique_graphs", 0)


def _compiled_trainer_loop():
    model, opt = _model_and_optimizer()
    engine = zt.prepare(model, opt, compile=True)
    rank = zt.get_context().get_world_rank()
    _train(engine, rank, lambda loss: zt.report({"loss": loss, "graphs": _graphs()}))


def _compiled_mp_worker(rank: int, world: int) -> list[float]:
    model, opt = _model_and_optimizer()
    engine = zeroray.initialize(model, opt, config={**DS_CONFIG, "compile": {"deepcompile": True}})
    losses: list[float] = []
    _train(engine, rank, losses.append)
    return losses


def test_prepare_compile_compiles_each_block_once_as_the_deepspeed_compile_block_does(ray_cluster, tmp_path):
    """``zt.prepare(compile=True)`` under ZeroTrainer and DeepSpeed's ``compile`` block under multiprocessing:
    the same compiled blocks, the same losses; one graph (TinyLM's blocks are alike), none after."""
    result = _fit(_compiled_trainer_loop, "engine-compile", tmp_path)
    reference = run_ranks(_compiled_mp_worker, 2)[0]
    history = result.metrics_history[:STEPS]
    assert [h["graphs"] for h in history] == [1] * STEPS
    torch.testing.assert_close(torch.tensor([h["loss"] for h in history]), torch.tensor(reference), rtol=1e-6, atol=1e-7)
    assert_nothing_left("engine-compile")
