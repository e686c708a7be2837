"""Hugging Face safetensors weights straight into an engine's shards: each rank reads only its bytes.

``zeroray.load_pretrained(engine, source)`` is a collective. Every rank reads the safetensors headers
(a few KB), matches the file's keys to the model's parameter names, and checks them; all ranks agree
on the outcome before anything else happens. Then, for each of the engine's flat groups,
:func:`zeroray.engine.layout.pieces` says which parameters (and which elements of them) this rank's
range holds; those elements are contiguous bytes of the file, so the rank requests exactly them
(adjacent ranges merged), casts bf16/fp16 into the fp32 masters, and — after a second agreement that
every rank's reads went well — installs them with ``engine.load_shard_state(tensors, {})``: weights
only, so the optimizer starts fresh and ``global_step`` is 0. All ranks together read the checkpoint
about once (headers and buffers once per rank); at stage 0, where every rank holds every group,
each reads all of it.

Names. A file key is mapped to a model name by ``key_map`` — a dict ``{file key: model name}``
(unlisted keys unchanged, a ``None`` value drops the key) or a callable ``file key -> model name or
None`` — applied to every key of the file. Without ``key_map`` the keys are used as they are,
unless stripping one leading component from the file's keys (``model.``, ``transformer.``) or adding
one of the model's leading components to them matches more of the model's names: then the best such
prefix change is applied and reported (``LoadReport.prefix``). A parameter the model ties under
several names (``lm_head.weight`` is ``model.embed_tokens.weight``) is loaded from whichever of its
names the file holds.
"""

from __future__ import annotations

import json
import posixpath
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zeroray.checkpoint.manifest import MANIFEST
from zeroray.checkpoint.safetensors_file import (
    PretrainedError,
    RangeReader,
    SafetensorsFile,
    TensorInfo,
    merge,
    read_header,
)
from zeroray.engine import GroupShard, ZeroEngine, layout
from zeroray.engine import names as tensor_names
from zeroray.storage import join_url, open_url

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
KeyMap = Mapping[str, "str | None"] | Callable[[str], "str | None"]


@dataclass(frozen=True)
class LoadReport:
    """What :func:`load_pretrained` did. The lists are model names (``mismatched``: "name: file
    shape, model shape"); bytes count what was requested from storage."""

    source: str
    files: list[str]
    loaded: list[str]
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)  # file keys (after key_map) the model lacks
    mismatched: list[str] = field(default_factory=list)
    prefix: str | None = None  # the automatic prefix change applied, e.g. "added 'model.'"
    bytes_read: int = 0  # by this rank: headers, its shards' ranges, buffers
    total_bytes_read: int = 0  # by all ranks together
    checkpoint_bytes: int = 0  # the files' sizes
    seconds: float = 0.0


@dataclass(frozen=True)
class _Plan:
    """The outcome of the headers: which file tensor each model name comes from."""

    files: list[SafetensorsFile]
    params: dict[str, TensorInfo]  # parameter slot name -> tensor
    buffers: dict[str, TensorInfo]
    where: dict[str, SafetensorsFile]  # file key (as in the file) -> its file
    missing: list[str]
    unexpected: list[str]
    mismatched: list[str]
    prefix: str | None


def load_pretrained(
    engine: ZeroEngine,
    source: str,
    *,
    strict: bool = True,
    key_map: KeyMap | None = None,
    storage_options: dict[str, Any] | None = None,
) -> LoadReport:
    """Collective: load the Hugging Face safetensors weights at ``source`` into ``engine``'s shards.

    ``source``: a directory (any fsspec URL) holding ``model.safetensors``, or sharded files with
    ``model.safetensors.index.json`` (a ``zeroray export`` is one), or one ``.safetensors`` file.
    With ``strict``, a missing or unexpected key or a shape mismatch raises :class:`PretrainedError`
    naming them, on every rank, before any weight changes; with ``strict=False`` they are returned
    in the report and the model's other values stay. Call it on a fresh engine: the optimizer
    state is dropped and the step counters restart at 0 (an LR scheduler's progress is not reset).
    """
    start = time.perf_counter()
    states = engine.shard_state()

    def headers() -> tuple[RangeReader, _Plan]:
        fs, root = open_url(source, storage_options)
        reader = RangeReader(fs)
        return reader, _plan(engine, states, reader, source, root, strict, key_map)

    (reader, plan), _ = _agree(engine, headers, "reading the headers of", "no weights changed")
    tensors, buffers = {}, {}
    urls = {f.path: f.url for f in plan.files}

    def read() -> None:
        pieces: list[tuple[str, int, int, torch.dtype, torch.Tensor]] = []
        for gs in states:
            tensors[gs.name] = {"weight": _destination(gs, plan, pieces)}
        for name, info in plan.buffers.items():
            dest = torch.empty(info.numel, dtype=info.dtype)
            pieces.append((plan.where[info.key].path, info.start, info.end, info.dtype, dest))
            buffers[name] = dest.view(info.shape)
        reader.fill(merge(pieces), urls)

    _, total = _agree(engine, read, "reading", "shards on the CPU may be partly loaded", reader)
    with torch.no_grad():
        named = dict(tensor_names.named_buffers(engine.module))
        for name, value in buffers.items():
            named[name].copy_(value)
    engine.load_shard_state(tensors, {})
    return LoadReport(
        source, [f.url for f in plan.files], sorted(plan.params) + sorted(plan.buffers), plan.missing,
        plan.unexpected, plan.mismatched, plan.prefix, reader.bytes_read, total,
        sum(f.size for f in plan.files), time.perf_counter() - start,
    )


