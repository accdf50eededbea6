"""FSDP-style features through hetero equal eager PyTorch: accumulation, no_sync, clipping,
state dicts (model and optimizer, interchangeable with torch's), summon_full_params."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

import hetero
from helpers import assert_same_model, assert_within_budgets, loss_of, seeded_gpt, train_pair
from models import GPT, batches, state_bytes





@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_accumulation_no_sync_and_clipping(tight: dict, norm_type: float) -> None:
    data = batches(6, seed=2)

    eager = seeded_gpt()
    wrapped = hetero.wrap(copy.deepcopy(eager), **tight)
    eopt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    hopt = hetero.optim.AdamW(wrapped.parameters(), lr=1e-2)
    for start in (0, 3):
        micro = data[start:start + 3]
        for i, (x, y) in enumerate(micro):
            (loss_of(eager(x, y)) / 3).backward()
            ctx = wrapped.no_sync() if i < 2 else torch.enable_grad()
            with ctx:
                (loss_of(wrapped(x, y)) / 3).backward()
        en = torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.5, norm_type)
        hn = wrapped.clip_grad_norm_(0.5, norm_type)
        torch.testing.assert_close(hn.cpu(), en)
        assert en > 0.5  # clipping really happened
        eopt.step(), hopt.step()
        eopt.zero_grad(), hopt.zero_grad()
    assert_same_model(eager, wrapped)
    assert_within_budgets(wrapped)


@pytest.mark.parametrize("chunk_size", ["8KiB", "1MiB"])
def test_gradients_accumulate_under_one_pinned_grad_block(chunk_size: str) -> None:
    """A backward keeps the grad block it accumulates into acquired across its chunk's gradients
    that arrive back to back: one recorded access per such run, not per parameter, and never more
    than one grad block pinned (what the minimum device budget allows for); none after it."""
    torch.manual_seed(0)
    model = GPT()
    total = state_bytes(model)
    wrapped = hetero.wrap(model, device="cpu", chunk_size=chunk_size,
                          device_budget=max(int(total * 0.25), 48 * 1024))
    rt = wrapped._hetero_state.runtime
    grads = [c.blocks["grad"] for c in wrapped._hetero_state.chunks]
    order: list[str] = []  # the chunk of each gradient, in arrival order
    pinned: list[int] = []

    def watch(param: torch.nn.Parameter) -> None:  # runs after hetero's own hook
        order.append(wrapped._hetero_state.slot_of[id(param)][0].blocks["grad"].id)
        pinned.append(sum(1 for b in grads if b.pins.get("device")))

    for p in wrapped.parameters():
        p.register_post_accumulate_grad_hook(watch)
    x, y = batches(1)[0]
    n0 = len(rt.tracker.accesses)
    loss_of(wrapped(x, y)).backward()
    recorded = [a.block for a in rt.tracker.accesses[n0:] if a.block in {b.id for b in grads}]
    runs = 1 + sum(1 for a, b in zip(order, order[1:]) if a != b)
    # A run may be split where a unit's backward ends, never merged across chunks.
    assert runs <= len(recorded) < len(order)
    assert max(pinned) == 1
    assert not any(b.pins.get("device") for b in grads)
    wrapped.close()


@pytest.mark.parametrize("after", ["zero_grad", "clip_then_step"])
def test_a_backward_that_raises_leaves_nothing_pinned(after: str) -> None:
    """A backward that raises after some gradients were accumulated never runs its end-of-backward
    callback: the grad block it was accumulating into and the unit's parameters stay pinned until
    the next zero_grad, clip or step lets them go, and training goes on (skipping the batch, or
    stepping on the gradients that arrived)."""
    torch.manual_seed(0)
    model = GPT()
    total = state_bytes(model)
    wrapped = hetero.wrap(model, device="cpu", chunk_size="8KiB", device_budget=int(total * 0.25))
    opt = hetero.optim.AdamW(wrapped.parameters(), lr=1e-3)
    grads = [c.blocks["grad"] for c in wrapped._hetero_state.chunks]

    def boom(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("backward failed half-way")

    (x, y), (x2, y2) = batches(2, seed=3)
    handle = wrapped.module.h[0].attn.weight.register_hook(boom)  # late: after other grads
    with pytest.raises(RuntimeError, match="half-way"):
        loss_of(wrapped(x, y)).backward()
    handle.remove()
    assert any(b.pins.get("device") for b in grads)  # what the failed backward left
    if after == "zero_grad":
        opt.zero_grad()
    else:
        wrapped.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    assert not any(n for b in wrapped._hetero_state.runtime.blocks() for n in b.pins.values())
    loss_of(wrapped(x2, y2)).backward()
    opt.step()
    opt.zero_grad()
    assert_within_budgets(wrapped)
    wrapped.close()


def test_zero_grad_set_to_none_false(tight: dict) -> None:
    def step(model, opt, batch):
        x, y = batch
        loss = loss_of(model(x, y))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss.item()

    make_routed = lambda: (torch.manual_seed(0), GPT(routed=True))[1]
    e, h, eager, wrapped = train_pair(make_routed, tight, batches(4, seed=5), step_fn=step)
    assert h == pytest.approx(e, rel=1e-5)
    assert_same_model(eager, wrapped)


def test_state_dict_round_trip(tight: dict) -> None:
    _, _, eager, wrapped = train_pair(seeded_gpt, tight, batches(2))
    sd = wrapped.state_dict()
    assert set(sd) == set(eager.state_dict())  # original keys, tied weight under both names
    assert all(v.device.type == "cpu" for v in sd.values())
    fresh = GPT()
    fresh.load_state_dict(sd)
    for k, v in eager.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[k], v)
    # ...and back: load a different model's weights into the wrapped one
    other = GPT()
    wrapped.load_state_dict(other.state_dict())
    assert_same_model(other, wrapped)
    x, y = batches(1)[0]
    torch.testing.assert_close(loss_of(wrapped(x, y)), loss_of(other(x, y)))


def test_the_wrapped_module_s_own_load_state_dict_loads_through_the_chunks(tight: dict) -> None:
    """``model.module.load_state_dict(sd)`` (the DDP habit) loads every value wherever its block
    lives, and reports keys as torch does (found in review: under a device budget torch's copies
    into non-resident parameters failed midway, half the model loaded)."""
    _, _, eager, wrapped = train_pair(seeded_gpt, tight, batches(1))
    other = GPT()
    assert not wrapped.module.load_state_dict(other.state_dict()).missing_keys
    assert_same_model(other, wrapped)
    partial = {k: v for k, v in eager.state_dict().items() if not k.startswith("h.0.")}
    result = wrapped.module.load_state_dict(partial, strict=False)
    assert sorted(result.missing_keys) == sorted(k for k in eager.state_dict() if k.startswith("h.0."))
    got = wrapped.state_dict()
    assert all(torch.equal(got[k], v) for k, v in partial.items())
    assert all(torch.equal(got[k], v) for k, v in other.state_dict().items() if k.startswith("h.0."))
    with pytest.raises(RuntimeError, match="Missing key"):
        wrapped.module.load_state_dict(partial)
    # A deep copy of the wrapped module (an EMA or eval copy) loads into itself, as torch does,
    # never into the wrapped model (found in review: the copy kept hooks pointing at it)
    before = wrapped.state_dict()
    with wrapped.summon_full_params(writeback=False):
        twin = copy.deepcopy(wrapped.module)
    assert not twin.load_state_dict(eager.state_dict()).missing_keys
    assert all(torch.equal(v, eager.state_dict()[k]) for k, v in twin.state_dict().items())
    after = wrapped.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # Keys with the module. level load at the root too (as through a parent), and a load refused
    # inside summon_full_params changes nothing there either (the summon writes back what it holds)
    assert not wrapped.load_state_dict({"module." + k: v for k, v in other.state_dict().items()}).missing_keys
    assert_same_model(other, wrapped)
    with wrapped.summon_full_params():
        with pytest.raises(RuntimeError, match="Missing key"):
            wrapped.load_state_dict(partial)
    assert_same_model(other, wrapped)
    wrapped.close()


def test_state_dict_hooks_on_the_wrapped_model_and_a_parent_s_state_dict_run_as_torch_s() -> None:
    """Hooks registered on the HeteroModule run (it overrides state_dict and load_state_dict, and
    skipped them: found in review); a parent module's state_dict gets what the HeteroModule's
    gives (buffers in their own dtype, not ``buffer_dtype``), and loads back."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    wrapped = hetero.wrap(net, device="cpu", device_budget=400, chunk_size=256, mixed_precision=hetero.MixedPrecision(
        param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16))
    calls = []
    wrapped.register_state_dict_pre_hook(lambda *a: calls.append("sd_pre"))
    wrapped.register_state_dict_post_hook(lambda *a: calls.append("sd_post"))
    wrapped.register_load_state_dict_pre_hook(lambda *a: calls.append("load_pre"))
    wrapped.register_load_state_dict_post_hook(lambda *a: calls.append("load_post"))
    wrapped.load_state_dict(wrapped.state_dict())
    assert calls == ["sd_pre", "sd_post", "load_pre", "load_post"]
    parent = nn.ModuleDict({"net": wrapped})
    calls.clear()
    sd = parent.state_dict()
    assert sd["net.1.running_mean"].dtype == torch.float32 and sd["net.0.weight"].dtype == torch.float32
    assert set(sd) == {"net." + k for k in wrapped.state_dict()} and calls == ["sd_pre", "sd_post"] * 2
    calls.clear()
    assert not parent.load_state_dict(sd).missing_keys and calls == ["load_pre", "load_post"]
    # As torch: what a pre-hook reports counts, and post-hooks may clear keys before the strict
    # check (found in review: hetero ran them after it, with fresh lists for the pre-hooks)
    partial = {k: v for k, v in wrapped.state_dict().items() if k != "1.bias"}
    forgive = wrapped.register_load_state_dict_post_hook(lambda m, keys: keys.missing_keys.clear())
    assert not wrapped.load_state_dict(partial).missing_keys
    forgive.remove()
    with pytest.raises(RuntimeError, match="Missing key.*1.bias"):
        wrapped.load_state_dict(partial)
    zeros = {k: torch.zeros_like(v) for k, v in wrapped.state_dict().items()}
    before = wrapped.state_dict()
    wrapped.register_load_state_dict_pre_hook(lambda *a: a[-1].append("the pre-hook says no"))
    with pytest.raises(RuntimeError, match="the pre-hook says no"):
        wrapped.load_state_dict(zeros)
    assert all(torch.equal(before[k], v) for k, v in wrapped.state_dict().items())  # nothing loaded
    # ...and with a size mismatch too, both errors in one message, as torch's
    wrong = dict(zeros, **{"1.bias": torch.zeros(9)})
    with pytest.raises(RuntimeError, match="(?s)the pre-hook says no.*size mismatch for 1.bias"):
        wrapped.load_state_dict(wrong)
    assert all(torch.equal(before[k], v) for k, v in wrapped.state_dict().items())
    wrapped.close()


