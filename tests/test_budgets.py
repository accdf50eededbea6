"""Budgets are hard caps: random budgets, chunk sizes and model shapes never push a tier over its
capacity, and training still equals eager."""

from __future__ import annotations

import shutil
import tempfile
from typing import Callable

import pytest
import torch
from torch import nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hetero
from helpers import assert_same_model, assert_same_state, assert_within_budgets, default_step, snapshot, train_pair
from models import GPT, batches, state_bytes


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    device_frac=st.floats(0.12, 1.2),
    host_frac=st.one_of(st.none(), st.floats(0.15, 0.6)),
    chunk_kib=st.sampled_from([2, 4, 8, 16, 64]),
    variant=st.sampled_from(["tied", "checkpointing", "repeat_block", "routed"]),
    n_layer=st.integers(1, 3),
    prefetch=st.integers(0, 3),
)
def test_random_budgets_never_exceeded(device_frac, host_frac, chunk_kib, variant, n_layer, prefetch) -> None:
    flags = {} if variant == "tied" else {variant: True}

    def make() -> GPT:
        torch.manual_seed(0)
        return GPT(n_layer=n_layer, **flags)

    total = state_bytes(make())
    swap = tempfile.mkdtemp(prefix="hetero-test-")
    kw = dict(device="cpu", device_budget=int(total * device_frac), chunk_size=chunk_kib * 1024,
              prefetch=prefetch)
    if host_frac is not None:
        kw |= dict(host_budget=int(total * host_frac), nvme_path=swap)
    try:
        try:
            e, h, eager, wrapped = train_pair(make, kw, batches(2, seed=n_layer))
        except hetero.HeteroConfigError as err:  # a budget below the minimum is refused up front
            assert "budget" in str(err) and ">=" in str(err)
            return
        assert h == pytest.approx(e, rel=1e-5)
        assert_same_model(eager, wrapped)
        assert_within_budgets(wrapped)
        wrapped.close()
    finally:
        shutil.rmtree(swap, ignore_errors=True)


def test_peak_is_reported_and_reached() -> None:
    """The report's peak is a real high-water mark: with a tight budget it comes close to it."""
    torch.manual_seed(0)
    model = GPT()
    total = state_bytes(model)
    _, _, _, wrapped = train_pair(lambda: (torch.manual_seed(0), GPT())[1],
                                  dict(device="cpu", device_budget=int(total * 0.25), chunk_size="8KiB"),
                                  batches(2))
    rep = assert_within_budgets(wrapped)
    dev = rep["tiers"]["device"]
    assert dev["peak"] > 0.8 * dev["capacity"]


def near_capacity_config(seed: int, nvme: bool, swap_dir) -> tuple:
    """A random test GPT (chunks 2-32 KiB, any policy) and budgets just above its state as the
    host charges it: ``(make, wrap kwargs)``. Without NVMe, device 10-60% and device + host
    0.97-1.15x the state; with NVMe, device and host 10-50% each and NVMe the rest of 0.9-1.3x."""
    import random

    r = random.Random(1000 + seed if nvme else seed)
    d, n_layer, chunk = r.choice([16, 32, 48]), r.choice([1, 2, 3]), r.choice([2048, 4096, 8192, 16384, 32768])
    flags = r.choice([{}, {"routed": True}, {"checkpointing": True}])
    policy = r.choice(["auto", "lru", "static", "opt", "hotness"])

    def make() -> GPT:
        torch.manual_seed(seed)
        return GPT(d=d, n_layer=n_layer, **flags)

    probe = hetero.wrap(make(), device="cpu", chunk_size=chunk)
    slots = probe._hetero_state.runtime.slot_bytes  # the state as the host tier charges it
    state = sum(slots(b.nbytes) * (3 if b.kind == "param" else 1)  # param, grad, m, v
                for c in probe._hetero_state.chunks for b in c.blocks.values())
    probe.close()
    if nvme:
        device, host = int(state * r.uniform(0.1, 0.5)), int(state * r.uniform(0.1, 0.5))
        kw = dict(host_budget=host, nvme_path=str(swap_dir),
                  nvme_budget=max(1, int(state * r.uniform(0.9, 1.3)) - device - host))
    else:
        device = int(state * r.uniform(0.1, 0.6))
        kw = dict(host_budget=int(state * r.uniform(0.97, 1.15)) - device)
    return make, kw | dict(device="cpu", device_budget=device, chunk_size=chunk, policy=policy)


