"""The CUDA device tier: the same placement paths with a real GPU (skipped without CUDA)."""

from __future__ import annotations

import copy

import pytest
import torch

import hetero
from helpers import assert_within_budgets
from models import GPT, batches, state_bytes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make() -> GPT:
    torch.manual_seed(0)
    return GPT()


@pytest.mark.parametrize("split", [(None, None), (0.25, None), (0.2, 0.3)])
def test_cuda_training_matches_eager(split, tmp_path) -> None:
    device_frac, host_frac = split
    total = state_bytes(make())
    kw: dict = {"device": "cuda", "chunk_size": "8KiB"}
    if device_frac is not None:
        kw["device_budget"] = int(total * device_frac)
    if host_frac is not None:
        kw |= {"host_budget": int(total * host_frac), "nvme_path": str(tmp_path)}
    eager = make().cuda()
    wrapped = hetero.wrap(copy.deepcopy(make()), **kw)
    eopt = torch.optim.AdamW(eager.parameters(), lr=1e-2, foreach=False)
    hopt = hetero.optim.AdamW(wrapped.parameters(), lr=1e-2)
    for x, y in batches(3):
        x, y = x.cuda(), y.cuda()
        le, lh = eager(x, y), wrapped(x, y)
        torch.testing.assert_close(lh, le, rtol=1e-4, atol=1e-4)
        le.backward(), lh.backward()
        eopt.step(), hopt.step()
        eopt.zero_grad(), hopt.zero_grad()
    sd = wrapped.state_dict()
    for k, v in eager.state_dict().items():
        assert sd[k].device.type == "cpu"
        torch.testing.assert_close(sd[k], v.cpu(), rtol=1e-4, atol=1e-5)
    rep = assert_within_budgets(wrapped)
    if device_frac is not None:
        assert rep["traffic"]["host->device"] > 0


def test_host_arena_is_pinned() -> None:
    wrapped = hetero.wrap(make(), device="cuda", chunk_size="8KiB")
    assert wrapped._hetero_state.runtime.storage.arena.buffer.is_pinned()
