"""GatherPool: the memory that stage-3 gathers land in, kept and reused across units and steps.

A sharded group's ``full`` buffer has storage only while it is gathered. Allocating it at every
gather and freeing it after each use leaves the CPU heap full of holes (glibc carves each new
block from the top of the heap when the hole the last one left does not fit exactly), which
shows up as resident memory that nothing uses. The pool keeps freed gather memory by size and
hands it to the next gather of that size, so a step makes no large allocations for gathers.

The memory moves between storages without changing which storage a tensor refers to
(``UntypedStorage._swap_data_ptr_``, the same move ``torch.utils.swap_tensors`` relies on):
autograd's saved views of a unit's ``full`` keep seeing that unit's values when it is gathered
again for its backward. Groups of the same byte size share buffers (the blocks of a transformer);
the pool holds at most as many buffers of a size as were gathered at once.
"""

from __future__ import annotations

import torch

# torch without _swap_data_ptr_ (2.11 has none) cannot move memory between storages: there a gather allocates (resize_) and a free gives
# the memory back to the allocator, as FSDP2 does; the storage object stays the same either way.
_SWAPS = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


class GatherPool:
    def __init__(self) -> None:
        self._free: dict[tuple[torch.device, int], list[torch.UntypedStorage]] = {}

    def fill(self, full: torch.Tensor, nbytes: int) -> None:
        """Give ``full`` (whose storage is empty) ``nbytes`` of memory: a pooled buffer if one of
        that size is free, else a new one. Its contents are whatever the last user left."""
        storage = full.untyped_storage()
        if not _SWAPS:
            storage.resize_(nbytes)
            return
        free = self._free.get((full.device, nbytes))
        buf = free.pop() if free else torch.UntypedStorage(nbytes, device=full.device)
        storage._swap_data_ptr_(buf)

    def empty(self, full: torch.Tensor) -> None:
        """Take ``full``'s memory back into the pool; its storage is left empty."""
        storage = full.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        if not _SWAPS:
            storage.resize_(0)
            return
        buf = torch.UntypedStorage(0, device=full.device)
        buf._swap_data_ptr_(storage)
        self._free.setdefault((full.device, nbytes), []).append(buf)

    def cached_bytes(self) -> int:
        """Bytes of free buffers the pool holds between gathers."""
        return sum(nbytes * len(bufs) for (_, nbytes), bufs in self._free.items())

    def clear(self) -> None:
        """Return every free buffer to the allocator."""
        self._free.clear()
