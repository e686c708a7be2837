"""The names zeroray gives a model's parameters and buffers: torch's, without the ``_orig_mod.`` that a
block wrapped by ``torch.compile(block)`` puts in them, as torch.distributed.checkpoint drops it. So a
checkpoint, ``full_state_dict()`` or a Hugging Face load names the same tensors compiled or not."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

_COMPILED = "_orig_mod."  # OptimizedModule's attribute holding the module it compiles


def clean(name: str) -> str:
    """``name`` without the compile wrappers' part."""
    return name.replace(_COMPILED, "") if _COMPILED in name else name


def named_parameters(module: nn.Module, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
    for n, p in module.named_parameters(remove_duplicate=remove_duplicate):
        yield clean(n), p


def named_buffers(module: nn.Module, remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    for n, b in module.named_buffers(remove_duplicate=remove_duplicate):
        yield clean(n), b