@pytest.mark.parametrize("nvme", [False, True])
def test_near_capacity_is_refused_up_front_or_trains(nvme: bool, tmp_path) -> None:
    """Budgets whose sum is just above the state (:func:`near_capacity_config`) either are
    refused before anything moves (by wrap, naming the budget, or by the optimizer, naming the
    bytes in host slots) or train exactly as eager: never an out-of-memory error in the middle of
    a step, which would leave it half-applied. Found by random budgets. Without NVMe, half the
    accepted configurations failed so: small blocks took whole host slots, a full host could not
    use free device room, and blocks larger than a slot found no contiguous run. With NVMe, 51 of
    94 did: NVMe full of blocks with no other copy could not take the host's victims (now the host
    makes room as without NVMe, or drops a copy that has another), or had free slots but no run
    of them for a block larger than a slot (now scattered over them).
    ``HETERO_NEAR_CAPACITY_CONFIGS`` sets how many random configurations (16; the tenth
    session's note ran 200 of each)."""
    import os

    configs = int(os.environ.get("HETERO_NEAR_CAPACITY_CONFIGS", "16"))
    accepted, refused = 0, {"wrap": 0, "optimizer": 0}
    for seed in range(configs):
        make, kw = near_capacity_config(seed, nvme, tmp_path / f"swap{seed}")
        try:
            e, h, eager, wrapped = train_pair(make, kw, batches(3, seed=seed))
        except hetero.HeteroConfigError as err:
            assert "budget" in str(err) and ">=" in str(err)
            refused["wrap"] += 1
            continue
        except hetero.HeteroOOMError as err:
            assert "optimizer states need" in str(err) and "slots" in str(err), (seed, kw, err)
            refused["optimizer"] += 1
            continue
        accepted += 1
        assert h == pytest.approx(e, rel=1e-5), (seed, kw)
        assert_same_model(eager, wrapped)
        rep = assert_within_budgets(wrapped)
        sim = wrapped.placement_report().simulate()  # blocks moved up or within the host replay too
        assert sim.oom is None and sim.traffic == rep["traffic"], (seed, kw, sim.oom)
        wrapped.close()
    print(f"near capacity, nvme={nvme}: {accepted} of {configs} trained, refused {refused}")  # (-s shows it)
    assert accepted >= configs // 3, f"only {accepted} of {configs} configurations were accepted: the test no longer tests training"


def wrap_at_named_needs(make: Callable[[], nn.Module], kw: dict, grow: Callable[[int], str]) -> tuple:
    """Wrap ``make()`` at the least budgets hetero names: each budget in ``kw`` starts at 1 and
    is raised to the minimum ``wrap``'s refusal names (``pass <budget>>=N``); where ``wrap`` or
    the optimizer finds the state larger than the tiers (``need N bytes ... hold M bytes``), the
    budget ``grow(shortfall)`` names is raised by the shortfall. ``(wrapped model, its optimizer, the budgets)``."""
    import re

    kw = dict(kw)
    for _ in range(12):
        wrapped = None
        try:
            wrapped = hetero.wrap(make(), **kw)
            return wrapped, hetero.optim.AdamW(wrapped.parameters(), lr=1e-2, weight_decay=0.01), kw
        except hetero.HeteroConfigError as err:
            name, value = re.search(r"pass (\w+)>=(\d+)", str(err)).groups()
            assert name in kw and int(value) > kw[name], (kw, err)
            kw[name] = int(value)
        except hetero.HeteroOOMError as err:  # by wrap (parameters and gradients) or the optimizer
            if wrapped is not None:
                wrapped.close()
            need, held = map(int, re.search(r"need (\d+) bytes.*?hold (\d+) bytes", str(err)).groups())
            kw[grow(need - held)] += need - held
    raise AssertionError(f"no budgets accepted after 12 tries: {kw}")


