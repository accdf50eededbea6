"""The deferred optimizer step (hetero.optim.adam, Runtime.defer): step() queues the host chunks'
updates and returns; whatever touches those blocks next waits for them. A slow host kernel widens
every race window: a deferred run must still equal the synchronous run bit for bit, whatever the
caller does between steps."""

from __future__ import annotations

import copy
import time
from typing import Callable

import pytest
import torch

import hetero
from hetero.optim import adam as adam_mod
from hetero.optim.kernel import has_kernel
from helpers import assert_same_model, default_step
from models import GPT, batches, state_bytes

SLOW = 0.01  # seconds added to every kernel call where a test measures time
SLOW_FUZZ = 0.003  # where it only widens race windows
NEEDS_QUEUE = pytest.mark.skipif(not has_kernel(), reason="updates are deferred on the C++ queue only")


def slow_kernel(monkeypatch, opt, delay: float, fail: bool = False) -> Callable[[], int]:
    """Make every kernel call of ``opt`` ``delay`` seconds slower, on both of its paths: the
    calls it makes itself and those its queue runs for deferred updates (with ``fail`` the
    first of those raises); returns a function counting the calls since."""
    real, calls = adam_mod.adam_step_, [0]

    def slow(*args, **kwargs):
        calls[0] += 1
        time.sleep(delay)
        real(*args, **kwargs)

    monkeypatch.setattr(adam_mod, "adam_step_", slow)
    if not has_kernel():  # every deferred update runs at once, through the function above
        return lambda: calls[0]
    queued = opt._queue.calls
    opt._queue._set_test_hook(delay, 1 if fail else 0)
    return lambda: calls[0] + opt._queue.calls - queued


