"""Topology: which ranks share one copy of the model states, and which node each rank is on.

Flat ZeRO shards every group over all N ranks. Hybrid sharding (MiCS; FSDP2's HSDP) shards over a
*shard group* of k ranks and replicates across the N/k groups: a 2-D mesh ``("replicate", "shard")``
over the ranks, as torch's ``init_device_mesh`` builds it, where shard group r holds the ranks
``[r*k, (r+1)*k)``. Put the ranks of one node next to each other and each shard group stays inside a
node: stage 3's all-gathers and the gradients' reduce-scatter never cross nodes, and only the
all-reduce of each gradient shard over its N/k replicas does (2Ψ/k bytes per rank and step).

hpZ (ZeRO++'s hierarchical partitioning, stage 3) adds a *secondary* group of h consecutive ranks
inside each shard group (the ranks of a node): after a unit's forward each rank keeps 1/h of its gathered
parameters, and the unit's backward gathers them from the secondary group, inside the node.

qgZ (ZeRO++'s quantized gradients) reduces hierarchically when the shard group spans nodes with m ranks on
each, node-major: ``node`` holds the m ranks of this rank's node among the shard group, ``cross`` the ranks at
this rank's place on every node (see :mod:`zeroray.engine.quantized_comm`).

The engine sends four kinds of traffic (six with qgZ's levels), each on its own :class:`Comm`:

- ``shard``: gathers and gradient reductions of the states (the whole world when flat);
- ``replicas``: the all-reduce of each gradient shard across the groups (None when flat);
- ``secondary``: hpZ's backward gathers (None without hpZ);
- ``world``: control messages (overflow and unused-parameter agreement, checkpoints) and the
  start-up broadcast of rank 0's weights, which keeps the replicas identical.

With ``nodes`` (the node of each rank, by rank in the world group), :meth:`report` tells the bytes
of collectives whose ranks are all on one node ("intra_node") from those whose ranks span nodes
("inter_node"). This module imports nothing from Ray: the Ray layer passes the nodes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from zeroray.config import CommConfig
from zeroray.engine.comm import Comm

SCOPES = ("intra_node", "inter_node")


def _mesh_groups(mesh: object, world: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """The (shard, replicate) groups of a 2-D ``DeviceMesh`` named ``("replicate", "shard")``."""
    names = getattr(mesh, "mesh_dim_names", None)
    if getattr(mesh, "ndim", None) != 2 or tuple(names or ()) != ("replicate", "shard"):
        raise ValueError(f"mesh must be a 2-D DeviceMesh with mesh_dim_names ('replicate', 'shard'), got {mesh!r}")
    size = dist.get_world_size(world) if world is not None else 1
    if mesh.size() != size:  # type: ignore[attr-defined]
        raise ValueError(f"mesh has {mesh.size()} ranks but the process group has {size}")  # type: ignore[attr-defined]
    return mesh.get_group("shard"), mesh.get_group("replicate")  # type: ignore[attr-defined]


def _split(world: dist.ProcessGroup, shard_groups: list[list[int]]) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """The groups of ``shard_groups`` (consecutive global ranks) and their replicate groups, made with torch's
    ``init_device_mesh`` when ``world`` is the default group (a mesh needs it), else by enumeration."""
    if world is dist.group.WORLD or world == dist.distributed_c10d._get_default_group():
        from torch.distributed.device_mesh import init_device_mesh

        device_type = "cuda" if str(dist.get_backend(world)).lower() == "nccl" else "cpu"
        shape = (len(shard_groups), len(shard_groups[0]))
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))
        return mesh.get_group("shard"), mesh.get_group("replicate")
    shard, _ = dist.new_subgroups_by_enumeration(shard_groups)
    replicate, _ = dist.new_subgroups_by_enumeration([list(column) for column in zip(*shard_groups, strict=True)])
    return shard, replicate


def _secondary(shard_groups: list[list[int]], h: int) -> dist.ProcessGroup:
    """Groups of ``h`` consecutive ranks of each shard group (global ranks), made on every rank: hpZ's secondary
    groups, and qgZ's node groups."""
    group, _ = dist.new_subgroups_by_enumeration([g[i : i + h] for g in shard_groups for i in range(0, len(g), h)])
    return group


