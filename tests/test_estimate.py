"""The memory estimator against the ZeRO paper's formulas, the CLI, and a real engine."""

from __future__ import annotations

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


@pytest.mark.parametrize("device", ["cpu", "nvme"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_offload_moves_optimizer_and_fp32_grads(device: str, stage: int) -> None:
    psi, n = 8_000_000, 8
    on, off = estimate(psi, n, stage, "bf16"), estimate(psi, n, stage, "bf16", offload=device)
    held = psi if stage == 0 else psi // n  # elements of optimizer state this rank owns
    assert off["optimizer"] == 0
    assert off["offloaded"] == (12 + 4) * held
    assert (off["params"], off["grads"]) == (on["params"], on["grads"])
    assert off["total"] == on["total"] - on["optimizer"]
    assert off["offload_device"] == device


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


def test_cli_all_stages_with_offload(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--params", "7B", "--world-size", "4", "--offload", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "offloaded (cpu)" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    for row in rows:
        expected = estimate(7e9, 4, int(row[0]), offload="cpu")
        assert float(row[-1]) == pytest.approx(expected["offloaded"] / GIB, abs=1e-3)


def test_cli_rejects_bad_count() -> None:
    with pytest.raises(SystemExit):
        main(["estimate", "--params", "lots", "--world-size", "2"])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_estimate_matches_engine_memory_report(stage: int, precision: str) -> None:
    zeroray = pytest.importorskip("zeroray")
    if not hasattr(zeroray, "initialize"):
        pytest.skip("the engine (zeroray.initialize) is not there yet")
    from zeroray.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=32))
    engine = zeroray.initialize(
        model,
        torch.optim.AdamW(model.parameters()),
        config=zeroray.ZeroConfig(stage=stage, precision=precision),
    )
    for step in range(2):
        x = torch.randint(128, (2, 16), generator=torch.Generator().manual_seed(step))
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()
    report = engine.memory_report()
    est = estimate(model.num_params(), 1, stage, precision)
    for key in ("params", "grads", "optimizer"):
        assert report[key] == pytest.approx(est[key], rel=0.05), key
    assert sum(report[k] for k in ("params", "grads", "optimizer")) == pytest.approx(est["total"], rel=0.05)
