"""The partition arithmetic: shards tile the padded group; pieces and owners invert each other."""

from __future__ import annotations

import pytest

from zeroray.engine import layout


@pytest.mark.parametrize("numel", [1, 2, 7, 13, 64, 1001])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_shards_tile_the_padded_group(numel: int, world: int) -> None:
    padded = layout.padded_numel(numel, world)
    assert padded % world == 0 and numel <= padded < numel + world
    ranges = [layout.shard_range(numel, world, r) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == padded
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_pieces_map_a_flat_range_to_tensors() -> None:
    slots = layout.build_slots(["a", "b", "c"], [(2, 3), (4,), (5,)])
    assert [s.offset for s in slots] == [0, 6, 10] and layout.group_numel(slots) == 15
    got = list(layout.pieces(slots, 4, 12))
    assert [(p.name, p.t_lo, p.t_hi, p.f_lo, p.f_hi) for p in got] == [
        ("a", 4, 6, 4, 6),
        ("b", 0, 4, 6, 10),
        ("c", 0, 2, 10, 12),
    ]
    assert list(layout.pieces(slots, 15, 18)) == []  # padding belongs to no tensor


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_owners_cover_any_range_exactly_once(world: int) -> None:
    numel = 23
    s = layout.shard_numel(numel, world)
    for lo in range(numel):
        for hi in range(lo + 1, numel + 1):
            parts = list(layout.owners(numel, world, lo, hi))
            covered = [r * s + i for r, a, b in parts for i in range(a, b)]
            assert covered == list(range(lo, hi))


def test_bad_rank() -> None:
    with pytest.raises(ValueError, match="rank 3 is outside world size 3"):
        layout.shard_range(10, 3, 3)