def test_optimizer_state_dict_interchangeable_with_torch(tight: dict) -> None:
    data = batches(5, seed=7)
    # hetero -> torch: continue eagerly from hetero's optimizer state
    wrapped2 = hetero.wrap(seeded_gpt(), **{**tight, "nvme_path": tight.get("nvme_path")})
    hopt = hetero.optim.AdamW(wrapped2.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in data[:3]:
        loss_of(wrapped2(x, y)).backward()
        hopt.step()
        hopt.zero_grad()
    osd = hopt.state_dict()
    assert set(osd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert float(osd["state"][0]["step"]) == 3
    plain = GPT()
    plain.load_state_dict(wrapped2.state_dict())
    topt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    topt.load_state_dict(osd)
    # torch -> hetero: a fresh hetero optimizer loads torch's state dict
    wrapped3 = hetero.wrap(copy.deepcopy(plain), **{**tight, "nvme_path": tight.get("nvme_path")})
    hopt3 = hetero.optim.AdamW(wrapped3.parameters(), lr=1e-2, weight_decay=0.1)
    hopt3.load_state_dict(topt.state_dict())
    for x, y in data[3:]:
        for model, opt in ((wrapped2, hopt), (plain, topt), (wrapped3, hopt3)):
            loss_of(model(x, y)).backward()
            opt.step()
            opt.zero_grad()
    assert_same_model(plain, wrapped2)
    assert_same_model(plain, wrapped3)


def test_plain_torch_optimizer_raises_clear_error(tight: dict) -> None:
    wrapped = hetero.wrap(seeded_gpt(), **tight)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    x, y = batches(1)[0]
    loss_of(wrapped(x, y)).backward()
    before = wrapped.state_dict()
    with pytest.raises(hetero.HeteroStateError, match="hetero.optim.AdamW"):
        opt.step()
    after = wrapped.state_dict()
    for k in before:
        torch.testing.assert_close(after[k], before[k], rtol=0, atol=0)


def test_summon_full_params_reads_and_writes_back(tight: dict) -> None:
    _, _, eager, wrapped = train_pair(seeded_gpt, tight, batches(2))
    with wrapped.summon_full_params():
        for (n, p), (_, q) in zip(wrapped.named_parameters(), eager.named_parameters()):
            torch.testing.assert_close(p.detach(), q.detach())
        with torch.no_grad():
            wrapped.module.ln_f.weight.mul_(2)
    torch.testing.assert_close(wrapped.state_dict()["ln_f.weight"], eager.ln_f.weight.detach() * 2)


def test_named_parameters_are_the_original_ones() -> None:
    model = seeded_gpt()
    originals = dict(model.named_parameters())
    wrapped = hetero.wrap(model, device="cpu")
    assert dict(wrapped.named_parameters()).keys() == originals.keys()
    for n, p in wrapped.named_parameters():
        assert p is originals[n] and isinstance(p, torch.nn.Parameter)
    assert wrapped.module is model
    assert wrapped.h is model.h  # attribute access falls through to the wrapped module


def test_eval_under_no_grad_matches(tight: dict) -> None:
    model = seeded_gpt()
    wrapped = hetero.wrap(copy.deepcopy(model), **tight)
    x, _ = batches(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), model(x))
    assert_within_budgets(wrapped)


def test_model_zero_grad_clears_the_gradients(tight: dict) -> None:
    """``model.zero_grad()`` instead of the optimizer's: gradients live in grad blocks, not in
    ``param.grad``, and the module's own zero_grad must clear them there (both modes)."""
    modes = iter([True, False, True, False])

    def step(model, opt, batch):
        x, y = batch
        loss = loss_of(model(x, y))
        loss.backward()
        opt.step()
        model.zero_grad(set_to_none=next(modes) if isinstance(model, hetero.HeteroModule) else True)
        return loss.item()

    e, h, eager, wrapped = train_pair(seeded_gpt, tight, batches(4, seed=3), step_fn=step)
    assert h == pytest.approx(e, rel=1e-5)
    assert_same_model(eager, wrapped)
    wrapped.close()


def test_loading_a_state_without_a_parameter_restarts_its_moments(tight: dict) -> None:
    """Resetting the optimizer with a state dict saved before its first step (no per-parameter
    state): torch starts every parameter afresh (step 0, zero moments), and so must hetero,
    including where the chunk's moments already exist. Saved group keys it does not know (a
    scheduler's initial_lr) come back too, as in torch."""
    data = batches(6, seed=11)
    eager = seeded_gpt()
    wrapped = hetero.wrap(copy.deepcopy(eager), **tight)
    topt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    hopt = hetero.optim.AdamW(wrapped.parameters(), lr=1e-2)
    fresh = [copy.deepcopy(o.state_dict()) for o in (topt, hopt)]
    for o in (topt, hopt):
        torch.optim.lr_scheduler.StepLR(o, 1, 0.5)  # adds initial_lr to the groups
    half = {}
    for i, (x, y) in enumerate(data):
        if i == 3:
            half = {id(o): copy.deepcopy(o.state_dict()) for o in (topt, hopt)}
            for o, sd in zip((topt, hopt), fresh):
                o.load_state_dict(sd)
        for model, opt in ((eager, topt), (wrapped, hopt)):
            loss_of(model(x, y)).backward()
            opt.step()
            opt.zero_grad()
    assert_same_model(eager, wrapped)
    assert hopt.state_dict()["state"][0]["step"] == 3
    for o in (topt, hopt):  # group keys round-trip: a scheduler resumes from the loaded state
        o.load_state_dict(half[id(o)])
        assert o.param_groups[0]["initial_lr"] == 1e-2
        torch.optim.lr_scheduler.StepLR(o, 1, 0.5, last_epoch=2)
    wrapped.close()


@pytest.mark.parametrize("how", ["group", "state_dict"])
@pytest.mark.parametrize("flag", ["maximize", "amsgrad"])
def test_unsupported_flags_raise_however_they_arrive(tight: dict, flag: str, how: str) -> None:
    """Options hetero's Adam does not implement raise before anything changes, set in a group
    after construction or loaded from torch's state dict, instead of being ignored."""
    wrapped = hetero.wrap(seeded_gpt(), **tight)
    opt = hetero.optim.AdamW(wrapped.parameters(), lr=1e-2)
    x, y = batches(1)[0]
    loss_of(wrapped(x, y)).backward()
    before = wrapped.state_dict()
    with pytest.raises(hetero.HeteroConfigError, match=flag):
        if how == "group":
            opt.param_groups[0][flag] = True
            opt.step()
        else:
            plain = seeded_gpt()
            topt = torch.optim.AdamW(plain.parameters(), lr=1e-2, **{flag: True})
            opt.load_state_dict(topt.state_dict())
    for k, v in wrapped.state_dict().items():
        assert torch.equal(v, before[k])
    if how == "state_dict":
        assert opt.param_groups[0][flag] is False  # nothing was loaded
    wrapped.close()


def test_a_parameter_unfrozen_after_wrap_raises() -> None:
    """Chunks are packed at wrap time by requires_grad: a parameter frozen then has no grad
    block, so unfrozen later its gradient would go nowhere. The optimizer says so."""
    model = seeded_gpt()
    frozen = next(p for p in model.parameters())
    frozen.requires_grad_(False)
    wrapped = hetero.wrap(model, device="cpu", chunk_size="8KiB")
    opt = hetero.optim.AdamW(wrapped.parameters(), lr=1e-2)
    frozen.requires_grad_(True)
    x, y = batches(1)[0]
    loss_of(wrapped(x, y)).backward()
    with pytest.raises(hetero.HeteroConfigError, match="frozen"):
        opt.step()
    with pytest.raises(hetero.HeteroConfigError, match="frozen"):
        hetero.optim.AdamW(wrapped.parameters(), lr=1e-2)
    wrapped.close()


def test_adam_takes_torch_newer_arguments() -> None:
    """torch 2.13's Adam arguments: a tensor lr, and decoupled_weight_decay=True (AdamW)."""
    data = batches(3, seed=2)
    results = []
    for cls, kw in ((hetero.optim.Adam, dict(lr=torch.tensor(1e-2), weight_decay=0.1, decoupled_weight_decay=True)),
                    (hetero.optim.AdamW, dict(lr=1e-2, weight_decay=0.1))):
        wrapped = hetero.wrap(seeded_gpt(), device="cpu", chunk_size="8KiB")
        opt = cls(wrapped.parameters(), **kw)
        for x, y in data:
            loss_of(wrapped(x, y)).backward()
            opt.step()
            opt.zero_grad()
        results.append(wrapped.state_dict())
        wrapped.close()
    for k in results[0]:
        assert torch.equal(results[0][k], results[1][k])
    with pytest.raises(hetero.HeteroConfigError, match="betas"):
        hetero.optim.AdamW(hetero.wrap(seeded_gpt(), device="cpu").parameters(), betas=None)


def test_state_dict_inside_summon_full_params(tight: dict) -> None:
    """``state_dict()`` (or a nested summon) inside ``summon_full_params()`` reads the summoned
    values and leaves the outer context's parameters in place: writes made after it are
    written back by the outer context."""
    _, _, eager, wrapped = train_pair(seeded_gpt, tight, batches(2))
    want = eager.state_dict()
    with wrapped.summon_full_params():
        inner = wrapped.state_dict()
        with wrapped.summon_full_params(writeback=False):
            pass
        for k, v in want.items():
            assert torch.equal(inner[k], v)
        assert all(bool(torch.isfinite(p).all()) for p in wrapped.parameters())
        with torch.no_grad():
            for p in wrapped.parameters():
                p.fill_(0.125)
    assert all(bool((v == 0.125).all()) for k, v in wrapped.state_dict().items() if k in dict(wrapped.named_parameters()))
    wrapped.close()


def test_a_wrapped_module_inside_a_parent_round_trips_its_state_dict(tight: dict) -> None:
    """A HeteroModule nested in another module (as FSDP units are): the parent's state_dict
    holds its keys under the child's name, and the parent's load_state_dict loads them into
    the chunks, with or without the ``module.`` level, and reports what is really missing."""
    _, _, eager, wrapped = train_pair(seeded_gpt, tight, batches(2))
    parent = torch.nn.ModuleDict({"net": wrapped})
    sd = parent.state_dict()
    assert set(sd) == {"net." + k for k in eager.state_dict()}
    other = GPT()
    for keys in ("plain", "module"):
        src = {("net." if keys == "plain" else "net.module.") + k: v for k, v in other.state_dict().items()}
        parent.load_state_dict(src)
        assert_same_model(other, wrapped)
        parent.load_state_dict(sd)
        assert_same_model(eager, wrapped)
    missing = dict(sd)
    gone = next(iter(missing))
    del missing[gone]
    with pytest.raises(RuntimeError, match="Missing key") as info:
        parent.load_state_dict(missing)
    assert gone in str(info.value) and "net.module." not in str(info.value)
    result = parent.load_state_dict(dict(missing, extra=torch.zeros(1)), strict=False)
    assert result.missing_keys == [gone] and result.unexpected_keys == ["extra"]
    wrapped.close()


def test_clipping_with_two_optimizers_sharing_chunks_and_clipping_twice(tight: dict) -> None:
    """The clip's scale is applied where a gradient is next read; it must survive one optimizer
    clearing its parameters' gradients while another's, in the same chunks, still wait (a
    partial zero_grad), and a second clip before the step must round as torch's in-place clips
    do ((g * c1) * c2). Bit-identical to torch's clip and two torch AdamWs."""
    eager = seeded_gpt()
    wrapped = hetero.wrap(copy.deepcopy(eager), **tight)
    halves = [list(m.parameters())[0::2] for m in (eager, wrapped)], [list(m.parameters())[1::2] for m in (eager, wrapped)]
    topts = [torch.optim.AdamW(h[0], lr=1e-2) for h in halves]
    hopts = [hetero.optim.AdamW(h[1], lr=1e-2) for h in halves]
    for i, (x, y) in enumerate(batches(4, seed=6)):
        norms = []
        for model, opts in ((eager, topts), (wrapped, hopts)):
            loss_of(model(x, y)).backward()
            clip = (lambda c: torch.nn.utils.clip_grad_norm_(model.parameters(), c)) if model is eager \
                else wrapped.clip_grad_norm_
            norms.append([clip(0.3), clip(0.07) if i % 2 else None])
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=i < 2)
        assert norms[0][0] == norms[1][0] and norms[0][1] == norms[1][1]
    for k, v in eager.state_dict().items():
        assert torch.equal(wrapped.state_dict()[k], v), k
    wrapped.close()


