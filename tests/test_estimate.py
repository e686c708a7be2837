"""The memory estimator against the ZeRO paper's formulas, the CLI, and a real engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zeroray.cli import main
from zeroray.estimate import estimate

GIB = 1024**3


def paper(psi: int, n: int, stage: int, p: int, k: int) -> int:
    """The ZeRO paper's per-rank bytes (Ψ divisible by N), grads as wide as params."""
    return {0: (p + p + k) * psi, 1: 2 * p * psi + k * psi // n, 2: p * psi + (p + k) * psi // n}.get(
        stage, (p + p + k) * psi // n
    )


@pytest.mark.parametrize("precision,p,k", [("fp32", 4, 8), ("bf16", 2, 12), ("fp16", 2, 12)])
@pytest.mark.parametrize("world_size", [1, 2, 4, 8, 64])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_matches_paper_formulas(precision: str, p: int, k: int, world_size: int, stage: int) -> None:
    psi = 7_500_000 * 64
    est = estimate(psi, world_size, stage, precision)
    assert est["total"] == paper(psi, world_size, stage, p, k)
    assert est["total"] == est["params"] + est["grads"] + est["optimizer"]
    assert est["offloaded"] == 0


def test_paper_example_7_5b_on_64_ranks() -> None:
    # The paper's Figure 1: 7.5B parameters, 64 GPUs, mixed precision Adam: 120, 31.4, 16.6, 1.9 GB.
    gb = {s: estimate(7.5e9, 64, precision="bf16")[s]["total"] / 1e9 for s in range(4)}
    assert gb == pytest.approx({0: 120.0, 1: 31.4, 2: 16.6, 3: 1.875}, rel=0.01)


def test_all_stages_and_padding() -> None:
    all_stages = estimate(10, 4, precision="fp32")
    assert set(all_stages) == {0, 1, 2, 3}
    # 10 elements on 4 ranks: shards of 3 (padded to 12), as the engine lays them out.
    assert all_stages[3] == estimate(10, 4, 3, "fp32")
    assert all_stages[3]["params"] == 4 * 3 and all_stages[3]["optimizer"] == 8 * 3


def test_optimizer_bytes_override() -> None:
    assert estimate(1000, 2, 1, "fp32", optimizer_bytes=4)["optimizer"] == 4 * 500


@pytest.mark.parametrize("precision,master", [("fp32", 4), ("bf16", 0)])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_cpu_offload_puts_master_states_and_an_fp32_grad_copy_in_host_memory(stage: int, precision: str, master: int) -> None:
    psi, n = 8_000_000, 8
    on, off = estimate(psi, n, stage, precision), estimate(psi, n, stage, precision, offload="cpu")
    held = psi // n  # elements of optimizer state this rank owns
    # fp32: the device keeps its parameters, so the host needs its own master copy besides the 8 bytes of
    # Adam's moments; mixed precision: K = 12 counts the master already. Both: + the fp32 gradient copy.
    assert off["host"] == on["optimizer"] + master * held + 4 * held == 16 * held
    assert off["nvme"] == 0 and off["offloaded"] == off["host"]
    assert off["optimizer"] == 0
    assert (off["params"], off["grads"]) == (on["params"], on["grads"])
    assert off["total"] == on["total"] - on["optimizer"]
    assert off["offload_device"] == "cpu"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_nvme_offload_counts_aligned_swap_files_and_the_buffer_pool(precision: str) -> None:
    # 10,000 elements on 2 ranks: a partition of 5,000 in sub-groups of 1,500, 1,500, 1,500 and 500.
    est = estimate(10_000, 2, 1, precision, offload="nvme", sub_group_size=1500)
    seg, last = 8192, 4096  # 1,500 x 4 bytes and 500 x 4 bytes, each padded to 4 KiB
    segments = 3  # the fp32 master and Adam's two moments, in fp32 and in mixed precision alike
    assert est["nvme"] == segments * (3 * seg + last)
    assert est["host"] == 4 * segments * seg  # buffer_count (4) buffers of the largest sub-group
    assert est["offloaded"] == est["host"] + est["nvme"]
    assert est["optimizer"] == 0 and est["total"] == est["params"] + est["grads"]
    assert estimate(10_000, 2, 1, precision, offload="nvme", sub_group_size=1500, buffer_count=2)["host"] == 2 * segments * seg
    # Fewer sub-groups than buffers: one buffer per sub-group.
    assert estimate(10_000, 2, 1, precision, offload="nvme", sub_group_size=10**9)["host"] == segments * 20480
    # SGD with momentum in fp32 (K = 4): the master and one state.
    sgd = estimate(10_000, 2, 1, "fp32", offload="nvme", optimizer_bytes=4, sub_group_size=1500)
    assert sgd["nvme"] == 2 * (3 * seg + last)


def test_offload_needs_a_sharded_optimizer() -> None:
    for device in ("cpu", "nvme"):
        with pytest.raises(ValueError, match="needs a sharded optimizer"):
            estimate(1e6, 2, 0, offload=device)
        assert set(estimate(1e6, 2, offload=device)) == {1, 2, 3}
    assert set(estimate(1e6, 2)) == {0, 1, 2, 3}


