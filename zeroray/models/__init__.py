"""Reference models for tests and benchmarks (plain torch)."""

from zeroray.models.gpt import GPT, Block, GPTConfig

__all__ = ["GPT", "GPTConfig", "Block"]
