"""In-memory snapshots: a lost rank's state recovered from its peers' host memory, with no storage read.

Every ``snapshot_interval`` steps each rank copies its part of the engine's state (its shards of the fp32
weights and optimizer states, the module's buffers, its RNG state, the engine's counters) into one host
buffer (:func:`take`) and sends a copy to its *buddy*, a rank on another node (:func:`replicate`): every
shard is then held twice, on two nodes. The copies live in a :class:`SnapshotStore`, which outlives the
group (a rank actor keeps it from one group to the next).

**Recovery from replicas.** Under hybrid sharding every shard already lives on the N/k ranks of its mesh
column (``Topology.replica_ranks``), one per replica group, so a lost node leaves a live copy of each of its
shards elsewhere. When a group fails, each surviving rank copies its live state (:func:`take` with
``live=True``: no collective, the group is broken) if that state is a completed optimizer step (the engine is
not ``mid_update``); a header names the ranks whose shards it also stands for (``replicas``).

A (re)started group, at any world size, rebuilds its state from what its ranks hold. The ranks agree on
the newest step of which their snapshots cover every old rank, a rank covered by its own snapshot or by one
of a replica (:func:`choose`); snapshots of different steps or groups are never mixed. Then each rank asks for
the elements it owns now, with the partition arithmetic a checkpoint load uses (``layout.pieces``,
``layout.owners``), and the holders answer with one message per pair of ranks (:func:`restore`). When a
shard has no copy left there is no complete snapshot, and the caller loads from storage instead.
"""

from __future__ import annotations

import logging
import math
import pickle
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from zeroray.checkpoint.reader import install
from zeroray.engine import Comm, ZeroEngine, layout
from zeroray.engine import names as tensor_names

logger = logging.getLogger(__name__)

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
    """A flat group as the group that took the snapshot laid it out (a GroupShard without tensors).
    ``shard_rank``: which of the group's ``shard_world`` shards this rank held (its place in its shard group,
    not its rank: a user's mesh may order the shard groups' ranks any way)."""

    name: str
    slots: tuple[layout.TensorSlot, ...]
    numel: int
    shard_world: int
    shard_rank: int


@dataclass(frozen=True)
class Header:
    """A snapshot without its bytes: what ranks exchange to agree on a step and to ask for ranges.
    ``group_id`` names the group that took it (two groups may snapshot the same step). ``replicas``: the
    ranks of that group whose shards this snapshot holds too (``rank`` alone unless hybrid); ``live``: taken
    from a failed group's live state (no RNG state: the step was cut short), not at a report."""

    group_id: str
    step: int
    rank: int
    world_size: int
    groups: tuple[GroupLayout, ...]
    entries: tuple[Entry, ...]
    meta: dict[str, Any]
    nbytes: int
    replicas: tuple[int, ...]
    live: bool


