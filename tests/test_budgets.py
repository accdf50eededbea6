"""Budgets are hard caps: random budgets, chunk sizes and model shapes never push a tier over its
capacity, and training still equals eager."""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hetero
from helpers import assert_same_model, assert_within_budgets, train_pair
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
