"""In-memory snapshots: a lost rank's state recovered from its peers' host memory, with no storage read.

Every ``snapshot_interval`` steps each rank copies its part of the engine's state (its shards of the fp32
weights and optimizer states, the module's buffers, its RNG state, the engine's counters) into one host
buffer (:func:`take`) and sends a copy to its *buddy*, a rank on another node (:func:`replicate`): every
shard is then held twice, on two nodes. The copies live in a :class:`SnapshotStore`, which outlives the
group (a rank actor keeps it from one group to the next).

A (re)started group, at any world size, rebuilds its state from what its ranks hold. The ranks agree on
the newest step of which some rank still holds every shard (:func:`choose`); then each rank asks for the
elements it owns now, with the partition arithmetic a checkpoint load uses (``layout.pieces``,
``layout.owners``), and the holders answer with one message per pair of ranks (:func:`restore`). When a
shard has no copy left there is no complete snapshot, and the caller loads from storage instead.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from zeroray.checkpoint.reader import install
from zeroray.engine import Comm, ZeroEngine, layout, names

_ALIGN = 64  # bytes: every tensor of a snapshot starts aligned, so a byte view can be viewed as its dtype


@dataclass(frozen=True)
class Entry:
    """One tensor in a snapshot's buffer. ``kind``: "shard" (``name``: a flat group, ``key``: "weight" or an
    optimizer state, fp32), "buffer" (a module buffer) or "rng" (``name``: "cpu" or "cuda")."""

    kind: str
    name: str
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class GroupLayout:
    """A flat group as the group that took the snapshot laid it out (a GroupShard without tensors)."""

    name: str
    slots: tuple[layout.TensorSlot, ...]
    numel: int
    shard_world: int


@dataclass(frozen=True)
class Header:
    """A snapshot without its bytes: what ranks exchange to agree on a step and to ask for ranges.
    ``group_id`` names the group that took it (two groups may snapshot the same step)."""

    group_id: str
    step: int
    rank: int
    world_size: int
    groups: tuple[GroupLayout, ...]
    entries: tuple[Entry, ...]
    meta: dict[str, Any]
    nbytes: int


@dataclass(frozen=True)
class Snapshot:
    """One rank's state at one step: ``data`` holds every entry's bytes (host memory)."""

    header: Header
    data: torch.Tensor

    def bytes_of(self, e: Entry, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Bytes ``[lo, hi)`` of entry ``e`` (a view)."""
        return self.data[e.offset + lo : e.offset + (e.nbytes if hi is None else hi)]


