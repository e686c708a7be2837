"""Safetensors files read by byte range over fsspec: the header, checked, and counted range reads.

A safetensors file is an 8-byte little-endian header length, a JSON header
(``{key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``) and the raw
little-endian tensor data, offsets counted from the end of the header. The ``safetensors`` package
reads whole local files (or memory-maps them); it has no range reads over fsspec, so a rank that
needs a slice of one tensor from an object store would have to fetch the file. Here the header is
parsed and checked as the package checks it (:func:`read_header`: a file the package refuses is
refused, with one line naming the problem), and then only the byte ranges a rank asks for are
requested, adjacent ones merged. :class:`RangeReader` counts every byte it requests, which is what the
"≤ 1.1 × the checkpoint's bytes across all ranks" promise of :func:`zeroray.load_pretrained` is
measured by. Nothing is unpickled.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from zeroray.checkpoint.manifest import CheckpointError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
MAX_HEADER = 100_000_000  # the safetensors package's own limit (bytes of JSON)
MAX_DEPTH = 127  # JSON nesting the package's parser (serde_json's recursion limit) accepts
_U64 = 1 << 64  # the package's sizes and offsets are u64: larger ones are refused
_TENSOR_FIELDS = ("dtype", "shape", "data_offsets")
MAX_RUN = 16 << 20  # bytes per range request (merged or cut to it)
_BATCH = 128 << 20  # bytes of requests in flight at once on object stores (cat_ranges runs them concurrently)
_IOV_MAX = 1024  # buffers per preadv call (Linux's IOV_MAX)
_ALIGN = 4096  # O_DIRECT: file offsets, lengths and memory aligned to the page (and any block size)


class PretrainedError(CheckpointError, ValueError):
    """Pretrained weights that cannot be loaded: no or a bad safetensors file, a pickle checkpoint,
    keys or shapes that do not fit the model. The message names the file or the keys."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a file: ``[start, end)`` are absolute byte offsets in the file."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SafetensorsFile:
    """A parsed, checked header: where each tensor lies in the file at ``url``."""

    url: str
    path: str
    size: int
    header_bytes: int  # 8 + the JSON header: what reading the header cost
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]


@dataclass(frozen=True)
class Range:
    """Read ``[start, end)`` of ``path`` and hand it to ``sinks``: (file offset, numel, source dtype,
    destination tensor) each, the destination filled with a cast copy."""

    path: str
    start: int
    end: int
    sinks: tuple[tuple[int, int, torch.dtype, torch.Tensor], ...]