@pytest.mark.parametrize("kwargs", [{"sub_group_size": 0}, {"sub_group_size": 1.5}, {"buffer_count": 0}, {"buffer_count": True}])
def test_bad_offload_settings(kwargs: dict) -> None:
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"{name} must be an integer >= 1"):
        estimate(1e6, 2, 1, offload="nvme", **kwargs)


def test_bad_input() -> None:
    for kwargs in ({"stage": 4}, {"precision": "fp8"}, {"offload": "disk"}, {"world_size": 0}):
        with pytest.raises(ValueError):
            estimate(**{"params": 1e6, "world_size": 2, **kwargs})


def test_cli_one_stage(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["estimate", "--params", "70e9", "--world-size", "8", "--stage", "3", "--precision", "bf16"])
        == 0
    )
    out = capsys.readouterr().out
    expected = estimate(70e9, 8, 3, "bf16")
    assert f"{expected['total'] / GIB:.3f}" in out  # 16 bytes x 70e9 / 8 = 130.385 GiB
    assert f"{expected['params'] / GIB:.3f}" in out
    assert len([line for line in out.splitlines() if line.strip().startswith("3 ")]) == 1


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_cli_all_stages_with_offload(device: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "--params", "7B", "--world-size", "4", "--offload", device]
    assert main([*argv, "--sub-group-size", "30M", "--buffer-count", "3"]) == 0
    out = capsys.readouterr().out
    header = next(line.split() for line in out.splitlines() if line.strip().startswith("stage"))
    assert header[-2:] == ["host", "nvme"]
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2", "3"]
    for row in rows:
        expected = estimate(7e9, 4, int(row[0]), offload=device, sub_group_size=30_000_000, buffer_count=3)
        assert float(row[-2]) == pytest.approx(expected["host"] / GIB, abs=1e-3)
        assert float(row[-1]) == pytest.approx(expected["nvme"] / GIB, abs=1e-3)
        assert float(row[-3]) == pytest.approx(expected["total"] / GIB, abs=1e-3)


def test_cli_without_offload_has_no_offload_columns(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--params", "7B", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "host" not in out and "nvme" not in out


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--sub-group-size", "0"], ["--sub-group-size", "whole number >= 1", "'0'"]),
        (["--sub-group-size", "1.5"], ["--sub-group-size", "whole number >= 1", "'1.5'"]),
        (["--sub-group-size", "many"], ["--sub-group-size", "whole number >= 1", "'many'"]),
        (["--sub-group-size", "inf"], ["--sub-group-size", "whole number >= 1", "'inf'"]),
        (["--buffer-count", "0"], ["--buffer-count", "must be >= 1"]),
        (["--buffer-count", "two"], ["--buffer-count", "not an integer"]),
    ],
)
def test_cli_bad_offload_settings_are_one_line_and_exit_2(
    extra: list[str], words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["estimate", "--params", "7B", "--world-size", "8", "--offload", "nvme", *extra])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err


def test_cli_offload_at_stage_0_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--params", "7B", "--world-size", "8", "--stage", "0", "--offload", "cpu"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    assert "needs a sharded optimizer (stage 1, 2 or 3)" in captured.err


def test_cli_rejects_bad_count() -> None:
    with pytest.raises(SystemExit):
        main(["estimate", "--params", "lots", "--world-size", "2"])


def test_estimate_imports_no_torch() -> None:
    """Pure arithmetic: every column (NVMe swap files, the parameter buffer pool) without torch, which
    took 5 of the command's 7-9 s to import."""
    argv = ["estimate", "--params", "7B", "--world-size", "8", "--stage", "3", "--precision", "bf16",
            "--offload", "nvme", "--offload-param", "nvme", "--largest-unit", "1e8"]
    code = (f"import sys; from zeroray.cli import main; assert main({argv!r}) == 0; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr
    assert "host" in done.stdout and "nvme" in done.stdout


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_estimate_matches_engine_memory_report(stage: int, precision: str) -> None:
    zeroray = pytest.importorskip("zeroray")
    if not hasattr(zeroray, "initialize"):
        pytest.skip("the engine (zeroray.initialize) is not there yet")
    from tests.support.recipe import gpt_loss, train
    from zeroray.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=32))
    engine = zeroray.initialize(
        model,
        torch.optim.AdamW(model.parameters()),
        config=zeroray.ZeroConfig(stage=stage, precision=precision),
    )
    tokens = [torch.randint(128, (2, 16), generator=torch.Generator().manual_seed(step)) for step in range(2)]
    train(engine, [(x, x) for x in tokens], loss=gpt_loss)
    report = engine.memory_report()
    est = estimate(model.num_params(), 1, stage, precision)
    for key in ("params", "grads", "optimizer"):
        assert report[key] == pytest.approx(est[key], rel=0.05), key
    assert sum(report[k] for k in ("params", "grads", "optimizer")) == pytest.approx(est["total"], rel=0.05)


