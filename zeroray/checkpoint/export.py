"""Export a sharded checkpoint as one consolidated state dict in the Hugging Face layout.

``model-00001-of-0000N.safetensors`` files cut by size plus ``model.safetensors.index.json``
(``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``), and ``config.json`` when the
saved model had a Hugging Face config (the save keeps it in the manifest): the directory is what
``save_pretrained`` writes, so ``from_pretrained`` and :func:`zeroray.load_pretrained` read it.
No process group: the tensors of one output file are read from the rank files (verified range
reads), cast, and streamed out in the safetensors format (8-byte header length, JSON header, raw
data), so memory stays near one output file.

The files are written into a temporary directory next to ``out_dir`` and moved into place at the
end, so a failed export leaves nothing behind and re-exporting into the same directory leaves no
stale shards of the previous export.
"""

from __future__ import annotations

import json
import math
import posixpath
import re
import struct
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from fsspec import AbstractFileSystem

from zeroray.checkpoint.manifest import (
    DTYPES,
    CheckpointStorageError,
    FileEntry,
    GroupEntry,
    SectionEntry,
    SlotEntry,
)
from zeroray.checkpoint.reader import CheckpointReader, Request
from zeroray.checkpoint.storage import open_url

INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
_OURS = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$|^" + re.escape(INDEX) + "$|^" + re.escape(CONFIG) + "$")
_ST = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class _Item:
    """One tensor of the output: a parameter (fp32 in the checkpoint) or a persistent buffer."""

    name: str
    shape: tuple[int, ...]
    saved: torch.dtype
    out: torch.dtype
    source: tuple[GroupEntry, SlotEntry] | tuple[FileEntry, SectionEntry]
    is_param: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.out.itemsize


def _items(ckpt: CheckpointReader, dtype: torch.dtype | None) -> list[_Item]:
    items = []
    for name, (group, slot) in ckpt.params.items():
        saved = DTYPES[group.dtype]
        items.append(_Item(name, tuple(slot.shape), saved, dtype or saved, (group, slot), True))
    for f, s in ckpt.sections("buffer"):
        saved = DTYPES[s.dtype]
        out = dtype if dtype is not None and saved.is_floating_point else saved
        items.append(_Item(s.name, tuple(s.shape), saved, out, (f, s), False))
    return items


def _plan(items: list[_Item], max_shard_bytes: int) -> list[list[_Item]]:
    """Greedy cut into files of at most ``max_shard_bytes`` (a larger tensor gets a file of its own)."""
    shards: list[list[_Item]] = [[]]
    size = 0
    for it in items:
        if shards[-1] and size + it.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += it.nbytes
    return shards


def _fetch(ckpt: CheckpointReader, items: list[_Item]) -> list[torch.Tensor]:
    """Read the tensors of one output file in one pass (shared chunks are read once)."""
    out, requests = [], []
    for it in items:
        if it.is_param:
            group, slot = it.source
            t = torch.empty(math.prod(it.shape), dtype=it.saved)
            requests += ckpt.flat_requests(group, "weight", slot.offset, slot.offset + t.numel(), t)
        else:
            f, s = it.source
            t = torch.empty(s.nbytes, dtype=torch.uint8)
            requests.append(Request(f.path, s.offset, t))
            t = t.view(it.saved)
        out.append(t)
    ckpt.read(requests)
    return [t.reshape(it.shape).to(it.out) for t, it in zip(out, items)]


def _header(items: list[_Item]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for it in items:
        header[it.name] = {"dtype": _ST[it.out], "shape": list(it.shape), "data_offsets": [pos, pos + it.nbytes]}
        pos += it.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _check_target(fs: AbstractFileSystem, root: str, out_dir: str) -> None:
    """Refuse, before any work, a target that is a file or a directory holding anything but an export."""
    if not fs.exists(root):
        return
    if not fs.isdir(root):
        raise CheckpointStorageError(f"export target {out_dir} is a file, not a directory")
    foreign = sorted(n for n in (posixpath.basename(p) for p in fs.ls(root, detail=False)) if not _OURS.match(n))
    if foreign:
        raise CheckpointStorageError(
            f"export target {out_dir} holds files that are not an export ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}); export into a new or empty directory"
        )


def _config(ckpt: CheckpointReader, dtype: torch.dtype | None) -> bytes | None:
    """The model's HF config.json, saved in the manifest by the engine's save, with the dtype the
    weights are exported in (as ``save_pretrained`` records it); None for a model without one."""
    config = ckpt.manifest.hf_config
    if config is None:
        return None
    key = "torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"  # transformers < 5: torch_dtype
    config = {**config, key: str(dtype or torch.float32).removeprefix("torch.")}
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


def _write(
    ckpt: CheckpointReader, shards: list[list[_Item]], fs: AbstractFileSystem, root: str, config: bytes | None
) -> list[str]:
    weight_map, written = {}, []
    for i, items in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        with fs.open(posixpath.join(root, name), "wb") as f:
            f.write(_header(items))
            for it, t in zip(items, _fetch(ckpt, items)):
                f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
                weight_map[it.name] = name
        written.append(name)
    total = sum(it.nbytes for items in shards for it in items)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    if config is not None:
        fs.pipe_file(posixpath.join(root, CONFIG), config)
        written.append(CONFIG)
    fs.pipe_file(posixpath.join(root, INDEX), json.dumps(index, indent=2).encode())
    return [*written, INDEX]


def export(
    checkpoint_url: str,
    out_dir: str,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 10**9,
    storage_options: dict[str, Any] | None = None,
    out_storage_options: dict[str, Any] | None = None,
) -> list[str]:
    """Write the checkpoint's weights (and persistent buffers) as safetensors files plus an index,
    and the model's ``config.json`` when it has a Hugging Face config (so ``from_pretrained(out_dir)``
    loads the export as it is).

    ``dtype``: "fp32" (default, as saved), "bf16" or "fp16" for floating tensors. ``out_dir`` is
    replaced as a whole (it must be new, empty, or a previous export). Returns the files written,
    index last.
    """
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(EXPORT_DTYPES)}, got {dtype!r}")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    fs, root = open_url(out_dir, out_storage_options)
    root = root.rstrip("/")
    _check_target(fs, root, out_dir)
    ckpt = CheckpointReader(checkpoint_url, storage_options)
    shards = _plan(_items(ckpt, EXPORT_DTYPES.get(dtype)), max_shard_bytes)
    config = _config(ckpt, EXPORT_DTYPES.get(dtype))
    tag = uuid.uuid4().hex[:12]
    tmp, old = f"{root}.tmp-{tag}", f"{root}.old-{tag}"
    try:
        fs.makedirs(tmp, exist_ok=True)
        files = _write(ckpt, shards, fs, tmp, config)
        if fs.exists(root):
            fs.mv(root, old, recursive=True)
        fs.mv(tmp, root, recursive=True)
    except BaseException:
        if fs.exists(tmp):
            fs.rm(tmp, recursive=True)
        if fs.exists(old) and not fs.exists(root):  # put the previous export back
            fs.mv(old, root, recursive=True)
        raise
    if fs.exists(old):
        fs.rm(old, recursive=True)
    return files
