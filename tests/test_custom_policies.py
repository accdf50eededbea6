"""Custom policies (``policy=`` an instance of the user's class) that misbehave, and the simulator's
arguments: a policy bug raises a HeteroStateError naming the policy and the hook, before the
runtime acts on the answer, and the model trains on afterwards; wrap and simulate check their
arguments alike."""

from __future__ import annotations

import math
import re

import pytest
import torch

import hetero
from helpers import SettleAll, default_step, loss_of
from hetero.errors import HeteroConfigError, HeteroStateError
from hetero.policies import LRU, BlockInfo, Opt, Policy
from hetero.simulator import load_event_log, replay
from models import GPT, batches, state_bytes

STEPS = 3


def _wrap(policy, nvme_path=None) -> hetero.HeteroModule:
    """The tests' GPT under a device budget of 30% of its state (and, with ``nvme_path``, a
    host budget of 50% over NVMe), in 8 KiB chunks."""
    torch.manual_seed(0)
    model = GPT()
    total = state_bytes(model)
    kw = dict(device="cpu", device_budget=int(total * 0.3), host_budget=2 * total,
              chunk_size="8KiB", policy=policy)
    if nvme_path is not None:
        kw.update(host_budget=int(total * 0.5), nvme_path=str(nvme_path), nvme_budget=2 * total)
    return hetero.wrap(model, **kw)


def _eager() -> tuple[list[float], dict]:
    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = [default_step(model, opt, b) for b in batches(STEPS, seed=2)]
    return losses, model.state_dict()


def _train(model: hetero.HeteroModule, policy, retry: bool) -> tuple[list[float], list[HeteroStateError]]:
    """STEPS steps with ``policy`` armed during step 1 only. A step that raised
    HeteroStateError is run again from its forward where ``retry`` (the error came before the
    update), else not (it says the update was applied)."""
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)
    losses, errors = [], []
    for i, (x, y) in enumerate(batches(STEPS, seed=2)):
        policy.armed = i == 1
        try:
            loss = loss_of(model(x, y))
            loss.backward()
            opt.step()
        except HeteroStateError as exc:
            errors.append(exc)
            policy.armed = False
            if retry:
                opt.zero_grad()
                loss = loss_of(model(x, y))
                loss.backward()
                opt.step()
        policy.armed = False
        opt.zero_grad()
        losses.append(loss.item())
    return losses, errors


def _assert_like_eager(model: hetero.HeteroModule, losses: list[float]) -> None:
    want_losses, want = _eager()
    assert losses == pytest.approx(want_losses, rel=1e-5)
    got = model.state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    assert model.placement_report().as_dict()["steps"] == STEPS


class Misbehaving(LRU):
    """LRU that, while armed, answers ``answer(self, *args)`` from ``hook`` instead."""

    def __init__(self, hook: str, answer) -> None:
        super().__init__()
        self.hook, self.answer = hook, answer
        self.armed, self.fired = False, 0
        self.rt = None  # the runtime, for answers that name a block in use

    def _bad(self, hook: str, *args):
        if not (self.armed and self.hook == hook):
            return None
        self.fired += 1
        return (self.answer(self, *args),)

    def victim(self, tier, candidates):
        bad = self._bad("victim", tier, candidates)
        return super().victim(tier, candidates) if bad is None else bad[0]

    def upcoming(self, groups):
        bad = self._bad("upcoming", groups)
        return super().upcoming(groups) if bad is None else bad[0]

    def next_use(self, block_id, tier):
        bad = self._bad("next_use", block_id, tier)
        return super().next_use(block_id, tier) if bad is None else bad[0]

    def end_step(self, step):
        bad = self._bad("end_step", step)
        return super().end_step(step) if bad is None else bad[0]


def _in_use(policy, tier, candidates):
    """A block on ``tier`` that is pinned (in use), so not among ``candidates``."""
    offered = {c.id for c in candidates}
    b = next(b for b in policy.rt._on[tier] if b.pins.get(tier) and b.id not in offered)
    return BlockInfo(b.id, b.kind, b.nbytes, False)


def _boom(*_):
    raise RuntimeError("boom")


