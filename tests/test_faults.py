"""Swap I/O failures in the middle of training: HeteroIOError from the step that hit them, no
parameter or optimizer state changed by that step, and training goes on (matching eager) once the
fault is gone."""

from __future__ import annotations

import copy

import pytest
import torch

import hetero
from hetero import copies, engine
from helpers import (assert_same_model, assert_same_state, assert_within_budgets, budgets, default_step,
                     failed_step, loss_of, seeded_gpt, snapshot)
from models import GPT, batches, state_bytes




def swap_requests_per_step(tmp_path) -> int:
    """How many swap transfers one training step of the faulty configuration makes."""
    model, opt, data = setup(tmp_path / "count")
    for b in data[:2]:
        default_step(model, opt, b)
    model._hetero_state.runtime.drain()
    snapshot(model, opt)  # as the test does: its reads move blocks too
    counter = {"n": 0}
    real = engine._take_fault

    def counting() -> str:
        counter["n"] += 1
        return real()

    engine._take_fault = counting
    try:
        default_step(model, opt, data[2])
        model._hetero_state.runtime.catch_up()  # the updates step() postponed
        model._hetero_state.runtime.drain()
    finally:
        engine._take_fault = real
    model.close()
    return counter["n"]


def setup(path) -> tuple[hetero.HeteroModule, torch.optim.Optimizer, list]:
    total = state_bytes(seeded_gpt())
    model = hetero.wrap(seeded_gpt(), **budgets(total, 0.2, 0.3, path), chunk_size="8KiB")
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt, batches(6, seed=3)


@pytest.mark.parametrize("kind,host_copies", [("eio", "inline"), ("enospc", "inline"), ("short", "inline"),
                                              ("eio", "async")])
def test_fault_anywhere_in_a_step_changes_nothing_and_training_goes_on(kind, host_copies, tmp_path,
                                                                       monkeypatch) -> None:
    """``async``: every host copy runs on the copy engine's workers (the tests' blocks are small
    enough to be copied inline otherwise), so a fault finds host <-> device copies in flight, as
    on a GPU."""
    if host_copies == "async":
        monkeypatch.setattr(copies, "INLINE_BYTES", 0)
    n = swap_requests_per_step(tmp_path)
    assert n > 20, "the configuration must swap during a step"
    # Faults at spread-out positions: forward, backward and optimizer step transfers alike (every
    # kind is an error the same way, so the other kinds get fewer positions).
    fractions = (0, 0.2, 0.4, 0.6, 0.8, 1) if kind == "eio" else (0.1, 0.5, 0.9)
    postponed = 0
    for k, after in enumerate(sorted({min(n - 2, int(f * n)) for f in fractions})):
        model, opt, data = setup(tmp_path / f"{kind}{k}")
        copier = model._hetero_state.runtime.storage.copier
        assert copier.inline_bytes == (0 if host_copies == "async" else copies.INLINE_BYTES)
        ref = seeded_gpt()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        for b in data[:2]:
            default_step(model, opt, b)
            default_step(ref, ref_opt, b)
        if failed_step(model, opt, data[2], kind, after):
            postponed += 1  # the fault hit an update step() postponed: the step is made
            default_step(ref, ref_opt, data[2])
            rest = data[3:]
        else:
            rest = data[2:]  # cleared: the failed step is redone
        # Training matches eager to the end.
        for b in rest:
            assert default_step(model, opt, b) == pytest.approx(default_step(ref, ref_opt, b), rel=1e-5)
        assert_same_model(ref, model)
        assert_within_budgets(model)
        model.close()
    assert postponed, "no fault hit an update postponed by step()"


