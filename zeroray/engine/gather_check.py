"""GatherCheck: stage 3's all-gathers pair up across ranks by their order alone, so ranks that run
different units at the same point (rank r runs ``linears[r % 2]``, as DeepSpeed's
``ChooseModuleByRankModel`` does) would each compute with another unit's weights, then hang in
backward. Before a group's gather is issued, the ranks agree on which group it is, and a
difference is an error naming the groups and the ranks, on every rank at once.

The agreement costs one small control collective per gather, so it runs only for the first
forward and backward passes (where a rank-dependent choice of units shows) and, while
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` is set (torch's own switch for collective checks), always.
"""

from __future__ import annotations

import torch.distributed as dist

from zeroray.engine.comm import Comm


class UnitMismatchError(RuntimeError):
    """Ranks gathered different stage-3 groups at the same point of a forward or backward."""


class GatherCheck:
    def __init__(self, comm: Comm, first_passes: int = 2):
        self.comm = comm
        self._left = first_passes if comm.world_size > 1 else 0
        self._always = comm.world_size > 1 and dist.is_available() and dist.get_debug_level() == dist.DebugLevel.DETAIL

    @property
    def active(self) -> bool:
        return self._always or self._left > 0

    def pass_done(self) -> None:
        """A backward ended (the engine calls it); the first passes were checked."""
        self._left = max(0, self._left - 1)

    def __call__(self, group: str) -> None:
        """Collective while active: every rank is about to gather ``group``, or all raise."""
        if not self.active:
            return
        names = self.comm.all_gather_object(group)
        if len(set(names)) > 1:
            seen = ", ".join(f"rank {r} {n!r}" for r, n in enumerate(names))
            raise UnitMismatchError(
                f"zeroray stage 3: the ranks gathered different parameter groups at the same point ({seen}); every "
                "rank must run the same units in the same order in each forward and backward. Put modules that "
                "ranks choose between into one unit (config units=[...]) or run all of them on every rank"
            )
