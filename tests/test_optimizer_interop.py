"""hetero.optim with the rest of torch's optimizer ecosystem: ``opt.state``, state-dict hooks, a
second optimizer over the same parameters, AdamW loading an Adam state, refused parameter
groups, torch.distributed.checkpoint's state-dict helpers, and all-or-nothing loads with NVMe.
Each compared with torch.optim on the same model and batches."""

from __future__ import annotations

import copy

import pytest
import torch

import hetero
from helpers import assert_same_model, budgets, loss_of, seeded_gpt
from models import GPT, batches, state_bytes





def train(model, opt, data) -> list[float]:
    losses = []
    for x, y in data:
        loss = loss_of(model(x, y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def pair(tight: dict, cls: str = "AdamW", **hp):
    eager = seeded_gpt()
    wrapped = hetero.wrap(copy.deepcopy(eager), **tight)
    hp = dict(lr=1e-2, weight_decay=0.1) | hp
    return eager, getattr(torch.optim, cls)(eager.parameters(), **hp), wrapped, getattr(hetero.optim, cls)(
        wrapped.parameters(), **hp)


def test_opt_state_reads_as_torch_s(tight: dict) -> None:
    eager, eopt, wrapped, hopt = pair(tight)
    assert not hopt.state and len(hopt.state) == 0  # (torch.distributed.checkpoint tests this)
    data = batches(3)
    train(eager, eopt, data)
    train(wrapped, hopt, data)
    assert len(hopt.state) == len(eopt.state) > 0
    for pe, ph in zip(eager.parameters(), wrapped.parameters()):
        assert (ph in hopt.state) == (pe in eopt.state)
        if pe in eopt.state:
            for k in ("step", "exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(hopt.state[ph][k], eopt.state[pe][k])
    assert list(hopt.state) == [p for p in wrapped.parameters() if p in hopt.state]
    # A parameter without a state reads as {} (torch's defaultdict), and get() gives the default.
    other = torch.zeros(1)
    assert hopt.state[other] == eopt.state[other] == {} and hopt.state.get(other) is None
    assert len(hopt.state) == len([p for p in eopt.state if eopt.state[p]])


def test_a_new_optimizer_over_the_same_parameters_starts_afresh(tight: dict) -> None:
    eager, eopt, wrapped, hopt = pair(tight)
    data = batches(6, seed=3)
    train(eager, eopt, data[:3])
    train(wrapped, hopt, data[:3])
    eopt2 = torch.optim.AdamW(eager.parameters(), lr=5e-3)
    hopt2 = hetero.optim.AdamW(wrapped.parameters(), lr=5e-3)
    assert not hopt2.state and hopt2.state_dict()["state"] == {}
    assert train(wrapped, hopt2, data[3:]) == pytest.approx(train(eager, eopt2, data[3:]), rel=1e-5)
    assert_same_model(eager, wrapped)
    assert float(hopt2.state_dict()["state"][0]["step"]) == 3
    with pytest.raises(hetero.HeteroStateError, match="another hetero optimizer"):
        hopt.step()  # its state was taken over: stepping it would use the newer one's
    with pytest.raises(hetero.HeteroStateError, match="another hetero optimizer"):
        hopt.state_dict()


def test_the_first_step_s_state_reads_at_once(tight: dict) -> None:
    """Right after the first step(): with NVMe the updates of chunks whose state moves are
    postponed, and their step counts rose only when they ran. ``opt.state`` read empty then, so
    torch.distributed.checkpoint's get_optimizer_state_dict took the optimizer for a fresh one
    and stepped it once more (lr 0: step 2, moments decayed), and a new optimizer over the same
    parameters inherited the pending step instead of starting afresh."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    eager, eopt, wrapped, hopt = pair(tight)
    data = batches(4, seed=5)
    train(eager, eopt, data[:1])
    train(wrapped, hopt, data[:1])
    assert len(hopt.state) == len(eopt.state) > 0
    assert all(ph in hopt.state for ph in wrapped.parameters())
    assert list(hopt.state) == list(wrapped.parameters())
    osd = get_optimizer_state_dict(wrapped, hopt)
    assert {float(v["step"]) for v in osd["state"].values()} == {1.0}
    # A new optimizer right after the first step starts afresh, as a new torch optimizer does.
    eopt2 = torch.optim.AdamW(eager.parameters(), lr=5e-3)
    hopt2 = hetero.optim.AdamW(wrapped.parameters(), lr=5e-3)
    assert not hopt2.state
    assert train(wrapped, hopt2, data[1:]) == pytest.approx(train(eager, eopt2, data[1:]), rel=1e-5)
    assert_same_model(eager, wrapped)
    assert float(hopt2.state_dict()["state"][0]["step"]) == 3


def test_state_dict_hooks_run_as_in_torch(tight: dict) -> None:
    calls: dict[str, list[str]] = {}
    for name, opt in zip(("torch", "hetero"), pair(tight)[1::2]):
        seen = calls[name] = []
        opt.register_state_dict_pre_hook(lambda o: seen.append("sd_pre"))
        opt.register_state_dict_post_hook(lambda o, sd: seen.append("sd_post") or {**sd, "extra": 1})
        opt.register_load_state_dict_pre_hook(lambda o, sd: seen.append("load_pre") or {
            k: v for k, v in sd.items() if k != "extra"})
        opt.register_load_state_dict_post_hook(lambda o: seen.append("load_post"))
        sd = opt.state_dict()
        assert sd["extra"] == 1
        opt.load_state_dict(sd)
    assert calls["hetero"] == calls["torch"] == ["sd_pre", "sd_post", "load_pre", "load_post"]


def test_adamw_loading_an_adam_state_keeps_decoupled_decay(tight: dict) -> None:
    eager, eopt, wrapped, hopt = pair(tight)
    adam = torch.optim.Adam(seeded_gpt().parameters(), lr=1e-2, weight_decay=0.1)
    for opt in (eopt, hopt):
        opt.load_state_dict(adam.state_dict())
        assert opt.param_groups[0]["decoupled_weight_decay"] is True
    data = batches(2)
    train(eager, eopt, data)
    train(wrapped, hopt, data)
    assert_same_model(eager, wrapped)


def test_a_refused_param_group_is_not_added(tight: dict) -> None:
    wrapped = hetero.wrap(seeded_gpt(), **tight)
    opt = hetero.optim.AdamW(list(wrapped.parameters())[:2], lr=1e-2)
    with pytest.raises(hetero.HeteroConfigError, match="no HeteroModule manages"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    assert len(opt.param_groups) == 1
    # A parameter listed twice in one group: torch warns and updates it twice per step (the
    # listing is deprecated); hetero updated it once, silently. Refused, naming it.
    twice = list(wrapped.parameters())[2:4]
    with pytest.warns(UserWarning, match="duplicate"), pytest.raises(hetero.HeteroConfigError, match="twice"):
        opt.add_param_group({"params": twice + twice[:1]})
    with pytest.warns(UserWarning, match="duplicate"), pytest.raises(hetero.HeteroConfigError, match="twice"):
        hetero.optim.AdamW(twice + twice[:1])
    assert len(opt.param_groups) == 1
    assert len(hetero.optim.AdamW([{"params": []}]).param_groups) == 1  # (as torch; it raised AttributeError)
    opt.add_param_group({"params": list(wrapped.parameters())[2:]})
    train(wrapped, opt, batches(1))
    assert len(opt.state_dict()["param_groups"]) == 2


def test_loaded_groups_are_copies(tight: dict) -> None:
    wrapped = hetero.wrap(seeded_gpt(), **tight)
    a = hetero.optim.AdamW(wrapped.parameters(), lr=torch.tensor(0.01))
    other = hetero.wrap(seeded_gpt(), **tight)
    b = hetero.optim.AdamW(other.parameters(), lr=0.5)
    b.load_state_dict(a.state_dict())
    a.param_groups[0]["lr"].fill_(0.02)  # a scheduler changing a tensor lr in place
    assert float(b.param_groups[0]["lr"]) == pytest.approx(0.01)


def test_torch_distributed_checkpoint_state_dict_round_trip(tight: dict) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    eager, eopt, wrapped, hopt = pair(tight)
    data = batches(5, seed=11)
    train(eager, eopt, data[:3])
    train(wrapped, hopt, data[:3])
    msd, osd = get_state_dict(wrapped, hopt)
    emsd, eosd = get_state_dict(eager, eopt)
    assert msd.keys() == emsd.keys() and osd["state"].keys() == eosd["state"].keys()
    fresh = hetero.wrap(GPT(), **tight)  # other initial weights
    fresh_opt = hetero.optim.AdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1)
    set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd)
    assert len(fresh_opt.state) == len(eopt.state)
    assert train(fresh, fresh_opt, data[3:]) == pytest.approx(train(eager, eopt, data[3:]), rel=1e-5)
    assert_same_model(eager, fresh)


def test_torch_distributed_checkpoint_resume_into_a_fresh_optimizer(tight: dict, tmp_path) -> None:
    """The usual DCP resume: a fresh model and optimizer, get_state_dict (which gives a fresh
    optimizer its states by assigning zero gradients to ``param.grad`` and stepping with lr 0),
    dcp.load into those, set_state_dict. hetero ignored the assigned gradients, so the fresh
    state dict had no states to load into and the run restarted Adam from zero (silently)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    eager, eopt, wrapped, hopt = pair(tight)
    data = batches(5, seed=11)
    train(eager, eopt, data[:3])
    train(wrapped, hopt, data[:3])
    msd, osd = get_state_dict(wrapped, hopt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "ckpt"))
    fresh = hetero.wrap(GPT(), **tight)  # other initial weights
    fresh_opt = hetero.optim.AdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1)
    msd, osd = get_state_dict(fresh, fresh_opt)
    assert len(osd["state"]) == len(eopt.state)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "ckpt"))
    set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd)
    assert train(fresh, fresh_opt, data[3:]) == pytest.approx(train(eager, eopt, data[3:]), rel=1e-5)
    assert_same_model(eager, fresh)