def quarter_pair():
    """The test GPT wrapped at a 25% device budget and its eager twin, each with AdamW."""
    torch.manual_seed(0)
    net = GPT()
    eager = copy.deepcopy(net)
    model = hetero.wrap(net, device="cpu", device_budget=state_bytes(net) // 4, chunk_size="8KiB")
    return (model, hetero.optim.AdamW(model.parameters(), lr=1e-2), eager,
            torch.optim.AdamW(eager.parameters(), lr=1e-2))


def second_step(monkeypatch, defer: str, fail: bool = False, step: bool = True):
    """One step of the test GPT at a 25% device budget, then the backward of a second one with a
    slow kernel; returns the model, its optimizer, the eager twin (model, optimizer, batches),
    how long the second ``step()`` took and the kernel-call counter (without ``step``: returns
    before that ``step()``)."""
    monkeypatch.setenv("HETERO_DEFER_STEP", defer)
    model, opt, eager, eager_opt = quarter_pair()
    data = batches(4, seed=1)
    default_step(model, opt, data[0])
    default_step(eager, eager_opt, data[0])
    model._hetero_state.runtime.drain()  # (the first step's deferred work runs the real kernel)
    calls = slow_kernel(monkeypatch, opt, SLOW, fail)
    x, y = data[1]
    model(x, y).backward()
    if not step:
        return model, opt, (eager, eager_opt, data), None, calls
    t0 = time.perf_counter()
    opt.step()
    return model, opt, (eager, eager_opt, data), time.perf_counter() - t0, calls


@NEEDS_QUEUE
def test_deferred_step_returns_at_once_and_the_next_forward_waits_for_it(monkeypatch) -> None:
    model, opt, (eager, eager_opt, data), took, calls = second_step(monkeypatch, "1")
    rt = model._hetero_state.runtime
    assert any(op.compute for op in rt._ops), "nothing was deferred"
    rt.drain()
    n = calls()
    assert n > 5 and took < 0.5 * n * SLOW, f"step() took {took:.3f} s for {n} slow kernel calls"
    opt.zero_grad()
    default_step(eager, eager_opt, data[1])
    # Each next forward reads parameters the previous step's deferred work writes: it must wait.
    for b in data[2:]:
        assert default_step(model, opt, b) == default_step(eager, eager_opt, b)
    rt.drain()
    sd = model.state_dict()
    for k, v in eager.state_dict().items():
        assert torch.equal(sd[k], v), k
    model.close()



@NEEDS_QUEUE
def test_each_parameter_fetch_waits_only_for_its_own_chunks_update(monkeypatch) -> None:
    # zero_grad drops the gradients' device copies while their chunks' deferred updates still
    # read the host copies: that device memory must not be held until then, or every transfer
    # onto the device (the next forward's first fetch) waits for the whole queue.
    model, opt, (_, _, data), _, _ = second_step(monkeypatch, "1")
    rt = model._hetero_state.runtime
    queued = len({id(op.handle) for op in rt._ops if op.compute and not op.handle.done()})
    opt.zero_grad()
    before = len(rt.tracker.stalls)
    model(*data[2])
    longest = max((end - start for start, end, _ in rt.tracker.stalls[before:]), default=0.0)
    assert queued > 5 and longest < 0.25 * queued * SLOW, (
        f"a fetch waited {longest:.3f} s; {queued} chunk updates of {SLOW} s or more were queued")
    # The report tells those waits apart from waits for transfers: the forward right after the
    # slowed updates waited for some of them (each at least as long as one update's delay)
    report = model.placement_report().as_dict()
    assert SLOW <= report["stall_seconds_optimizer"] <= report["stall_seconds"], report["stall_seconds"]
    assert "optimizer" in str(model.placement_report())
    # ... per step too: those waits fall in the third step, whose forward it was
    per_step = report["step_stall_seconds"]
    assert len(per_step) == 3 and per_step[2] >= SLOW, per_step
    assert sum(per_step) == pytest.approx(report["stall_seconds"])
    rt.drain()
    model.close()

def test_synchronous_step_when_not_deferred(monkeypatch) -> None:
    model, _, _, took, calls = second_step(monkeypatch, "0")
    n = calls()
    assert n > 5 and took >= n * SLOW
    assert not any(op.compute for op in model._hetero_state.runtime._ops)
    assert model.placement_report().as_dict()["stall_seconds_optimizer"] == 0.0
    model.close()


@NEEDS_QUEUE
def test_deferred_step_failure_is_reported_once(monkeypatch) -> None:
    model, opt, _, _, _ = second_step(monkeypatch, "1", fail=True, step=False)
    rt = model._hetero_state.runtime
    with pytest.raises(RuntimeError, match="injected kernel failure"):  # from step() or a later call
        opt.step()
        rt.drain()
    rt.drain()  # the other ops of the failed work finish without raising it again
    assert not rt._ops
    model.close()


# ---- deferred == synchronous, whatever happens between steps


POSTPONED = {"0": 0, "1": 0}  # updates train() found postponed after its steps, by HETERO_DEFER_STEP


def train(monkeypatch, defer: str, between, mp=None, device=0.25, host=None, prefetch=2, steps=4,
          nvme=None, routed=False):
    """Losses, what ``between(model, opt, "pre"|"post", i)`` returned around each step(), and the
    final model and optimizer state dicts of a short training run with a slow kernel (with swap
    files in the directory ``nvme``: postponed updates where deferred)."""
    monkeypatch.setenv("HETERO_DEFER_STEP", defer)
    torch.manual_seed(0)
    net = GPT(routed=routed)
    kw = dict(device="cpu", device_budget=int(state_bytes(net) * device), chunk_size="8KiB", prefetch=prefetch)
    if host is not None:
        kw["host_budget"] = int(state_bytes(net) * host)
    if nvme is not None:
        kw["nvme_path"] = str(nvme / defer)
    if mp is not None:
        kw["mixed_precision"] = hetero.MixedPrecision(param_dtype=mp, reduce_dtype=mp)
    model = hetero.wrap(net, **kw)
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    slow_kernel(monkeypatch, opt, SLOW_FUZZ)
    losses, extra = [], []
    for i, (x, y) in enumerate(batches(steps, seed=1)):
        loss = model(x, y)
        loss.backward()
        extra.append(between(model, opt, "pre", i))
        opt.step()
        POSTPONED[defer] += len(model._hetero_state.runtime._postponed)
        extra.append(between(model, opt, "post", i))
        losses.append(loss.item())
    model._hetero_state.runtime.drain()
    result = losses, extra, model.state_dict(), opt.state_dict()
    model.close()
    return result


def assert_same_run(a, b) -> None:
    (la, ea, sda, osda), (lb, eb, sdb, osdb) = a, b
    assert la == lb
    for x, y in zip(ea, eb):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)
        elif isinstance(x, dict):
            for k in x:
                assert torch.equal(x[k], y[k]), k
    for k in sda:
        assert torch.equal(sda[k], sdb[k]), k
    for i in osda["state"]:
        for k in osda["state"][i]:
            assert torch.equal(osda["state"][i][k], osdb["state"][i][k]), (i, k)


