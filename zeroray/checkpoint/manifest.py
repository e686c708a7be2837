"""The checkpoint format: file names, the manifest (JSON, written last) and chunk checksums.

A checkpoint directory holds one ``rank-NNNNN.bin`` per rank that wrote it (raw little-endian
sections, each 64-byte aligned) and ``manifest.json``. The manifest describes *logical* tensors —
every parameter's name, shape and offset in its logical flat group — so it does not depend on the
world size or stage that wrote it; beside that it records who wrote it, the byte range of every
section of every file, and a checksum per ``chunk_bytes`` chunk of every file. Nothing here
unpickles: a file from storage is parsed as JSON or copied as raw numbers, never run.

The manifest is a tree of dataclasses (:class:`Manifest`, :class:`GroupEntry`, :class:`SlotEntry`,
:class:`FileEntry`, :class:`SectionEntry`) with ``to_json``/``from_json``; the JSON keys are those of
format version 1, so manifests written before these classes existed still load. Version 2 only adds
the checksum ``crc32c`` (hardware CRC, ~3x zlib's crc32 here); each file entry names its algorithm,
so version-1 files (``crc32``) are verified with zlib as before.

A manifest comes from storage, so it is input: ``from_json`` checks every field (its type, its range,
and sizes against the layout) before anything is read or allocated from it. A file entry's ``path``
must be a plain file name inside the checkpoint directory (never ``../x``, an absolute path or a
URL); every section must lie inside its file, sections must not overlap, and a shard's byte count
must be its group's shard at the world size that saved it, so the bytes a manifest claims are
bounded by its files' sizes (which the reader checks against the listing before any read).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import crc32c as _crc32c
import torch

from zeroray.engine.layout import shard_numel
from zeroray.storage import StorageError

FORMAT = "zeroray-checkpoint"
VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
CHUNK_BYTES = 4 << 20
ALIGN = 64
ALGORITHM = "crc32c"
# Incremental checksum functions: fn(data, previous) -> crc.
CHECKSUMS: dict[str, Callable[[Any, int], int]] = {
    "crc32": lambda data, crc: zlib.crc32(data, crc),
    "crc32c": lambda data, crc: _crc32c.crc32c(data, crc),
}
DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found or trusted; the message names the URL or file."""


class CheckpointStorageError(CheckpointError, StorageError):
    """The storage under a checkpoint cannot be used (bad URL, no credentials, unreachable).

    Both a :class:`CheckpointError` (what checkpoint callers catch) and a
    :class:`zeroray.storage.StorageError` (a ValueError: bad input, what the CLI reports as a usage
    error)."""


class CheckpointNotFoundError(CheckpointStorageError):
    """The checkpoint directory does not exist: a wrong URL, or a checkpoint that retention deleted."""


def _tag(epoch: int | None) -> str:
    return "" if epoch is None else f".e{epoch}"


def rank_file(rank: int, epoch: int | None = None) -> str:
    """A rank's file; a fenced save's names its epoch (``rank-00000.e7.bin``), so a cut-off rank of an
    older epoch never writes over a newer checkpoint's file (see fence.py)."""
    return f"rank-{rank:05d}{_tag(epoch)}.bin"


def part_file(rank: int, epoch: int | None = None) -> str:
    """A rank's "done" marker: its file entry, read by the committer and deleted after the commit."""
    return f"rank-{rank:05d}{_tag(epoch)}.part.json"


_EPOCH_NAME = re.compile(r"^rank-\d+\.e(\d+)\.")


def file_epoch(name: str) -> int | None:
    """The epoch a rank file's name carries (None: an unfenced save's name)."""
    m = _EPOCH_NAME.match(name)
    return int(m.group(1)) if m else None


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def itemsize(dtype: str) -> int:
    """Bytes per element of a manifest dtype name ("float32", ...)."""
    return DTYPES[dtype].itemsize


