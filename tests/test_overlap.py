"""Prefetch overlaps transfers with compute: with an artificially slow host -> device link, the
time compute waits for blocks (the runtime's own stall counter) nearly vanishes with prefetch; and
the optimizer's NVMe reads are fetched ahead even where the recorded step cannot predict them."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

import hetero
from models import GPT, batches, state_bytes

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



@pytest.mark.parametrize("defer,policy", [("0", "auto"), ("1", "lru")], ids=["synchronous", "postponed"])
def test_the_optimizer_fetches_its_next_chunk_while_one_updates(tmp_path, monkeypatch, defer, policy) -> None:
    # Which chunks must move changes from step to step, so the recorded step does not predict
    # the optimizer's order: its reads from NVMe are fetched ahead only because the optimizer
    # names its next chunk (Runtime.hint), in step() or, postponed, in the next forward. (There
    # the order is the forward's, which a recording does predict: `lru` predicts nothing.)
    monkeypatch.setenv("HETERO_DEFER_STEP", defer)
    torch.manual_seed(0)
    net = GPT()
    total = state_bytes(net)
    model = hetero.wrap(net, device="cpu", device_budget=total // 5, host_budget=int(total * 0.45),
                        nvme_path=str(tmp_path), chunk_size="8KiB", policy=policy)
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)
    tracker = model._hetero_state.runtime.tracker
    issued: list[tuple[str, int, bool]] = []
    real_count = tracker.count

    def count(block, src, dst, nbytes, prefetch=False):
        if "exp_avg" in block:  # the optimizer's own reads
            issued.append((f"{src}->{dst}", nbytes, prefetch))
        real_count(block, src, dst, nbytes, prefetch)

    try:
        for i, (x, y) in enumerate(batches(5, seed=1)):
            if i == 3:
                tracker.count = count
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        reads = [(n, ahead) for d, n, ahead in issued if d == "nvme->host"]
        ahead = sum(n for n, a in reads if a) / sum(n for n, _ in reads)
        assert len(reads) > 10 and ahead > 0.6, f"{ahead:.0%} of {len(reads)} NVMe reads were fetched ahead"
    finally:
        tracker.count = real_count
        model.close()