def test_fault_in_the_optimizer_step_on_nvme_resident_state_rolls_back(tmp_path, monkeypatch) -> None:
    """Optimizer states on NVMe only (the device holds one unit, the host one chunk's step): a
    read failing in the middle of the synchronous step() leaves every parameter and state as
    before."""
    monkeypatch.setenv("HETERO_DEFER_STEP", "0")
    total = state_bytes(seeded_gpt())
    model = hetero.wrap(seeded_gpt(), device="cpu", device_budget=int(total * 0.15),
                        host_budget=int(total * 0.2), nvme_path=str(tmp_path), chunk_size="8KiB")
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches(4, seed=5)
    for b in data[:2]:
        default_step(model, opt, b)
    rt = model._hetero_state.runtime
    on_nvme = [b for b in rt.blocks() if b.kind == "exp_avg" and rt.top(b) == "nvme"]
    assert on_nvme, "the configuration must keep optimizer states on NVMe"
    x, y = data[2]
    model(x, y).backward()
    rt.drain()
    before = snapshot(model, opt)
    for after in (3, 10, 25):
        engine.inject_fault("eio", after=after)
        try:
            with pytest.raises(hetero.HeteroIOError):
                opt.step()
                rt.drain()
        finally:
            engine.inject_fault("none")
        assert_same_state(snapshot(model, opt), before)
    opt.step()  # gradients are still there: the step now goes through
    after_step = snapshot(model, opt)
    assert any(not torch.equal(after_step[0][k], before[0][k]) for k in before[0])
    assert_within_budgets(model)
    model.close()


@pytest.mark.parametrize("kind", ["eio", "short", "enospc"])
def test_a_postponed_update_that_fails_rolls_forward(tmp_path, kind) -> None:
    """Optimizer states on NVMe: step() postpones the updates that read them to the next
    forward. A swap fault there raises HeteroIOError from that forward and leaves the update's
    chunk as it was and still postponed; the forward runs again once the fault is gone, and the
    step that returned is then applied once, neither lost nor applied twice: parameters and
    optimizer states equal eager PyTorch's after that step, and training goes on to match."""
    total = state_bytes(seeded_gpt())
    model = hetero.wrap(seeded_gpt(), device="cpu", device_budget=int(total * 0.15),
                        host_budget=int(total * 0.2), nvme_path=str(tmp_path), chunk_size="8KiB")
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)
    ref = seeded_gpt()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    rt = model._hetero_state.runtime
    data = batches(6, seed=5)
    for b in data[:3]:
        default_step(model, opt, b)
        default_step(ref, ref_opt, b)
    waiting = len(rt._postponed)
    assert waiting > 5, "the configuration must postpone updates"
    x, y = data[3]
    raised = failed = 0
    for after in (0, 0, 1, 2, 4, 8, 12):
        if not rt._postponed:
            break
        n = len(rt.tracker.events)
        engine.inject_fault(kind, after=after)
        try:
            model(x, y)
        except hetero.HeteroIOError:
            raised += 1
        finally:
            engine.inject_fault("none")
        # An update that failed is postponed again, in front (a write fault may instead hit a
        # write-back, which fails the forward without failing an update).
        failed += any(e[0] == "postpone" and e[2] for e in rt.tracker.events[n:])
        assert len(rt._postponed) <= waiting
        waiting = len(rt._postponed)
    assert raised and (failed or kind == "enospc"), (raised, failed)
    # Unchanged by the failed forwards: the step of data[2], applied once (rolled forward here).
    assert_same_model(ref, model)
    expected = ref_opt.state_dict()["state"]
    for i, st in opt.state_dict()["state"].items():
        assert st["step"] == expected[i]["step"]
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(st[k], expected[i][k], rtol=1e-5, atol=1e-7)
    for b in data[3:]:
        assert default_step(model, opt, b) == pytest.approx(default_step(ref, ref_opt, b), rel=1e-5)
    assert_same_model(ref, model)
    assert_within_budgets(model)
    model.close()