@dataclass(frozen=True)
class Snapshot:
    """One rank's state at one step: ``data`` holds every entry's bytes (host memory)."""

    header: Header
    data: torch.Tensor

    def bytes_of(self, e: Entry, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Bytes ``[lo, hi)`` of entry ``e`` (a view)."""
        return self.data[e.offset + lo : e.offset + (e.nbytes if hi is None else hi)]


def take(engine: ZeroEngine, group_id: str, live: bool = False) -> Snapshot:
    """Copy this rank's part of ``engine``'s state into one host buffer (device to host on a GPU). ``live``:
    the group failed, maybe inside a step: the state must be a completed step (checked), its RNG state is
    left out and its micro-step count set to the step's start (partial accumulations are not kept)."""
    if engine.mid_update:
        raise RuntimeError(f"zeroray: rank {engine.rank}'s state is inside an optimizer step or a load; no snapshot "
                           "of it is a completed step")
    tensors: list[tuple[str, str, str, torch.Tensor]] = []
    groups = []
    for gs in engine.shard_state():
        groups.append(GroupLayout(gs.name, tuple(gs.slots), gs.numel, gs.shard_world, gs.shard_rank))
        tensors += [("shard", gs.name, key, gs.tensors[key]) for key in sorted(gs.tensors)]
    tensors += [("buffer", name, "", b) for name, b in tensor_names.named_buffers(engine.module)]
    if not live:
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
    if engine.device.type == "cuda":  # this stream's copies only: a failed group's collectives may never end
        torch.cuda.current_stream(engine.device).synchronize()
    meta = engine.state_meta()
    if live:
        meta["micro_step"] = engine.global_step * engine.gradient_accumulation_steps
    replicas = engine.topology.replica_ranks or (engine.rank,)
    header = Header(group_id, int(engine.global_step), engine.rank, engine.world_size, tuple(groups),
                    tuple(entries), meta, pos, tuple(replicas), live)
    return Snapshot(header, data)


@dataclass
class SnapshotStore:
    """This process's snapshots (its own, its buddies' copies, its live state after a failure), by (group id,
    step, rank).
    ``saved_step``: the newest step this process's groups saved to storage, so a restart knows whether
    a checkpoint there may be newer than the snapshots."""

    held: dict[tuple[str, int, int], Snapshot] = field(default_factory=dict)
    saved_step: int | None = None

    def add(self, snap: Snapshot) -> None:
        h = snap.header
        if h.live and (h.group_id, h.step, h.rank) in self.held:
            return  # the report's snapshot of this step: the same state, with the RNG state
        self.held[(h.group_id, h.step, h.rank)] = snap

    def drop_live(self, group_id: str) -> None:
        """Drop the live snapshots of groups other than ``group_id``: once every rank of that group runs, a
        failure of it leaves live copies at least as new."""
        self.held = {k: v for k, v in self.held.items() if not v.header.live or k[0] == group_id}

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


def uncovered(columns: Sequence[Sequence[int]], holders: Collection[int]) -> list[int]:
    """The ranks none of whose shards' holders is in ``holders`` (the ranks whose copies the next group has):
    ``columns[r]`` names the ranks holding rank ``r``'s shards (its mesh column, ``Topology.replica_ranks``,
    ``r`` included). A recovery from replicas needs this empty. Pure."""
    held = set(holders)
    return [r for r, column in enumerate(columns) if held.isdisjoint(column)]


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
    ``holders[o]``: the rank (of the new group) that serves old rank ``o``'s shard, from the snapshot of old
    rank ``sources[o]`` (``o`` itself, or a replica of it); ``headers[o]`` that snapshot's header.
    ``newest_saved``: the newest step any rank's groups saved to storage (None: none). ``live``: some
    piece comes from a failed group's live state (a recovery from replicas)."""

    group_id: str
    step: int
    world_size: int
    holders: tuple[int, ...]
    sources: tuple[int, ...]
    headers: tuple[Header, ...]
    newest_saved: int | None
    live: bool


def choose(comm: Comm, store: SnapshotStore) -> Choice | None:
    """Collective: the newest snapshot of which the group's ranks hold every old rank's shards, each from its
    own snapshot or a replica's (the same answer on every rank), or None. Rank 0 logs the newer live sets it
    had to pass over, and the ranks they lack."""
    gathered = comm.all_gather_object((store.headers(), store.saved_step))
    saved = [s for _, s in gathered if s is not None]
    sets: dict[tuple[str, int], list[tuple[int, Header]]] = {}  # (group, step) -> (holder, header)
    for holder, (headers, _) in enumerate(gathered):
        for h in headers:
            sets.setdefault((h.group_id, h.step), []).append((holder, h))
    missing = {key: set(range(held[0][1].world_size)).difference(*(h.replicas for _, h in held))
               for key, held in sets.items()}
    complete = [(step, gid) for (gid, step) in sets if not missing[(gid, step)]]
    best = max(complete) if complete else None
    if comm.rank == 0:
        _log_passed_over(sets, missing, best)
    if best is None:
        return None
    step, gid = best
    world = sets[(gid, step)][0][1].world_size
    load = [0] * comm.world_size  # spread the serving over the holders
    holders, headers = [], []
    for o in range(world):
        # A rank's own snapshot first (it has the rank's RNG state), then the least busy holder.
        holder, h = min(((holder, h) for holder, h in sets[(gid, step)] if o in h.replicas),
                        key=lambda c: (c[1].rank != o, load[c[0]], c[0], c[1].rank))
        load[holder] += 1
        holders.append(holder)
        headers.append(h)
    return Choice(gid, step, world, tuple(holders), tuple(h.rank for h in headers), tuple(headers),
                  max(saved) if saved else None, any(h.live for h in headers))


def _log_passed_over(sets: dict[tuple[str, int], list[tuple[int, Header]]], missing: dict[tuple[str, int], set[int]],
                     best: tuple[int, str] | None) -> None:
    """Say which live (failure-time) sets newer than the one chosen lack a shard, and what is used instead."""
    for (gid, step), held in sorted(sets.items(), key=lambda kv: kv[0][1]):
        if missing[(gid, step)] and any(h.live for _, h in held) and (best is None or step > best[0]):
            instead = f"step {best[0]} in memory" if best is not None else "storage"
            logger.warning(
                "zeroray: no recovery from replicas at step %d: no surviving rank holds a copy of the shards of "
                "rank(s) %s of the group that failed; resuming from %s instead", step,
                sorted(missing[(gid, step)]), instead)


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
    size by the same rank at a report, else reseeded (as a checkpoint load does)."""
    asks, dests = [], []  # what this rank needs, and where each piece goes (a byte view)

    def ask(rank: int, kind: str, name: str, key: str, lo: int, dest: torch.Tensor) -> None:
        dest = dest.reshape(-1).view(torch.uint8)
        asks.append(_Ask(rank, kind, name, key, lo, lo + dest.numel()))
        dests.append(dest)

    old = {s.name: (g, s) for g in choice.headers[0].groups for s in g.slots}
    holds: dict[tuple[str, int], int] = {}  # (old group, shard index) -> the first old rank that held it
    for o, h in enumerate(choice.headers):  # h: old rank o's snapshot, or a replica's (the same shard index)
        for g in h.groups:
            holds.setdefault((g.name, g.shard_rank), o)
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
                for k in keys:  # fp32: 4 bytes an element
                    ask(holds[(g.name, o)], "shard", g.name, k, 4 * llo, out[k][at : at + lhi - llo])
        tensors[gs.name] = out
    buffers = {}
    for e in (e for e in choice.headers[0].entries if e.kind == "buffer"):
        buffers[e.name] = torch.empty(e.shape, dtype=e.dtype)
        ask(0, "buffer", e.name, "", 0, buffers[e.name])
    rng = None
    saved_rng = [e for e in choice.headers[engine.rank].entries if e.kind == "rng"] if (
        choice.world_size == engine.world_size and choice.sources[engine.rank] == engine.rank) else []
    if saved_rng:  # this rank's stream goes on where the same rank left it
        rng = {}
        for e in saved_rng:
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
        source = choice.sources[a.rank]
        snap = store.held[(choice.group_id, choice.step, source)]
        if source not in entries:
            entries[source] = {(e.kind, e.name, e.key): e for e in snap.header.entries}
        return snap.bytes_of(entries[source][(a.kind, a.name, a.key)], a.lo, a.hi)

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
