"""What a benchmark rank measures besides time: bytes moved by collectives and bytes of live tensors.

Both are measured the same way for every system, so no peer is credited with a number its own
code did not produce.
"""

from __future__ import annotations

import ctypes
import gc
import resource
import threading
import warnings
import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _nbytes(obj: object) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor))


class CommCounter(TorchDispatchMode):
    """Counts the bytes handed to torch.distributed collectives, by operation.

    Every c10d collective (DDP's reducer, FSDP2, ZeroRedundancyOptimizer and DeepSpeed alike) goes
    through the dispatcher's ``c10d`` ops, so a dispatch mode sees them all without patching
    anything. Convention (the ZeRO paper's): an all-reduce counts twice its size, an all-gather
    its gathered output, a reduce-scatter its full input, a broadcast or send its tensor.
    It slows every op down, so it is used for one separate step, never a timed one.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func.__name__.split(".")[0].strip("_")
            if name.startswith("allreduce"):
                n = 2 * _nbytes(args[0])
            elif name.startswith("allgather"):
                n = _nbytes(args[0])
            elif name.startswith(("reduce_scatter", "alltoall")):
                n = _nbytes(args[1])
            elif name == "barrier":
                n = 0
            else:
                n = _nbytes(args[0])
            self.bytes[name] = self.bytes.get(name, 0) + n
        return func(*args, **(kwargs or {}))


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """``(data_ptr, nbytes)`` of the memory behind a tensor (a DTensor's local shard)."""
    t = getattr(t, "_local_tensor", t)
    if t.device.type == "meta":
        return None
    try:
        s = t.untyped_storage()
        return (s.data_ptr(), s.nbytes()) if s.nbytes() else None
    except (RuntimeError, NotImplementedError):  # no memory of its own: torch.compile's fake tensors
        return None


def storages(tensors: Iterable[torch.Tensor | None]) -> dict[int, int]:
    """Distinct storages behind some tensors, ``{data_ptr: nbytes}`` (views and ties count once)."""
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and (s := _storage(t)) is not None:
            out[s[0]] = s[1]
    return out


def live_storages() -> dict[int, int]:
    """Every tensor storage that Python can reach in this process."""
    with warnings.catch_warnings():  # isinstance() on some deprecated torch objects warns
        warnings.simplefilter("ignore", FutureWarning)
        # A weak proxy (torch.compile keeps some) is not a tensor itself; a dead one raises on isinstance().
        proxies = (weakref.ProxyType, weakref.CallableProxyType)
        return storages(o for o in gc.get_objects() if type(o) not in proxies and isinstance(o, torch.Tensor))


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """An optimizer's state tensors and the parameters it updates (master copies, if it has them)."""
    out = [p for g in optimizer.param_groups for p in g["params"]]
    out += [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def dynamo_counts() -> dict[str, int]:
    """torch.compile's work so far in this process: frames compiled, graphs, graph breaks.

    The optimizer's first step imports dynamo anyway, so reading them costs an eager system nothing."""
    from torch._dynamo.utils import counters

    return {
        "frames_compiled": counters["frames"]["ok"],
        "unique_graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def current_rss_bytes() -> int:
    """Resident set size of this process now (the baseline that peak RSS growth is measured from)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def _mallinfo2() -> ctypes._CFuncPtr | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):  # not glibc, or glibc < 2.33
        return None
    return libc.mallinfo2


def malloc_bytes() -> dict[str, int] | None:
    """glibc's view of this process's heap (``mallinfo2``): bytes in use, free but still held
    (resident until reused: what peak RSS counts beyond live memory) and mmapped. None elsewhere
    (under jemalloc, glibc's counters read 0)."""
    mallinfo2 = _mallinfo2()
    if mallinfo2 is None:
        return None
    m = mallinfo2()
    return {"in_use": m.uordblks, "free_held": m.fordblks, "mmapped": m.hblkhd}


class HeapPeak:
    """The most bytes malloc had handed out (heap in use plus mmapped chunks) while the block ran,
    sampled from a thread every ``interval`` seconds: the memory a step really uses, without what the
    allocator keeps resident on top (peak RSS counts both). ``peak`` stays None without glibc."""

    def __init__(self, interval: float = 0.0005) -> None:
        self.interval = interval
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mallinfo2 = _mallinfo2()

    def _sample(self) -> None:
        while True:
            m = self._mallinfo2()
            self.peak = max(self.peak or 0, m.uordblks + m.hblkhd)
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> HeapPeak:
        if self._mallinfo2 is not None:
            self._thread = threading.Thread(target=self._sample, name="heap-peak", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