def test_chunks_updated_in_place_give_up_no_guarantee(tmp_path, caplog) -> None:
    """With optimizer states that stay on the device (room for them there, a small host tier and
    NVMe), steady-state steps update those chunks in place, which moves nothing: they run after
    the step's transaction has committed and need no older copies, so no step reports that it
    could no longer be undone. (They ran inside the transaction before, and each write of a
    block with a single copy was reported as a lost guarantee: hundreds of false warnings a run.)"""
    total = state_bytes(seeded_gpt())
    model = hetero.wrap(seeded_gpt(), **budgets(total, 0.8, 0.3, tmp_path), chunk_size="8KiB", policy="lru")
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)
    rt = model._hetero_state.runtime
    data = batches(5, seed=2)
    for b in data[:2]:
        default_step(model, opt, b)
    on_device = [b for b in rt.blocks() if b.kind == "exp_avg" and "device" in b.tiers]
    assert on_device, "the configuration must keep optimizer states on the device"
    caplog.clear()
    with caplog.at_level("WARNING", logger="hetero"):
        for b in data[2:]:
            default_step(model, opt, b)
        rt.drain()
    assert "can no longer be undone" not in caplog.text
    assert_within_budgets(model)
    model.close()


def test_a_transfer_failing_while_every_chunk_is_in_place_changes_nothing(tmp_path, monkeypatch) -> None:
    """Every chunk of the step is in place (nothing to move), but an earlier transfer, here a
    write-back to NVMe of a block outside the optimizer, is still in flight and fails. The
    step must wait for it before committing: it raises HeteroIOError with nothing changed.
    (It used to commit at once and update chunks until the failure surfaced among them.)"""
    import time

    from hetero.optim import adam

    total = state_bytes(seeded_gpt())
    model = hetero.wrap(seeded_gpt(), **budgets(total, 1.5, 0.5, tmp_path), chunk_size="8KiB")
    rt = model._hetero_state.runtime
    last = model._hetero_state.chunks[-1]
    outside = {id(s.param) for s in last.slots}
    opt = hetero.optim.AdamW([p for p in model.parameters() if id(p) not in outside], lr=1e-2)
    data = batches(5, seed=3)
    for b in data[:3]:
        default_step(model, opt, b)
    x, y = data[3]
    model(x, y).backward()
    rt.drain()
    work = [c for c in opt._chunks() if opt._runs(c, opt._group_index())]
    assert all(opt._in_place(c) for c in work), "the configuration must leave every chunk in place"
    before = snapshot(model, opt)
    block = last.blocks["param"]
    rt._evict(block, "device")
    rt.drain()
    # Each update takes a while, and the disk reports the write-back done only 30 ms after it
    # was submitted: without the wait, the failure surfaces after some chunks were updated.
    real_step = adam.adam_step_

    def slow_step(*a, **k):
        time.sleep(0.005)
        return real_step(*a, **k)

    real_done = engine.Handle.done
    submitted: dict[int, float] = {}

    def slow_done(self) -> bool:
        t = submitted.setdefault(id(self), time.monotonic())
        return real_done(self) and time.monotonic() - t > 0.03

    monkeypatch.setattr(adam, "adam_step_", slow_step)
    monkeypatch.setattr(engine.Handle, "done", slow_done)
    engine.inject_fault("eio", after=0)
    try:
        rt._evict(block, "host")  # written to NVMe, in flight, failing
        with pytest.raises(hetero.HeteroIOError):
            opt.step()
    finally:
        engine.inject_fault("none")
    assert_same_state(snapshot(model, opt), before)
    opt.step()  # the fault is gone: the step goes through
    assert any(not torch.equal(a, b) for a, b in zip(snapshot(model, opt)[0].values(), before[0].values()))
    model.close()


