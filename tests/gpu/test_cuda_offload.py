"""CPU offload on CUDA: the optimizer steps fp32 masters in pinned host memory, gradient shards go to
the host on a side stream as each group's reduction completes (during backward), and each stepped
sub-group's weights go back to the device, cast there.

Against plain PyTorch / DDP on the device (the optimizer runs on the CPU here, so the tolerances are
the CUDA parity tests' own), and the copies counted: every gradient copy of a step must have started
during backward, none in the step.
"""

from __future__ import annotations

import copy

import pytest
import torch

import zeroray
from tests.support import recipe
from tests.support.dist import run_ranks
from tests.support.models import TinyLM, batches
from tests.support.offload import train_run
from tests.support.recipe import GAS, OPT_STEPS, reference, train

OFFLOAD = {"device": "cpu", "pin_memory": True}


def _offloaded(model: torch.nn.Module, data: list, stage: int, precision: str) -> tuple[list[float], dict, dict, dict]:
    # Several sub-groups: each one's weights go back while the next steps.
    cfg = recipe.config(stage, precision, sub_group_size=3000, offload_optimizer=OFFLOAD)
    engine = zeroray.initialize(model, recipe.optimizer(model), cfg)
    losses = train(engine, data)
    groups = sum(g.trainable for g in engine.groups)
    io = {**engine.optim.io_report(), "groups": groups}
    offload = engine.offload_report()
    state = engine.full_state_dict()
    engine.close()
    return losses, state, io, offload


def _on_cuda(rank: int) -> tuple[list, torch.nn.Module]:
    """This rank's batches and the initial model, on cuda:0."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    data = [(x.to(dev), y.to(dev)) for x, y in batches(rank, GAS * OPT_STEPS)]
    torch.manual_seed(0)
    return data, TinyLM().to(dev)


def _worker(rank: int, world: int) -> dict:
    data, init = _on_cuda(rank)
    out = {"ref": reference(rank, copy.deepcopy(init), data)}
    for stage in (1, 2, 3):
        for precision in ("fp32", "bf16"):
            out[(stage, precision)] = _offloaded(copy.deepcopy(init), data, stage, precision)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_cpu_offload_on_cuda_matches_pytorch_and_copies_gradients_during_backward(world: int) -> None:
    """World 1 on NCCL; world 2 as two ranks sharing cuda:0 over gloo (against DDP)."""
    results = run_ranks(_worker, world, backend="nccl" if world == 1 else "gloo")
    for rank, res in enumerate(results):
        ref_losses, ref_state, _ = res["ref"]
        for stage in (1, 2, 3):
            for precision in ("fp32", "bf16"):
                losses, state, io, offload = res[(stage, precision)]
                what = f"rank {rank} world {world} stage {stage} {precision}: {io}"
                print(what)
                if precision == "fp32":  # CPU AdamW against the device's: last-bit differences only
                    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5, msg=what)
                    for name in ref_state:
                        torch.testing.assert_close(state[name].cpu(), ref_state[name].cpu(), rtol=1e-4, atol=1e-5,
                                                   msg=f"{what} {name}")
                else:
                    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=3e-2, atol=3e-2, msg=what)
                # Every trainable group's gradient shard went to the host during backward, once a step.
                assert io["grad_copies_in_backward"] == io["groups"] * OPT_STEPS, what
                assert io["grad_copies_in_step"] == 0, what
                assert offload["cpu:write"] == io["bytes_to_host"] > 0, what
                assert offload["cpu:read"] == io["bytes_to_device"] > 0, what


def _params_in_files(rank: int, world: int, path: str) -> dict:
    data, init = _on_cuda(rank)
    out = {}
    for precision in ("fp32", "bf16"):
        for name, extra in {
            "none": {},
            "params": {"offload_param": {"device": "nvme", "nvme_path": path}},
            "nvme": {"offload_optimizer": {"device": "nvme", "nvme_path": path}},
            "params+nvme": {"offload_param": {"device": "nvme", "nvme_path": path},
                            "offload_optimizer": {"device": "nvme", "nvme_path": path}},
        }.items():
            cfg = recipe.config(3, precision, sub_group_size=3000, **extra)
            out[(precision, name)] = train_run(copy.deepcopy(init), data, cfg)
    return out


def test_parameters_in_nvme_files_on_cuda_are_bitwise_equal_to_no_offload(tmp_path) -> None:
    """Stage 3 on NCCL with the parameter shards in files (read into the gathered device buffer), against
    the same run with them on the device: the optimizer runs in the same place (the device, or the CPU
    with its states in files), so the bits must not change."""
    (res,) = run_ranks(_params_in_files, 1, str(tmp_path), backend="nccl")
    for (precision, name), (losses, state, mem) in res.items():
        if not name.startswith("params"):
            continue
        ref_losses, ref_state, _ = res[(precision, "nvme" if name == "params+nvme" else "none")]
        assert losses == ref_losses, (precision, name)
        for k in ref_state:
            assert torch.equal(state[k], ref_state[k]), (precision, name, k)
        assert mem["params"] == 0 and mem["nvme"] > 0, mem