def take(engine: ZeroEngine, group_id: str) -> Snapshot:
    """Copy this rank's part of ``engine``'s state into one host buffer (device to host on a GPU)."""
    tensors: list[tuple[str, str, str, torch.Tensor]] = []
    groups = []
    for gs in engine.shard_state():
        groups.append(GroupLayout(gs.name, tuple(gs.slots), gs.numel, gs.shard_world))
        tensors += [("shard", gs.name, key, gs.tensors[key]) for key in sorted(gs.tensors)]
    tensors += [("buffer", name, "", b) for name, b in names.named_buffers(engine.module)]
    tensors.append(("rng", "cpu", "", torch.get_rng_state()))
    if engine.device.type == "cuda":
        tensors.append(("rng", "cuda", "", torch.cuda.get_rng_state(engine.device)))
    entries, pos = [], 0
    for kind, name, key, t in tensors:
        dtype = torch.float32 if kind == "shard" else t.dtype
        e = Entry(kind, name, key, dtype, tuple(t.shape), pos)
        entries.append(e)
        pos = -(-(pos + e.nbytes) // _ALIGN) * _ALIGN
    data = torch.empty(pos, dtype=torch.uint8, pin_memory=engine.device.type == "cuda")
    with torch.no_grad():
        for e, (_, _, _, t) in zip(entries, tensors, strict=True):
            data[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape).copy_(t, non_blocking=True)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    header = Header(group_id, int(engine.global_step), engine.rank, engine.world_size, tuple(groups),
                    tuple(entries), engine.state_meta(), pos)
    return Snapshot(header, data)


@dataclass
class SnapshotStore:
    """This process's snapshots (its own and its buddies' copies), by (group id, step, rank).
    ``saved_step``: the newest step this process's groups saved to storage, so a restart knows whether
    a checkpoint there may be newer than the snapshots."""

    held: dict[tuple[str, int, int], Snapshot] = field(default_factory=dict)
    saved_step: int | None = None

    def add(self, snap: Snapshot) -> None:
        h = snap.header
        self.held[(h.group_id, h.step, h.rank)] = snap

    def keep_only(self, group_id: str, step: int) -> None:
        """Drop every snapshot but those of ``group_id`` at ``step``."""
        self.held = {k: v for k, v in self.held.items() if k[:2] == (group_id, step)}

    def headers(self) -> list[Header]:
        return [s.header for s in self.held.values()]

    @property
    def nbytes(self) -> int:
        return sum(s.data.numel() for s in self.held.values())


def buddies(nodes: Sequence[Hashable]) -> list[int]:
    """For each rank (``nodes[r]``: its node), the rank that keeps its copy: on another node where one exists.

    A cyclic shift when one puts every pair on two nodes (each rank then sends one copy and keeps one);
    else the next rank on another node; on one node the next rank (a lost process is covered, not a lost
    node)."""
    w = len(nodes)
    for s in range(1, w):
        if all(nodes[r] != nodes[(r + s) % w] for r in range(w)):
            return [(r + s) % w for r in range(w)]
    return [next(((r + s) % w for s in range(1, w) if nodes[(r + s) % w] != nodes[r]), (r + 1) % w) for r in range(w)]


def replicate(comm: Comm, store: SnapshotStore, snap: Snapshot, nodes: Sequence[Hashable]) -> None:
    """Collective: keep ``snap``, send a copy to this rank's buddy, keep the copies sent to this rank; once
    every rank holds both copies of this step, drop the older snapshots.

    Three exchanges, the fewest that keep a failure midway harmless: the sizes (one all-reduce), the copies
    (header and bytes, point to point), and a barrier (one all-reduce) before anything older is dropped."""
    store.add(snap)
    if comm.world_size == 1:
        store.keep_only(snap.header.group_id, snap.header.step)
        return
    to, me = buddies(nodes), comm.rank
    header = torch.frombuffer(bytearray(pickle.dumps(snap.header)), dtype=torch.uint8)
    sizes = torch.zeros(comm.world_size, 2, dtype=torch.int64)  # per rank: header bytes, snapshot bytes
    sizes[me] = torch.tensor([header.numel(), snap.data.numel()])
    comm.all_reduce(sizes)
    recvs = {r: [torch.empty(int(sizes[r, 0]), dtype=torch.uint8), torch.empty(int(sizes[r, 1]), dtype=torch.uint8)]
             for r in range(comm.world_size) if to[r] == me}
    comm.exchange({to[me]: [header, snap.data]}, recvs)
    for h, data in recvs.values():
        store.add(Snapshot(pickle.loads(h.numpy().tobytes()), data))
    comm.all_reduce(torch.zeros(1))  # a barrier: every rank holds both copies of this step
    store.keep_only(snap.header.group_id, snap.header.step)


@dataclass(frozen=True)
class Choice:
    """The snapshot a group restores: taken by group ``group_id`` of ``world_size`` ranks at ``step``.
    ``holders[o]``: the rank (of the new group) that serves old rank ``o``'s shard; ``headers[o]`` its header.
    ``newest_saved``: the newest step any rank's groups saved to storage (None: none)."""

    group_id: str
    step: int
    world_size: int
    holders: tuple[int, ...]
    headers: tuple[Header, ...]
    newest_saved: int | None


def choose(comm: Comm, store: SnapshotStore) -> Choice | None:
    """Collective: the newest snapshot of which the group's ranks hold every shard (the same answer on every
    rank), or None."""
    gathered = comm.all_gather_object((store.headers(), store.saved_step))
    saved = [s for _, s in gathered if s is not None]
    sets: dict[tuple[str, int], dict[int, list[tuple[int, Header]]]] = {}
    for holder, (headers, _) in enumerate(gathered):
        for h in headers:
            sets.setdefault((h.group_id, h.step), {}).setdefault(h.rank, []).append((holder, h))
    complete = [(step, gid) for (gid, step), ranks in sets.items()
                if len(ranks) == next(iter(ranks.values()))[0][1].world_size]
    if not complete:
        return None
    step, gid = max(complete)
    ranks = sets[(gid, step)]
    load = [0] * comm.world_size  # spread the serving over the holders
    holders, headers = [], []
    for o in range(len(ranks)):
        holder, h = min(ranks[o], key=lambda c: (load[c[0]], c[0]))
        load[holder] += 1
        holders.append(holder)
        headers.append(h)
    return Choice(gid, step, len(ranks), tuple(holders), tuple(headers), max(saved) if saved else None)


@dataclass(frozen=True)
class _Ask:
    """A byte range of one entry of old rank ``rank``'s snapshot."""

    rank: int
    kind: str
    name: str
    key: str
    lo: int
    hi: int


def restore(engine: ZeroEngine, comm: Comm, store: SnapshotStore, choice: Choice) -> None:
    """Collective: load ``choice`` into ``engine`` at this group's world size and stage, from the ranks' host
    memory. Counters, loss scale, LR scheduler and buffers as saved; RNG state as saved at the same world
    size, else reseeded (as a checkpoint load does)."""
    asks, dests = [], []  # what this rank needs, and where each piece goes (a byte view)

    def ask(rank: int, kind: str, name: str, key: str, lo: int, dest: torch.Tensor) -> None:
        dest = dest.reshape(-1).view(torch.uint8)
        asks.append(_Ask(rank, kind, name, key, lo, lo + dest.numel()))
        dests.append(dest)

    old = {s.name: (g, s) for g in choice.headers[0].groups for s in g.slots}
    saved_keys: dict[str, list[str]] = {}  # old group -> the states it was snapshotted with
    for e in choice.headers[0].entries:
        if e.kind == "shard":
            saved_keys.setdefault(e.name, []).append(e.key)
    tensors = {}
    for gs in engine.shard_state():
        _check_fits(gs.slots, old, choice)
        keys = ["weight"] if gs.param_group is None else saved_keys[old[gs.slots[0].name][0].name]
        out = {k: torch.zeros(gs.hi - gs.lo, dtype=torch.float32) for k in keys}
        for p in layout.pieces(gs.slots, gs.lo, gs.hi):
            g, slot = old[p.name]
            lo = slot.offset + p.t_lo
            for o, llo, lhi in layout.owners(g.numel, g.shard_world, lo, lo + p.numel):
                at = p.f_lo - gs.lo + layout.shard_range(g.numel, g.shard_world, o)[0] + llo - lo  # in ``out``
                for k in keys:
                    ask(o, "shard", g.name, k, 4 * llo, out[k][at : at + lhi - llo])  # fp32: 4 bytes an element
        tensors[gs.name] = out
    buffers = {}
    for e in (e for e in choice.headers[0].entries if e.kind == "buffer"):
        buffers[e.name] = torch.empty(e.shape, dtype=e.dtype)
        ask(0, "buffer", e.name, "", 0, buffers[e.name])
    rng = None
    if choice.world_size == engine.world_size:  # this rank's stream goes on where the same rank left it
        rng = {}
        for e in (e for e in choice.headers[engine.rank].entries if e.kind == "rng"):
            rng[e.name] = torch.empty(e.shape, dtype=e.dtype)
            ask(engine.rank, "rng", e.name, "", 0, rng[e.name])

    _move(comm, store, choice, asks, dests)
    install(engine, tensors, choice.headers[0].meta, buffers, rng)


def _move(comm: Comm, store: SnapshotStore, choice: Choice, asks: list[_Ask], dests: list[torch.Tensor]) -> None:
    """Serve every rank's asks from the snapshots this rank holds, and fill ``dests`` with this rank's."""
    me = comm.rank
    everyone = comm.all_gather_object(asks)
    entries: dict[int, dict[tuple[str, str, str], Entry]] = {}  # old rank -> its snapshot's entries by name

    def piece(a: _Ask) -> torch.Tensor:
        snap = store.held[(choice.group_id, choice.step, a.rank)]
        if a.rank not in entries:
            entries[a.rank] = {(e.kind, e.name, e.key): e for e in snap.header.entries}
        return snap.bytes_of(entries[a.rank][(a.kind, a.name, a.key)], a.lo, a.hi)

    sends, recvs, incoming = {}, {}, {}
    for j, theirs in enumerate(everyone):
        served = [a for a in theirs if choice.holders[a.rank] == me]
        if j == me:
            for a, dest in zip(asks, dests, strict=True):
                if choice.holders[a.rank] == me:
                    dest.copy_(piece(a))
        elif served:
            sends[j] = [torch.cat([piece(a) for a in served])]
    for h in sorted({choice.holders[a.rank] for a in asks} - {me}):
        incoming[h] = [(a, d) for a, d in zip(asks, dests, strict=True) if choice.holders[a.rank] == h]
        recvs[h] = [torch.empty(sum(a.hi - a.lo for a, _ in incoming[h]), dtype=torch.uint8)]
    comm.exchange(sends, recvs)
    for h, pairs in incoming.items():
        pos = 0
        for a, dest in pairs:
            dest.copy_(recvs[h][0][pos : pos + a.hi - a.lo])
            pos += a.hi - a.lo


def _check_fits(slots: Sequence[layout.TensorSlot], old: dict[str, tuple[GroupLayout, layout.TensorSlot]],
                choice: Choice) -> None:
    for s in slots:
        if s.name not in old or old[s.name][1].shape != s.shape:
            saved = old[s.name][1].shape if s.name in old else "nothing"
            raise RuntimeError(
                f"zeroray: the in-memory snapshot of step {choice.step} does not fit this model: parameter "
                f"{s.name!r} {tuple(s.shape)} was snapshotted as {saved}")