@pytest.mark.parametrize("hook, answer, nvme, match", [
    ("victim", _in_use, False, r"Misbehaving\.victim\(\) returned BlockInfo.*candidates"),
    ("victim", lambda p, t, c: None, False, r"victim\(\) returned None.*candidates"),
    ("victim", lambda p, t, c: BlockInfo("no.such", "param", 4, False), False, "no.such"),
    ("victim", lambda p, t, c: c[0].id, False, r"victim\(\) returned '"),
    ("upcoming", lambda p, g: None, False, r"upcoming\(\) returned None.*pairs"),
    ("upcoming", lambda p, g: [(next(iter(p.sizes)), "gpu")], False, r"upcoming\(\).*'gpu'"),
    ("next_use", lambda p, b, t: None, True, r"next_use\(\) returned None.*number"),
], ids=["victim-in-use", "victim-None", "victim-made-up", "victim-id-string", "upcoming-None",
        "upcoming-no-such-tier", "next_use-None"])
def test_a_nonsense_answer_raises_naming_the_policy_and_training_goes_on(
        hook, answer, nvme, match, tmp_path) -> None:
    """A victim not among the candidates (one in use: evicting it broke the model for good with
    setStorage errors), None, a made-up BlockInfo or an id string; upcoming() None or naming a
    tier that does not exist; next_use() None (asked with NVMe, for the host's headroom). Each
    raises HeteroStateError at once, nothing is acted on, and the step runs again to eager's
    results."""
    policy = Misbehaving(hook, answer)
    model = _wrap(policy, tmp_path if nvme else None)
    policy.rt = model._hetero_state.runtime
    losses, errors = _train(model, policy, retry=True)
    assert policy.fired == 1 and len(errors) == 1
    assert "Misbehaving" in str(errors[0])
    assert re.search(match, str(errors[0])), str(errors[0])
    _assert_like_eager(model, losses)
    model.close()


class MixedKeys(Policy):
    """Most recently used last, except that while armed a parameter's key is None."""

    def __init__(self) -> None:
        self.last: dict[str, int] = {}
        self.armed = False

    def observe(self, blocks, tier, step, seq, write=False):
        for i, b in enumerate(blocks):
            self.last[b] = seq + i

    def victim_key(self, tier):
        if self.armed:
            return lambda b: None if b.kind == "param" else -self.last.get(b.id, -1)
        return lambda b: -self.last.get(b.id, -1)


def test_victim_keys_that_do_not_compare_raise_naming_the_policy() -> None:
    """Keys mixing None and ints gave a bare TypeError from a sort inside backward; the tier's
    ranking, maybe half re-sorted, is dropped and made afresh once the keys are sound again."""
    policy = MixedKeys()
    model = _wrap(policy)
    losses, errors = _train(model, policy, retry=True)
    assert len(errors) == 1
    assert "MixedKeys.victim_key()" in str(errors[0]) and "compare" in str(errors[0])
    assert isinstance(errors[0].__cause__, TypeError)
    _assert_like_eager(model, losses)
    model.close()


class NaNKeys(MixedKeys):
    """MixedKeys whose armed keys are NaN for parameters (numpy's 0 / 0, say)."""

    def victim_key(self, tier):
        if self.armed:
            return lambda b: float("nan") if b.kind == "param" else -self.last.get(b.id, -1)
        return super().victim_key(tier)


def test_nan_victim_keys_raise_naming_the_policy() -> None:
    """Found in review: NaN compares false both ways, so the sorted ranking lost track of its
    entries and the forward failed with a bare KeyError from hetero/victims.py. Refused like
    keys that do not compare, and training goes on as eager once the keys are sound."""
    policy = NaNKeys()
    model = _wrap(policy)
    losses, errors = _train(model, policy, retry=True)
    assert len(errors) == 1
    assert "NaNKeys.victim_key()" in str(errors[0]) and "NaN" in str(errors[0])
    _assert_like_eager(model, losses)
    model.close()


class RaisingSettle(SettleAll):
    """Settles every Adam state onto the device (helpers.SettleAll); while armed, settle()
    raises or (``answer``) returns a tier that does not exist."""

    def __init__(self, answer=None) -> None:
        super().__init__()
        self.answer, self.armed, self.fired = answer, False, 0

    def settle(self, block, capacity):
        if not self.armed:
            return super().settle(block, capacity)
        self.fired += 1
        self.armed = False
        if self.answer is None:
            raise RuntimeError("boom in settle")
        return self.answer