def test_a_write_inside_summon_without_writeback_raises(tight: dict) -> None:
    """Inside summon_full_params(writeback=False) every change is discarded at its end: a
    load_state_dict there would report success and load nothing, so it raises instead."""
    _, _, eager, wrapped = train_pair(seeded_gpt, tight, batches(1))
    with wrapped.summon_full_params(writeback=False):
        with pytest.raises(hetero.HeteroStateError, match="writeback=False"):
            wrapped.load_state_dict(GPT().state_dict())
        wrapped.state_dict()  # reading is fine
    assert_same_model(eager, wrapped)
    wrapped.close()


def test_parameters_at_rest_after_wrap_hold_no_stale_copy() -> None:
    """After wrap the state lives in the chunks: a parameter at rest reads NaN (as off the
    device), not the tensor it had before wrapping, which is let go. A computation that reads a
    unit's parameter outside that unit's forward therefore fails loudly instead of training on
    the initial values in silence (nn.MultiheadAttention reads out_proj.weight without calling
    out_proj: with out_proj a unit of its own, the loss is NaN or the call raises)."""
    model = seeded_gpt()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    wrapped = hetero.wrap(model, device="cpu", chunk_size="8KiB")
    for n, p in wrapped.named_parameters():
        assert torch.isnan(p).all(), n
    got = wrapped.state_dict()
    for n, v in before.items():
        assert torch.equal(got[n], v), n
    x, y = batches(1)[0]
    assert torch.isfinite(loss_of(wrapped(x, y)))  # in its units' forwards they are there
    wrapped.close()

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mha(x, x, x, need_weights=False)[0]

    torch.manual_seed(0)
    net = torch.nn.Sequential(Attention(), Attention())
    wrapped = hetero.wrap(net, device="cpu", chunk_size="4KiB", auto_wrap_policy={torch.nn.Linear, Attention})
    x = torch.randn(2, 5, 16)
    try:
        loss = wrapped(x).pow(2).mean()
    except RuntimeError:
        pass
    else:
        assert torch.isnan(loss)
    wrapped.close()


