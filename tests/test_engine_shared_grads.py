"""SharedGradSum: a tied weight's two gradients are added in place, with the same values.

Plain PyTorch sums an embedding's gradient and its tied head's into a new tensor of the weight's
size (the head's arrives as a view, so autograd will not add into it). Checked with the profiler's
allocation record: with the hooks, backward allocates no such tensor; without them it does (so
the premise is checked too), and every gradient is bitwise the same. Higher-order gradients
(``create_graph``) stay whole. The engine hooks only the tied weight's two feeders, and nothing in
a model without tied weights.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import zeroray
from tests.support.recipe import train_gpt
from zeroray.engine.shared_grads import SharedGradSum
from zeroray.models.gpt import GPT, GPTConfig

VOCAB, WIDTH = 1024, 64
WEIGHT_BYTES = VOCAB * WIDTH * 4


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(idx)))).logsumexp(-1).sum()


def _weight_sized_adds(prof: profile) -> list[int]:
    """Allocations made by ``aten::add`` of the tied weight's size: autograd's out-of-place sum."""
    return [e.cpu_memory_usage for e in prof.events() if e.name == "aten::add" and e.cpu_memory_usage >= WEIGHT_BYTES]


def _backward(watch: bool) -> tuple[dict[str, torch.Tensor], list[int], int]:
    torch.manual_seed(0)
    model = TiedLM()
    idx = torch.randint(VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = model(idx)
    watcher = SharedGradSum([model.embed.weight] if watch else [])
    watcher.prepare(loss)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}, _weight_sized_adds(prof), watcher.hooked


def test_tied_gradients_are_added_in_place_with_the_same_values() -> None:
    plain, plain_adds, _ = _backward(watch=False)
    summed, adds, hooked = _backward(watch=True)
    assert plain_adds, "plain autograd no longer sums a tied weight's gradients out of place"
    assert adds == []
    assert hooked == 2  # the head's transpose and the embedding
    assert plain.keys() == summed.keys()
    for name in plain:
        assert torch.equal(plain[name], summed[name]), name


def test_a_parameter_used_once_is_left_alone() -> None:
    model = nn.Linear(4, 4)
    watcher = SharedGradSum([model.weight])
    loss = model(torch.randn(2, 4)).sum()
    watcher.prepare(loss)
    assert watcher.hooked == 0


def test_create_graph_keeps_higher_order_gradients() -> None:
    def second_order(watch: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = TiedLM()
        loss = model(torch.randint(VOCAB, (2, 8), generator=torch.Generator().manual_seed(2)))
        SharedGradSum([model.embed.weight] if watch else []).prepare(loss)
        (grad,) = torch.autograd.grad(loss, model.embed.weight, create_graph=True)
        grad.pow(2).sum().backward()
        return model.mix.weight.grad

    assert torch.equal(second_order(watch=False), second_order(watch=True))


@pytest.mark.parametrize("stage", [0, 3])
def test_the_engine_watches_the_tied_weight_and_sums_in_place(stage: int) -> None:
    cfg = GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=WIDTH)
    torch.manual_seed(0)
    model = GPT(cfg)
    engine = zeroray.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=zeroray.ZeroConfig(stage=stage)
    )
    idx = torch.randint(VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    loss = engine(idx, idx)[1]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        engine.backward(loss)
    engine.step()
    assert engine.shared_grads.hooked == 2
    assert _weight_sized_adds(prof) == []
    train_gpt(engine, VOCAB, 2)  # later steps prepare their own graphs
    assert engine.shared_grads.hooked == 2

    untied = GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=WIDTH, tie_weights=False))
    engine = zeroray.initialize(
        untied, torch.optim.AdamW(untied.parameters(), lr=1e-3), config=zeroray.ZeroConfig(stage=stage)
    )
    train_gpt(engine, VOCAB, 1)
    assert engine.shared_grads.hooked == 0