def clip_then_zero_in_place(model, opt, when, i):
    if when == "pre":
        return model.clip_grad_norm_(0.05)
    opt.zero_grad(set_to_none=False)


def model_state_dict(model, opt, when, i):
    if when == "post":
        out = model.state_dict()
        opt.zero_grad()
        return out


def optimizer_state_dict(model, opt, when, i):
    if when == "post":
        st = opt.state_dict()["state"]
        opt.zero_grad()
        return {f"{k}.{n}": v for k, d in st.items() for n, v in d.items() if n != "step"}


def summon_and_write_back(model, opt, when, i):
    if when == "post":
        with model.summon_full_params(writeback=True):
            for p in model.module.parameters():
                p.data.mul_(0.999)
        opt.zero_grad()


def halve_lr(model, opt, when, i):
    if when == "post":
        for g in opt.param_groups:
            g["lr"] = g["lr"] * 0.5
        opt.zero_grad()


def tensor_lr_scheduler(model, opt, when, i):
    """A tensor lr (torch optimizers accept one; loading a torch state dict can bring one in)
    that an LR scheduler updates in place right after step(), as torch's schedulers do: the
    deferred work must use the lr of its step."""
    if i == 0 and when == "pre":
        for g in opt.param_groups:
            g["lr"] = torch.tensor(g["lr"])
        opt._test_scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    if when == "post":
        opt._test_scheduler.step()
        opt.zero_grad()


def no_zero_grad(model, opt, when, i):
    """Gradients accumulate across steps (an update postponed past the next backward must read
    its own step's gradient, and leave it for the next)."""


def eval_forward_then_zero(model, opt, when, i):
    """A forward without autograd between the steps reads the parameters of every chunk."""
    if when == "post":
        with torch.no_grad():
            out = model(*batches(1, seed=9)[0])
        opt.zero_grad()
        return out


BETWEEN = [clip_then_zero_in_place, model_state_dict, optimizer_state_dict, summon_and_write_back,
           halve_lr, tensor_lr_scheduler, no_zero_grad, eval_forward_then_zero]