def test_gradients_assigned_to_param_grad_are_used_as_in_torch(tight: dict) -> None:
    """A gradient assigned to ``param.grad`` (computed by hand, or after a backward) is the
    parameter's gradient for step(), clip_grad_norm_ and zero_grad, as in torch; hetero's
    step ignored it, changing nothing."""
    eager, eopt, wrapped, hopt = pair(tight)
    data = batches(4, seed=3)
    for i, (x, y) in enumerate(data):
        for model, opt in ((eager, eopt), (wrapped, hopt)):
            params = list(model.parameters())
            loss = loss_of(model(x, y))
            if i == 0:  # no backward: every gradient assigned
                for p, g in zip(params, torch.autograd.grad(loss, params)):
                    p.grad = g
            else:
                loss.backward()
                if i == 1:  # one replaced after the backward
                    params[3].grad = torch.full_like(params[3], 0.5)
            if i == 2:
                params[2].grad = torch.ones_like(params[2])
                opt.zero_grad(set_to_none=False)  # the assigned one is zeroed with the rest
            if i == 3:
                params[1].grad = torch.full_like(params[1], 3.0)
                norm = (model.clip_grad_norm_(1.0) if model is wrapped
                        else torch.nn.utils.clip_grad_norm_(params, 1.0))
                norms = norms + [norm] if model is wrapped else [norm]
            opt.step()
            opt.zero_grad()
            assert all(p.grad is None for p in params)
    torch.testing.assert_close(norms[1].cpu(), norms[0])
    assert_same_model(eager, wrapped)


