"""ZeRO-Infinity's parameter offload: stage-3 compute shards in NVMe files (``offload_param.device="nvme"``).

Real processes (gloo), real files. Parameters move through files and a bounded buffer pool, so
against the same run without offload losses and weights must be *bitwise* equal, at every world
size (3 pads the shards), with the optimizer states anywhere (device, host, files), and after a
checkpoint round trip or a reshard into a plain run.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

import zeroray
import zeroray.checkpoint as ckpt
from tests.support import recipe
from tests.support.dist import run_ranks
from tests.support.models import TinyLM, batches
from tests.support.offload import nvme_offload, train_run
from tests.support.recipe import GAS, OPT_STEPS, train
from zeroray.config import ConfigError
from zeroray.engine.offload.files import aligned


def _params(path: str, **kw) -> dict:
    return {"offload_param": {"device": "nvme", "nvme_path": path, **kw}}


def _worker(rank: int, world: int, path: str) -> dict:
    path = os.path.join(path, f"rank{rank}")  # what is left is this rank's alone, whenever the others finish
    os.makedirs(path)
    data = batches(rank, GAS * OPT_STEPS)
    torch.manual_seed(0)
    init = TinyLM()
    out = {}
    for precision in ("fp32", "bf16"):
        runs = {
            "none": {},
            "params": _params(path),
            "params-2buf": _params(path, buffer_count=2),
            "params+cpu": {**_params(path), "offload_optimizer": {"device": "cpu"}},
            "params+nvme": {**_params(path, buffer_count=3), **nvme_offload(path, rank, buffer_count=3), "sub_group_size": 50},
        }
        for name, extra in runs.items():
            out[(precision, name)] = train_run(copy.deepcopy(init), data, recipe.config(3, precision, **extra))
    out["left"] = sorted(os.listdir(os.path.join(path, "zeroray-swap")))
    return out


@pytest.mark.parametrize("world", [1, 2, pytest.param(3, marks=pytest.mark.slow)])  # world 3: the reshard test
def test_parameters_in_files_are_bitwise_equal_to_no_offload(world, tmp_path):
    for rank, res in enumerate(run_ranks(_worker, world, str(tmp_path))):
        assert res.pop("left") == [], "swap directories must be removed by close()"
        for (precision, name), (losses, state, mem) in res.items():
            ref_losses, ref_state, ref_mem = res[(precision, "none")]
            what = (world, rank, precision, name)
            assert losses == ref_losses, what
            for k in ref_state:
                assert torch.equal(state[k], ref_state[k]), (*what, k)
            if name != "none":  # the shards left memory for files; the pool is what host memory holds
                assert mem["params"] == 0 and ref_mem["params"] > 0, (what, mem)
                assert mem["nvme"] >= ref_mem["params"] and mem["host"] > 0, (what, mem)


def test_read_ahead_serves_the_gathers_and_the_counts_add_up(tmp_path):
    """With enough buffers, gathers find their shard read ahead (forward order, then backward's
    reverse); every gather is served once, either way."""
    torch.manual_seed(0)
    model = TinyLM()
    # Optimizer states in files too, in small sub-groups: the new weights come back piece by piece.
    cfg = recipe.config(3, "bf16", **_params(str(tmp_path), buffer_count=8), **nvme_offload(str(tmp_path), 0),
                        sub_group_size=50)
    engine = zeroray.initialize(model, recipe.optimizer(model), cfg)
    steps = 6
    train(engine, batches(0, steps * GAS))
    io = engine.offload_io()["params"]
    units = engine.scheduler.units
    # Per micro-step: every group gathered for forward, and every unit's groups again for backward.
    gathers = steps * GAS * (len(engine.groups) + sum(len(u.groups) for u in units))
    assert io["reads_ahead_used"] + io["reads_on_demand"] == gathers, io
    assert io["reads_ahead_used"] > 0.8 * gathers, io
    # Each gather reads its shard once, nothing more: no read-ahead given up, no read behind a write
    # (a group's new values are written whole, piece by piece, without reading the old ones first).
    assert io["reads_given_up"] == 0, io
    nbytes = {g: aligned(g.shard_numel * g.full.element_size()) for g in engine.groups}
    per_micro_step = sum(nbytes.values()) + sum(nbytes[g] for u in units for g in u.groups)
    assert io["bytes_read"] == steps * GAS * per_micro_step, io
    assert engine.offload_report()["nvme:read"] == io["bytes_read"] + engine.offload_io()["optimizer"]["bytes_read"]
    engine.close()


def _save(rank: int, world: int, path: str, url: str, offload: bool) -> dict:
    torch.manual_seed(0)
    model = TinyLM()
    extra = {**_params(path), **nvme_offload(path, rank), "sub_group_size": 60} if offload else {}
    engine = zeroray.initialize(model, recipe.optimizer(model), recipe.config(3, "bf16", **extra))
    data = batches(rank, 4 * GAS)
    train(engine, data[: 2 * GAS])
    ckpt.save(engine, url)
    rest = train(engine, data[2 * GAS :])
    engine.close()
    return {"rest": rest}


def _load(rank: int, world: int, url: str, stage: int, extra: dict) -> dict:
    torch.manual_seed(1)  # other initial values: everything must come from the checkpoint
    model = TinyLM()
    engine = zeroray.initialize(model, recipe.optimizer(model), recipe.config(stage, "bf16", **extra))
    ckpt.load(engine, url)
    full = engine.full_state_dict()
    rest = []
    if engine.world_size == 2:  # the saving world: the same data, the same losses
        rest = train(engine, batches(rank, 4 * GAS)[2 * GAS :])
    engine.close()
    return {"full": full, "rest": rest}


def test_checkpoints_with_parameters_in_files_resume_and_reshard_bitwise(tmp_path):
    """Saved from a run with parameters and optimizer states in files, a checkpoint equals the plain
    run's: it loads into a plain stage-1 run at world 3 with the same weights, and back into a
    parameter-offloaded run at world 2, which resumes with the same losses."""
    plain, offloaded = str(tmp_path / "plain"), str(tmp_path / "offloaded")
    want = run_ranks(_save, 2, str(tmp_path), plain, False)
    got = run_ranks(_save, 2, str(tmp_path), offloaded, True)
    assert [r["rest"] for r in got] == [r["rest"] for r in want]
    for a, b in zip(run_ranks(_load, 3, plain, 1, {}), run_ranks(_load, 3, offloaded, 1, {})):
        for k in a["full"]:
            assert torch.equal(a["full"][k], b["full"][k]), k
    for optimizer in ({"device": "cpu"}, {"device": "nvme", "nvme_path": str(tmp_path)}):  # streamed into files too
        back = {**_params(str(tmp_path)), "offload_optimizer": optimizer, "sub_group_size": 70}
        for r, res in enumerate(run_ranks(_load, 2, offloaded, 3, back)):
            assert res["rest"] == want[r]["rest"], optimizer
    assert os.listdir(tmp_path / "zeroray-swap") == []


def test_weights_written_inside_gathered_parameters_reach_the_files(tmp_path):
    torch.manual_seed(0)
    init = TinyLM()
    out = []
    for extra in ({}, _params(str(tmp_path))):
        model = copy.deepcopy(init)
        engine = zeroray.initialize(model, recipe.optimizer(model), recipe.config(3, "fp32", **extra))
        with engine.gathered_parameters(modifier_rank=0):
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
        x, y = batches(0, 1)[0]
        out.append((engine(x, y).item(), engine.full_state_dict()))
        engine.close()
    assert out[0][0] == out[1][0]
    for k in out[0][1]:
        assert torch.equal(out[0][1][k], out[1][1][k]), k


def test_parameter_offload_to_nvme_is_refused_below_stage_3_and_without_a_usable_path(tmp_path):
    with pytest.raises(ConfigError, match="'nvme' needs stage 3") as info:
        zeroray.ZeroConfig(stage=2, **_params(str(tmp_path)))
    assert info.value.field == "offload_param.device"
    with pytest.raises(ConfigError, match="needs nvme_path"):
        zeroray.ZeroConfig(stage=3, offload_param={"device": "nvme"})
    model = TinyLM()
    with pytest.raises(ConfigError, match="is not an existing directory") as info:
        zeroray.initialize(model, torch.optim.AdamW(model.parameters()), zeroray.ZeroConfig(stage=3, **_params(str(tmp_path / "absent"))))
    assert info.value.field == "offload_param.nvme_path"
    assert not (tmp_path / "absent").exists()


def test_zeroray_estimate_agrees_with_memory_report_for_parameters_in_files(tmp_path):
    """``zeroray estimate --offload nvme --offload-param nvme --largest-unit N`` against the engine's
    own report (world 1, bf16): host (both buffer pools) and nvme (both kinds of files) within 5%."""
    from zeroray.estimate import estimate
    from zeroray.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, block_size=32, n_layer=4, n_head=4, n_embd=256))
    cfg = zeroray.ZeroConfig(stage=3, precision="bf16", sub_group_size=200_000,
                             offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 3},
                             **_params(str(tmp_path), buffer_count=3))
    engine = zeroray.initialize(model, torch.optim.AdamW(model.parameters()), cfg)
    x = torch.randint(512, (2, 32))
    _, loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    rep = engine.memory_report()
    largest = max(g.numel for g in engine.groups)
    est = estimate(model.num_params(), 1, 3, "bf16", "nvme", sub_group_size=200_000, buffer_count=3,
                   offload_param="nvme", largest_unit=largest, param_buffer_count=3)
    engine.close()
    assert rep["params"] == est["params"] == 0
    assert rep["host"] == pytest.approx(est["host"], rel=0.05), (rep, est)
    assert rep["nvme"] == pytest.approx(est["nvme"], rel=0.05), (rep, est)
