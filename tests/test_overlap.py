"""Prefetch overlaps transfers with compute: with an artificially slow host -> device link, the
time compute waits for blocks (the runtime's own stall counter) nearly vanishes with prefetch."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

import hetero

DELAY = 0.02  # seconds added to every transfer
COMPUTE = 0.03  # seconds of "compute" per unit forward (sleeps release the GIL like kernels do)


class SlowUnit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(COMPUTE)
        return torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(SlowUnit() for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


class _Delayed:
    def __init__(self, future) -> None:
        self._future = future

    def wait(self) -> None:
        self._future.result()

    def done(self) -> bool:
        return self._future.done()


def slow_down(model: hetero.HeteroModule, pool: ThreadPoolExecutor) -> None:
    """Every transfer of the runtime takes DELAY longer, on another thread (like a slow link)."""
    storage = model._hetero_state.runtime.storage
    real = storage.copy

    def copy(*args):
        def run():
            time.sleep(DELAY)
            real(*args).wait()
        return _Delayed(pool.submit(run))

    storage.copy = copy


def run(prefetch: int) -> tuple[float, int]:
    torch.manual_seed(0)
    net = Net()
    unit_bytes = sum(p.numel() * 4 for p in net.blocks[0].parameters())
    # Room for three units' params on the device: every step fetches most of them again.
    model = hetero.wrap(net, device="cpu", device_budget=4 * unit_bytes, prefetch=prefetch,
                        chunk_size="64KiB")
    x = torch.randn(4, 32)
    with ThreadPoolExecutor(4) as pool:
        slow_down(model, pool)
        with torch.no_grad():
            rt = model._hetero_state.runtime
            for _ in range(2):  # records the access sequence, then locks on to it
                model(x)
                rt.end_step()
            rt.drain()
            stalls0 = rt.tracker.stall_seconds
            fetches0 = rt.tracker.traffic["host->device"]
            for _ in range(3):
                model(x)
                rt.end_step()
            rt.drain()
    stalled = rt.tracker.stall_seconds - stalls0
    fetched = (rt.tracker.traffic["host->device"] - fetches0) // unit_bytes
    model.close()
    return stalled, fetched


def test_prefetch_hides_transfer_time_behind_compute() -> None:
    stalled0, fetched0 = run(prefetch=0)
    stalled2, fetched2 = run(prefetch=2)
    assert fetched0 >= 12 and fetched2 >= 12, "the budget must force fetches every step"
    # Without prefetch, compute waits for every fetch in full.
    assert stalled0 >= 0.8 * fetched0 * DELAY
    # With it, transfers run while earlier units compute (COMPUTE > DELAY): little waiting left.
    assert stalled2 <= 0.25 * stalled0, (stalled0, stalled2)


# ---- the optimizer's host step, deferred to the runtime's worker (hetero.optim.adam)

SLOW = 0.01  # seconds added to every kernel call


def deferred_run(monkeypatch, defer: str, fail: bool = False, step: bool = True):
    """Two steps of the test GPT at a 25% device budget with a slow host kernel; returns the
    model, its optimizer, the eager twin, how long the second ``step()`` took and a one-item
    list counting the kernel calls made since (without ``step``: stops before that ``step()``)."""
    import copy

    from hetero.optim import adam as adam_mod
    from helpers import default_step
    from models import GPT, batches, state_bytes

    monkeypatch.setenv("HETERO_DEFER_STEP", defer)
    real, calls = adam_mod.adam_step_, [0]

    def slow(*args, **kwargs):
        calls[0] += 1
        time.sleep(SLOW)
        if fail:
            raise RuntimeError("kernel failed")
        real(*args, **kwargs)

    torch.manual_seed(0)
    net = GPT()
    eager = copy.deepcopy(net)
    model = hetero.wrap(net, device="cpu", device_budget=state_bytes(net) // 4, chunk_size="8KiB")
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    data = batches(4, seed=1)
    default_step(model, opt, data[0])
    default_step(eager, eager_opt, data[0])
    monkeypatch.setattr(adam_mod, "adam_step_", slow)
    x, y = data[1]
    model(x, y).backward()
    calls[0] = 0
    if not step:
        return model, opt, (eager, eager_opt, data), None, calls
    t0 = time.perf_counter()
    opt.step()
    took = time.perf_counter() - t0
    return model, opt, (eager, eager_opt, data), took, calls


def test_deferred_step_returns_at_once_and_the_next_forward_waits_for_it(monkeypatch) -> None:
    from helpers import default_step

    model, opt, (eager, eager_opt, data), took, calls = deferred_run(monkeypatch, "1")
    rt = model._hetero_state.runtime
    assert any(op.compute for op in rt._ops), "nothing was deferred"
    rt.drain()
    n = calls[0]
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


def test_synchronous_step_when_not_deferred(monkeypatch) -> None:
    model, _, _, took, calls = deferred_run(monkeypatch, "0")
    n = calls[0]
    assert n > 5 and took >= n * SLOW
    assert not any(op.compute for op in model._hetero_state.runtime._ops)
    model.close()


def test_deferred_step_failure_surfaces_and_the_runtime_drains(monkeypatch) -> None:
    model, opt, _, _, _ = deferred_run(monkeypatch, "1", fail=True, step=False)
    rt = model._hetero_state.runtime
    with pytest.raises(RuntimeError, match="kernel failed"):  # from step() or a later call
        opt.step()
        rt.drain()
    while rt._ops:  # every op of the failed work reports it once, then is gone
        with pytest.raises(RuntimeError, match="kernel failed"):
            rt.drain()
    model.close()