def _node_runs(shard_groups: list[list[int]], world_ranks: list[int], nodes: Sequence[str]) -> int | None:
    """m when every shard group (global ranks, ascending) holds m > 1 consecutive ranks of each of its 2 or
    more nodes (what a hierarchical reduction needs), else None."""
    sizes = set()
    for g in shard_groups:
        if g != sorted(g):
            return None
        owners = [nodes[world_ranks.index(r)] for r in g]
        runs = [owners[0]]
        for a, b in zip(owners, owners[1:]):
            if a != b:
                runs.append(b)
        if len(runs) != len(set(runs)) or len(runs) < 2 or len(g) % len(runs):
            return None
        m = len(g) // len(runs)
        if any(owners[i] != owners[i - i % m] for i in range(len(g))):
            return None
        sizes.add(m)
    return sizes.pop() if len(sizes) == 1 and min(sizes) > 1 else None


def _column(shard_groups: list[list[int]], world_ranks: list[int], me: int) -> tuple[int, ...]:
    """The world-group ranks at world rank ``me``'s place in every shard group (global ranks in the groups)."""
    mine = next(g for g in shard_groups if world_ranks[me] in g)
    at = mine.index(world_ranks[me])
    return tuple(sorted(world_ranks.index(g[at]) for g in shard_groups))


