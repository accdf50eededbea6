"""The runtime's ranked victim choice (hetero.victims) gives exactly the policy's own answer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hetero
from hetero.policies import LRU, BlockInfo, Policy
from hetero.simulator import replay
from hetero.victims import Victims, _Ranked
from helpers import default_step
from models import GPT, batches, state_bytes
from test_policies import training_logs

POLICIES = ["auto", "opt", "hotness", "lru", "static"]


class _Block:
    def __init__(self, id: str, tiers: set[str]) -> None:
        self.id, self.tiers = id, tiers


class _Keyed(Policy):
    def __init__(self) -> None:
        self.rank: dict[str, int] = {}

    def victim_key(self, tier):
        return lambda b: (self.rank.get(b.id, 0), b.clean_below, b.id)


def _info(b: _Block) -> BlockInfo:
    return BlockInfo(b.id, "param", 1, len(b.tiers) > 1)


def test_ranking_follows_copies_that_change_between_observations() -> None:
    p = _Keyed()
    v = Victims(p)
    a, b, c = _Block("a", {"device"}), _Block("b", {"device"}), _Block("c", {"device"})
    on = [a, b, c]
    p.rank = {"a": 3, "b": 2, "c": 1}
    assert v.choose("device", on, _info, lambda x: True) is a
    assert v.choose("device", on, _info, lambda x: x is not a) is b  # eligibility is asked each time
    a.tiers.discard("device")  # a left the tier
    v.changed(a)
    assert v.choose("device", on, _info, lambda x: True) is b
    d = _Block("d", {"device"})  # arrived after the ranking: weighed afresh
    v.changed(d)
    p.rank["d"] = 5
    assert v.choose("device", on + [d], _info, lambda x: True) is d
    c.tiers.add("host")  # c is clean below now: its key changed
    v.changed(c)
    p.rank["c"] = 2  # (an equal rank: the clean flag decides between b and c)
    assert v.choose("device", on, _info, lambda x: x is not d) is c
    p.rank = {"a": 0, "b": 9, "c": 0}  # keys change with an observation, and only then
    v.invalidate()
    assert v.choose("device", on, _info, lambda x: x is not d) is b


def test_a_policy_that_overrides_victim_is_asked_every_time() -> None:
    class FirstId(LRU):
        def victim(self, tier, candidates):
            return min(candidates, key=lambda b: b.id)

    v = Victims(FirstId())
    a, b = _Block("a", {"device"}), _Block("b", {"device"})
    assert v.choose("device", [b, a], _info, lambda x: True) is a  # not LRU's key


def test_a_policy_must_define_victim_or_a_key() -> None:
    with pytest.raises(NotImplementedError, match="victim"):
        Policy().victim("device", [BlockInfo("a", "param", 1, False)])


@pytest.fixture
def checked(monkeypatch):
    """Every ranked choice is compared with the policy's victim() over the same candidates."""
    real = Victims.choose
    calls = {"n": 0}

    def choose(self, tier, blocks, info, eligible, within=None):
        # The ranking's stored keys are current, except for blocks marked as changed: a copy
        # change or an observation the runtime did not report would leave a stale key even
        # where it happens not to change the answer.
        r = self._ranked.get(tier)
        if r is not None:
            key = self.policy.victim_key(tier)
            for k, b in r.entries.values():
                if b not in r.stale:
                    assert tier in b.tiers, f"{b.id} is ranked on {tier} without a copy there"
                    assert (key(info(b)), b.id) == k, f"stale key of {b.id} on {tier}"
            assert all(b.id in r.entries or b in r.stale for b in blocks), f"a block on {tier} is not ranked"
        got = real(self, tier, blocks, info, eligible, within)
        key = self.policy.victim_key(tier) if self._keyed else None
        if within is not None and key is not None:  # only the ranking's first ``within`` may go
            blocks = sorted(blocks, key=lambda b: (key(info(b)), b.id), reverse=True)[:within]
        candidates = [info(b) for b in blocks if eligible(b)]
        want = self.policy.victim(tier, candidates).id if candidates else None
        assert (got.id if got is not None else None) == want
        calls["n"] += 1
        return got

    monkeypatch.setattr(Victims, "choose", choose)
    return calls


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(log=training_logs(), policy=st.sampled_from(POLICIES), prefetch=st.integers(0, 2))
def test_ranked_choices_match_the_policy_on_random_logs(log, policy, prefetch, checked) -> None:
    events, catalog, capacity = log
    total = sum(n for _, n in catalog.values())
    replay(events, catalog, policy, {"device": capacity, "host": total // 2 + 3072, "nvme": 4 * total},
           1024, prefetch)


def test_keys_stay_current_when_one_acquire_moves_the_recording_ahead_and_back(checked) -> None:
    """One acquire of two blocks: the first matches ahead (the accesses between count as
    skipped), the second behind (they do not any more). Every block between changed its record
    of hits and misses, and so its key (``auto`` asks hotness for blocks the recording is not
    reliable on), though the position ends where it was."""
    ids = [f"p{i:02d}" for i in range(12)]

    def acquire(*group: str) -> list[tuple]:
        return [("acquire", group, "device", False, True), ("release", group, "device")]

    events = [("create", b, "param", 1024, None) for b in ids] + sum((acquire(b) for b in ids), [])
    events += [("end_step",)] + acquire("p00") + acquire("p01") + acquire("p10", "p06")
    events += sum((acquire(b) for b in ids[7:]), [])
    replay(events, {b: ("param", 1024) for b in ids}, "auto",
           {"device": 3072, "host": 4096, "nvme": 49152}, 1024, 2)
    assert checked["n"] > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_ranked_choices_match_the_policy_in_a_real_run(policy, tmp_path, checked) -> None:
    """Routed experts, tight device and host budgets and NVMe: evictions on every tier, shadows
    taken and released by the optimizer's transactions, prefetches and hints."""
    torch.manual_seed(0)
    total = state_bytes(GPT(routed=True))
    torch.manual_seed(0)
    model = hetero.wrap(GPT(routed=True), device="cpu", device_budget=int(total * 0.2),
                        host_budget=int(total * 0.3), nvme_path=str(tmp_path), chunk_size="8KiB",
                        policy=policy)
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)
    for b in batches(4, seed=4):
        default_step(model, opt, b)
    model.close()
    assert checked["n"] > 100