@dataclasses.dataclass
class _Hidden:
    """A unit's output: a field that is no init argument, set after construction, and a
    ``__post_init__`` that must run once (hooking must not rebuild the instance)."""

    h: torch.Tensor
    note: str = "kept"
    extra: str = dataclasses.field(init=False, default="unset")

    def __post_init__(self) -> None:
        self.h = self.h * 0.5


class _DataclassBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> _Hidden:
        out = _Hidden(torch.tanh(self.lin(x)))
        out.extra = "set"
        return out


class _DataclassNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_DataclassBlock() for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            out = b(x)
            assert out.note == "kept" and out.extra == "set"
            x = out.h
        return x.pow(2).mean()


def _weight_normed() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    for lin in net:
        torch.nn.utils.weight_norm(lin)  # a forward pre-hook, registered before wrap, reads params
    return net


@pytest.mark.filterwarnings("ignore:.*weight_norm.*is deprecated:FutureWarning")
@pytest.mark.parametrize("make_net", [_weight_normed, lambda: (torch.manual_seed(0), _DataclassNet())[1]],
                         ids=["pre-hook before wrap", "dataclass outputs"])
def test_units_with_hooks_of_their_own_or_dataclass_outputs_train_as_eager(make_net) -> None:
    """A unit's parameters are fetched before any forward pre-hook the model already had (the
    old weight_norm's recomputes the weight from them), and the backward hooks are attached to
    tensors inside a dataclass a unit returns (else its backward runs without its parameters)."""
    eager = make_net()
    wrapped = hetero.wrap(make_net(), device="cpu", device_budget=3000, chunk_size="4KiB")
    eopt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    hopt = hetero.optim.AdamW(wrapped.parameters(), lr=1e-2)
    torch.manual_seed(1)
    for _ in range(3):
        x = torch.randn(8, 16)
        losses = []
        for model, opt in ((eager, eopt), (wrapped, hopt)):
            out = model(x)
            loss = out if out.dim() == 0 else out.pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert_same_model(eager, wrapped)
    wrapped.close()


