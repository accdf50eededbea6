"""The in-flight op index against the conflict rules it implements, checked by brute force."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from hetero.tiers import Scattered
from hetero.transfers import PAGE, InFlight, Op, overlap


@dataclasses.dataclass(eq=False)
class FakeBlock:
    id: str
    nbytes: int


def brute_conflicts(in_flight: list[Op], op: Op, over: int) -> list[Op]:
    """The rules as stated, by scanning every op in flight: ops of the same block or of
    overlapping memory, and evictions freeing the tier ``op`` writes that gave back ``over``
    bytes (those already among the others, then the oldest)."""
    deps = []
    for p in in_flight:
        if p is op:
            continue
        if p.block is op.block or (any(overlap(w, r) for w in op.writes for r in p.reads + p.writes)
                                   or any(overlap(r, w) for r in op.reads for w in p.writes)):
            deps.append(p)
    freeing = [p for p in in_flight if op.dst is not None and p.freed_src and p.src == op.dst]
    over -= sum(p.freed for p in freeing if p in deps)
    for p in freeing:
        if over <= 0:
            break
        if p not in deps:
            deps.append(p)
            over -= p.freed
    return sorted(deps, key=lambda p: p.seq)


def loc(tier: str, draw) -> object:
    if tier == "device":
        return None
    offset = draw(st.integers(0, 12)) * PAGE
    if tier == "nvme" and draw(st.booleans()):  # scattered: extents apart, several in one slot
        return Scattered([(draw(st.integers(0, 1)), draw(st.integers(0, 12)) * PAGE, PAGE)
                          for _ in range(draw(st.integers(2, 4)))])
    return offset if tier == "host" else (draw(st.integers(0, 1)), offset)


@st.composite
def scripts(draw):
    blocks = [FakeBlock(f"b{i}", draw(st.integers(1, 3 * PAGE))) for i in range(draw(st.integers(1, 5)))]
    actions = []
    for seq in range(draw(st.integers(1, 40))):
        if actions and draw(st.booleans()) and draw(st.booleans()):
            actions.append(("remove", draw(st.integers(0, 10 ** 6))))
            continue
        block = draw(st.sampled_from(blocks))
        src = draw(st.sampled_from([None, "device", "host", "nvme"]))
        dst = draw(st.sampled_from([None, "device", "host", "nvme"]))
        freed = src is not None and draw(st.booleans())
        op = Op(seq, block, src, dst, loc(src, draw) if src else None, loc(dst, draw) if dst else None,
                freed, False, None, 0.0, PAGE)  # (slots of a page: regions are page-rounded bytes)
        op.freed = block.nbytes if freed else 0
        actions.append(("add", op, draw(st.integers(-PAGE, 4 * PAGE))))
    return actions


@settings(max_examples=300, deadline=None)
@given(scripts(), st.sampled_from([PAGE, 2 * PAGE, 8 * PAGE]))
def test_conflicts_equal_a_scan_of_every_op_in_flight(actions, unit) -> None:
    index, live = InFlight(unit), []
    for what, arg, *over in actions:
        if what == "remove":
            if live:
                op = live.pop(arg % len(live))
                index.remove(op)
            continue
        assert index.conflicts(arg, over[0]) == brute_conflicts(live, arg, over[0])
        index.add(arg)
        live.append(arg)
        assert list(index) == live
        assert index.of(arg.block) == [p for p in live if p.block is arg.block]
        for tier in ("device", "host", "nvme"):
            assert index.freeing(tier) == sum(p.freed for p in live if p.freed_src and p.src == tier)
    for op in list(live):
        index.remove(op)
    assert len(index) == 0 and not index._readers and not index._writers and not index._freeing
    assert not index._freeing_bytes


def test_a_copy_s_region_is_the_room_it_holds_not_only_its_bytes() -> None:
    """A block of more than a slot holds whole slots, a small one whole units of a shared slot:
    a placement in the tail of a slot a freed copy held, past that copy's last byte, is a
    conflict (undoing the freeing op takes the room back). Regions of bytes alone let a small
    block's units in the last slot of a larger block's freed run go unordered."""
    from hetero.tiers import HOST, NVME, unit_for
    from hetero.transfers import regions

    slot = 12 * 1024
    unit = unit_for(slot)
    large = FakeBlock("large", slot + 20)  # two slots, its bytes end early in the second
    small = FakeBlock("small", 100)  # shares a slot: one unit
    (_, _, a, b), = regions(large, HOST, 0, slot)
    assert (a, b) == (0, 2 * slot)
    (_, _, a, b), = regions(small, HOST, slot + unit, slot)
    assert (a, b) == (slot + unit, slot + 2 * unit)
    assert overlap(regions(large, HOST, 0, slot)[0], regions(small, HOST, 2 * slot - unit, slot)[0])
    assert overlap(regions(large, NVME, (1, 0), slot)[0], regions(small, NVME, (1, 2 * slot - unit), slot)[0])
    assert not overlap(regions(large, NVME, (0, 0), slot)[0], regions(small, NVME, (1, slot), slot)[0])