@pytest.mark.parametrize("policy, cause", [
    (lambda: Misbehaving("end_step", _boom), RuntimeError),
    (lambda: RaisingSettle(), RuntimeError),
    (lambda: RaisingSettle("gpu"), HeteroStateError),
], ids=["end_step-raises", "settle-raises", "settle-no-such-tier"])
def test_a_policy_failing_after_a_step_says_that_the_step_was_applied(policy, cause) -> None:
    """end_step() or settle() raising (or settle() answering nonsense) after every chunk was
    updated: step() raises, but the error says the step was applied, and the runtime's own
    bookkeeping is complete (the report counts the step: it counted one fewer when end_step
    raised). Not retried, the run ends as eager's."""
    policy = policy()
    model = _wrap(policy)
    losses, errors = _train(model, policy, retry=False)
    assert policy.fired >= 1 and len(errors) == 1
    msg = str(errors[0])
    assert type(policy).__name__ in msg and "applied" in msg and "do not run that step again" in msg
    assert isinstance(errors[0].__cause__, cause)
    _assert_like_eager(model, losses)  # (the report counts STEPS steps)
    model.close()


def test_wrap_refuses_a_policy_that_cannot_choose_a_victim() -> None:
    """A Policy subclass with neither victim() nor victim_key() failed with NotImplementedError
    at the first eviction, mid-backward: now wrap refuses it before anything moves, and so does
    simulate()."""

    class HomesOnly(Policy):
        def home(self, block, free, capacity):
            return "host"

    torch.manual_seed(0)
    model = GPT()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(HeteroConfigError, match=r"policy=HomesOnly\(\) defines neither victim"):
        hetero.wrap(model, device="cpu", device_budget=state_bytes(model) // 3, policy=HomesOnly())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert not any(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("answer", ["gpu", None, 0])
def test_home_naming_no_tier_raises_naming_the_policy(answer) -> None:
    """home() answering a tier that does not exist was replaced silently (or failed later with
    "that tier is not enabled"): a policy bug, raised from the first block's placement in wrap,
    which gives the model back as it was."""

    class Nowhere(LRU):
        def home(self, block, free, capacity):
            return answer

    torch.manual_seed(0)
    model = GPT()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(HeteroStateError, match=r"Nowhere\.home\(\) returned .*expected a tier name"):
        hetero.wrap(model, device="cpu", device_budget=state_bytes(model) // 3, policy=Nowhere())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_home_on_nvme_without_an_nvme_tier_starts_blocks_on_the_host() -> None:
    """The documented fallback (Policy.home): NVMe without an NVMe tier is NVMe without room."""

    class OnNvme(LRU):
        def home(self, block, free, capacity):
            return "nvme"

    model = _wrap(OnNvme())
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)
    losses = [default_step(model, opt, b) for b in batches(STEPS, seed=2)]
    _assert_like_eager(model, losses)
    d = model.placement_report().as_dict()
    assert "nvme" not in d["tiers"] and {b["tier"] for b in d["blocks"]} <= {"device", "host", "none"}
    model.close()


# ------------------------------------------------------------------ one policy instance, one run


def test_simulate_replays_a_copy_of_the_live_policy() -> None:
    """simulate(policy=the run's own instance) re-pointed the live policy's tables at the
    simulator's blocks, so blocks the run made afterwards were unknown to it."""
    policy = Opt()
    model = _wrap(policy)
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)
    default_step(model, opt, batches(1, seed=2)[0])
    sizes, seen = policy.sizes, policy.timeline.seen
    model.placement_report().simulate(policy)
    assert policy.sizes is sizes and policy.timeline.seen == seen
    assert policy.sizes is model._hetero_state.runtime._sizes
    model.close()


def test_one_policy_instance_runs_one_open_model_at_a_time() -> None:
    """Two models on one instance decided on each other's history (and their replays did not
    match their runs): wrap refuses an instance an open model runs, and so does a replay, which
    would take it over; once that model is closed the instance may run another."""
    policy = LRU()
    first = _wrap(policy)
    with pytest.raises(HeteroConfigError, match=r"policy=LRU\(\) is the live policy of another"):
        _wrap(policy)
    rep = first.placement_report()
    with pytest.raises(HeteroConfigError, match="live policy"):
        replay(rep.events, rep.catalog, policy, rep.capacities(), rep.slot_size)
    assert rep.simulate(policy).traffic is not None  # (simulate copies it)
    first.close()
    second = _wrap(policy)
    assert policy.sizes is second._hetero_state.runtime._sizes
    second.close()


# ------------------------------------------------------------------ names


class MyLRU(LRU):
    """A user's variant of lru: every new block starts on the host where it fits."""

    def home(self, block, free, capacity):
        return "host" if free.get("host", 0) >= block.nbytes else super().home(block, free, capacity)


