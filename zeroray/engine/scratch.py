"""ScratchPool: the CPU temporaries of the quantized collectives, kept by byte size and reused.

A qwZ gather or qgZ reduction needs a few buffers as large as the unit's group (codes to send, codes
received, the fp32 values being quantized or summed), and needs them only until it completes. Fresh
ones from glibc's malloc are new pages of memory: every one faults in on first touch, which on CPU
cost more than the quantizing itself (a ZeRO++ step's CPU cost over hpZ: 0.11 s per rank and step
with fresh buffers, 0.03 s with reused ones; docs/multi-node.md). The pool hands back a buffer
of the same byte size that a finished collective returned, so a step makes no large allocation here.
It holds, per size, at most as many buffers as were in use at once. Only CPU memory is pooled: on CUDA
the caching allocator already does this, so there ``take`` allocates and ``give`` lets go.
"""

from __future__ import annotations

import math

import torch


class ScratchPool:
    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}  # flat uint8 buffers by byte size

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous tensor of ``shape`` and ``dtype``; its contents are whatever the last user left."""
        if device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        nbytes = math.prod(shape) * dtype.itemsize
        free = self._free.get(nbytes)
        buf = free.pop() if free else torch.empty(nbytes, dtype=torch.uint8)
        return buf.view(dtype).view(shape)

    def give(self, *tensors: torch.Tensor) -> None:
        """Take back tensors from :meth:`take` that nothing reads or writes any more."""
        for t in tensors:
            if t.device.type == "cpu":
                self._free.setdefault(t.numel() * t.element_size(), []).append(t.view(-1).view(torch.uint8))

    def cached_bytes(self) -> int:
        """Bytes of the free buffers held between collectives."""
        return sum(nbytes * len(bufs) for nbytes, bufs in self._free.items())

    def clear(self) -> None:
        """Return every free buffer to the allocator."""
        self._free.clear()