def test_a_failed_read_of_a_settling_state_loses_nothing(tmp_path, monkeypatch) -> None:
    """States settling on the device after a step may be read from NVMe, speculatively, after
    step() returned or after a postponed update. A read that fails surfaces from a later
    runtime call, like a failed prefetch: the step that asked is complete, nothing is lost, the
    call it surfaces from changes nothing, and training goes on to match eager PyTorch. (The
    synchronous step: postponed updates leave host memory no room to stage a settling state
    from NVMe in this configuration.) (A policy that settles every state it is offered: the built-in ones home the
    states on the device in the first step where they fit, leaving little to settle here.)"""
    from hetero import runtime as R
    from helpers import assert_same_model, settling

    monkeypatch.setenv("HETERO_DEFER_STEP", "0")
    model = hetero.wrap(seeded_gpt(), **settling(seeded_gpt, 0.5, tmp_path))
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)
    eager = seeded_gpt()
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    rt = model._hetero_state.runtime
    real_settle = R.Runtime.settle
    reads = {"n": 0}

    def failing_settle(self, blocks):
        before = self.tracker.traffic["nvme->host"]
        engine.inject_fault("eio", after=0)  # the settle's first swap read fails
        try:
            real_settle(self, blocks)
        finally:
            engine.inject_fault("none")
        reads["n"] += self.tracker.traffic["nvme->host"] > before

    data = batches(6, seed=1)
    failed = 0
    for i, (x, y) in enumerate(data):
        default_step(eager, eager_opt, (x, y))
        # The first settle (after the first step): host memory has room to stage reads from NVMe.
        monkeypatch.setattr(R.Runtime, "settle", failing_settle if i == 0 else real_settle)
        stepped = False
        try:
            model(x, y).backward()
            opt.step()  # returns: the step is complete
            stepped = True
            opt.zero_grad()
            rt.drain()
        except hetero.HeteroIOError:  # from a later call, which changed nothing
            failed += 1
            opt.zero_grad()
            if not stepped:
                default_step(model, opt, (x, y))
    assert reads["n"], "the configuration must settle states from NVMe"
    assert failed, "no failed settle read surfaced"
    assert_same_model(eager, model)
    model.close()


@pytest.mark.parametrize("after", [0, 2, 5, 9, 14])
def test_a_fault_while_clipping_leaves_the_gradients_as_they_were(tmp_path, after) -> None:
    """Clipping reads every gradient (the norms) and writes none: the scale is applied where
    each gradient is next read. So a swap fault in the middle raises with no gradient scaled,
    and clipping again then gives the norm and the training of a fault-free run. (Clipping
    that scaled the gradients in place, chunk by chunk, failed in its second pass with some
    of them scaled.)"""
    eager = seeded_gpt()
    total = state_bytes(eager)
    wrapped = hetero.wrap(copy.deepcopy(eager), device="cpu", chunk_size="8KiB", device_budget=int(total * 0.2),
                          host_budget=int(total * 0.3), nvme_path=str(tmp_path), nvme_budget=4 * total)
    eopt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    hopt = hetero.optim.AdamW(wrapped.parameters(), lr=1e-2)
    for i, (x, y) in enumerate(batches(3, seed=4)):
        loss_of(eager(x, y)).backward()
        want = torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.05)
        eopt.step()
        eopt.zero_grad()
        loss_of(wrapped(x, y)).backward()
        wrapped._hetero_state.runtime.drain()
        if i == 1:
            engine.inject_fault("eio", after=after)
            got = None
            try:
                try:
                    got = wrapped.clip_grad_norm_(0.05)
                except hetero.HeteroIOError:
                    pass
                try:  # a write-back its reads made room with may hit the fault (undone: no harm)
                    wrapped._hetero_state.runtime.drain()
                except hetero.HeteroIOError:
                    pass
            finally:
                engine.inject_fault("none")
            if got is None:
                got = wrapped.clip_grad_norm_(0.05)  # again, with the fault gone
        else:
            got = wrapped.clip_grad_norm_(0.05)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        hopt.step()
        hopt.zero_grad()
    assert_same_model(eager, wrapped)
    wrapped.close()