class Unnamed(Policy):
    def victim(self, tier, candidates):
        return candidates[0]


def test_a_custom_policy_reports_its_own_name_and_replays_only_as_an_instance(tmp_path) -> None:
    """A subclass of lru reported "lru" (as_dict, the event log's header), so a replay by the
    header's name gave other traffic than the run; a custom policy without a name was "base"."""
    model = _wrap(MyLRU())
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)
    for b in batches(2, seed=2):
        default_step(model, opt, b)
    rep = model.placement_report()
    model.close()
    d = rep.as_dict()
    assert d["policy"] == "MyLRU"
    path = tmp_path / "events.jsonl"
    rep.save_event_log(str(path))
    events, catalog, header = load_event_log(str(path))
    assert header["policy"] == "MyLRU"
    args = (header["capacities"], header["slot_size"], header["prefetch"], header["host_slots"],
            header["nvme_files"])
    with pytest.raises(HeteroConfigError, match="instance"):
        replay(events, catalog, header["policy"], *args)
    assert replay(events, catalog, MyLRU(), *args).traffic == d["traffic"] == rep.simulate().traffic
    model = _wrap(Unnamed())
    assert model.placement_report().as_dict()["policy"] == "Unnamed"
    model.close()
    model = _wrap(LRU())
    assert model.placement_report().as_dict()["policy"] == "lru"
    model.close()


# ------------------------------------------------------------------ simulate's arguments


@pytest.fixture(scope="module")
def report() -> hetero.Report:
    model = _wrap("lru")
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)
    for b in batches(2, seed=2):
        default_step(model, opt, b)
    rep = model.placement_report()
    model.close()
    return rep


@pytest.mark.parametrize("kwargs, match", [
    (dict(policy="nope"), "policy='nope'"),
    (dict(policy=3), "policy=3"),
    (dict(policy=LRU), r"LRU is a class: pass an instance"),
    (dict(device=-1), "device=-1"),
    (dict(device=0), "device=0"),
    (dict(device=1.5), "device=1.5"),
    (dict(host=-5), "host=-5"),
    (dict(host="lots"), "host='lots'"),
    (dict(nvme=0), "nvme=0"),
    (dict(prefetch=-1), "prefetch=-1"),
    (dict(prefetch="2"), "prefetch='2'"),
    (dict(prefetch=2.5), "prefetch=2.5"),
])
def test_simulate_refuses_what_wrap_refuses(report, kwargs, match) -> None:
    with pytest.raises(HeteroConfigError, match=match):
        report.simulate(**kwargs)


def test_simulate_and_the_bounds_take_sizes_as_wrap_does(report) -> None:
    """"128KiB" is what wrap accepts for a budget (it gave TypeError); a negative budget is not
    (the bounds computed one)."""
    assert report.simulate(device="128KiB").traffic == report.simulate(device=128 * 1024).traffic
    assert report.simulate(host="1MiB", prefetch=0).oom is None
    assert report.belady_bound(device="128KiB") == report.belady_bound(device=131072)
    assert report.coresident_bound(device="128KiB") == report.coresident_bound(device=131072)
    for bound in (report.belady_bound, report.coresident_bound):
        with pytest.raises(HeteroConfigError, match="device=-1"):
            bound(device=-1)
    assert math.isfinite(report.belady_bound())


def test_simulate_and_the_bounds_refuse_budgets_below_wrap_s_minimums(report) -> None:
    """A budget wrap would refuse for this model was replayed anyway (all-zero traffic, only
    ``oom`` saying why) and bounded; now it is refused the same way, naming the minimum, and
    the minimum itself is accepted."""
    least = report._minimums
    assert least and least["host+nvme"] >= least["host"] > 0
    with pytest.raises(HeteroConfigError, match=f"device=.*device>={least['device']}"):
        report.simulate(device=least["device"] - 1)
    for bound in (report.belady_bound, report.coresident_bound):
        with pytest.raises(HeteroConfigError, match=f"device>={least['device']}"):
            bound(device=least["device"] // 2)
    host = least["host+nvme"] if "nvme" in report.capacities() else least["host"]
    with pytest.raises(HeteroConfigError, match=f"host>={host}"):
        report.simulate(host=host - 1)
    report.simulate(device=least["device"])  # accepted (it may still run out later, as a run may)
    report.belady_bound(device=least["device"])