def pretrained_keys(
    model: nn.Module, source: str, *, key_map: KeyMap | None = None, storage_options: dict[str, Any] | None = None
) -> list[str]:
    """The model's parameter and buffer names (every name of a tied parameter) that the safetensors
    weights at ``source`` hold, keys mapped as :func:`load_pretrained` maps them; reads only the
    headers. Pass it as ``zeroray.initialize(..., loaded_keys=...)`` so a meta-built model initializes
    only what the file lacks."""
    fs, root = open_url(source, storage_options)
    _, where = _files(RangeReader(fs), source, root)
    aliases = _aliases(model, {n: None for n, _ in tensor_names.named_parameters(model)})
    buffers = set(_persistent_buffers(model, aliases))
    mapped, _ = _map_keys(list(where), key_map, set(aliases) | buffers)
    slot_of = {a: slot for slot, names in aliases.items() for a in names}
    provided = {name for name in mapped.values() if name is not None}
    slots = {slot_of[n] for n in provided if n in slot_of}
    return sorted({a for slot in slots for a in aliases[slot]} | (provided & buffers))


def _agree(
    engine: ZeroEngine, fn: Callable[[], Any], what: str, changed: str, reader: RangeReader | None = None
) -> tuple[Any, int]:
    """Collective: run ``fn`` on every rank; if it raised anywhere, raise on every rank (this rank's
    own error as it is, else the failing ranks' messages, saying ``changed``). Returns what ``fn`` returned and the
    bytes ``reader`` has read on all ranks together."""
    error: BaseException | None = None
    result = None
    try:
        result = fn()
    except Exception as e:  # every rank must reach the agreement below, or the others hang
        error = e
    mine = (None if error is None else f"{type(error).__name__}: {error}", reader.bytes_read if reader else 0)
    everyone = engine.comm.all_gather_object(mine)
    if error is not None:
        raise error
    failed = [f"rank {r}: {msg}" for r, (msg, _) in enumerate(everyone) if msg]
    if failed:
        raise PretrainedError(f"{what} the pretrained weights failed on another rank ({changed}): " + "; ".join(failed))
    return result, sum(n for _, n in everyone)


def _destination(gs: GroupShard, plan: _Plan, pieces: list) -> torch.Tensor:
    """This rank's new flat shard of one group, with a read planned into every element the file
    holds; the rest (padding, and what the file lacks under strict=False) keeps its current value.

    On the CPU that is the live fp32 shard itself: its memory is in use already, while fresh
    destinations (4.4 GB at 1.1B parameters) made the load 2x slower on first touch (benchmarks/RESULTS.md).
    So the headers are checked on every rank first; only an I/O error during the reads themselves
    leaves a shard partly loaded (every rank raises)."""
    current = gs.tensors["weight"].detach().reshape(-1)
    if current.device.type == "cpu" and current.is_contiguous():
        dest = current
    else:
        dest = torch.empty(current.numel(), dtype=current.dtype)
        tail = max(0, gs.numel - gs.lo)
        dest[tail:] = current[tail:].cpu()
    for p in layout.pieces(gs.slots, gs.lo, min(gs.hi, gs.numel)):
        info = plan.params.get(p.name)
        if info is None:
            if dest is not current:
                dest[p.f_lo - gs.lo : p.f_hi - gs.lo] = current[p.f_lo - gs.lo : p.f_hi - gs.lo].cpu()
            continue
        size = info.dtype.itemsize
        path = plan.where[info.key].path
        pieces.append((path, info.start + p.t_lo * size, info.start + p.t_hi * size, info.dtype,
                       dest[p.f_lo - gs.lo : p.f_hi - gs.lo]))
    return dest