@pytest.mark.parametrize("after", [0, 6, 20, 45])
@pytest.mark.parametrize("call", ["model.load_state_dict", "optimizer.load_state_dict", "summon writeback"])
def test_a_fault_in_a_load_leaves_every_state_as_it_was(tmp_path, call, after) -> None:
    """Loading state dicts and writing back summoned parameters write many blocks: a swap fault
    among them rolls back those already written (every parameter, optimizer state and step count
    as the call found them), and the same call then runs again, as the README promises for any
    call. Parameters partly on NVMe, so that the writes read and write swap."""
    torch.manual_seed(5)
    source = GPT()
    sopt = torch.optim.AdamW(source.parameters(), lr=1e-2, weight_decay=0.1)
    for b in batches(1, seed=9):
        default_step(source, sopt, b)
    msd, osd = source.state_dict(), sopt.state_dict()
    torch.manual_seed(0)
    model = GPT()
    total = state_bytes(model)
    wrapped = hetero.wrap(model, device="cpu", chunk_size="8KiB", device_budget=int(total * 0.125),
                          host_budget=int(total * 0.15), nvme_path=str(tmp_path), nvme_budget=4 * total)
    opt = hetero.optim.AdamW(wrapped.parameters(), lr=1e-2, weight_decay=0.1)
    for b in batches(3):
        default_step(wrapped, opt, b)

    def run() -> None:
        if call == "model.load_state_dict":
            wrapped.load_state_dict(msd)
        elif call == "optimizer.load_state_dict":
            opt.load_state_dict(osd)
        else:
            with wrapped.summon_full_params():
                for p in wrapped.parameters():
                    p.data.mul_(0.5)

    before = snapshot(wrapped, opt)
    groups = [dict(g, params=None) for g in opt.param_groups]
    engine.inject_fault("eio", after=after)
    try:
        run()
        failed = False
    except hetero.HeteroIOError:
        failed = True
    finally:
        engine.inject_fault("none")
    if failed:
        assert_same_state(snapshot(wrapped, opt), before)
        assert [dict(g, params=None) for g in opt.param_groups] == groups
        run()
    want_sd, want_state = before
    if call == "model.load_state_dict":
        want_sd = msd
    elif call == "summon writeback":
        want_sd = {k: v * 0.5 for k, v in want_sd.items()}
    else:
        want_state = {i: {k: v for k, v in s.items()} for i, s in osd["state"].items()}
    assert_same_state(snapshot(wrapped, opt), (want_sd, want_state))
    wrapped.close()


@pytest.mark.parametrize("after", [3, 8, 15])
def test_a_failed_optimizer_load_near_capacity_keeps_each_parameter_consistent(tmp_path, after) -> None:
    """Near capacity the load cannot keep every previous version (given up, logged): a fault
    then leaves the chunks that lost one with the loaded moments. Their step counts must be the
    loaded ones too (a parameter never pairs new moments with its old step), and the same load
    then completes."""
    from test_budgets import near_capacity_config

    make, kw = near_capacity_config(4, True, tmp_path / "swap")
    model = hetero.wrap(make(), **kw)
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-3)
    for b in batches(2, seed=4):
        default_step(model, opt, b)
    new = copy.deepcopy(opt.state_dict())
    for st in new["state"].values():
        st["exp_avg"].add_(1.0)
        st["step"] = st["step"] + 5
    _, old = snapshot(model, opt)
    engine.inject_fault("eio", after=after)
    try:
        with pytest.raises(hetero.HeteroIOError):
            opt.load_state_dict(new)
    finally:
        engine.inject_fault("none")
    _, now = snapshot(model, opt)
    for i, st in now.items():
        loaded = torch.equal(st["exp_avg"], new["state"][i]["exp_avg"])
        assert loaded or torch.equal(st["exp_avg"], old[i]["exp_avg"]), i
        assert float(st["step"]) == float((new if loaded else {"state": old})["state"][i]["step"]), i
    opt.load_state_dict(new)
    _, now = snapshot(model, opt)
    for i, st in now.items():
        assert torch.equal(st["exp_avg"], new["state"][i]["exp_avg"]) and float(st["step"]) == float(new["state"][i]["step"])
    model.close()


def test_a_failed_write_at_the_end_of_wrap_fails_wrap(tmp_path):
    """The last writes of the state wrap places were not waited for: a fault there was raised
    by the first state_dict() after wrap returned."""
    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(12)])

    total = 16 * sum(p.numel() for p in make().parameters())
    kw = dict(device="cpu", device_budget=total // 12, host_budget=65536, nvme_path=str(tmp_path),
              chunk_size="16KiB")
    hetero.wrap(make(), **kw).close()  # (the swap tuning, once)
    for after in range(12):
        engine.inject_fault("eio", after=after)
        try:
            model = hetero.wrap(make(), **kw)
        except hetero.HeteroIOError:
            continue
        finally:
            engine.inject_fault("none")
        model.state_dict()  # (raised the fault of wrap's own last write)
        model.close()