def test_apply_initializes_the_chunks_and_conversions_are_refused(tight: dict) -> None:
    """``apply(init)`` runs with every parameter summoned (as FSDP's), so the values reach the
    chunks wherever they live; ``.half()``, ``.to("meta")`` and pickling raise a clear error
    before changing anything; a conversion that changes nothing is accepted."""
    import pickle

    eager = seeded_gpt()
    wrapped = hetero.wrap(copy.deepcopy(eager), **tight)

    def init(m: torch.nn.Module) -> None:
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.constant_(m.weight, 0.01)

    eager.apply(init)
    assert wrapped.apply(init) is wrapped
    assert_same_model(eager, wrapped)
    for convert in (lambda m: m.half(), lambda m: m.to("meta"), lambda m: m.double(), pickle.dumps):
        with pytest.raises(hetero.HeteroStateError):
            convert(wrapped)
    assert wrapped.to("cpu") is wrapped and wrapped.float() is wrapped
    x, y = batches(1)[0]
    torch.testing.assert_close(loss_of(wrapped(x, y)), loss_of(eager(x, y)))
    wrapped.close()


class _Towers(torch.nn.Module):
    """Two embedding tables fed token ids (no input needs grad), then a layer over both."""

    def __init__(self) -> None:
        super().__init__()
        self.tables = torch.nn.ModuleList([torch.nn.Embedding(30, 8), torch.nn.Embedding(30, 8)])
        self.fc = torch.nn.Linear(16, 2)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.tables[0](a), self.tables[1](b)], -1)).pow(2).mean()


