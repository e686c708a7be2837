"""Stage 3 frees the root unit in the middle of backward once nothing saved for backward views it.

The root (parameters in no block: embeddings, final norm, a tied head) used to stay gathered from
the start of forward to the end of backward. Now the scheduler counts the tensors autograd saved
that view the root's memory and frees the root at a block's backward once backward has read them
all. Three cases, each against plain PyTorch on a copy of the model:

- GPT: the embedding saves only token ids, so the root is freed as the blocks' backward begins;
- a root input projection applied to inputs that need a gradient saves its weight: the root stays
  gathered until that weight is read at the end of backward;
- the same projection under non-reentrant activation checkpointing saves nothing we can see, so
  the root is freed, and the recompute in backward gathers it again;
- saved-tensor hooks the caller set around the forward still see every saved tensor.
"""

from __future__ import annotations

import copy

import torch
import torch.utils.checkpoint
from torch import nn

import zeroray
from zeroray.models.gpt import GPT, GPTConfig

LR = 1e-2


class Projected(nn.Module):
    """A root input projection (optionally checkpointed), three blocks, a root head."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(16, 1)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            h = torch.utils.checkpoint.checkpoint(self.proj, x, use_reentrant=False)
        else:
            h = self.proj(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h).square().mean()


def _engine(model: nn.Module) -> zeroray.ZeroEngine:
    return zeroray.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR), zeroray.ZeroConfig(stage=3))


def _root_gathered_in_first_block_backward(engine: zeroray.ZeroEngine, block: nn.Module) -> list[bool]:
    """Whether the root is gathered when the gradient reaches the first block's output (the last
    block in backward), recorded once per backward."""
    seen: list[bool] = []
    root = engine.scheduler.root

    def on_output(m: nn.Module, args: object, out: torch.Tensor) -> None:
        if out.requires_grad:
            out.register_hook(lambda g: seen.append(root.gathered))

    block.register_forward_hook(on_output)
    return seen


def test_gpt_frees_the_root_as_the_blocks_backward_begins() -> None:
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    engine = _engine(model)
    seen = _root_gathered_in_first_block_backward(engine, model.transformer.h[0])
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        tokens = torch.randint(cfg.vocab_size, (2, 9), generator=g)
        _, loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        _, ref_loss = ref(tokens[:, :-1], tokens[:, 1:])
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert seen == [False, False, False]
    units = engine.scheduler.units  # all prefetched at once in a model this small
    assert engine.gather_pool.cached_bytes() == len(units) * units[0].numel * 4  # the blocks', not the root's
    state = engine.full_state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=1e-5, atol=1e-6)
    engine.close()


def _input_grads(checkpointed: bool) -> tuple[list[bool], list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = Projected(checkpointed)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    engine = _engine(model)
    seen = _root_gathered_in_first_block_backward(engine, model.blocks[0])
    ours, theirs = [], []
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 6, generator=g)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        engine.backward(engine(x1))
        engine.step()
        ref(x2).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ours.append(x1.grad)
        theirs.append(x2.grad)
    engine.close()
    return seen, ours, theirs


def test_a_root_weight_saved_for_the_end_of_backward_keeps_the_root_gathered() -> None:
    seen, ours, theirs = _input_grads(checkpointed=False)
    assert seen == [True, True, True]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_a_checkpointed_root_module_is_gathered_again_for_its_recompute() -> None:
    seen, ours, theirs = _input_grads(checkpointed=True)
    assert seen == [False, False, False]  # freed early: the checkpoint's saves are not ours
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_the_callers_saved_tensor_hooks_still_see_every_saved_tensor() -> None:
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    ref = copy.deepcopy(model)
    engine = _engine(model)
    seen = _root_gathered_in_first_block_backward(engine, model.transformer.h[0])
    calls = {"pack": 0, "unpack": 0}

    def pack(t: torch.Tensor) -> tuple[str, torch.Tensor]:
        calls["pack"] += 1
        return "mine", t.detach().clone()

    def unpack(packed: tuple[str, torch.Tensor]) -> torch.Tensor:
        calls["unpack"] += 1
        assert packed[0] == "mine"
        return packed[1]

    tokens = torch.randint(cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        _, loss = engine(tokens[:, :-1], tokens[:, 1:])
    engine.backward(loss)
    ours = dict(calls)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        _, ref_loss = ref(tokens[:, :-1], tokens[:, 1:])
    ref_loss.backward()
    assert ours["pack"] == ours["unpack"] > 0  # every tensor the engine's forward saved, read back
    assert calls["pack"] == 2 * ours["pack"]  # as many as plain PyTorch saves
    assert seen == [False]  # the copies the caller's hook saved do not need the root
    torch.testing.assert_close(loss, ref_loss)
    engine.step()
    torch.optim.AdamW(ref.parameters(), lr=LR).step()
    state = engine.full_state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=1e-5, atol=1e-6)
    engine.close()