class RangeReader:
    """Range reads through one filesystem, counting the bytes requested."""

    def __init__(self, fs: AbstractFileSystem):
        self.fs = fs
        self.bytes_read = 0

    def cat(self, path: str, start: int, end: int, url: str) -> bytes:
        data = self.fs.cat_file(path, start=start, end=end)
        self.bytes_read += end - start
        if len(data) != end - start:
            raise PretrainedError(f"{url} is shorter than its header says (wanted bytes [{start}, {end}))")
        return data

    def fill(self, ranges: Sequence[Range], urls: dict[str, str]) -> None:
        """Read ``ranges`` and cast them into their sinks: on a local disk each with one ``preadv``
        straight into the destinations, elsewhere a few at a time through ``cat_ranges``."""
        if isinstance(self.fs, LocalFileSystem):
            bounce = mmap.mmap(-1, MAX_RUN + 2 * _ALIGN)  # page-aligned, for O_DIRECT reads
            try:
                for r in ranges:
                    self._preadv(r, urls[r.path], bounce)
            finally:
                bounce.close()
            return
        for batch in _batches(ranges):
            datas = self.fs.cat_ranges([r.path for r in batch], [r.start for r in batch], [r.end for r in batch])
            for r, data in zip(batch, datas):
                self.bytes_read += r.end - r.start
                if isinstance(data, BaseException):
                    raise PretrainedError(f"cannot read {urls[r.path]}: {type(data).__name__}: {data}")
                if len(data) != r.end - r.start:
                    raise PretrainedError(
                        f"{urls[r.path]} is shorter than its header says (wanted bytes [{r.start}, {r.end}))"
                    )
                _scatter(r, data)


    def _preadv(self, r: Range, url: str, bounce: mmap.mmap) -> None:
        """One range of a local file into its sinks, no intermediate copy where the dtypes agree.

        Read once, the file bypasses the page cache where the filesystem allows (``O_DIRECT``, through
        ``bounce``): ranks holding their model states while the file streamed through the cache pushed
        the machine into page-cache reclaim, measured 2-3 x slower (benchmarks/RESULTS.md)."""
        buffers, casts = [], []
        for _, numel, dtype, dest in r.sinks:
            if dtype == dest.dtype:
                buffers.append(memoryview(dest.view(torch.uint8).numpy()))
            else:
                raw = torch.empty(numel * dtype.itemsize, dtype=torch.uint8)
                buffers.append(memoryview(raw.numpy()))
                casts.append((raw.view(dtype), dest))
        direct = _open_direct(r.path)
        try:
            fd = direct if direct is not None else os.open(r.path, os.O_RDONLY)
        except OSError as e:
            raise PretrainedError(f"cannot read {url}: {type(e).__name__}: {e}") from None
        try:
            if direct is not None:
                got = _read_direct(fd, bounce, r.start, buffers)
            else:
                got = 0
                for i in range(0, len(buffers), _IOV_MAX):
                    got += os.preadv(fd, buffers[i : i + _IOV_MAX], r.start + got)
            if got != r.end - r.start:
                raise PretrainedError(f"{url} is shorter than its header says (wanted bytes [{r.start}, {r.end}))")
        finally:
            os.close(fd)
            self.bytes_read += r.end - r.start
        for src, dest in casts:
            dest.copy_(src)


