"""Training loops shared by the tests: the same model trained eagerly and through hetero."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from torch import nn

import hetero
from models import GPT, state_bytes

OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, hetero.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adam": (torch.optim.Adam, hetero.optim.Adam, dict(lr=1e-2, weight_decay=0.05)),
}


class SettleAll(hetero.policies.Auto):
    """``auto``, except that it settles every Adam state it is offered onto the device: the
    built-in policies home states on the device in the first step where they fit, which leaves
    nothing to settle in the tests' small models."""

    def settle(self, block, capacity):
        return "device" if block.kind in ("exp_avg", "exp_avg_sq") else None


def seeded_gpt() -> GPT:
    """The tests' default GPT, initialized from seed 0 (the same weights every call)."""
    torch.manual_seed(0)
    return GPT()


def tight_budgets(kind: str, tmp_path: Any) -> dict:
    """wrap() kwargs whose budgets force movement in :func:`seeded_gpt`: ``device25_host`` (device
    25% of the state, host the rest) or ``device20_host30_nvme`` (device 20%, host 30%, NVMe)."""
    total = state_bytes(seeded_gpt())
    if kind == "device25_host":
        return budgets(total, 0.25, None) | {"chunk_size": "8KiB"}
    return budgets(total, 0.20, 0.30, tmp_path) | {"chunk_size": "8KiB"}


def budgets(total: int, device: float | None, host: float | None, nvme_path: Any = None) -> dict:
    """wrap() kwargs giving the device and host tiers the given fractions of ``total`` bytes."""
    kw: dict[str, Any] = {"device": "cpu"}
    if device is not None:
        kw["device_budget"] = int(total * device)
    if host is not None:
        kw["host_budget"] = int(total * host)
    if nvme_path is not None:
        kw["nvme_path"] = str(nvme_path)
    return kw


def settling(make: Callable[[], nn.Module], device: float, nvme_path: Any,
             policy: hetero.policies.Policy | None = None) -> dict:
    """wrap() kwargs where Adam states settle on the device: ``device`` of ``make()``'s state
    there, 30% on the host, swap files in ``nvme_path``, 8 KiB chunks, and ``policy``, by
    default a fresh :class:`SettleAll` (the built-in policies settle nothing in models this
    small)."""
    from models import state_bytes

    return dict(budgets(state_bytes(make()), device, 0.3, nvme_path), chunk_size="8KiB",
                policy=SettleAll() if policy is None else policy)


def loss_of(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


def train_pair(make: Callable[[], nn.Module], wrap_kwargs: dict, data: list, *, opt: str = "adamw",
               step_fn: Callable | None = None) -> tuple[list[float], list[float], nn.Module, hetero.HeteroModule]:
    """Train ``make()`` eagerly and a deep copy through hetero on the same batches.

    ``step_fn(model, optimizer, batch) -> loss`` defaults to forward, backward, step, zero_grad.
    Returns both loss curves, the eager model and the hetero model.
    """
    torch_cls, hetero_cls, hp = OPTIMIZERS[opt]
    eager = make()
    wrapped = hetero.wrap(copy.deepcopy(eager), **wrap_kwargs)
    eager_opt = torch_cls(eager.parameters(), **hp)
    hetero_opt = hetero_cls(wrapped.parameters(), **hp)
    step_fn = step_fn or default_step
    eager_losses = [step_fn(eager, eager_opt, b) for b in data]
    hetero_losses = [step_fn(wrapped, hetero_opt, b) for b in data]
    return eager_losses, hetero_losses, eager, wrapped


def default_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> float:
    x, y = batch
    loss = loss_of(model(x, y))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def assert_same_model(eager: nn.Module, wrapped: hetero.HeteroModule) -> None:
    got = wrapped.state_dict()
    want = eager.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].device.type == "cpu"
        torch.testing.assert_close(got[k], want[k], msg=lambda m: f"{k}: {m}")


def assert_within_budgets(wrapped: hetero.HeteroModule) -> dict:
    rep = wrapped.placement_report().as_dict()
    for name, tier in rep["tiers"].items():
        assert tier["peak"] <= tier["capacity"], f"{name} peak {tier['peak']} > capacity {tier['capacity']}"
        assert 0 <= tier["used"] <= tier["peak"]
    return rep


def snapshot(model: hetero.HeteroModule, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Copies of the model's state dict and the optimizer's per-parameter state, to compare."""
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    osd = opt.state_dict()
    state = {i: {k: v.clone() for k, v in s.items()} for i, s in osd["state"].items()}
    return sd, state


def assert_same_state(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    """Two snapshots are bit-identical (a failed step must change nothing)."""
    (sd_a, st_a), (sd_b, st_b) = a, b
    assert sd_a.keys() == sd_b.keys()
    for k in sd_a:
        assert torch.equal(sd_a[k], sd_b[k]), f"parameter {k} changed"
    assert st_a.keys() == st_b.keys()
    for i in st_a:
        for k in st_a[i]:
            assert torch.equal(st_a[i][k], st_b[i][k]), f"optimizer state {i}.{k} changed"


def failed_step(model: hetero.HeteroModule, opt: torch.optim.Optimizer, batch: Any, kind: str,
                after: int) -> bool:
    """A training step on ``batch`` hit by an injected swap ``kind`` fault after ``after`` more
    requests must raise HeteroIOError: from the forward, backward or ``step()``, or from the
    updates ``step()`` postponed (run here at once, as the next forward would run them), or
    from the drain after them (a write-back). Returns whether the step took effect: only once
    ``step()`` has returned, whose postponed updates then roll forward once the fault is gone
    (the caller checks the values against eager training). Otherwise every parameter and
    optimizer state must be as before; the gradients the step made are cleared."""
    from hetero import engine

    rt = model._hetero_state.runtime
    rt.drain()
    before = snapshot(model, opt)
    engine.inject_fault(kind, after=after)
    stepped = False
    try:
        with pytest.raises(hetero.HeteroIOError):
            x, y = batch
            loss_of(model(x, y)).backward()
            opt.step()
            stepped = True
            opt.zero_grad()
            rt.catch_up()
            rt.drain()
    finally:
        engine.inject_fault("none")
    opt.zero_grad()
    if not stepped:
        assert_same_state(snapshot(model, opt), before)
    return stepped


def copy_engine(backend: str, monkeypatch: pytest.MonkeyPatch, cuda: bool = False):
    """A 2-thread ``hetero.copies.CopyEngine`` on ``backend`` ("extension" or "python"), or a
    skip where the extension (with its CUDA path, for ``cuda``) is not built."""
    from hetero import copies

    if backend == "extension":
        if copies._C is None:
            pytest.skip(f"hetero._C not built: {copies.EXTENSION_ERROR}")
        if cuda and not copies._C.COPY_CUDA:
            pytest.skip("hetero._C was built without CUDA (HETERO_CUDA)")
        monkeypatch.delenv("HETERO_FORCE_PYTHON_COPY", raising=False)
    else:
        monkeypatch.setenv("HETERO_FORCE_PYTHON_COPY", "1")
    eng = copies.CopyEngine(num_threads=2)
    assert eng.backend == backend
    return eng