@pytest.mark.parametrize("policy", ["opt", "auto"])  # whose keys change at a step's end
def test_a_ranking_does_not_outlive_the_step(policy, checked) -> None:
    """A step's end changes the policy's keys (``opt`` adopts the recorded step): a ranking made
    after the step's last acquire is not used after its end."""
    s = 1024
    create = lambda b: ("create", b, "param", s, "device")  # noqa: E731
    events = [create("a"), create("b")]
    for b in "ab":
        events += [("acquire", (b,), "device", False, True), ("release", (b,), "device")]
    events += [create("c"), ("end_step",), create("d")]
    res = replay(events, {b: ("param", s) for b in "abcd"}, policy, {"device": 2 * s, "host": 8 * s}, s, 0)
    assert res.oom is None and checked["n"] == 2


@pytest.mark.parametrize("policy", ["opt", "auto", "lru"])
def test_a_ranking_outlives_the_observations_of_a_step(policy, monkeypatch, checked) -> None:
    """Policies that name the blocks whose keys an access changed have each tier sorted about
    once per step, not once per acquire; the choices are still the policy's own (``checked``)."""
    sorts = {"n": 0}
    init = _Ranked.__init__

    def counting(self, order):
        sorts["n"] += 1
        init(self, order)

    monkeypatch.setattr(_Ranked, "__init__", counting)
    torch.manual_seed(0)
    total = state_bytes(GPT())
    torch.manual_seed(0)
    model = hetero.wrap(GPT(), device="cpu", device_budget=int(total * 0.15), chunk_size="4KiB",
                        policy=policy)
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)
    steps = 4
    for b in batches(steps, seed=4):
        default_step(model, opt, b)
    model.close()
    # 23-28 sorts here (a step's end, and a tier whose blocks mostly changed, re-sort it);
    # re-sorting after every observation that precedes an eviction gives 71.
    assert checked["n"] > 200 and sorts["n"] <= 10 * steps


def test_ranked_choices_match_the_policy_when_states_settle(tmp_path, checked) -> None:
    """Settling changes a policy's keys between observations (``Opt.settled``: the settled
    chunk's blocks are expected on the device): the rankings must hear of it. (A policy that
    settles every state it is offered: the built-in ones settle nothing in a model this small.)"""
    from helpers import SettleAll, settling

    settled = {"n": 0}

    class Counting(SettleAll):
        def settled(self, block, tier):
            super().settled(block, tier)
            settled["n"] += 1

    kw = settling(GPT, 0.6, tmp_path, Counting())
    torch.manual_seed(0)
    model = hetero.wrap(GPT(), **kw)
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)
    for b in batches(5, seed=1):
        default_step(model, opt, b)
    model.close()
    assert settled["n"] and checked["n"] > 50
