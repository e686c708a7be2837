"""Model FLOPs for MFU: training FLOPs per token of known model families, and device peaks.

Training FLOPs per token follow PaLM's appendix B: ``6 N + 12 L d T``, where N counts the weights
that take part in a matrix multiply (every layer's projections and the output head; embedding
lookups do none), L is the depth, d the width and T the sequence length (the attention scores and
their weighted sum). Forward is a third of it. MFU uses the model's FLOPs, not the hardware's
(activation recomputation does not count), so it compares across systems.
"""

from __future__ import annotations

from typing import Any

# Dense peak FLOP/s per device by compute precision (vendor data sheets, no sparsity). The name is
# matched as a substring of torch.cuda.get_device_name(), longest first.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12},
}


def device_peak_flops(device_name: str, precision: str) -> float | None:
    """The dense peak of a CUDA device (by name) at ``precision`` ("bf16", "fp16", "fp32"), or None
    when it is not in :data:`PEAK_FLOPS`."""
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if key in device_name:
            return PEAK_FLOPS[key].get(precision)
    return None


def _shape(model: Any) -> tuple[int, int, int, int] | None:
    """(layers, width, matmul weights per layer, vocabulary) of a known family, or None."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    if all(hasattr(cfg, k) for k in ("n_layer", "n_embd", "vocab_size")):  # zeroray's GPT (nanoGPT)
        d = cfg.n_embd
        return cfg.n_layer, d, 12 * d * d, cfg.vocab_size
    if all(hasattr(cfg, k) for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size")):
        d, heads = cfg.hidden_size, cfg.num_attention_heads  # Llama-like: GQA attention, gated MLP
        head_dim = getattr(cfg, "head_dim", None) or d // heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        attn = 2 * d * heads * head_dim + 2 * d * kv * head_dim
        return cfg.num_hidden_layers, d, attn + 3 * d * cfg.intermediate_size, cfg.vocab_size
    return None


def training_flops_per_token(model: Any, seq_len: float) -> float | None:
    """Forward plus backward FLOPs per token at sequence length ``seq_len`` for zeroray's GPT or a
    Hugging Face Llama-like model (by its ``config``); None for other models."""
    shape = _shape(model)
    if shape is None:
        return None
    layers, d, per_layer, vocab = shape
    n = layers * per_layer + vocab * d
    return 6.0 * n + 12.0 * layers * d * seq_len
