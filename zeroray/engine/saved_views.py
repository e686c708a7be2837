"""SavedViews: how many tensors saved for backward still view a unit's gathered memory.

The root unit (embeddings, final norm, a tied head) used to stay gathered from the start of forward
to the end of backward. Most of that time nothing reads it: a transformer's embedding lookup saves only
the token ids, so once the head's and the final norm's backward ran, the root's parameters are dead
until the next forward. This class tells when: while the model's forward runs, autograd's
saved-tensor hooks see every tensor an op saves; those whose storage is the root's gathered memory
are counted, and each is uncounted when backward unpacks it. At zero, no saved tensor of this
forward reads the root again and the scheduler frees it early.

Hooks the caller set around the forward (``save_on_cpu``, say) keep working: ours call them. Tensors
saved under hooks set inside the model (non-reentrant activation checkpointing) are not seen; a
checkpointed region reads parameters again when it recomputes in backward, so the scheduler gathers
the root again when one of its modules runs then. Where torch does not expose the caller's hooks,
nothing is watched and the root is never freed early.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from zeroray.engine.flat_group import FlatGroup


class _Saved:
    """What was saved for a tensor: counted if it views the watched memory, and the caller's unpack
    hook if its pack hook made ``saved``."""

    __slots__ = ("saved", "counted", "unpack")

    def __init__(self, saved: Any, counted: bool, unpack: Callable[[Any], torch.Tensor] | None) -> None:
        self.saved, self.counted, self.unpack = saved, counted, unpack


_Hooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]


def _caller_hooks() -> _Hooks | None | bool:
    """The saved-tensor hooks active now (None: none), or False where torch does not say."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return False if top is None else top(False)


class SavedViews:
    def __init__(self) -> None:
        self.unread = 0  # saved by the forwards since the last reset, not unpacked yet
        self._blind = False  # a forward since the last reset was not watched
        self._ptrs: frozenset[int] = frozenset()
        self._outer: _Hooks | None = None
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def start(self, groups: Sequence[FlatGroup]) -> None:
        """A forward begins: watch the gathered memory of ``groups`` until :meth:`stop`."""
        outer = _caller_hooks()
        if outer is False:
            self._blind = True
            return
        self._outer = outer
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
        self._blind = False

    @property
    def all_read(self) -> bool:
        return not self._blind and self.unread <= 0  # below zero: a retained graph unpacked twice

    def _pack(self, t: torch.Tensor) -> Any:
        # A pack hook must not hold the tensor itself (a reference cycle): a detached alias, or
        # whatever the caller's hook makes of it.
        saved = t.detach() if self._outer is None else self._outer[0](t)
        counted = t.layout is torch.strided and t.untyped_storage().data_ptr() in self._ptrs
        if self._outer is None and not counted:
            return saved
        self.unread += counted
        return _Saved(saved, counted, None if self._outer is None else self._outer[1])

    def _unpack(self, packed: Any) -> torch.Tensor:
        if type(packed) is not _Saved:
            return packed
        self.unread -= packed.counted
        return packed.saved if packed.unpack is None else packed.unpack(packed.saved)