# ---------------------------------------------------------------------------------- the headers


def _plan(
    engine: ZeroEngine, states: list[GroupShard], reader: RangeReader, url: str, root: str, strict: bool,
    key_map: KeyMap | None,
) -> _Plan:
    files, where = _files(reader, url, root)
    slots = {s.name: s.shape for gs in states for s in gs.slots}
    aliases = _aliases(engine.module, slots)
    buffers = _persistent_buffers(engine.module, aliases)
    known = set(aliases) | set(buffers)
    mapped, prefix = _map_keys(list(where), key_map, known)
    by_model: dict[str, str] = {}  # model name -> file key
    for key, name in mapped.items():
        if name is None:
            continue
        if name in by_model:
            raise PretrainedError(f"{url}: file keys {by_model[name]!r} and {key!r} both map to {name!r}")
        by_model[name] = key

    params, bufs, used, missing, mismatched = {}, {}, set(), [], []
    for name, shape in slots.items():
        found = [a for a in aliases[name] if a in by_model]
        used.update(found)
        if not found:
            missing.append(name)
            continue
        info = where[by_model[found[0]]].tensors[by_model[found[0]]]
        if info.shape != tuple(shape):
            mismatched.append(f"{name}: file {list(info.shape)}, model {list(shape)}")
        else:
            params[name] = info
    for name, shape in buffers.items():
        if name not in by_model:
            missing.append(name)
            continue
        used.add(name)
        info = where[by_model[name]].tensors[by_model[name]]
        if info.shape != shape:
            mismatched.append(f"{name}: file {list(info.shape)}, model {list(shape)}")
        else:
            bufs[name] = info
    unexpected = sorted(set(by_model) - used)
    if strict and (missing or unexpected or mismatched):
        raise PretrainedError(
            f"{url} does not fit this {type(engine.module).__name__}"
            + (f" (after {prefix})" if prefix else "")
            + f": missing keys {_few(sorted(missing))}, unexpected keys {_few(unexpected)}, shape mismatches "
            f"{_few(mismatched)}"
            + " (pass key_map to rename keys, or strict=False to load what fits)"
        )
    return _Plan(files, params, bufs, where, sorted(missing), unexpected, mismatched, prefix)


def _few(names: list[str], most: int = 20) -> str:
    """A list for a message: all of a short one, the first ``most`` of a long one and a count."""
    if len(names) <= most:
        return str(names)
    return str(names[:most])[:-1] + f", ... and {len(names) - most} more]"


def _files(reader: RangeReader, url: str, root: str) -> tuple[list[SafetensorsFile], dict[str, SafetensorsFile]]:
    """The safetensors files of ``source``, their headers read and checked, and which file holds each key."""
    fs = reader.fs
    root = root.rstrip("/")
    if fs.isfile(root):
        name = posixpath.basename(root)
        if name == INDEX:
            return _indexed(reader, url.rstrip("/").rpartition("/")[0] or ".", posixpath.dirname(root))
        if name.endswith(_PICKLE_SUFFIXES):
            raise PretrainedError(_pickle_message(url, [name]))
        f = read_header(reader, root, url)
        return [f], dict.fromkeys(f.tensors, f)
    if not fs.isdir(root):
        raise PretrainedError(f"pretrained weights {url} do not exist")
    names = sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(root, detail=False))
    if INDEX in names:
        return _indexed(reader, url, root)
    if SINGLE in names:
        f = read_header(reader, posixpath.join(root, SINGLE), join_url(url, SINGLE))
        return [f], dict.fromkeys(f.tensors, f)
    pickles = [n for n in names if n.endswith(_PICKLE_SUFFIXES) or n == "pytorch_model.bin.index.json"]
    if pickles:
        raise PretrainedError(_pickle_message(url, pickles))
    others = [n for n in names if n.endswith(".safetensors")]
    if others:
        raise PretrainedError(
            f"{url} holds {others} but neither {SINGLE} nor {INDEX}; pass the URL of the file to load"
        )
    if MANIFEST in names:
        raise PretrainedError(
            f"{url} is a zeroray sharded checkpoint, not Hugging Face weights: load it with "
            "zeroray.checkpoint.load(engine, url), or write safetensors with `zeroray export`"
        )
    raise PretrainedError(f"{url} holds no safetensors file ({SINGLE} or {INDEX}); it holds {names[:10]}")