def test_units_whose_inputs_need_no_grad_train_at_the_minimum_budget() -> None:
    """A unit whose inputs need no gradient gets no signal that its backward ended: it is let go
    once its own parameters' gradients are in, not at the end of the pass, where several such
    units pinned together exceeded the minimum device budget wrap names (and accepts)."""
    torch.manual_seed(0)
    eager = _Towers()
    with pytest.raises(hetero.HeteroConfigError) as info:
        hetero.wrap(copy.deepcopy(eager), device="cpu", device_budget=1, chunk_size="4KiB")
    minimum = int(str(info.value).split("device_budget>=")[1].split(",")[0].split(" ")[0])
    wrapped = hetero.wrap(copy.deepcopy(eager), device="cpu", device_budget=minimum, chunk_size="4KiB")
    eopt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    hopt = hetero.optim.AdamW(wrapped.parameters(), lr=1e-2)
    torch.manual_seed(1)
    for _ in range(3):
        a, b = torch.randint(0, 30, (4,)), torch.randint(0, 30, (4,))
        for model, opt in ((eager, eopt), (wrapped, hopt)):
            model(a, b).backward()
            opt.step()
            opt.zero_grad()
    assert_same_model(eager, wrapped)
    assert_within_budgets(wrapped)
    wrapped.close()


