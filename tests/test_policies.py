"""Policies on hand-computed sequences, Belady's bound, and the simulator against real runs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hetero
from hetero.policies import LRU, Auto, BlockInfo, Hotness, Opt, Static, Timeline
from hetero.simulator import belady_bound, replay, replay_access_log
from models import GPT, batches, state_bytes


def info(i: str, clean: bool = False, nbytes: int = 10, kind: str = "param") -> BlockInfo:
    return BlockInfo(i, kind, nbytes, clean)


_SEQ: dict[int, int] = {}


def feed(policy, blocks: str, step: int = 0, tier: str = "device") -> None:
    """One acquire per block, with access numbers continuing across calls."""
    for b in blocks:
        seq = _SEQ.get(id(policy), 0)
        policy.observe([b], tier, step, seq)
        _SEQ[id(policy)] = seq + 1


def test_timeline_next_use_wraps_into_the_next_step() -> None:
    t = Timeline()
    for b in "abca":  # one acquire per block
        t.observe([b], "device")
    t.end_step()
    assert [t.next_use(b, "device") for b in "abc"] == [0, 1, 2]
    t.observe(["a"], "device")
    t.observe(["b"], "device")
    assert t.next_use("c", "device") == 0
    assert t.next_use("a", "device") == 1  # its second use in this step
    assert t.next_use("b", "device") == 3  # wraps: 4 - 2 + 1
    assert t.next_use("z", "device") is None
    assert t.upcoming(2) == []  # two matches in a row are not enough to trust the recording
    t.LOCK = 2
    assert t.upcoming(2) == [("c", "device"), ("a", "device")]


def test_timeline_resynchronizes_after_a_skipped_branch() -> None:
    t = Timeline()
    for b in "abcdef":
        t.observe([b], "device")
    t.end_step()
    t.observe(["a"], "device")
    t.observe(["d"], "device")  # b, c skipped this step (routing)
    assert t.pos == 4 and t.next_use("e", "device") == 0
    t.observe(["x"], "device")  # never seen before: position unchanged
    assert t.pos == 4
    t.LOCK = 1
    assert t.upcoming(1) == []  # diverging: no prefetch on a guess ...
    t.observe(["e"], "device")
    assert t.upcoming(1) == [("f", "device")]  # ... until the step follows the recording again
    assert t.end_step() == (3, 4)  # a, d and e matched the recording, x did not


def test_opt_is_belady_with_wrap_around() -> None:
    opt = Opt()
    feed(opt, "abcd")
    opt.end_step(0)
    feed(opt, "ab", step=1)
    # next uses: c at 0, d at 1, a at 2 (next step), b at 3 (next step): b is furthest
    assert opt.victim("device", [info("a"), info("b"), info("c")]).id == "b"
    # without wrap-around a and b would both be "never used again"; LRU would pick c
    lru = LRU()
    feed(lru, "abcdab")
    assert lru.victim("device", [info("a"), info("b"), info("c")]).id == "c"


def test_opt_prefers_a_clean_victim_among_equal_futures() -> None:
    opt = Opt()
    feed(opt, "ab")
    opt.end_step(0)
    # x and y are both unknown to the recording (equal, infinite future): evict the clean one
    assert opt.victim("device", [info("x"), info("y", clean=True), info("a")]).id == "y"
    assert opt.victim("device", [info("x", clean=True), info("y"), info("a")]).id == "x"


def test_hotness_evicts_the_block_predicted_furthest() -> None:
    h = Hotness()
    feed(h, "abababac")  # a every 2, b every 2 (last long ago), c once
    assert h.predicted("c") == math.inf
    assert h.victim("device", [info("a"), info("b"), info("c")]).id == "c"
    assert h.predicted("a") <= h.predicted("b")


def test_auto_uses_hotness_for_blocks_the_recording_does_not_know() -> None:
    auto = Auto()
    assert auto.upcoming(2) == []  # nothing recorded yet: hotness only
    feed(auto, "abcxyx")
    auto.end_step(0)
    feed(auto, "abc", step=1)
    feed(auto, "qq", step=1)  # q: new this step, reused every access
    # x and y are known (next step); q is predicted by hotness to come back at once
    assert auto.next_use("q", "device") < auto.next_use("y", "device")
    auto.timeline.LOCK = 3  # a, b, c matched in a row; q broke the streak
    assert auto.upcoming(1) == []
    feed(auto, "x", step=1)
    auto.timeline.LOCK = 1
    assert auto.upcoming(1) == [("y", "device")]


def test_static_homes_are_fixed_by_kind() -> None:
    s = Static()
    free = {"device": 10**9, "host": 100, "nvme": 10**9}
    caps = dict(free)
    assert s.home(info("p", nbytes=10), free, caps) == "host"  # never the device
    assert s.home(info("m", nbytes=1000, kind="exp_avg"), free, caps) == "nvme"  # host short


def events_for(groups_per_step: list[list[str]], steps: int) -> list[tuple]:
    events: list[tuple] = [("create", b, "param", 4096, None) for b in sorted({b for g in groups_per_step for b in g})]
    for _ in range(steps):
        for g in groups_per_step:
            events.append(("acquire", tuple(g), "device", False, True))
            events.append(("release", tuple(g), "device"))
        events.append(("end_step",))
    return events


def test_belady_bound_on_a_known_optimum() -> None:
    # capacity 2 of unit blocks, a b c a b c: first uses are free; MIN misses only b once
    events = [("create", b, "param", 1, None) for b in "abc"]
    events += [("acquire", (b,), "device", False, True) for b in "abcabc"]
    catalog = {b: ("param", 1) for b in "abc"}
    assert belady_bound(events, catalog, capacity=2) == 1
    assert belady_bound(events, catalog, capacity=3) == 0
    assert belady_bound(events, catalog, capacity=1) == 3  # a b c a b c: every reuse misses


@settings(max_examples=60, deadline=None)
@given(seq=st.lists(st.integers(0, 7), min_size=4, max_size=40), cap=st.integers(2, 6),
       steps=st.integers(2, 4), policy=st.sampled_from(["opt", "auto", "lru", "hotness", "static"]),
       prefetch=st.integers(0, 2))
def test_simulated_traffic_is_at_least_belady_and_budgets_hold(seq, cap, steps, policy, prefetch) -> None:
    size = 4096
    groups = [[f"b{i}"] for i in seq]
    events = events_for(groups, steps)
    catalog = {f"b{i}": ("param", size) for i in seq}
    capacities = {"device": cap * size, "host": 64 * size}
    res = replay(events, catalog, policy, capacities, size, prefetch)
    assert res.oom is None  # every access served
    assert res.accesses == len(seq) * steps
    for tier, peak in res.peak.items():
        assert peak <= capacities[tier]
    bound = belady_bound(events, catalog, cap * size)
    assert res.traffic["host->device"] >= bound
    if policy == "opt" and prefetch == 0:  # steady state: Belady's choices after one step
        assert res.traffic["host->device"] <= bound + len(set(seq)) * size * 2


def make() -> GPT:
    torch.manual_seed(0)
    return GPT(routed=True)


@pytest.mark.parametrize("policy", ["auto", "lru", "opt", "hotness", "static"])
def test_simulator_reproduces_a_real_run(policy, tmp_path) -> None:
    total = state_bytes(make())
    model = hetero.wrap(make(), device="cpu", device_budget=int(total * 0.25), host_budget=int(total * 0.3),
                        nvme_path=str(tmp_path), chunk_size="8KiB", policy=policy)
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in batches(4, seed=9):
        model(x, y).backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    rep = model.placement_report()
    d = rep.as_dict()
    assert d["policy"] == policy
    sim = rep.simulate()
    assert sim.oom is None
    assert sim.traffic == d["traffic"]
    assert sim.misses == d["misses"]
    assert sim.peak == {n: t["peak"] for n, t in d["tiers"].items()}
    # the event log survives a round trip through a file
    from hetero.simulator import load_event_log

    rep.save_event_log(str(tmp_path / "events.jsonl"))
    events, catalog, header = load_event_log(str(tmp_path / "events.jsonl"))
    again = replay(events, catalog, policy, header["capacities"], header["slot_size"], header["prefetch"])
    assert again.traffic == d["traffic"]
    # and the public access log replays too (approximately: no creation order, no releases)
    lines = [a.as_dict() for a in rep.accesses]
    approx = replay_access_log(lines, policy, rep.capacities(), rep.slot_size, rep.prefetch)
    assert approx.oom is None and approx.accesses == len(lines)


def test_prefetch_keeps_working_when_routing_changes() -> None:
    """Routed experts change every few steps: auto keeps prefetching, and its prefetches hit."""
    total = state_bytes(make())
    model = hetero.wrap(make(), device="cpu", device_budget=int(total * 0.25), chunk_size="8KiB",
                        policy="auto", prefetch=2)
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches(60, seed=4)
    by_expert = {e: [b for b in data if int(b[0][0, 0]) % 2 == e] for e in (0, 1)}
    schedule = by_expert[0][:3] + by_expert[1][:3] + by_expert[0][3:5]
    hits_before = []
    for i, (x, y) in enumerate(schedule):
        rep = model.placement_report().as_dict()
        hits_before.append(rep["prefetch"]["hits"])
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    rep = model.placement_report().as_dict()
    follow = rep["trace_follow"]
    assert min(follow[1:]) < 1.0  # the routing change was noticed ...
    assert follow[-1] > 0.9  # ... and learned
    # prefetch issued and hit in the steps right after each routing change (steps 3 and 6)
    assert rep["prefetch"]["hits"] - hits_before[4] > 0
    assert rep["prefetch"]["hits"] - hits_before[7] > 0
    assert rep["prefetch"]["issued"] >= rep["prefetch"]["hits"] > 0