_REQUIRED = object()
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")  # one path component: no "/", "\\", ":" or ".."
_HEX8 = re.compile(r"[0-9a-f]{8}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
MAX_CHUNK_BYTES = 1 << 30  # a chunk is read and checked in one piece
KINDS = ("shard", "rng", "buffer")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Fields:
    """One JSON object of a manifest, its fields checked (type and range) as they are read: a bad one
    is a ValueError naming where it is, e.g. ``files[0].sections[3].nbytes is -1, not an integer >= 0``."""

    def __init__(self, d: Any, where: str):
        if not isinstance(d, dict):
            raise ValueError(f"{where} is {_show(d)}, not a JSON object")
        self.d, self.where = d, where

    def _get(self, key: str, default: Any) -> Any:
        if key in self.d:
            return self.d[key]
        if default is _REQUIRED:
            raise ValueError(f"{self.where} has no {key!r}")
        return default

    def integer(self, key: str, lo: int = 0, hi: int | None = None, *, optional: bool = False) -> int | None:
        v = self._get(key, None if optional else _REQUIRED)
        if v is None and optional:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
            bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise ValueError(f"{self.where}.{key} is {_show(v)}, not an integer {bound}")
        return v

    def string(self, key: str, choices: Iterable[str] | None = None, default: Any = _REQUIRED) -> str:
        v = self._get(key, default)
        if not isinstance(v, str) or (choices is not None and v not in choices):
            what = f"one of {sorted(choices)}" if choices is not None else "a string"
            raise ValueError(f"{self.where}.{key} is {_show(v)}, not {what}")
        return v

    def array(self, key: str) -> list[Any]:
        v = self._get(key, _REQUIRED)
        if not isinstance(v, list):
            raise ValueError(f"{self.where}.{key} is {_show(v)}, not a list")
        return v

    def shape(self, key: str) -> list[int]:
        v = self.array(key)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in v):
            raise ValueError(f"{self.where}.{key} is {_show(v)}, not a list of sizes >= 0")
        return list(v)

    def mapping(self, key: str, *, optional: bool = False) -> dict[str, Any] | None:
        v = self._get(key, None if optional else _REQUIRED)
        if (v is not None or not optional) and not isinstance(v, dict):
            raise ValueError(f"{self.where}.{key} is {_show(v)}, not a JSON object")
        return v


@dataclass
class SlotEntry:
    """One parameter in a logical flat group: name, shape, element offset."""

    name: str
    shape: list[int]
    offset: int


@dataclass
class GroupEntry:
    """A logical flat group (rank-independent): its parameters and which tensors were saved of it."""

    name: str
    numel: int
    shard_world: int
    param_group: int | None
    dtype: str
    keys: list[str]
    slots: list[SlotEntry]

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str = "group") -> GroupEntry:
        """Checked: a known dtype, its optimizer keys (with "weight"), and every slot inside the group."""
        f = _Fields(d, where)
        name, numel = f.string("name"), f.integer("numel")
        where = f.where = f"{where} {name!r}"
        keys = f.array("keys")
        if not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys) or "weight" not in keys:
            raise ValueError(f"{where}.keys is {_show(keys)}, not distinct names with 'weight' among them")
        slots = []
        for i, raw in enumerate(f.array("slots")):
            s = _Fields(raw, f"{where}.slots[{i}]")
            slot = SlotEntry(s.string("name"), s.shape("shape"), s.integer("offset"))
            if slot.offset + math.prod(slot.shape) > numel:
                raise ValueError(f"{s.where} ({slot.name!r}, {slot.shape} at {slot.offset}) runs past the group's "
                                 f"{numel} elements")
            slots.append(slot)
        return cls(
            name, numel, f.integer("shard_world", 1), f.integer("param_group", optional=True),
            f.string("dtype", DTYPES), list(keys), slots,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "numel": self.numel, "shard_world": self.shard_world,
            "param_group": self.param_group, "dtype": self.dtype, "keys": list(self.keys),
            "slots": [{"name": s.name, "shape": list(s.shape), "offset": s.offset} for s in self.slots],
        }