class _LoraTowers(torch.nn.Module):
    """Towers fed the raw input, each a leaf unit with a frozen base layer beside a trainable one
    (LoRA's shape), in both orders."""

    class Block(torch.nn.Module):
        def __init__(self, frozen_first: bool) -> None:
            super().__init__()
            self.w = torch.nn.Linear(32, 32)
            self.f = torch.nn.Linear(32, 32).requires_grad_(False)
            self.frozen_first = frozen_first

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.w(self.f(x)) if self.frozen_first else self.f(self.w(x)))

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([self.Block(i % 2 == 0) for i in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x) for layer in self.layers).pow(2).mean()


def _train_both(eager, eopt, wrapped, hopt, shape: tuple[int, ...], loss=lambda out: out) -> None:
    """Three steps of both models on the same random inputs (``loss`` of their output), then
    the same weights."""
    torch.manual_seed(1)
    for _ in range(3):
        x = torch.randn(*shape)
        for model, opt in ((eager, eopt), (wrapped, hopt)):
            loss(model(x)).backward()
            opt.step()
            opt.zero_grad()
    assert_same_model(eager, wrapped)


def test_leaf_units_with_frozen_layers_are_let_go_at_their_last_gradient() -> None:
    """A unit holding no other unit needs its frozen layers no more once its trainable
    parameters' gradients are in: four such towers pinned to the end of the pass exceeded
    the minimum device budget wrap names (HeteroOOMError in the first backward)."""
    from hetero.wrap import minimum_budgets

    torch.manual_seed(0)
    eager = _LoraTowers()
    probe = hetero.wrap(copy.deepcopy(eager), device="cpu", chunk_size="4KiB")
    device_min, _ = minimum_budgets(probe, False)
    probe.close()
    wrapped = hetero.wrap(copy.deepcopy(eager), device="cpu", device_budget=device_min, chunk_size="4KiB")
    eopt = torch.optim.AdamW([p for p in eager.parameters() if p.requires_grad], lr=1e-2)
    hopt = hetero.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-2)
    _train_both(eager, eopt, wrapped, hopt, (8, 32))
    assert_within_budgets(wrapped)
    wrapped.close()