@pytest.mark.parametrize("corrupt", ["shape", "missing", "not_a_tensor", "step"])
def test_a_refused_optimizer_load_changes_nothing(tight: dict, corrupt: str) -> None:
    """A saved state hetero cannot load is refused, naming the entry, before anything is
    written: without NVMe the moments of the parameters before it were already overwritten."""
    from helpers import assert_same_state, snapshot

    eager, eopt, wrapped, hopt = pair(tight)
    data = batches(3, seed=6)
    train(eager, eopt, data[:1])
    train(wrapped, hopt, data[:2])
    bad = copy.deepcopy(eopt.state_dict())
    last = max(bad["state"])
    if corrupt == "shape":
        bad["state"][last]["exp_avg"] = torch.zeros(5, 5)
    elif corrupt == "missing":
        del bad["state"][last]["exp_avg_sq"]
    elif corrupt == "not_a_tensor":
        bad["state"][last]["exp_avg"] = "zeros"
    else:
        bad["state"][last]["step"] = torch.zeros(2)
    before = snapshot(wrapped, hopt)
    with pytest.raises(hetero.HeteroConfigError, match=rf"state\[{last}\]"):
        hopt.load_state_dict(bad)
    assert_same_state(snapshot(wrapped, hopt), before)


def test_torch_distributed_checkpoint_between_backward_and_step(tight: dict) -> None:
    """get_state_dict on an optimizer whose gradients are pending must not step it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    eager, eopt, wrapped, hopt = pair(tight)
    for i, (x, y) in enumerate(batches(3, seed=5)):
        for model, opt in ((eager, eopt), (wrapped, hopt)):
            loss_of(model(x, y)).backward()
            if i == 1:
                get_optimizer_state_dict(model, opt)
            opt.step()
            opt.zero_grad()
    assert_same_model(eager, wrapped)


@pytest.mark.parametrize("after", range(0, 12, 3))
def test_optimizer_load_with_nvme_is_all_or_nothing(tmp_path, after: int) -> None:
    """Each chunk's moments are written as one group: a shadow copied for one block of it must
    not be the room the next block's shadow takes (it was, so a fault left some chunks
    loaded)."""
    from hetero import engine
    from helpers import snapshot, assert_same_state

    wrapped = hetero.wrap(seeded_gpt(), **budgets(state_bytes(seeded_gpt()), 0.3, 0.35, tmp_path), chunk_size="8KiB")
    opt = hetero.optim.AdamW(wrapped.parameters(), lr=1e-2)
    data = batches(4)
    train(wrapped, opt, data[:2])
    saved = opt.state_dict()
    train(wrapped, opt, data[2:])
    before = snapshot(wrapped, opt)
    engine.inject_fault("eio", after=after)
    try:
        with pytest.raises(hetero.HeteroIOError):
            opt.load_state_dict(saved)
    finally:
        engine.inject_fault("none")
    assert_same_state(before, snapshot(wrapped, opt))
    opt.load_state_dict(saved)
    assert float(opt.state_dict()["state"][0]["step"]) == 2


def test_step_after_close_raises_even_without_gradients(tight: dict) -> None:
    wrapped = hetero.wrap(seeded_gpt(), **tight)
    opt = hetero.optim.AdamW(wrapped.parameters(), lr=1e-2)
    train(wrapped, opt, batches(1))
    wrapped.close()
    with pytest.raises(hetero.HeteroStateError, match="closed"):
        opt.step()
    with pytest.raises(hetero.HeteroStateError, match="closed"):  # (with NVMe it read {})
        opt.state[next(wrapped.parameters())]


@pytest.mark.parametrize("clip", [False, True])
def test_grad_scaler_matches_torch_s_with_skipped_steps(tight: dict, clip: bool) -> None:
    """hetero.optim.GradScaler as torch.amp.GradScaler: the same scale, unscale (before a clip
    too), steps skipped where a gradient is inf (batch 2 here) and the scale's backoff."""
    eager, eopt, wrapped, hopt = pair(tight)
    scalers = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2),
               hetero.optim.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2))
    for i, (x, y) in enumerate(batches(5, seed=4)):
        for model, opt, scaler in ((eager, eopt, scalers[0]), (wrapped, hopt, scalers[1])):
            loss = loss_of(model(x, y)) * (float("inf") if i == 2 else 1.0)
            scaler.scale(loss).backward()
            if clip:
                scaler.unscale_(opt)
                (torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5) if model is eager
                 else model.clip_grad_norm_(0.5))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert scalers[1].get_scale() == scalers[0].get_scale()
    assert_same_model(eager, wrapped)
    assert float(hopt.state_dict()["state"][0]["step"]) == float(eopt.state_dict()["state"][0]["step"]) == 4


