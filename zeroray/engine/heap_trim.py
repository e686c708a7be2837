"""HeapTrimmer: hands the free pages of the C heap back to the OS during a stage-3 backward on CPU.

On CPU a rank's tensors come from glibc's malloc, which keeps freed memory resident. A stage-3
backward frees a lot of it in pieces: autograd's gradient of each parameter (copied into a
temporary and dropped), the activations and their gradients. The pieces leave holes that later,
differently sized requests do not fit, so the heap grows at its top while the holes stay resident:
at 115M parameters, world 4, peak RSS ran 200-250 MiB above the bytes malloc had handed out
(docs/architecture.md, "Peak RSS at stage 3 on CPU"). ``malloc_trim(0)`` after each unit's
backward returns every whole free page (``MADV_DONTNEED``) while the memory stays mapped, so the
next allocation there costs a page fault instead of resident memory. It takes a few milliseconds.

Nothing happens where glibc's ``malloc_trim`` is missing (another libc, another OS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


class HeapTrimmer:
    def __init__(self) -> None:
        self._trim = _malloc_trim()
        self.trims = 0  # calls that ran

    @property
    def available(self) -> bool:
        """True where the C library can trim (glibc)."""
        return self._trim is not None

    def trim(self) -> None:
        """Return the heap's free pages to the OS (keeping nothing in reserve)."""
        if self._trim is not None:
            self._trim(0)
            self.trims += 1