@pytest.mark.parametrize("policy", ["auto", "lru"])
def test_the_named_minimums_train_when_the_largest_block_is_frozen(policy, tmp_path) -> None:
    """Found by a randomized review: with NVMe the host minimum counted one chunk's optimizer
    step, or the largest block alone. Where the largest block is a frozen layer's (no step of its
    own), staging it through a host of exactly that size left no room for the blocks the device
    evicts to make room for it: HeteroOOMError in the first forward at the budgets wrap named."""
    from hetero.wrap import minimum_budgets

    def make() -> torch.nn.Sequential:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(86, 21), torch.nn.Linear(21, 84), torch.nn.Linear(84, 85),
                                torch.nn.Linear(85, 3))
        m[2].requires_grad_(False)
        return m

    kw = dict(device="cpu", chunk_size=16384, nvme_path=str(tmp_path), nvme_budget="1MiB", policy=policy)
    probe = hetero.wrap(make(), **kw)
    device_min, host_min = minimum_budgets(probe, True)
    probe.close()
    eager, wrapped = make(), hetero.wrap(make(), **kw, device_budget=device_min, host_budget=host_min)
    eopt = torch.optim.AdamW([p for p in eager.parameters() if p.requires_grad], lr=1e-2)
    hopt = hetero.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-2)
    _train_both(eager, eopt, wrapped, hopt, (4, 86), loss=lambda out: out.pow(2).mean())
    assert_within_budgets(wrapped)
    wrapped.close()


class _FrozenMiddle(torch.nn.Module):
    """The root's own parameters: a frozen layer between two units, then a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)])
        self.mid = torch.nn.Linear(64, 64).requires_grad_(False)
        self.head = torch.nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers[1](self.mid(self.layers[0](x)))).pow(2).mean()


@pytest.mark.parametrize("policy", ["lru", "static", "auto"])
def test_a_unit_with_a_frozen_parameter_waits_for_the_end_of_its_backward(policy) -> None:
    """The root's inputs need no grad, and its trainable head's gradient arrives first: its
    frozen middle layer is still on the gradient's way to the first unit. Let go early (at
    its last trainable gradient), its block was evicted under the frozen layer's backward."""
    from hetero.wrap import minimum_budgets

    torch.manual_seed(0)
    eager = _FrozenMiddle()
    probe = hetero.wrap(copy.deepcopy(eager), device="cpu", chunk_size=64 * 64 * 4)
    device_min, _ = minimum_budgets(probe, False)
    probe.close()
    wrapped = hetero.wrap(copy.deepcopy(eager), device="cpu", device_budget=device_min,
                          chunk_size=64 * 64 * 4, policy=policy)
    eopt = torch.optim.AdamW([p for p in eager.parameters() if p.requires_grad], lr=1e-2)
    hopt = hetero.optim.AdamW(wrapped.parameters(), lr=1e-2)
    _train_both(eager, eopt, wrapped, hopt, (8, 64))
    wrapped.close()