def test_budgets_at_the_needs_hetero_names_train(tmp_path) -> None:
    """A user told "pass host_budget>=N" or "need N bytes" and giving exactly that trains:
    budgets at the minimums ``wrap`` names, raised by the shortfall the optimizer names, then
    three steps equal to eager, within budgets, and replayed alike. Found by a randomized review
    (27 of 101 such configurations failed mid-run, all but one with NVMe): with NVMe full, host
    room split into runs too short for a block could not be joined (host compaction ran only
    without NVMe) and a host victim too large for NVMe's room gave up where a smaller one fit;
    NVMe room free in units of shared slots could not hold a block taking whole slots; and a
    budget that is not a whole number of slots counted room the swap files do not have.
    ``HETERO_NAMED_NEEDS_CONFIGS`` sets how many random configurations (12)."""
    import os

    for seed in range(int(os.environ.get("HETERO_NAMED_NEEDS_CONFIGS", "12"))):
        train_at_named_needs(seed, tmp_path / f"swap{seed}")


def test_budgets_at_the_named_needs_train_where_shared_slots_pack_with_waste(tmp_path) -> None:
    """One configuration of the test above beyond its default 12 (seed 50 of 60): its 20 KiB
    slots hold 5 units, so each shared slot held one 10 KiB block (3 units) and kept 2 free
    that no such block could take, while the capacity checks counted them free; at the
    budgets they named, the host ran out of slots mid-run. The checks now count shared slots
    as their blocks pack (:func:`hetero.tiers.packed_bytes`)."""
    train_at_named_needs(50, tmp_path / "swap")


def train_at_named_needs(seed: int, swap_dir) -> None:
    """One configuration of :func:`test_budgets_at_the_needs_hetero_names_train`."""
    import random

    r = random.Random(seed)
    d, n_layer = r.choice([16, 32, 48]), r.choice([1, 2, 3])
    flags = r.choice([{}, {"routed": True}, {"checkpointing": True}])

    def make() -> GPT:
        torch.manual_seed(seed)
        return GPT(d=d, n_layer=n_layer, **flags)

    kw = dict(device="cpu", device_budget=1, host_budget=1, nvme_path=str(swap_dir),
              nvme_budget=1, chunk_size=r.choice([2048, 4096, 8192, 12288, 16384, 32768]),
              policy=r.choice(["auto", "lru", "static", "opt", "hotness"]), prefetch=r.randint(0, 3))
    grow = lambda short: r.choice(["device_budget", "host_budget", "nvme_budget"])  # noqa: E731
    wrapped, opt, kw = wrap_at_named_needs(make, kw, grow)
    eager = make()
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2, weight_decay=0.01)
    data = batches(3, seed=seed)
    e = [default_step(eager, eager_opt, b) for b in data]
    h = [default_step(wrapped, opt, b) for b in data]
    assert h == pytest.approx(e, rel=1e-5), (seed, kw)
    assert_same_model(eager, wrapped)
    rep = assert_within_budgets(wrapped)
    sim = wrapped.placement_report().simulate()
    assert sim.oom is None and sim.traffic == rep["traffic"], (seed, kw, sim.oom)
    wrapped.close()