@dataclass
class SectionEntry:
    """A byte range of a rank file: a shard of a group's tensor, an RNG state, or a model buffer.

    ``kind`` "shard" uses group/key/shard, "rng" uses key, "buffer" uses name/shape."""

    kind: str
    dtype: str
    offset: int = 0
    nbytes: int = 0
    group: str | None = None
    key: str | None = None
    shard: int | None = None
    name: str | None = None
    shape: list[int] | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str = "section") -> SectionEntry:
        """Checked: its kind's fields, and a buffer's byte count against its dtype and shape."""
        f = _Fields(d, where)
        kind = f.string("kind", KINDS)
        s = cls(kind, f.string("dtype", DTYPES), f.integer("offset"), f.integer("nbytes"))
        if kind == "shard":
            s.group, s.key, s.shard = f.string("group"), f.string("key"), f.integer("shard")
        elif kind == "rng":
            s.key = f.string("key")
        else:
            s.name, s.shape = f.string("name"), f.shape("shape")
            want = math.prod(s.shape) * itemsize(s.dtype)
            if s.nbytes != want:
                raise ValueError(f"{where} (buffer {s.name!r}) has {s.nbytes} bytes; {s.dtype} {s.shape} is {want}")
        return s

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _SECTION_KEYS if getattr(self, k) is not None}


_SECTION_KEYS = ("kind", "dtype", "offset", "nbytes", "group", "key", "shard", "name", "shape")