@pytest.mark.parametrize("between", BETWEEN, ids=lambda f: f.__name__)
@pytest.mark.parametrize("mp", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("nvme", [False, True], ids=["host", "nvme"])
def test_deferred_equals_synchronous(monkeypatch, tmp_path, between, mp, nvme) -> None:
    """With NVMe (host 30%: optimizer states in swap files) the deferred step postpones the
    updates of chunks whose state must move to the next forward, against the synchronous
    all-or-nothing step."""
    kw = dict(mp=mp, host=0.3, nvme=tmp_path) if nvme else dict(mp=mp)
    POSTPONED.update({"0": 0, "1": 0})
    sync, deferred = train(monkeypatch, "0", between, **kw), train(monkeypatch, "1", between, **kw)
    assert POSTPONED["0"] == 0 and (POSTPONED["1"] > 10 if nvme else POSTPONED["1"] == 0), POSTPONED
    assert_same_run(sync, deferred)


@pytest.mark.parametrize("between", [halve_lr, no_zero_grad, eval_forward_then_zero], ids=lambda f: f.__name__)
def test_postponed_updates_of_a_routed_model_equal_synchronous(monkeypatch, tmp_path, between) -> None:
    """An expert the next batch is not routed to: its postponed update runs when its gradient is
    next written or at the next step(), not in the forward."""
    kw = dict(host=0.3, nvme=tmp_path, routed=True, steps=6)
    POSTPONED.update({"0": 0, "1": 0})
    sync, deferred = train(monkeypatch, "0", between, **kw), train(monkeypatch, "1", between, **kw)
    assert POSTPONED["1"] > 10, POSTPONED
    assert_same_run(sync, deferred)


def state_dicts_around_a_clipped_mixed_precision_step(model, opt, when, i):
    """Found by fuzzing: a state dict read right after a deferred mixed-precision step, while a
    prefetch of a parameter block was still queued behind the step's work, re-attached the
    parameters to a device buffer not allocated yet."""
    if when == "pre" and i == 2:
        model.clip_grad_norm_(0.1)
    if when == "post":
        if i == 0:
            opt.zero_grad()
            opt.state_dict()
        if i == 2:
            model.state_dict()
            opt.zero_grad(set_to_none=False)
            with model.summon_full_params(writeback=True):
                for p in model.module.parameters():
                    p.data.mul_(0.999)
        opt.zero_grad()


def test_state_dict_after_a_deferred_mixed_precision_step(monkeypatch) -> None:
    # (host 2.0: with 8 KiB slots the blocks take 1.8x the state's bytes; 1.6 fit only by luck)
    kw = dict(mp=torch.bfloat16, device=0.15, host=2.0, prefetch=4, steps=3)
    between = state_dicts_around_a_clipped_mixed_precision_step
    assert_same_run(train(monkeypatch, "0", between, **kw), train(monkeypatch, "1", between, **kw))


def test_parameters_of_a_postponed_update_read_as_nan_until_it_runs(tmp_path) -> None:
    """Between step() and the next forward, a chunk whose update is postponed must not show its
    parameters' old values (found in review: a device copy stayed attached, so code reading
    parameters after step(), an EMA say, got the pre-step values): they read as NaN, as
    parameters off the device do, and summon_full_params shows the stepped values."""
    torch.manual_seed(0)
    net = GPT()
    eager = copy.deepcopy(net)
    total = state_bytes(net)
    model = hetero.wrap(net, device="cpu", device_budget=total // 4, host_budget=int(total * 0.3),
                        nvme_path=str(tmp_path), chunk_size="8KiB")
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    for b in batches(2, seed=1):
        default_step(model, opt, b)
        default_step(eager, eager_opt, b)
    rt = model._hetero_state.runtime
    waiting = [c for c in model._hetero_state.chunks if rt.postponed(c.blocks["param"].chunk_id)]
    assert waiting, "the configuration must postpone updates"
    for c in waiting:
        for s in c.slots:
            assert torch.isnan(s.param).all(), s.names[0]
    with model.summon_full_params(writeback=False):
        for (name, p), q in zip(model.module.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p, q, msg=name)
    model.close()


def test_a_postponed_update_inside_a_forward_runs_on_the_host_where_the_device_is_held(tmp_path) -> None:
    """A chunk whose states are on the device updates there, but a postponed update runs inside
    the next forward, whose enclosing units hold device memory: where the chunk's blocks do not
    fit beside what is pinned, it runs on the host instead of failing for want of room (found in
    review). (A policy that settles every state it is offered puts states on the device.)"""
    from helpers import settling

    kw = settling(GPT, 0.5, tmp_path)
    torch.manual_seed(0)
    model = hetero.wrap(GPT(), **kw)
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)
    for b in batches(4, seed=1):
        default_step(model, opt, b)
    rt = model._hetero_state.runtime
    on_device = [c for c in model._hetero_state.chunks if "exp_avg" in c.blocks
                 and "device" in c.blocks["exp_avg"].tiers]
    assert on_device, "the configuration must keep optimizer states on the device"
    chunk = on_device[0]
    assert opt._tier_for(chunk) == "device"
    held = [b for b in rt._on["device"] if b.chunk is not chunk]
    own = list(chunk.blocks.values())
    pinned = sum(b.nbytes for b in held)
    need = sum(b.nbytes for b in own)
    device, capacity = rt.tiers["device"], rt.tiers["device"].capacity
    for b in held:
        rt._pin(b, "device", 1)
    try:
        assert rt.pinned_bytes("device", besides=own) == pinned > 0
        device.capacity = pinned + need - 1  # the chunk fits the device, not beside what is held
        assert need <= device.capacity and opt._tier_for(chunk) == "host"
        device.capacity = pinned + need
        assert opt._tier_for(chunk) == "device"
    finally:
        device.capacity = capacity
        for b in held:
            rt._pin(b, "device", -1)
    assert rt.pinned_bytes("device") == 0 and opt._tier_for(chunk) == "device"
    model.close()