# ------------------------------------------------------------------ offload against real engines, world 2
GPT_SHAPE = {"vocab_size": 256, "block_size": 32, "n_layer": 3, "n_head": 4, "n_embd": 256}  # 2.4M parameters
SUB_GROUP = 300_000  # 1.22M elements a rank: five sub-groups, so the pool and the padding both show
ENGINE_CASES = [(stage, precision) for stage in (1, 2, 3) for precision in ("fp32", "bf16")]


def _offloaded_engines(rank: int, world: int, nvme_path: str) -> dict:
    """After one training step (the optimizer states exist): each offloaded engine's memory report."""
    import zeroray
    from zeroray.models import GPT, GPTConfig

    out: dict = {}
    for stage, precision in ENGINE_CASES:
        for device in ("nvme", "cpu"):
            offload = {"device": device, "nvme_path": nvme_path} if device == "nvme" else {"device": device}
            torch.manual_seed(0)
            model = GPT(GPTConfig(**GPT_SHAPE))
            cfg = zeroray.ZeroConfig(stage=stage, precision=precision, sub_group_size=SUB_GROUP, offload_optimizer=offload)
            engine = zeroray.initialize(model, torch.optim.AdamW(model.parameters()), cfg)
            x = torch.randint(256, (2, 32), generator=torch.Generator().manual_seed(rank))
            _, loss = engine(x, x)
            engine.backward(loss)
            engine.step()
            out[(stage, precision, device)] = {
                "report": engine.memory_report(),
                "sub_groups": len(engine.optim.sub_groups),
                "params": model.num_params(),
            }
            engine.close()
    return out


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    from tests.support.dist import run_ranks

    return run_ranks(_offloaded_engines, 2, str(tmp_path_factory.mktemp("nvme")))


def _device_total(report: dict) -> int:
    return report["params"] + report["grads"] + report["optimizer"]


@pytest.mark.parametrize(("stage", "precision"), ENGINE_CASES)
def test_nvme_estimate_matches_memory_report(offloaded: list[dict], stage: int, precision: str) -> None:
    for rank, res in enumerate(offloaded):
        got = res[(stage, precision, "nvme")]
        rep = got["report"]
        est = estimate(got["params"], 2, stage, precision, offload="nvme", sub_group_size=SUB_GROUP)
        assert got["sub_groups"] == 5 and est["host"] > 0 and est["nvme"] > 0
        what = f"rank {rank} stage {stage} {precision}: report {rep}, estimate {est}"
        assert _device_total(rep) == pytest.approx(est["total"], rel=0.05), what
        assert rep["host"] == pytest.approx(est["host"], rel=0.05), what
        assert rep["nvme"] == pytest.approx(est["nvme"], rel=0.05), what
        assert rep["host"] + rep["nvme"] == pytest.approx(est["offloaded"], rel=0.05), what


@pytest.mark.parametrize(("stage", "precision"), ENGINE_CASES)
def test_cpu_offload_on_a_cpu_only_machine_is_no_offload(offloaded: list[dict], stage: int, precision: str) -> None:
    """Here host memory is the device: the engine makes no copy and reports what it reports without offload,
    so the no-offload estimate is the one that holds (the host bytes of CPU offload on a GPU are checked
    against the estimate in tests/gpu/test_cuda_engine.py)."""
    for res in offloaded:
        cpu = res[(stage, precision, "cpu")]
        rep = cpu["report"]
        assert (rep["host"], rep["nvme"]) == (0, 0)
        est = estimate(cpu["params"], 2, stage, precision)
        for key in ("params", "grads", "optimizer"):
            assert rep[key] == pytest.approx(est[key], rel=0.05), (key, rep, est)


@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
def test_hybrid_sharding_is_the_flat_formula_over_the_shard_group(offload: str) -> None:
    """Shard groups of k ranks: each rank holds what a flat run at world k holds (N -> k)."""
    hybrid = estimate(7e9, 16, None, "bf16", offload, shard_group_size=8)
    assert set(hybrid) == {1, 2, 3}
    flat = estimate(7e9, 8, None, "bf16", offload)
    assert hybrid == {s: v for s, v in flat.items() if s > 0}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"shard_group_size": 5}, "shard_group_size 5 does not divide the world size 16"),
        ({"shard_group_size": 0}, "shard_group_size must be an integer >= 1, got 0"),
        ({"shard_group_size": 8, "stage": 0}, "applies to stages 1-3"),
    ],
)
def test_bad_hybrid_estimate(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        estimate(7e9, 16, **kwargs)


def test_cli_hybrid(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--params", "7B", "--world-size", "16", "--shard-group-size", "8", "--stage", "3"]) == 0
    out = capsys.readouterr().out
    assert "world size 16 (shards over groups of 8)" in out
    assert main(["estimate", "--params", "7B", "--world-size", "8", "--stage", "3"]) == 0
    flat = capsys.readouterr().out
    assert out.splitlines()[-1] == flat.splitlines()[-1]