def assert_each_parameter_whole(before: tuple[dict, dict], after: tuple[dict, dict],
                                model: hetero.HeteroModule) -> None:
    """After a failed step that could not be undone everywhere: each parameter has either all
    of the step (value, both moments and step count changed) or none of it."""
    names = [n for n, _ in model.named_parameters()]
    (sd0, st0), (sd1, st1) = before, after
    for i, name in enumerate(names):
        key = name.removeprefix("module.")
        if key not in sd0 or i not in st0:
            continue
        changed = [not torch.equal(sd0[key], sd1[key])] + [
            not torch.equal(st0[i][k], st1[i][k]) for k in ("exp_avg", "exp_avg_sq", "step")]
        assert all(changed) or not any(changed), f"{name} is half-updated: {changed}"


@pytest.mark.parametrize("defer", ["0", "1"], ids=["synchronous", "postponed"])
def test_near_capacity_with_nvme_a_failed_step_changes_nothing_unless_it_said_so(tmp_path, caplog, monkeypatch,
                                                                                   defer) -> None:
    """Near capacity with NVMe, the host's ways around a full NVMe (dropping copies, moving
    blocks up, scattering) must keep the optimizer step safe under a swap fault: HeteroIOError,
    and every parameter and optimizer state as before, unless that step logged that it gave up
    the previous version of a block for room; then each parameter has the whole step or none of
    it (found in review: a rollback restored the moments of a chunk whose parameters it could
    not restore, under the new step count). Postponed (the default), a fault that hits the
    updates step() postponed instead rolls forward: once the fault is gone the state is that of
    a twin trained without faults. Faults: eio and short, each at a random early and later
    request of the third step (with its postponed updates). ``HETERO_NEAR_CAPACITY_CONFIGS`` as
    above (8 here; the tenth session's note ran 200). That training then goes on is not
    asserted: near capacity, one configuration of 94 in that note's trial could not place a
    block larger than a slot in a later step (no contiguous host run, NVMe full); a step that
    raises HeteroOOMError is checked like a faulted one, and its configuration stops there."""
    import os
    import random

    from hetero import engine

    monkeypatch.setenv("HETERO_DEFER_STEP", defer)
    configs = int(os.environ.get("HETERO_NEAR_CAPACITY_CONFIGS", "8"))
    trained, rolled_back, rolled_forward, kept_whole = 0, 0, 0, 0
    for seed in range(configs):
        make, kw = near_capacity_config(seed, True, tmp_path / f"swap{seed}")
        try:
            model = hetero.wrap(make(), **kw)
            opt = hetero.optim.AdamW(model.parameters(), lr=1e-3)
            twin = hetero.wrap(make(), **dict(kw, nvme_path=str(tmp_path / f"twin{seed}")))
            twin_opt = hetero.optim.AdamW(twin.parameters(), lr=1e-3)
        except (hetero.HeteroConfigError, hetero.HeteroOOMError):
            continue  # refused up front
        data, r = batches(5, seed=seed), random.Random(seed)
        for batch in data[:2]:
            default_step(model, opt, batch)
            default_step(twin, twin_opt, batch)
        rt = model._hetero_state.runtime
        for kind in ("eio", "short"):
            for after in (r.randrange(0, 12), r.randrange(12, 40)):
                rt.drain()
                before = snapshot(model, opt)
                caplog.clear()
                engine.inject_fault(kind, after=after)
                stepped = hit = stuck = False
                try:
                    x, y = data[2]
                    model(x, y).backward()
                    opt.step()
                    stepped = True
                    opt.zero_grad()
                    rt.catch_up()
                    rt.drain()
                except hetero.HeteroIOError:
                    hit = True
                except hetero.HeteroOOMError:  # no room left to go on (see above): a failed step too
                    hit = stuck = True
                finally:
                    engine.inject_fault("none")
                opt.zero_grad()
                if stepped and not stuck:  # the twin takes the same step
                    default_step(twin, twin_opt, data[2])
                if hit and not any("undone" in m for m in caplog.messages):
                    if not stepped:
                        assert_same_state(snapshot(model, opt), before)
                        rolled_back += 1
                    elif not stuck:
                        assert_same_state(snapshot(model, opt), snapshot(twin, twin_opt))
                        rolled_forward += 1
                elif hit and not stepped:  # said so: each chunk kept the step whole, or none of it
                    assert_each_parameter_whole(before, snapshot(model, opt), model)
                    kept_whole += 1
                if stuck:
                    break
            if stuck:
                break
        trained += 1
        model.close()
        twin.close()
    print(f"near capacity, HETERO_DEFER_STEP={defer}: {trained} trained, {rolled_back} faults rolled "
          f"back, {rolled_forward} rolled forward, {kept_whole} partly kept")  # (-s shows it)
    assert trained >= configs // 4, f"only {trained} of {configs} configurations trained"
    assert rolled_back + rolled_forward >= trained, f"only {rolled_back + rolled_forward} faults in {trained} configurations"
    assert (rolled_forward > 0) == (defer == "1"), rolled_forward