def test_grad_scaler_s_inf_check_is_in_the_access_log(tight: dict) -> None:
    """The unscale's inf/NaN check reads every gradient block, wherever it is: compute touching
    blocks, so one access per block in the log (as clip_grad_norm_'s reads), and the replay
    still reproduces the run."""
    _, _, wrapped, hopt = pair(tight)
    scaler = hetero.optim.GradScaler("cpu")
    for x, y in batches(2, seed=5):
        scaler.scale(loss_of(wrapped(x, y))).backward()
        grads = {c.blocks["grad"].id for c in wrapped._hetero_state.chunks if "grad" in c.blocks
                 and c.blocks["grad"].tiers}
        before = len(wrapped.placement_report().accesses)
        scaler.unscale_(hopt)
        read = [a.block for a in wrapped.placement_report().accesses[before:]]
        assert sorted(read) == sorted(grads)
        scaler.step(hopt)
        scaler.update()
        hopt.zero_grad()
    rep = wrapped.placement_report()
    assert rep.simulate().traffic == rep.as_dict()["traffic"]
    wrapped.close()


def test_torch_s_grad_scaler_does_not_see_hetero_gradients(tight: dict) -> None:
    """(documented: use hetero.optim.GradScaler)"""
    wrapped = hetero.wrap(seeded_gpt(), **tight)
    opt = hetero.optim.AdamW(wrapped.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    x, y = batches(1)[0]
    scaler.scale(loss_of(wrapped(x, y))).backward()
    with pytest.raises(AssertionError, match="No inf checks"):
        scaler.step(opt)


def test_grad_scaler_with_two_optimizers_over_one_model(tight: dict) -> None:
    """torch's recipe for several optimizers, scaler.step(a); scaler.step(b), where a chunk holds
    gradients of both: it was refused, after the chunks before it had their unscale pending."""
    eager, _, wrapped, _ = pair(tight)
    halves = []
    for model in (eager, wrapped):
        params = list(model.parameters())
        halves.append((params[::2], params[1::2]))  # weights and biases of one layer share chunks
    opts = [[cls(h, lr=1e-2, weight_decay=0.1) for h in halves[i]]
            for i, cls in enumerate((torch.optim.AdamW, hetero.optim.AdamW))]
    scalers = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 10), hetero.optim.GradScaler("cpu", init_scale=2.0 ** 10))
    for x, y in batches(3, seed=8):
        for model, (a, b), scaler in ((eager, opts[0], scalers[0]), (wrapped, opts[1], scalers[1])):
            scaler.scale(loss_of(model(x, y))).backward()
            scaler.unscale_(a)
            scaler.step(a)
            scaler.step(b)
            scaler.update()
            a.zero_grad()
            b.zero_grad()
    assert_same_model(eager, wrapped)


