"""The checkpoint format: file names, the manifest (JSON, written last) and chunk checksums.

A checkpoint directory holds one ``rank-NNNNN.bin`` per rank that wrote it (raw little-endian
sections, each 64-byte aligned) and ``manifest.json``. The manifest describes *logical* tensors —
every parameter's name, shape and offset in its logical flat group — so it does not depend on the
world size or stage that wrote it; beside that it records who wrote it, the byte range of every
section of every file, and a crc32 per ``chunk_bytes`` chunk of every file. Nothing here unpickles:
a file from storage is parsed as JSON or copied as raw numbers, never run.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Iterable
from typing import Any

FORMAT = "zeroray-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
CHUNK_BYTES = 4 << 20
ALIGN = 64
ALGORITHM = "crc32"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found or trusted; the message names the URL or file."""


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


def part_file(rank: int) -> str:
    """A rank's "done" marker: its file entry, read by the committer and deleted after the commit."""
    return f"rank-{rank:05d}.part.json"


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class ChunkHasher:
    """crc32 of every ``chunk_bytes`` chunk of a byte stream fed in arbitrary pieces."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        self.chunk_bytes = chunk_bytes
        self.digests: list[str] = []
        self._crc = 0
        self._fill = 0

    def update(self, data: memoryview | bytes) -> None:
        data = memoryview(data).cast("B")
        while len(data):
            take = min(len(data), self.chunk_bytes - self._fill)
            self._crc = zlib.crc32(data[:take], self._crc)
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


def file_digest(chunk_digests: Iterable[str]) -> str:
    """One checksum per file: sha256 over its chunk checksums (a hash list, no full re-read)."""
    return hashlib.sha256(",".join(chunk_digests).encode()).hexdigest()


def verify_chunks(data: bytes | memoryview, entry: dict[str, Any], first_chunk: int, url: str) -> None:
    """Check ``data`` (whole chunks of the file ``entry`` from ``first_chunk`` on) against the manifest."""
    c, data = entry["chunk_bytes"], memoryview(data)
    for i in range(-(-len(data) // c)):
        got = f"{zlib.crc32(data[i * c : (i + 1) * c]):08x}"
        want = entry["chunks"][first_chunk + i]
        if got != want:
            lo = (first_chunk + i) * c
            raise CheckpointError(
                f"checksum mismatch in {url} (bytes {lo}-{lo + c}): {ALGORITHM} {got}, manifest says {want}; "
                "the file is corrupt or was replaced"
            )


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def dump_manifest(body: dict[str, Any]) -> bytes:
    """The manifest bytes, with a sha256 over its own canonical form so a flipped byte is caught."""
    body = {"format": FORMAT, "version": VERSION, **body}
    sealed = {**body, "sha256": hashlib.sha256(_canonical(body)).hexdigest()}
    return json.dumps(sealed, sort_keys=True, indent=1).encode()


def parse_manifest(raw: bytes, url: str) -> dict[str, Any]:
    """Parse and check a manifest; any damage raises CheckpointError naming ``url``."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{url} is not a valid manifest (not JSON: {e})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise CheckpointError(f"{url} is not a zeroray checkpoint manifest")
    seal = body.pop("sha256", None)
    if seal != hashlib.sha256(_canonical(body)).hexdigest():
        raise CheckpointError(f"checksum mismatch in {url}: the manifest is corrupt")
    if body.get("version") != VERSION:
        raise CheckpointError(f"{url} has format version {body.get('version')}; this zeroray reads {VERSION}")
    return body
