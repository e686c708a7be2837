"""The in-flight bound shared by gradient reductions and parameter gathers; the object collectives."""

from __future__ import annotations

import torch.distributed as dist

from tests.support.dist import run_ranks
from zeroray.engine.comm import Comm, Handle, InFlight


def test_in_flight_waits_oldest_first_past_the_limit() -> None:
    waited: list[str] = []
    inflight = InFlight(limit=10)

    def handle(name: str) -> Handle:
        return Handle(then=lambda: waited.append(name))

    inflight.add(handle("a"), 6)
    assert waited == []  # one may always be in flight
    inflight.add(handle("b"), 6)  # 12 > 10: the oldest must finish
    assert waited == ["a"]
    inflight.add(handle("c"), 3)  # 9 <= 10
    assert waited == ["a"]
    inflight.add(handle("d"), 20)  # over the limit: wait until only d is left
    assert waited == ["a", "b", "c"]
    inflight.wait_all()
    assert waited == ["a", "b", "c", "d"]


def _exchange_objects(rank: int, world: int) -> tuple[list, object, dict]:
    comm = Comm(dist.group.WORLD)
    # Sizes differ per rank (padding) and a rank may send None.
    gathered = comm.all_gather_object({"rank": rank, "text": "x" * (10 * rank)} if rank != 1 else None)
    chosen = comm.broadcast_object(f"from rank {rank}" if rank == world - 1 else None, src=world - 1)
    return gathered, chosen, comm.report()


def test_object_collectives_gather_every_rank_and_count_no_training_traffic() -> None:
    results = run_ranks(_exchange_objects, 3)
    expected = [{"rank": 0, "text": ""}, None, {"rank": 2, "text": "x" * 20}]
    for gathered, chosen, report in results:
        assert gathered == expected
        assert chosen == "from rank 2"
        assert report == {}
    assert Comm(None).all_gather_object("alone") == ["alone"]