class Rotor(torch.nn.Module):
    """A complex parameter (then a real layer): a loss of a real input."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.z = torch.nn.Parameter(torch.randn(rows, cols, dtype=torch.complex64))
        self.out = torch.nn.Linear(rows, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.view_as_real(x.to(torch.complex64) @ self.z.T).sum(-1)).pow(2).mean()


def test_complex_parameters_step_as_torch_s() -> None:
    """torch's Adam updates a complex parameter as its real and imaginary parts; hetero's took
    complex products (exp_avg_sq with negative real parts)."""
    torch.manual_seed(0)
    eager = Rotor(16, 8)
    wrapped = hetero.wrap(copy.deepcopy(eager), device="cpu", chunk_size="1KiB", device_budget=2200)
    eopt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    hopt = hetero.optim.AdamW(wrapped.parameters(), lr=1e-2)
    for x in torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(1)):
        for model, opt in ((eager, eopt), (wrapped, hopt)):
            model(x).backward()
            opt.step()
            opt.zero_grad()
    assert_same_model(eager, wrapped)
    torch.testing.assert_close(hopt.state_dict()["state"][0]["exp_avg_sq"], eopt.state_dict()["state"][0]["exp_avg_sq"])


def test_unsupported_options_in_groups_are_refused_before_they_are_added() -> None:
    wrapped = hetero.wrap(seeded_gpt(), device="cpu")
    params = list(wrapped.parameters())
    for option in ("amsgrad", "maximize", "capturable", "differentiable"):
        with pytest.raises(hetero.HeteroConfigError, match=option):
            hetero.optim.AdamW([{"params": params, option: True}])
        opt = hetero.optim.AdamW(params[:2])
        with pytest.raises(hetero.HeteroConfigError, match=option):
            opt.add_param_group({"params": params[2:], option: True})
        assert len(opt.param_groups) == 1


def test_hyper_parameters_of_other_number_types_are_accepted_as_torch_does() -> None:
    """numpy numbers and one-element tensors, as torch's constructor takes them."""
    import numpy as np

    for kw in (dict(lr=np.float32(0.01)), dict(eps=np.float64(1e-8)), dict(betas=(torch.tensor(0.9), torch.tensor(0.99)))):
        eager, eopt, wrapped, hopt = pair({"device": "cpu"}, **kw)
        data = batches(2)
        assert train(wrapped, hopt, data) == pytest.approx(train(eager, eopt, data), rel=1e-5)
    with pytest.raises(hetero.HeteroConfigError, match="lr"):
        hetero.optim.AdamW(wrapped.parameters(), lr=np.float32(-1))