@pytest.mark.parametrize("defer", ["0", "1"])
def test_the_steps_wait_for_the_transfers_in_flight_counts_as_stall(monkeypatch, tmp_path, defer: str) -> None:
    """With NVMe, step() lets every transfer in flight land before it updates anything (a
    failure must surface before the first update): compute waiting for blocks, counted as stall
    (``drain(stall=True)``), whichever way the step runs."""
    monkeypatch.setenv("HETERO_DEFER_STEP", defer)
    torch.manual_seed(0)
    net = GPT()
    total = state_bytes(net)
    model = hetero.wrap(net, device="cpu", device_budget=total // 4, host_budget=int(total * 0.3),
                        nvme_path=str(tmp_path), chunk_size="8KiB")
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)
    rt = model._hetero_state.runtime
    real, drains = rt.drain, []
    monkeypatch.setattr(rt, "drain", lambda stall=False: (drains.append(stall), real(stall))[1])
    x, y = batches(1, seed=1)[0]
    model(x, y).backward()
    drains.clear()
    opt.step()
    assert drains == [True]
    model.close()


def test_a_bad_defer_setting_is_refused_before_the_step_moves_anything(monkeypatch) -> None:
    """HETERO_DEFER_STEP=bogus meant "on", silently; it is refused as the HETERO_IO_* flags are,
    at the step, before anything moves, and the step then runs once the value is sound."""
    model, opt, eager, eager_opt = quarter_pair()
    x, y = batches(1, seed=1)[0]
    for m in (model, eager):
        m(x, y).backward()
    monkeypatch.setenv("HETERO_DEFER_STEP", "bogus")
    with pytest.raises(hetero.HeteroConfigError, match="HETERO_DEFER_STEP='bogus'"):
        opt.step()
    assert opt.state_dict()["state"] == {}
    monkeypatch.setenv("HETERO_DEFER_STEP", "off")
    opt.step()
    eager_opt.step()
    assert_same_model(eager, model)
    model.close()


@NEEDS_QUEUE
def test_close_and_a_newer_optimizer_stop_the_update_thread() -> None:
    """An optimizer kept referenced after close() (a sweep's results), or after a newer one took
    its parameters over, kept its deferred-update thread: one more thread per run."""
    model, opt, _, _ = quarter_pair()
    for x, y in batches(2, seed=1):
        default_step(model, opt, (x, y))
    assert opt._queue._queue is not None  # (host updates were deferred: the thread runs)
    newer = hetero.optim.AdamW(model.parameters(), lr=1e-2)
    assert opt._queue._queue is None
    for x, y in batches(2, seed=2):
        default_step(model, newer, (x, y))
    assert newer._queue._queue is not None
    model.close()
    assert newer._queue._queue is None
