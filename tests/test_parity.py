"""Training through hetero equals eager PyTorch training, under every budget split and model shape."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_same_model, assert_within_budgets, budgets, train_pair
from models import GPT, batches, state_bytes

VARIANTS = {
    "tied": {},
    "checkpointing": {"checkpointing": True},
    "repeat_block": {"repeat_block": True},
    "routed": {"routed": True},
    "frozen": {},
}
SPLITS = {
    "all_device": (None, None, False),
    "device25_host": (0.25, None, False),
    "device20_host30_nvme": (0.20, 0.30, True),
}


def make_model(variant: str) -> GPT:
    torch.manual_seed(0)
    model = GPT(**VARIANTS[variant])
    if variant == "frozen":
        model.wpe.weight.requires_grad_(False)
        for p in model.h[1].parameters():
            p.requires_grad_(False)
    return model


@pytest.mark.parametrize("opt", ["adamw", "adam"])
@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity(variant: str, split: str, opt: str, tmp_path) -> None:
    device, host, nvme = SPLITS[split]
    total = state_bytes(make_model(variant))
    kw = budgets(total, device, host, tmp_path if nvme else None)
    data = batches(4, seed=1)
    eager_losses, hetero_losses, eager, wrapped = train_pair(
        lambda: make_model(variant), dict(kw, chunk_size="8KiB"), data, opt=opt)
    assert hetero_losses == pytest.approx(eager_losses, rel=1e-5)
    assert_same_model(eager, wrapped)
    rep = assert_within_budgets(wrapped)
    assert rep["steps"] == len(data)
    if device is not None:
        assert rep["tiers"]["device"]["capacity"] < total / 3
        assert rep["traffic"]["host->device"] > 0 and rep["traffic"]["device->host"] > 0
    if nvme:
        assert rep["traffic"]["host->nvme"] > 0 and rep["traffic"]["nvme->host"] > 0
        assert any(b["tier"] == "nvme" for b in rep["blocks"])


def test_frozen_parameters_have_no_grad_or_optimizer_blocks() -> None:
    _, _, eager, wrapped = train_pair(lambda: make_model("frozen"), {"device": "cpu", "chunk_size": "8KiB"},
                                      batches(2))
    kinds_by_frozen: dict[bool, set[str]] = {True: set(), False: set()}
    state = wrapped._hetero_state
    for chunk in state.chunks:
        kinds_by_frozen[not chunk.requires_grad].update(chunk.blocks)
    assert kinds_by_frozen[True] == {"param"}
    assert {"param", "grad", "exp_avg", "exp_avg_sq"} <= kinds_by_frozen[False]
    torch.testing.assert_close(wrapped.state_dict()["wpe.weight"], eager.wpe.weight.detach())


def test_routed_expert_unused_in_a_step_is_not_updated(tmp_path) -> None:
    """With set_to_none zero_grad, an expert no batch was routed to keeps its weights (as eager)."""
    data = [b for b in batches(40, seed=3) if int(b[0][0, 0]) % 2 == 0][:3]  # always expert 0
    make = lambda: make_model("routed")
    before = make().state_dict()
    _, _, eager, wrapped = train_pair(make, budgets(state_bytes(make()), 0.25, 0.3, tmp_path) | {"chunk_size": "8KiB"}, data)
    after = wrapped.state_dict()
    for k in before:
        if k.startswith("experts.1."):
            torch.testing.assert_close(after[k], before[k], rtol=0, atol=0)
        if k.startswith("experts.0."):
            assert not torch.equal(after[k], before[k])
    assert_same_model(eager, wrapped)