def _indexed(reader: RangeReader, url: str, root: str) -> tuple[list[SafetensorsFile], dict[str, SafetensorsFile]]:
    """Sharded weights: the index's files (plain names beside it), each key where the index says."""
    index_url = join_url(url, INDEX)
    try:
        raw = reader.fs.cat_file(posixpath.join(root, INDEX))
        reader.bytes_read += len(raw)
        weight_map = json.loads(raw)["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except FileNotFoundError:
        raise PretrainedError(f"{index_url} does not exist") from None
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise PretrainedError(f"{index_url} is not a safetensors index ({type(e).__name__}: {e})") from None
    names = sorted(set(weight_map.values()))
    bad = [n for n in names if not isinstance(n, str) or "/" in n or "\\" in n or n in ("", ".", "..")]
    if bad:
        raise PretrainedError(f"{index_url} names files outside its directory: {bad}")
    files = [read_header(reader, posixpath.join(root, n), join_url(url, n)) for n in names]
    by_name = dict(zip(names, files))
    where: dict[str, SafetensorsFile] = {}
    for f in files:
        for key in f.tensors:
            if key in where:
                raise PretrainedError(f"tensor {key!r} is in both {where[key].url} and {f.url}")
            where[key] = f
    for key, name in weight_map.items():
        if key not in by_name[name].tensors:
            raise PretrainedError(f"{index_url} puts {key!r} in {name}, but that file's header has no such tensor")
    return files, where


def _pickle_message(url: str, names: list[str]) -> str:
    return (
        f"{url} holds a pickle checkpoint ({', '.join(names[:3])}); zeroray loads no pickle, since unpickling can "
        "run code. Convert it once, where you trust it, to safetensors: with transformers "
        "`AutoModelForCausalLM.from_pretrained(path).save_pretrained(out, safe_serialization=True)`, or "
        "`safetensors.torch.save_file(torch.load(file, weights_only=True), 'model.safetensors')`; then load `out`"
    )


def _aliases(module: nn.Module, slots: dict[str, Any]) -> dict[str, list[str]]:
    """Every parameter slot's names: its own first, then the other names the model ties it under."""
    names: dict[int, list[str]] = {}
    for n, p in tensor_names.named_parameters(module, remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    out = {}
    for group in names.values():
        slot = next((n for n in group if n in slots), None)
        if slot is not None:
            out[slot] = [slot, *(n for n in group if n != slot)]
    for slot in slots:
        out.setdefault(slot, [slot])
    return out


def _persistent_buffers(module: nn.Module, aliases: dict[str, list[str]]) -> dict[str, tuple[int, ...]]:
    """The model's persistent buffers (what its state_dict holds beside the parameters)."""
    params = {a for names in aliases.values() for a in names}
    shapes = {n: tuple(b.shape) for n, b in tensor_names.named_buffers(module)}
    return {n: shapes[n] for n in module.state_dict(keep_vars=True) if n not in params and n in shapes}


def _map_keys(keys: list[str], key_map: KeyMap | None, known: set[str]) -> tuple[dict[str, str | None], str | None]:
    """File key -> model name (None: dropped), and the automatic prefix change applied, if any."""
    if key_map is not None:
        if callable(key_map):
            return {k: key_map(k) for k in keys}, None
        return {k: key_map.get(k, k) for k in keys}, None
    best: tuple[int, dict[str, str | None], str | None] = (sum(k in known for k in keys), dict(zip(keys, keys)), None)
    for p in sorted({k.split(".", 1)[0] + "." for k in keys if "." in k}):
        mapped = {k: k[len(p):] if k.startswith(p) else k for k in keys}
        best = max(best, (sum(v in known for v in mapped.values()), mapped, f"stripped {p!r}"), key=lambda b: b[0])
    for p in sorted({n.split(".", 1)[0] + "." for n in known if "." in n}):
        mapped = {k: p + k for k in keys}
        best = max(best, (sum(v in known for v in mapped.values()), mapped, f"added {p!r}"), key=lambda b: b[0])
    return best[1], best[2]