@dataclass
class Topology:
    """The engine's communicators; build it with :meth:`build`."""

    world: Comm
    shard: Comm
    replicas: Comm | None = None
    nodes: tuple[str, ...] | None = None  # the node of each world rank
    secondary: Comm | None = None  # hpZ
    node: Comm | None = None  # qgZ's levels: this rank's node among the shard group ...
    cross: Comm | None = None  # ... and the ranks at its place on every node
    # The world ranks holding the same shards as this one (this rank's column of the mesh), hybrid only: a
    # recovery finds a lost rank's state on them. Kept as numbers, since an aborted group is dropped.
    replica_ranks: tuple[int, ...] | None = None
    _spans: dict[int, bool] | None = None  # id(comm) -> its ranks span nodes

    @classmethod
    def build(
        cls,
        process_group: dist.ProcessGroup | None,
        comm_config: CommConfig,
        *,
        shard_group_size: int | str | None = None,
        mesh: object | None = None,
        nodes: Sequence[object] | None = None,
        hpz_partition_size: int | str | None = None,
        node_levels: bool = False,
    ) -> Topology:
        """Collective when hybrid, hpZ or ``node_levels`` (the groups are made on every rank). ``shard_group_size``
        k: shard over k consecutive ranks, replicate across the N/k groups (None or N: flat); ``mesh``: a 2-D
        ``DeviceMesh`` ``("replicate", "shard")`` to use instead; ``nodes``: each rank's node;
        ``hpz_partition_size`` h: hpZ's secondary groups of h consecutive ranks of a shard group;
        ``node_levels``: also the ``node`` and ``cross`` groups of qgZ's hierarchical reduction, where ``nodes``
        shows that the shard groups span nodes with equal rank counts (else they stay None)."""
        def comm(group: dist.ProcessGroup | None) -> Comm:
            return Comm(group, comm_config.reduce_scatter, comm_config.all_gather_by_broadcast)

        world = comm(process_group)
        n = world.world_size
        if nodes is not None:
            nodes = tuple(str(x) for x in nodes)
            if len(nodes) != n:
                raise ValueError(f"nodes names {len(nodes)} ranks' nodes, but the process group has {n} ranks")
        for name, value in (("shard_group_size", shard_group_size), ("hpz_partition_size", hpz_partition_size)):
            if value == "auto":
                raise ValueError(
                    f"{name} 'auto' needs each rank's node: ZeroTrainer resolves it from its placement group; "
                    "at the engine level give an integer (the ranks per node)"
                )
        if mesh is not None and shard_group_size is not None:
            raise ValueError("give shard_group_size or a mesh, not both")
        if mesh is not None:
            shard, replicate = _mesh_groups(mesh, process_group)  # existing groups: nothing is made here
            k = mesh.size(1)  # type: ignore[attr-defined]
        else:
            k = n if shard_group_size is None else int(shard_group_size)
            if n % k:
                raise ValueError(f"shard_group_size {k} does not divide the world size {n}")
        h = None if hpz_partition_size in (None, 1, k) else int(hpz_partition_size)
        if h is not None and k % h:
            raise ValueError(f"hpz_partition_size {h} does not divide the shard group size {k}")
        # ---- the groups (collective from here on)
        if mesh is not None:
            shard_groups = mesh.mesh.tolist()  # type: ignore[attr-defined]
        elif k < n or h is not None:
            ranks = dist.get_process_group_ranks(process_group)
            shard_groups = [ranks[i : i + k] for i in range(0, n, k)]
            shard, replicate = _split(process_group, shard_groups) if k < n else (None, None)
        else:
            shard_groups, shard, replicate = [], None, None
        secondary = comm(_secondary(shard_groups, h)) if h is not None else None
        levels: tuple[Comm | None, Comm | None] = (None, None)
        if node_levels and nodes is not None and n > 1:
            world_ranks = dist.get_process_group_ranks(process_group)
            groups = shard_groups or [world_ranks]
            m = _node_runs(groups, world_ranks, nodes)
            if m is not None:  # hpZ over the ranks of a node made this rank's node group already
                node = secondary if h == m else comm(_secondary(groups, m))
                cross, _ = dist.new_subgroups_by_enumeration([g[place::m] for g in groups for place in range(m)])
                levels = (node, comm(cross))
        if shard is None:
            return cls._with_nodes(world, world, None, nodes, secondary, levels)
        topo = cls._with_nodes(world, comm(shard), comm(replicate), nodes, secondary, levels)
        topo.replica_ranks = _column(shard_groups, dist.get_process_group_ranks(world.group), world.rank)
        return topo

    @classmethod
    def _with_nodes(cls, world: Comm, shard: Comm, replicas: Comm | None, nodes: tuple[str, ...] | None,
                    secondary: Comm | None, levels: tuple[Comm | None, Comm | None] = (None, None)) -> Topology:
        topo = cls(world, shard, replicas, nodes, secondary, *levels)
        if nodes is not None:
            topo._spans = {id(c): topo._group_spans(c) for c in topo.comms}
        return topo

    def _group_spans(self, c: Comm) -> bool:
        assert self.nodes is not None
        if c.group is None or c is self.world:
            return len(set(self.nodes)) > 1
        world = self.world.group
        members = [dist.get_group_rank(world, r) for r in dist.get_process_group_ranks(c.group)]
        return len({self.nodes[r] for r in members}) > 1

    # ------------------------------------------------------------------ shape
    @property
    def comms(self) -> list[Comm]:
        """Every distinct communicator, world first."""
        out = [self.world]
        for c in (self.shard, self.replicas, self.secondary, self.node, self.cross):
            if c is not None and all(c is not o for o in out):
                out.append(c)
        return out

    @property
    def hybrid(self) -> bool:
        return self.replicas is not None

    @property
    def shard_size(self) -> int:
        return self.shard.world_size

    @property
    def replica_count(self) -> int:
        return 1 if self.replicas is None else self.replicas.world_size

    @property
    def replica_rank(self) -> int:
        return 0 if self.replicas is None else self.replicas.rank

    # ------------------------------------------------------------------ accounting and lifetime
    def report(self, by_scope: bool = False) -> dict[str, int]:
        """Bytes per collective kind; ``by_scope`` (with nodes): keyed ``"<scope>:<kind>"``, scope
        "intra_node" or "inter_node" (its ranks span nodes). Either way the values sum to the total."""
        out: Counter[str] = Counter()
        for c in self.comms:
            scope = None
            if by_scope and self._spans is not None:
                scope = SCOPES[self._spans[id(c)]]
            for kind, n in c.report().items():
                out[kind if scope is None else f"{scope}:{kind}"] += n
        return dict(out)

    def reset(self) -> None:
        for c in self.comms:
            c.reset()

    def close(self) -> None:
        for c in self.comms:
            c.close()

    def abort(self, reason: str) -> None:
        for c in self.comms:
            c.abort(reason)