def test_a_state_the_device_holds_is_accepted_with_the_smallest_host_budget() -> None:
    """The optimizer's capacity check counts blocks at their host-slot cost, which errs on the
    side of refusing; it must not refuse a state the device budget alone holds (found in review:
    a device budget at 1.3x the state was refused with the minimum host budget)."""
    from hetero.wrap import minimum_budgets

    def make() -> GPT:
        torch.manual_seed(0)
        return GPT(d=16, n_layer=2)

    total = state_bytes(make())
    probe = hetero.wrap(make(), device="cpu", chunk_size=16384)
    _, host_min = minimum_budgets(probe, nvme=False)
    probe.close()
    e, h, eager, wrapped = train_pair(make, dict(device="cpu", chunk_size=16384, device_budget=int(total * 1.05),
                                                 host_budget=host_min), batches(2))
    assert h == pytest.approx(e, rel=1e-5)
    assert_same_model(eager, wrapped)
    assert_within_budgets(wrapped)
    wrapped.close()



class _Tied(nn.Module):
    """Embedding and head tied, in different units (from the review that found the test below)."""

    def __init__(self, vocab: int = 64, d: int = 32) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Embedding(vocab, d), nn.Linear(d, d), nn.Linear(d, d),
                                    nn.Linear(d, vocab, bias=False))
        self.layers[3].weight = self.layers[0].weight

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.layers(x).flatten(0, 1), y.flatten())


@pytest.mark.parametrize("policy", ["static", "auto"])
def test_a_host_too_small_for_an_update_runs_it_on_the_device(policy: str) -> None:
    """``static`` homes optimizer states on the host. With a host budget of two slots, which
    cannot hold one chunk's parameters, gradient and states together, the first step failed
    with HeteroOOMError although the device had room (found in review). Such an update now runs
    on the device; where neither tier can hold it, the optimizer refuses up front."""

    def make() -> nn.Module:
        torch.manual_seed(0)
        return _Tied()

    kw = dict(device="cpu", chunk_size=65536, prefetch=3, policy=policy, device_budget=88031, host_budget=16463)
    data = [(x, torch.roll(x, 1, 1)) for x in torch.randint(0, 64, (3, 4, 6), generator=torch.Generator().manual_seed(1))]
    e, h, eager, wrapped = train_pair(make, kw, data)
    assert h == pytest.approx(e, rel=1e-5)
    assert_same_model(eager, wrapped)
    assert_within_budgets(wrapped)
    wrapped.close()
    # One chunk, the whole state: device and host together hold it, neither holds its update
    # (which failed in the first step).
    one = hetero.wrap(nn.Linear(32, 200), device="cpu", policy=policy, device_budget=90000, host_budget=90000)
    with pytest.raises(hetero.HeteroOOMError, match="one chunk's update"):
        hetero.optim.AdamW(one.parameters(), lr=1e-2)
    one.close()


