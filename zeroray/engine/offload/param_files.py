"""ParamFiles: stage-3 compute-dtype parameter shards in NVMe files (``offload_param.device="nvme"``).

Each sharded flat group's shard lives in one file of this rank's swap directory, and host memory
holds a fixed pool of ``buffer_count`` aligned buffers of the largest shard's size, whatever the
model size. The flat group asks this object for its shard when it gathers (:meth:`fill`, right into
its gathered buffer, so no pool buffer is held across a collective) and hands it the new values
after the optimizer step (:meth:`write`, staged into a pool buffer and written behind).

Read-ahead: the unit scheduler names the groups it will gather next, in forward order and, in
backward, in reverse (:meth:`read_ahead`); their reads are issued into free buffers, so by the time
a unit gathers, its shard is usually in memory. A buffer holding a read-ahead nobody used yet is
given up to a demand read when the pool is full (it is clean: the file has the same bytes).

A read of a group waits for that group's write in flight, so a gather never sees stale weights.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from zeroray.engine.layout import param_pool_size as pool_size
from zeroray.engine.offload.files import AlignedBuffer, SwapDir, aligned, wait_all

if TYPE_CHECKING:
    from zeroray.engine.flat_group import FlatGroup


class ParamFiles:
    """The swap files and the buffer pool of this rank's parameter shards; see the module docstring."""

    def __init__(self, swap: SwapDir, buffer_count: int):
        self.swap = swap
        self.buffer_count = pool_size(buffer_count)
        self._groups: list[FlatGroup] = []
        self._index: dict[FlatGroup, int] = {}
        self._bufs: list[AlignedBuffer] = []
        self._free: list[int] = []
        self._ahead: dict[FlatGroup, tuple[int, list[Future]]] = {}  # read-ahead: group -> (buffer, reads)
        self._writing: list[tuple[int, list[Future]]] = []  # buffers whose write is in flight, oldest first
        self._write_of: dict[FlatGroup, list[Future]] = {}  # the last write of each group
        self._staged: dict[FlatGroup, int] = {}  # group -> buffer its new values are being written into
        self.read_wait_s = 0.0
        self.reads_ahead_used = 0  # gathers whose shard was read ahead
        self.reads_on_demand = 0  # gathers that had to start their read
        self.reads_given_up = 0  # read-aheads whose buffer a demand took before any gather used them

    # ------------------------------------------------------------------ set-up
    def attach(self, groups: Sequence[FlatGroup]) -> None:
        """Write each group's current shard (``g.shard``, in memory at set-up) to its file, then let the
        group drop it: from here on the files hold the parameters."""
        self._groups = list(groups)
        self._index = {g: i for i, g in enumerate(self._groups)}
        size = max((self._nbytes(g) for g in self._groups), default=1)
        self._bufs = [AlignedBuffer(size) for _ in range(self.buffer_count)]
        self._free = list(range(self.buffer_count))
        for g in self._groups:
            self.write(g, 0, g.shard_numel, g.shard)
        self.drain()

    @staticmethod
    def _nbytes(g: FlatGroup) -> int:
        return g.shard_numel * torch.empty((), dtype=g.compute_dtype).element_size()

    def _name(self, g: FlatGroup) -> str:
        return f"param{self._index[g]:05d}.swap"

    def _view(self, b: int, g: FlatGroup) -> torch.Tensor:
        return self._bufs[b].tensor.view(torch.uint8)[: self._nbytes(g)].view(g.compute_dtype)

    # ------------------------------------------------------------------ buffers
    def _take(self) -> int:
        """A free buffer: reclaims finished writes, then waits for the oldest write or gives up the
        oldest unused read-ahead."""
        while True:
            self._reclaim(block=False)
            if self._free:
                return self._free.pop()
            if self._ahead:
                g = next(iter(self._ahead))
                b, reads = self._ahead.pop(g)
                wait_all(reads)
                self.reads_given_up += 1
                return b
            if not self._writing:
                raise RuntimeError("zeroray param swap: every buffer is staged; raise offload_param.buffer_count")
            self._reclaim(block=True)

    def _reclaim(self, block: bool) -> None:
        while self._writing and (block or all(f.done() for f in self._writing[0][1])):
            b, futures = self._writing.pop(0)
            wait_all(futures)  # raises a short write
            self._free.append(b)
            block = False

    def _wait_write(self, g: FlatGroup) -> None:
        futures = self._write_of.pop(g, None)
        if futures is not None:
            wait_all(futures)

    # ------------------------------------------------------------------ reads
    def read_ahead(self, groups: Iterable[FlatGroup]) -> None:
        """Start reading these groups' shards (in this order) into free buffers; stops at the first
        that finds none (never waits, never evicts)."""
        for g in groups:
            if g not in self._index or g in self._ahead or g in self._staged:
                continue
            self._reclaim(block=False)
            if not self._free:
                return
            writes = self._write_of.get(g)
            if writes is not None and not all(f.done() for f in writes):
                return  # its new values are still going out; the demand read will wait for them
            self._wait_write(g)
            b = self._free.pop()
            self._ahead[g] = (b, self.swap.read(self._name(g), self._bufs[b], self._nbytes(g)))

    def fill(self, g: FlatGroup, dst: torch.Tensor) -> None:
        """Copy ``g``'s shard into ``dst`` (its slice of the gathered buffer, on any device)."""
        staged = self._staged.get(g)
        if staged is not None:  # values written but not flushed yet: they are the truth
            dst.copy_(self._view(staged, g))
            return
        found = self._ahead.pop(g, None)
        t0 = time.perf_counter()
        if found is None:
            self._wait_write(g)
            b = self._take()
            found = (b, self.swap.read(self._name(g), self._bufs[b], self._nbytes(g)))
            self.reads_on_demand += 1
        else:
            self.reads_ahead_used += 1
        b, reads = found
        try:
            wait_all(reads)
            self.read_wait_s += time.perf_counter() - t0
            dst.copy_(self._view(b, g))
        finally:
            self._free.append(b)

    def values(self, g: FlatGroup) -> torch.Tensor:
        """A fresh host tensor with ``g``'s shard (outside the training loop: checkpoints, frozen
        weights, the optimizer's first masters)."""
        out = torch.empty(g.shard_numel, dtype=g.compute_dtype)
        self.fill(g, out)
        return out

    # ------------------------------------------------------------------ writes
    def write(self, g: FlatGroup, lo: int, hi: int, values: torch.Tensor) -> None:
        """Set ``g``'s shard ``[lo, hi)`` (cast to its dtype). Pieces of a group come in order and run to
        its end (the optimizer publishes sub-group by sub-group); they are staged in a pool buffer and
        the file is written once the piece ending the shard arrives. A first piece that does not start
        the shard reads the part before it from the file first."""
        b = self._staged.get(g)
        if b is None:
            ahead = self._ahead.pop(g, None)
            if ahead is not None:  # a read-ahead of the old values: reuse its buffer
                b = ahead[0]
                wait_all(ahead[1])
            else:
                self._wait_write(g)
                b = self._take()
                if lo != 0:  # the part before this piece is not being rewritten: keep the file's
                    wait_all(self.swap.read(self._name(g), self._bufs[b], self._nbytes(g)))
            self._staged[g] = b
        self._view(b, g)[lo:hi].copy_(values)
        if hi == g.shard_numel:
            del self._staged[g]
            futures = self.swap.write(self._name(g), self._bufs[b], self._nbytes(g))
            self._writing.append((b, futures))
            self._write_of[g] = futures

    def drain(self) -> None:
        """Wait for every write in flight."""
        while self._writing:
            self._reclaim(block=True)
        self._write_of.clear()

    # ------------------------------------------------------------------ accounting / teardown
    def host_bytes(self) -> int:
        return sum(b.nbytes for b in self._bufs)

    def file_bytes(self) -> int:
        return sum(aligned(self._nbytes(g)) for g in self._groups)

    def io_report(self) -> dict[str, float]:
        return {"bytes_read": self.swap.bytes_read, "bytes_written": self.swap.bytes_written,
                "read_wait_s": self.read_wait_s, "reads_ahead_used": self.reads_ahead_used,
                "reads_on_demand": self.reads_on_demand, "reads_given_up": self.reads_given_up}

    def close(self) -> None:
        try:
            for _, reads in self._ahead.values():
                wait_all(reads)
            self.drain()
        finally:
            self._ahead.clear()
            for b in self._bufs:
                b.close()
            self._bufs = []
            self.swap.close()
