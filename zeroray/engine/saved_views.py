"""SavedViews: how many tensors saved for backward still view a unit's gathered memory.

The root unit (embeddings, final norm, a tied head) is gathered from the start of forward to the
end of backward. Most of that time nothing reads it: a transformer's embedding lookup saves only
the token ids, so once the head's and the final norm's backward ran, the root's parameters are dead
until the next forward. This class tells when: while the model's forward runs, autograd's
saved-tensor hooks see every tensor an op saves; those whose storage is the root's gathered memory
are counted, and each is uncounted when backward unpacks it. At zero, no saved tensor of this
forward reads the root again and the scheduler frees it early.

Tensors saved under other saved-tensor hooks (nested inside the model: non-reentrant activation
checkpointing, ``save_on_cpu``) are not seen; a checkpointed region reads parameters again when it
recomputes in backward, so the scheduler re-gathers the root when one of its modules runs then.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zeroray.engine.flat_group import FlatGroup


class _View:
    """A saved tensor that views the watched memory (a detached alias of it)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedViews:
    def __init__(self) -> None:
        self.unread = 0  # saved by the forwards since the last reset, not unpacked yet
        self._ptrs: frozenset[int] = frozenset()
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def start(self, groups: Sequence[FlatGroup]) -> None:
        """A forward begins: watch the gathered memory of ``groups`` until :meth:`stop`."""
        self._ptrs = frozenset(p for p in (g.full.untyped_storage().data_ptr() for g in groups) if p)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()

    def stop(self) -> None:
        """The forward ended (or raised)."""
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None

    def reset(self) -> None:
        """A backward ended: its saved tensors are gone."""
        self.unread = 0

    @property
    def all_read(self) -> bool:
        return self.unread <= 0  # below zero: a retained graph unpacked twice

    def _pack(self, t: torch.Tensor) -> torch.Tensor | _View:
        saved = t.detach()  # a pack hook must not hold the tensor itself (a reference cycle)
        if t.layout is torch.strided and t.untyped_storage().data_ptr() in self._ptrs:
            self.unread += 1
            return _View(saved)
        return saved

    def _unpack(self, packed: torch.Tensor | _View) -> torch.Tensor:
        if type(packed) is _View:
            self.unread -= 1
            return packed.tensor
        return packed