def test_the_optimizer_s_named_need_trains(tmp_path) -> None:
    """Found by a randomized review: budgets the optimizer accepted (its need met exactly, NVMe
    the rest) failed mid-run, here in state_dict(), with every tier full: the need counted one
    block's room to trade blocks between full tiers, but the device holds whole blocks and can
    leave up to one block's bytes of its budget unused. At the need it names now, it trains."""
    import re

    def make() -> nn.Sequential:
        torch.manual_seed(13)
        emb, head = nn.Embedding(51, 91), nn.Linear(91, 51, bias=False)
        head.weight = emb.weight
        return nn.Sequential(emb, nn.Linear(91, 87, bias=False), nn.GELU(), nn.Linear(87, 91), head)

    kw = dict(device="cpu", device_budget=67149, host_budget=226100, chunk_size=16384, prefetch=3)
    nvme = 103271
    for attempt in range(3):
        wrapped = hetero.wrap(make(), **kw, nvme_path=str(tmp_path / str(attempt)), nvme_budget=nvme)
        try:
            opt = hetero.optim.AdamW(wrapped.parameters(), lr=0.03, weight_decay=0.01)
            break
        except hetero.HeteroOOMError as exc:  # the need and what the tiers hold, as it says them
            need, held = map(int, re.findall(r"need (\d+) bytes.*hold (\d+) bytes", str(exc))[0])
            nvme += need - held
            wrapped.close()
    else:
        pytest.fail("the optimizer refused the budgets it named")
    eager = make()
    eopt = torch.optim.AdamW(eager.parameters(), lr=0.03, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, y = torch.randint(0, 51, (2, 4), generator=g), torch.randint(0, 51, (2, 4), generator=g)
        for model, o in ((eager, eopt), (wrapped, opt)):
            nn.functional.cross_entropy(model(x).reshape(-1, 51), y.reshape(-1)).backward()
            o.step()
            o.zero_grad()
    for k, v in eager.state_dict().items():
        torch.testing.assert_close(wrapped.state_dict()[k], v, rtol=0, atol=0)
    wrapped.close()



def test_compaction_tries_every_run_until_one_opens(monkeypatch) -> None:
    """Found by a randomized review (no NVMe, the default policy; HeteroOOMError in a fourth
    forward): a block needing a whole host slot found the host's free bytes split over shared
    slots, and compaction tried only the first cheapest run, a slot one block fills that had
    nowhere to go, and gave up; the shared slot after it could move into the other's free
    units. Here: slot 0 holds ``a``, slot 1 shares seven small blocks, slot 2 one."""
    from hetero import tiers
    from hetero.policies import LRU
    from hetero.runtime import Runtime
    from hetero.simulator import SimBlock, SimStorage

    slot, kib = 64 * 1024, 1024

    def host_with_split_room() -> tuple[Runtime, SimBlock]:
        caps = {"device": 4 * kib, "host": 3 * slot}  # (no block can move up into the device)
        rt = Runtime(caps, slot, LRU(), SimStorage(caps, slot), prefetch=0)
        rt.create(SimBlock("a.param", "param", slot), tier="host")
        small = [SimBlock(f"s{i}.param", "param", 8 * kib) for i in range(9)]
        for b in small:
            rt.create(b, tier="host")
        rt.discard(small[0])  # (free units in slot 1, whose other blocks stay)
        return rt, SimBlock("b.param", "param", slot)

    rt, b = host_with_split_room()
    rt.create(b, tier="host")
    assert rt.top(b) == "host" and rt.tiers["host"].used <= 3 * slot
    first_only = tiers.SlotPool.window_at
    monkeypatch.setattr(tiers.SlotPool, "window_at",
                        lambda self, n, ev, skip=(): None if skip else first_only(self, n, ev))
    rt, b = host_with_split_room()
    with pytest.raises(hetero.HeteroOOMError, match="contiguous"):  # (trying only the first run)
        rt.create(b, tier="host")