def _open_direct(path: str) -> int | None:
    """``path`` opened for reads that bypass the page cache; None where the platform or the
    filesystem (e.g. tmpfs) has no ``O_DIRECT``."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_RDONLY | flag)
    except OSError:
        return None


def _read_direct(fd: int, bounce: mmap.mmap, start: int, buffers: list[memoryview]) -> int:
    """Fill ``buffers`` in order from the file's byte ``start`` on: ``O_DIRECT`` reads of aligned
    blocks into ``bounce``, then copies. Returns the bytes delivered (fewer at the end of the file)."""
    end = start + sum(len(b) for b in buffers)
    view = memoryview(bounce)
    pos, bi, boff = start, 0, 0
    while pos < end:
        lo = pos - pos % _ALIGN
        n = min(len(bounce) // _ALIGN * _ALIGN, -(-(end - lo) // _ALIGN) * _ALIGN)
        got = os.preadv(fd, [view[:n]], lo)
        take = min(lo + got - pos, end - pos)
        if take <= 0:
            break  # the end of the file
        src, done = view[pos - lo : pos - lo + take], 0
        while done < take:
            b = buffers[bi]
            k = min(len(b) - boff, take - done)
            b[boff : boff + k] = src[done : done + k]
            done, boff = done + k, boff + k
            if boff == len(b):
                bi, boff = bi + 1, 0
        pos += take
    return pos - start


def _batches(ranges: Sequence[Range]) -> Iterator[list[Range]]:
    """Ranges grouped so that one ``cat_ranges`` call holds at most _BATCH bytes (or one range)."""
    batch: list[Range] = []
    size = 0
    for r in ranges:
        if batch and size + r.end - r.start > _BATCH:
            yield batch
            batch, size = [], 0
        batch.append(r)
        size += r.end - r.start
    if batch:
        yield batch


def _scatter(r: Range, data: bytes) -> None:
    view = memoryview(data)
    for offset, numel, dtype, dest in r.sinks:
        lo = offset - r.start
        nbytes = numel * dtype.itemsize
        if dtype == dest.dtype:  # straight into the destination's bytes, one copy
            memoryview(dest.view(torch.uint8).numpy())[:] = view[lo : lo + nbytes]
        else:
            raw = torch.empty(nbytes, dtype=torch.uint8)
            memoryview(raw.numpy())[:] = view[lo : lo + nbytes]
            dest.copy_(raw.view(dtype))


def merge(pieces: Sequence[tuple[str, int, int, torch.dtype, torch.Tensor]]) -> list[Range]:
    """(path, start, end, source dtype, 1-D CPU destination) pieces as requests: a piece larger
    than MAX_RUN cut into parts (one request's bytes are held in memory at once), byte-adjacent
    ones of one file merged up to MAX_RUN bytes."""
    out: list[Range] = []
    for path, start, end, dtype, dest in sorted(_split(pieces), key=lambda p: (p[0], p[1])):
        sink = (start, (end - start) // dtype.itemsize, dtype, dest)
        last = out[-1] if out else None
        if last is not None and last.path == path and last.end == start and end - last.start <= MAX_RUN:
            out[-1] = Range(path, last.start, end, (*last.sinks, sink))
        else:
            out.append(Range(path, start, end, (sink,)))
    return out


def _split(
    pieces: Sequence[tuple[str, int, int, torch.dtype, torch.Tensor]],
) -> Iterator[tuple[str, int, int, torch.dtype, torch.Tensor]]:
    for path, start, _end, dtype, dest in pieces:
        step = max(1, MAX_RUN // dtype.itemsize)
        for i in range(0, dest.numel(), step):
            part = dest[i : i + step]
            lo = start + i * dtype.itemsize
            yield path, lo, lo + part.numel() * dtype.itemsize, dtype, part


def read_header(reader: RangeReader, path: str, url: str) -> SafetensorsFile:
    """Read and check the header of the safetensors file at ``path``: two small range reads.

    The checks are the ``safetensors`` package's (``safe_open``): a header of at most 100 MB of
    UTF-8 JSON (no BOM, no NaN, no lone surrogate, nested at most 127 deep) holding an object of
    tensors ``{"dtype", "shape", "data_offsets"}`` and an optional ``__metadata__`` of strings; the
    tensors, in offset order, tile the data from its first byte to the end of the file with no hole
    and no overlap, each as many bytes as its dtype and shape need. Beyond the package, a dtype
    zeroray cannot read is refused."""
    try:
        size = int(reader.fs.size(path))
    except FileNotFoundError:
        raise PretrainedError(f"{url} does not exist") from None
    if size < 8:
        raise PretrainedError(f"{url} is truncated: {size} bytes, not even a safetensors header length")
    (n,) = struct.unpack("<Q", reader.cat(path, 0, 8, url))
    if n > MAX_HEADER or 8 + n > size:
        raise PretrainedError(
            f"{url} is truncated or not a safetensors file: its header length {n} runs past the file's {size} "
            f"bytes or the format's {MAX_HEADER}"
        )
    header = _parse(reader.cat(path, 8, 8 + n, url), url)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise PretrainedError(f"{url} is not a safetensors file: its __metadata__ is not a map of strings")
    data_bytes = size - 8 - n
    tensors = {key: _tensor(key, entry, 8 + n, data_bytes, url) for key, entry in header.items()}
    _check_tiling(tensors, 8 + n, data_bytes, url)
    return SafetensorsFile(url, path, size, 8 + n, tensors, metadata)


class _Object(dict):
    """A JSON object, remembering which keys it had more than once (the package refuses a repeated
    ``__metadata__`` or tensor field; a repeated tensor name keeps the last, as here)."""

    repeated: frozenset[str] = frozenset()


def _object(pairs: list[tuple[str, Any]]) -> _Object:
    out = _Object(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        out.repeated = frozenset(k for k, _ in pairs if k in seen or seen.add(k))
    return out


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _parse(raw: bytes, url: str) -> dict[str, Any]:
    """The header's JSON as the package reads it: strict UTF-8 (``json.loads`` of bytes would also take
    UTF-16 and UTF-32, and a BOM), strict JSON, bounded nesting; one line on anything else."""
    try:
        text = raw.decode("utf-8")
        header = json.loads(text, object_pairs_hook=_object, parse_constant=_refuse_constant)
    except UnicodeDecodeError as e:
        raise PretrainedError(f"{url} is not a safetensors file: its header is not UTF-8 ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise PretrainedError(f"{url} is not a safetensors file: its header nests deeper than {MAX_DEPTH}") from None
    except ValueError as e:  # json.JSONDecodeError included
        raise PretrainedError(f"{url} is not a safetensors file: its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise PretrainedError(f"{url} is not a safetensors file: its header is not a JSON object")
    if _depth(header) > MAX_DEPTH:
        raise PretrainedError(f"{url} is not a safetensors file: its header nests deeper than {MAX_DEPTH}")
    if "\\u" in text:
        try:  # an escaped lone surrogate decodes to a str that has no UTF-8 form
            json.dumps(header, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise PretrainedError(f"{url} is not a safetensors file: its header escapes a lone surrogate") from None
    if "__metadata__" in header.repeated:
        raise PretrainedError(f"{url} is not a safetensors file: its header repeats __metadata__")
    return header


def _depth(root: dict[str, Any]) -> int:
    """How deep JSON objects and arrays nest in ``root`` (itself 1)."""
    deepest, stack = 0, [(root, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def _size(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < _U64


def _tensor(key: str, entry: Any, base: int, data_bytes: int, url: str) -> TensorInfo:
    """One header entry, checked: its three fields once each, a known dtype, sizes that are u64s,
    and a byte range inside the file as long as its dtype and shape need."""
    if not isinstance(entry, dict) or not all(f in entry for f in _TENSOR_FIELDS) or entry.repeated & {*_TENSOR_FIELDS}:
        raise PretrainedError(f"{url}: tensor {key!r} is not an entry of one dtype, shape and data_offsets")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not isinstance(shape, list) or not all(_size(d) for d in shape):
        raise PretrainedError(f"{url}: tensor {key!r} has a bad shape {str(shape)[:60]}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_size(x) for x in offsets):
        raise PretrainedError(f"{url}: tensor {key!r} has bad data_offsets {str(offsets)[:60]}")
    dtype = DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise PretrainedError(f"{url}: tensor {key!r} has a dtype zeroray cannot read: {str(entry['dtype'])[:30]!r}")
    numel = 1
    for d in shape:  # the package's checked product, in order: an overflow on the way is refused
        numel *= d
        if numel >= _U64:
            raise PretrainedError(f"{url}: tensor {key!r}'s shape {shape} overflows 64 bits")
    begin, end = offsets
    want = numel * dtype.itemsize
    if want >= _U64 or end < begin or end - begin != want:
        raise PretrainedError(
            f"{url}: tensor {key!r} has data_offsets [{begin}, {end}] ({end - begin} bytes) but {entry['dtype']} "
            f"{shape} needs {want} bytes"
        )
    if end > data_bytes:
        raise PretrainedError(
            f"{url}: tensor {key!r} has data_offsets [{begin}, {end}] outside the file's {data_bytes} data bytes "
            "(the file is truncated or its header is corrupt)"
        )
    return TensorInfo(key, dtype, tuple(shape), base + begin, base + end)


def _check_tiling(tensors: dict[str, TensorInfo], base: int, data_bytes: int, url: str) -> None:
    """In offset order the tensors cover the data exactly: no hole (before the first, between two,
    after the last) and no two sharing bytes."""
    pos = base
    for t in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
        if t.start != pos:
            what = "overlaps the tensor before it" if t.start < pos else f"leaves a hole of {t.start - pos} bytes before it"
            raise PretrainedError(f"{url}: tensor {t.key!r} at data bytes [{t.start - base}, {t.end - base}] {what}")
        pos = t.end
    if pos != base + data_bytes:
        raise PretrainedError(f"{url} has {base + data_bytes - pos} bytes after its last tensor's data "
                              "(a safetensors file's tensors end at the end of the file)")