def test_a_gradient_assigned_between_two_backwards_replaces_the_first(tight: dict) -> None:
    """backward, p.grad = g, backward: torch's gradient is g + the second backward's; hetero
    kept the first backward's under both."""
    eager, eopt, wrapped, hopt = pair(tight)
    (x1, y1), (x2, y2) = batches(2, seed=9)
    norms = []
    for model in (eager, wrapped):
        loss_of(model(x1, y1)).backward()
        p = list(model.parameters())[2]
        p.grad = torch.full_like(p, 0.25)
        loss_of(model(x2, y2)).backward()
        norms.append(model.clip_grad_norm_(1e9) if model is wrapped
                     else torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    torch.testing.assert_close(norms[1].cpu(), norms[0])


def test_optimizer_states_of_complex_parameters_and_empty_entries_load() -> None:
    """A complex parameter's moments are complex (torch's and hetero's state_dict alike), and
    torch saves {} for a parameter whose state was only looked at: both were refused."""
    torch.manual_seed(0)
    eager = Rotor(4, 4)
    wrapped = hetero.wrap(copy.deepcopy(eager), device="cpu")
    eopt, hopt = torch.optim.AdamW(eager.parameters()), hetero.optim.AdamW(wrapped.parameters())
    for model, opt in ((eager, eopt), (wrapped, hopt)):
        model(torch.randn(2, 4)).backward()
        opt.step()
    saved = copy.deepcopy(eopt.state_dict())
    saved["state"][1] = {}  # (as torch saves a parameter whose state was only looked at)
    hopt.load_state_dict(copy.deepcopy(hopt.state_dict()))
    hopt.load_state_dict(saved)
    assert 1 not in hopt.state_dict()["state"] and hopt.state_dict()["state"][0]["exp_avg"].is_complex()


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_the_constructors_take_torch_s_arguments(name: str) -> None:
    """API.md: the same arguments as torch's. Names, order, positional or keyword-only, and
    defaults match torch's (an unknown keyword to AdamW was reported as Adam's, and
    ``amsgrad`` could not be passed by position)."""
    import inspect

    def shape(cls: type) -> tuple[list, dict]:  # positional in order; keyword-only by name
        params = inspect.signature(cls.__init__).parameters.values()
        return ([(p.name, p.default) for p in params if p.kind != p.KEYWORD_ONLY],
                {p.name: p.default for p in params if p.kind == p.KEYWORD_ONLY})

    ours, theirs = getattr(hetero.optim, name), getattr(torch.optim, name)
    assert shape(ours) == shape(theirs)
    with pytest.raises(TypeError, match=f"{name}.__init__.*'bogus'"):
        ours([torch.nn.Parameter(torch.zeros(1))], bogus=1)
