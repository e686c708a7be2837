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
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import crc32c as _crc32c
import torch

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


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


def part_file(rank: int) -> str:
    """A rank's "done" marker: its file entry, read by the committer and deleted after the commit."""
    return f"rank-{rank:05d}.part.json"


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def itemsize(dtype: str) -> int:
    """Bytes per element of a manifest dtype name ("float32", ...)."""
    return DTYPES[dtype].itemsize


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
    def from_json(cls, d: dict[str, Any]) -> GroupEntry:
        return cls(
            d["name"], d["numel"], d["shard_world"], d["param_group"], d["dtype"], list(d["keys"]),
            [SlotEntry(s["name"], list(s["shape"]), s["offset"]) for s in d["slots"]],
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
    def from_json(cls, d: dict[str, Any]) -> SectionEntry:
        return cls(**{k: d.get(k) for k in _SECTION_KEYS if k in d})

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
    def from_json(cls, d: dict[str, Any]) -> FileEntry:
        return cls(
            d["path"], d["rank"], d["size"], d.get("algorithm", "crc32"), d["chunk_bytes"], list(d["chunks"]),
            d["sha256"], [SectionEntry.from_json(s) for s in d["sections"]],
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

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Manifest:
        return cls(
            d["world_size"], d["stage"], [GroupEntry.from_json(g) for g in d["groups"]], d["meta"],
            [FileEntry.from_json(f) for f in d["files"]], d["version"], d.get("hf_config"),
        )

    def to_json(self) -> dict[str, Any]:
        out = {
            "format": FORMAT, "version": self.version, "world_size": self.world_size, "stage": self.stage,
            "groups": [g.to_json() for g in self.groups], "meta": self.meta,
            "files": [f.to_json() for f in self.files],
        }
        if self.hf_config is not None:  # absent otherwise: manifests of other models are unchanged
            out["hf_config"] = self.hf_config
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
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{url} is not a valid manifest (bad entry: {type(e).__name__}: {e})") from None
