"""The in-flight bound shared by gradient reductions and parameter gathers."""

from __future__ import annotations

from zeroray.engine.comm import Handle, InFlight


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
