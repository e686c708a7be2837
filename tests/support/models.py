"""Small models that hit the cases users hit: tied weights, frozen parameters, a parameter used
twice in one forward, a buffer, sizes no world size divides."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 3 * d + 1)
        self.proj = nn.Linear(3 * d + 1, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.tanh(self.fc(self.ln(x))))


class TinyLM(nn.Module):
    """Embedding tied to the LM head, a ModuleList of blocks, a frozen projection, a shared gate."""

    def __init__(self, vocab: int = 37, d: int = 13, n_layer: int = 3, seq: int = 9):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.h = nn.ModuleList(Block(d) for _ in range(n_layer))
        self.gate = nn.Linear(d, d)  # applied twice per forward
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        self.register_buffer("pos_scale", torch.linspace(0.5, 1.5, seq).unsqueeze(-1))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # The buffer keeps fp32 under bf16 parameters (as DeepSpeed and FSDP2 keep it): cast where it is read.
        x = self.wte(idx) + self.wpe[: idx.shape[1]] * self.pos_scale[: idx.shape[1]].to(self.wpe.dtype)
        x = x + self.frozen(x)
        for blk in self.h:
            x = blk(x)
            x = x * torch.sigmoid(self.gate(x))
        logits = self.head(self.ln_f(x))
        return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def param_groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict]:
    """Two groups as users make them: decay for matrices, none for biases, norms and embeddings' pos."""
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def batches(rank: int, steps: int, batch: int = 3, seq: int = 9, vocab: int = 37) -> list[tuple]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [
        (torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))
        for _ in range(steps)
    ]