@dataclass
class FileEntry:
    """One rank file: size, per-chunk checksums (and their algorithm) and its sections."""

    path: str
    rank: int
    size: int
    algorithm: str
    chunk_bytes: int
    chunks: list[str]
    sha256: str
    sections: list[SectionEntry] = field(default_factory=list)

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str = "file") -> FileEntry:
        """Checked: a plain file name, a checksum for every chunk of ``size`` bytes, and sections that
        lie inside the file without overlapping."""
        f = _Fields(d, where)
        path = f.string("path")
        if not _PLAIN_NAME.fullmatch(path) or ".." in path:
            raise ValueError(f"{where}.path {_show(path)} is not a plain file name inside the checkpoint directory")
        where = f.where = f"{where} ({path})"
        size, chunk_bytes = f.integer("size"), f.integer("chunk_bytes", 1, MAX_CHUNK_BYTES)
        chunks = f.array("chunks")
        if len(chunks) != -(-size // chunk_bytes):
            raise ValueError(f"{where} has {len(chunks)} chunk checksums; {size} bytes in chunks of {chunk_bytes} "
                             f"need {-(-size // chunk_bytes)}")
        if not all(isinstance(c, str) and _HEX8.fullmatch(c) for c in chunks):
            raise ValueError(f"{where}.chunks holds something other than 8-digit hex checksums")
        sha = f.string("sha256")
        if not _HEX64.fullmatch(sha) or sha != file_digest(chunks):
            raise ValueError(f"{where}.sha256 does not match its chunk checksums")
        sections = [SectionEntry.from_json(s, f"{where}.sections[{i}]") for i, s in enumerate(f.array("sections"))]
        end = 0
        for s in sorted(sections, key=lambda s: s.offset):
            what = f"{where}: the {s.kind} section at bytes [{s.offset}, {s.offset + s.nbytes})"
            if s.offset + s.nbytes > size:
                raise ValueError(f"{what} runs past the file's {size} bytes")
            if s.offset < end:
                raise ValueError(f"{what} overlaps the section before it")
            end = s.offset + s.nbytes
        return cls(
            path, f.integer("rank"), size, f.string("algorithm", CHECKSUMS, default="crc32"), chunk_bytes,
            list(chunks), sha, sections,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path, "rank": self.rank, "size": self.size, "algorithm": self.algorithm,
            "chunk_bytes": self.chunk_bytes, "chunks": list(self.chunks), "sha256": self.sha256,
            "sections": [s.to_json() for s in self.sections],
        }

    @property
    def num_chunks(self) -> int:
        return -(-self.size // self.chunk_bytes)


@dataclass
class Manifest:
    """What a committed checkpoint holds: who wrote it, its logical groups, its files, engine meta."""

    world_size: int
    stage: int
    groups: list[GroupEntry]
    meta: dict[str, Any]
    files: list[FileEntry] = field(default_factory=list)
    version: int = VERSION
    # The model's Hugging Face config (``model.config``, as its config.json holds it), when it has one:
    # `zeroray export` writes it beside the weights, so ``from_pretrained(export_dir)`` needs nothing else.
    hf_config: dict[str, Any] | None = None
    # The fencing epoch of the attempt that committed it (fence.py); None: an unfenced save (and every
    # checkpoint from before fencing), whose JSON has no "epoch" key.
    epoch: int | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Manifest:
        """The manifest, every field checked (see the module docstring); a ValueError names the bad one."""
        f = _Fields(d, "manifest")
        m = cls(
            f.integer("world_size", 1), f.integer("stage", 0, 3),
            [GroupEntry.from_json(g, f"groups[{i}]") for i, g in enumerate(f.array("groups"))], f.mapping("meta"),
            [FileEntry.from_json(e, f"files[{i}]") for i, e in enumerate(f.array("files"))], f.integer("version"),
            f.mapping("hf_config", optional=True), f.integer("epoch", 1, optional=True),
        )
        m._check_layout()
        return m

    def _check_layout(self) -> None:
        """Across entries: one file per rank, unique names, and every shard of every group's tensors
        saved exactly once, in a section of the shard's size."""
        if sorted(e.rank for e in self.files) != list(range(self.world_size)):
            raise ValueError(f"files are of ranks {sorted(e.rank for e in self.files)}, not one for each of the "
                             f"{self.world_size} ranks")
        if len({e.path for e in self.files}) != len(self.files):
            raise ValueError("two file entries name the same file")
        for e in self.files:  # one epoch throughout: a cut-off rank's file never completes a newer checkpoint
            if file_epoch(e.path) != self.epoch:
                raise ValueError(f"a mixed checkpoint: {e.path} is a file of epoch {file_epoch(e.path)}, the manifest's "
                                 f"epoch is {self.epoch}")
        groups = {g.name: g for g in self.groups}
        slots = [s.name for g in self.groups for s in g.slots]
        if len(groups) != len(self.groups) or len(set(slots)) != len(slots):
            raise ValueError("two groups, or two parameters, have the same name")
        seen: set[tuple[str, str, int]] = set()
        buffers: set[str] = set()
        for e, s in self.sections("shard"):
            g = groups.get(s.group)
            where = f"{e.path}: the shard section {s.shard} of {s.group!r} {s.key!r}"
            if g is None or s.key not in g.keys or s.shard >= g.shard_world or s.dtype != g.dtype:
                raise ValueError(f"{where} names no shard of a group in the manifest (or another dtype)")
            want = itemsize(g.dtype) * shard_numel(g.numel, g.shard_world)
            if s.nbytes != want:
                raise ValueError(f"{where} has {s.nbytes} bytes; a shard of {g.numel} elements over "
                                 f"{g.shard_world} is {want}")
            if (s.group, s.key, s.shard) in seen:
                raise ValueError(f"{where} is saved twice")
            seen.add((s.group, s.key, s.shard))
        for e, s in self.sections("buffer"):
            if s.name in buffers:
                raise ValueError(f"{e.path}: buffer {s.name!r} is saved twice")
            buffers.add(s.name)
        saved = Counter(name for name, _, _ in seen)
        for g in self.groups:
            if saved[g.name] != len(g.keys) * g.shard_world:
                raise ValueError(f"group {g.name!r}: some of its {len(g.keys)} tensors x {g.shard_world} shards "
                                 "have no section")

    def to_json(self) -> dict[str, Any]:
        out = {
            "format": FORMAT, "version": self.version, "world_size": self.world_size, "stage": self.stage,
            "groups": [g.to_json() for g in self.groups], "meta": self.meta,
            "files": [f.to_json() for f in self.files],
        }
        if self.hf_config is not None:  # absent otherwise: manifests of other models are unchanged
            out["hf_config"] = self.hf_config
        if self.epoch is not None:  # absent otherwise: unfenced manifests are as before
            out["epoch"] = self.epoch
        return out

    def sections(self, kind: str) -> Iterator[tuple[FileEntry, SectionEntry]]:
        """(file, section) of every section of ``kind`` ("shard", "rng", "buffer")."""
        for f in self.files:
            for s in f.sections:
                if s.kind == kind:
                    yield f, s


class ChunkHasher:
    """Checksum of every ``chunk_bytes`` chunk of a byte stream fed in arbitrary pieces."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES, algorithm: str = ALGORITHM):
        self.chunk_bytes = chunk_bytes
        self.digests: list[str] = []
        self._fn = CHECKSUMS[algorithm]
        self._crc = 0
        self._fill = 0

    def update(self, data: memoryview | bytes) -> None:
        data = memoryview(data).cast("B")
        while len(data):
            take = min(len(data), self.chunk_bytes - self._fill)
            self._crc = self._fn(data[:take], self._crc)
            self._fill += take
            data = data[take:]
            if self._fill == self.chunk_bytes:
                self._close_chunk()

    def _close_chunk(self) -> None:
        self.digests.append(f"{self._crc:08x}")
        self._crc, self._fill = 0, 0

    def finish(self) -> list[str]:
        if self._fill:
            self._close_chunk()
        return self.digests


def hf_config(model: Any) -> dict[str, Any] | None:
    """``model.config`` as Hugging Face's config.json holds it (with ``architectures`` naming the
    model's class, as ``save_pretrained`` sets it), or None for a model without a HF config."""
    config = getattr(model, "config", None)
    if not callable(getattr(config, "to_json_string", None)):
        return None
    out = json.loads(config.to_json_string(use_diff=False))
    if not out.get("architectures"):
        out["architectures"] = [type(model).__name__]
    return out


def file_digest(chunk_digests: Iterable[str]) -> str:
    """One checksum per file: sha256 over its chunk checksums (a hash list, no full re-read)."""
    return hashlib.sha256(",".join(chunk_digests).encode()).hexdigest()


def check_chunk(crc: int, entry: FileEntry, chunk: int, url: str) -> None:
    """Compare a chunk's computed checksum with the manifest's."""
    got, want = f"{crc:08x}", entry.chunks[chunk]
    if got != want:
        lo = chunk * entry.chunk_bytes
        raise CheckpointError(
            f"checksum mismatch in {url} (bytes {lo}-{lo + entry.chunk_bytes}): {entry.algorithm} {got}, "
            f"manifest says {want}; the file is corrupt or was replaced"
        )


def verify_chunks(data: bytes | memoryview, entry: FileEntry, first_chunk: int, url: str) -> None:
    """Check ``data`` (whole chunks of the file ``entry`` from ``first_chunk`` on) against the manifest."""
    c, data, fn = entry.chunk_bytes, memoryview(data), checksum(entry, url)
    for i in range(-(-len(data) // c)):
        check_chunk(fn(data[i * c : (i + 1) * c], 0), entry, first_chunk + i, url)


def checksum(entry: FileEntry, url: str) -> Callable[[Any, int], int]:
    try:
        return CHECKSUMS[entry.algorithm]
    except KeyError:
        raise CheckpointError(f"{url}: unknown checksum algorithm {entry.algorithm!r}") from None


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def dump_manifest(manifest: Manifest) -> bytes:
    """The manifest bytes, with a sha256 over its own canonical form so a flipped byte is caught."""
    body = manifest.to_json()
    sealed = {**body, "sha256": hashlib.sha256(_canonical(body)).hexdigest()}
    return json.dumps(sealed, sort_keys=True, indent=1).encode()


def parse_manifest(raw: bytes, url: str) -> Manifest:
    """Parse and check a manifest; any damage (torn, flipped, foreign) raises CheckpointError naming ``url``."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{url} is not a valid manifest (not JSON: {e})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise CheckpointError(f"{url} is not a zeroray checkpoint manifest")
    seal = body.pop("sha256", None)
    if seal != hashlib.sha256(_canonical(body)).hexdigest():
        raise CheckpointError(f"checksum mismatch in {url}: the manifest is corrupt")
    if body.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{url} has format version {body.get('version')}; this zeroray reads {list(READABLE_VERSIONS)}"
        )
    try:
        return Manifest.from_json(body)
    except ValueError as e:
        raise CheckpointError(f"{url} is not a valid manifest: {e}") from None
