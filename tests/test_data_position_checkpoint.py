"""A bad data position inside a real checkpoint: a run with ``zt.DistributedSampler`` saves a checkpoint (its
position beside the engine's state in the manifest, ``ZeroEngine.register_stateful``). The position stored
there is then made invalid, the manifest resealed (its checksum matches: a position saved bad, by a bug or an
edit, not a torn file, which makes the checkpoint broken and passed over), and the run started again on the
same storage fails in ``zt.prepare``, before any step, in one line that names the sampler, the field and why."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zeroray.checkpoint as zc
import zeroray.train as zt
from tests.support.ray import run_config
from zeroray.checkpoint.manifest import MANIFEST, dump_manifest, parse_manifest
from zeroray.train import FailureConfig, ScalingConfig, TrainingFailedError, ZeroTrainer

N, GLOBAL_BATCH, STEPS = 30, 6, 2


def _loop(config: dict) -> None:
    control = Path(config["control"])
    sampler = zt.DistributedSampler(list(range(N)), seed=3)
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    engine = zt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    (control / f"prepared-{engine.global_step}").write_text("")  # the resume is behind us
    loader = torch.utils.data.DataLoader(list(range(N)), batch_size=engine.config.train_micro_batch_size_per_gpu,
                                         sampler=sampler)
    for idx in loader:
        if engine.global_step >= STEPS:
            break
        loss = model(idx.float().view(-1, 1)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        if engine.micro_step % engine.gradient_accumulation_steps == 0:
            zt.report({"step": engine.global_step, "samples": idx.tolist()}, checkpoint=engine.global_step == STEPS)


def _fit(tmp_path: Path, control: Path) -> zt.Result:
    return ZeroTrainer(
        _loop, train_loop_config={"control": str(control)},
        zero_config={"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": 3},
        scaling_config=ScalingConfig(num_workers=1),
        run_config=run_config(tmp_path, "bad-position", failure_config=FailureConfig(max_failures=0)),
    ).fit()


def test_a_bad_position_in_a_checkpoint_fails_the_resume_before_any_step(ray_cluster, tmp_path):
    control = tmp_path / "control"
    control.mkdir()
    first = _fit(tmp_path, control)
    assert first.error is None, first.error
    url = zc.latest_committed(str(tmp_path / "runs" / "bad-position"))
    assert url == zc.checkpoint_url(str(tmp_path / "runs" / "bad-position"), STEPS)
    path = Path(url) / MANIFEST
    manifest = parse_manifest(path.read_bytes(), str(path))
    saved = manifest.meta["stateful"]["sampler:train"]
    assert saved == {"epoch": 0, "index": STEPS * GLOBAL_BATCH, "step": STEPS, "num_samples": N, "seed": 3,
                     "shuffle": True}
    saved["index"] = N + 6  # past the epoch's end
    path.write_bytes(dump_manifest(manifest))
    assert zc.latest_committed(str(tmp_path / "runs" / "bad-position")) == url  # a valid checkpoint still

    assert [p.name for p in control.iterdir()] == ["prepared-0"]
    with pytest.raises(TrainingFailedError) as raised:
        _fit(tmp_path, control)
    assert [p.name for p in control.iterdir()] == ["prepared-0"]  # zt.prepare never returned: no step ran
    assert raised.value.result.metrics_history == []
    want = (f"ValueError: the saved position of zt.DistributedSampler('train') is not valid: index {N + 6} is past "
            f"the epoch's {N} samples")
    assert [(f.rank, f.message) for f in raised.value.failures] == [(0, want)], str(raised.value)
    assert str(raised.value).startswith("zeroray training failed (rank 0)\n")
