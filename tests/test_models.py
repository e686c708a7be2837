"""The benchmark/test GPT: shapes, tied weights, determinism, and sizing by parameter count."""

from __future__ import annotations

import pytest
import torch

from zeroray.models import GPT, Block, GPTConfig

TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def test_forward_backward_shapes() -> None:
    torch.manual_seed(0)
    model = GPT(TINY)
    idx = torch.randint(64, (3, 10))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 10, 64)
    assert loss.shape == () and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    logits, loss = model(idx)
    assert loss is None and logits.shape == (3, 10, 64)


def test_structure_and_too_long_input() -> None:
    model = GPT(TINY)
    assert len(model.transformer.h) == 2 and all(isinstance(b, Block) for b in model.transformer.h)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_tied_weights_are_one_tensor() -> None:
    model = GPT(TINY)
    assert model.lm_head.weight is model.transformer.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # counted once
    logits, loss = model(torch.randint(64, (2, 8)), torch.randint(64, (2, 8)))
    loss.backward()
    assert model.transformer.wte.weight.grad is model.lm_head.weight.grad
    untied = GPT(GPTConfig(**{**TINY.__dict__, "tie_weights": False}))
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    assert untied.num_params() == model.num_params() + 64 * 32


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("tie", [True, False])
def test_config_counts_params_without_building(bias: bool, tie: bool) -> None:
    cfg = GPTConfig(vocab_size=100, block_size=20, n_layer=3, n_head=4, n_embd=48, bias=bias, tie_weights=tie)
    assert cfg.num_params() == GPT(cfg).num_params()


def test_same_seed_same_weights() -> None:
    torch.manual_seed(1)
    a = GPT(TINY)
    torch.manual_seed(1)
    b = GPT(TINY)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("target", [2e6, 5e6, 25e6, 124e6, 350e6])
def test_for_params_is_near_target(target: float) -> None:
    cfg = GPTConfig.for_params(target)
    assert abs(cfg.num_params() - target) / target < 0.2
    assert cfg.n_embd % cfg.n_head == 0


def test_bad_config() -> None:
    with pytest.raises(ValueError):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError):
        GPTConfig.for_params(0)
