"""A nanoGPT-style decoder: the model the benchmarks and tests train.

Plain torch, no Ray, no zeroray imports, so the same module is handed unchanged to zeroray and to
every peer (DDP, FSDP2, DeepSpeed) and their numbers compare the same work. The size is one
number (:meth:`GPTConfig.for_params`), from a few million to a few hundred million parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    """Shape of a GPT decoder; head size is ``n_embd // n_head``."""

    vocab_size: int = 8192
    block_size: int = 256
    n_layer: int = 6
    n_head: int = 8
    n_embd: int = 512
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")

    @property
    def hidden_size(self) -> int:
        """``n_embd`` under Hugging Face's name (as GPT2Config maps it), which HF-style "auto" bucket sizes read."""
        return self.n_embd

    def num_params(self) -> int:
        """Parameter count of :class:`GPT` with this config, without building it."""
        d, L, b = self.n_embd, self.n_layer, int(self.bias)
        ln = d * (1 + b)
        block = (
            2 * ln + (3 * d * d + 3 * d * b) + (d * d + d * b) + (4 * d * d + 4 * d * b) + (4 * d * d + d * b)
        )
        head = 0 if self.tie_weights else self.vocab_size * d
        return self.vocab_size * d + self.block_size * d + L * block + ln + head

    @classmethod
    def for_params(
        cls, n: float, vocab_size: int = 8192, block_size: int = 256, head_dim: int = 64, **kw: object
    ) -> GPTConfig:
        """A config whose parameter count is near ``n``, with a GPT-2-like shape.

        Among depths 1..64 (width a multiple of ``head_dim``), keep the shapes within 10% of ``n``
        and take the one whose width/depth ratio is closest to 64 (GPT-2 small: 768/12); if none
        is that close, take the nearest count.
        """
        if n <= 0:
            raise ValueError(f"target parameter count must be positive, got {n}")
        best: list[tuple[float, float, GPTConfig]] = []
        for n_layer in range(1, 65):
            for n_embd in range(head_dim, 16 * 1024 + 1, head_dim):
                cfg = cls(vocab_size, block_size, n_layer, n_embd // head_dim, n_embd, **kw)  # type: ignore[arg-type]
                err = abs(cfg.num_params() - n) / n
                if cfg.num_params() > n and err > 0.1:
                    break
                best.append((err, abs(math.log(n_embd / n_layer / 64)), cfg))
        close = [b for b in best if b[0] <= 0.1]
        if close:
            return min(close, key=lambda b: (b[1], b[0]))[2]
        return min(best, key=lambda b: b[0])[2]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, C)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-norm transformer layer: the natural unit for ZeRO-3 gathering and FSDP wrapping."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx, targets)`` returns ``(logits, loss)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.transformer.wte.weight
        # Initialisation as GPT-2 (and nanoGPT), drawn from torch's global RNG: torch.manual_seed(s)
        # before construction gives the same weights in every process.
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        """Distinct parameters (a tied weight counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss
