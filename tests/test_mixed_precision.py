"""Mixed precision: bf16/fp16 compute copies on the device, fp32 masters placed by the runtime,
equal to torch's fp32-master recipe (compute in a low-precision copy, step the fp32 master)."""

from __future__ import annotations

import copy

import pytest
import torch

import hetero
from helpers import assert_within_budgets, budgets
from models import GPT, batches, state_bytes


def make(qkv_bias: bool = True) -> GPT:
    torch.manual_seed(0)
    return GPT(qkv_bias=qkv_bias)


def eager_master_recipe(dtype: torch.dtype, data, clip: float | None, device: str = "cpu",
                        eps: float = 1e-8, prepare=None):
    """torch's recipe; ``prepare`` is applied to the compute copy first (benchmarks/mp_diag.py
    lays its parameters out as a chunk would)."""
    # On the GPU eager steps there and hetero steps host-resident chunks on the CPU: the model
    # without the q/k/v bias, which would amplify their last-bit differences (see models.GPT).
    master = make(qkv_bias=device == "cpu").to(device)
    compute = copy.deepcopy(master).to(dtype)
    if prepare is not None:
        prepare(compute)
    opt = torch.optim.AdamW(master.parameters(), lr=1e-2, weight_decay=0.1, eps=eps)
    losses = []
    for x, y in data:
        loss = compute(x.to(device), y.to(device))
        loss.backward()
        for pm, pc in zip(master.parameters(), compute.parameters()):
            pm.grad = None if pc.grad is None else pc.grad.float()
            pc.grad = None
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for pm, pc in zip(master.parameters(), compute.parameters()):
                pc.copy_(pm)
        losses.append(loss.item())
    return losses, master


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split", ["all_device", "device25_host30_nvme"])
def test_mixed_precision_matches_fp32_master_recipe(dtype, split, device, tmp_path) -> None:
    data = batches(4, seed=3)
    want_losses, master = eager_master_recipe(dtype, data, clip=None, device=device)
    kw = {} if split == "all_device" else budgets(state_bytes(make(device == "cpu")), 0.25, 0.3, tmp_path)
    wrapped = hetero.wrap(make(qkv_bias=device == "cpu"), **kw | {"device": device}, chunk_size="8KiB",
                          mixed_precision=hetero.MixedPrecision(param_dtype=dtype))
    opt = hetero.optim.AdamW(wrapped.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for x, y in data:
        loss = wrapped(x.to(device), y.to(device))
        assert loss.dtype == dtype
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses == pytest.approx(want_losses, rel=1e-3)
    sd = wrapped.state_dict()
    for k, v in master.state_dict().items():
        assert sd[k].dtype == torch.float32  # the state dict holds the fp32 masters
        # On the GPU the CPU-stepped chunks round differently from torch's GPU step: 1 ulp a step.
        tol = {} if device == "cpu" else {"rtol": 1e-5, "atol": 1e-6}
        torch.testing.assert_close(sd[k], v.cpu(), **tol)
    rep = assert_within_budgets(wrapped)
    kinds = {b["kind"] for b in rep["blocks"]}
    assert {"param", "grad", "master", "exp_avg", "exp_avg_sq"} <= kinds
    sizes = {(b["id"].split(".")[0], b["kind"]): b["bytes"] for b in rep["blocks"]}
    for (chunk, kind), n in sizes.items():
        if kind == "param":
            assert sizes[(chunk, "master")] == 2 * n  # 2-byte compute copy, 4-byte master


def test_mixed_precision_clip_and_state_dict_round_trip() -> None:
    data = batches(3, seed=8)
    _, master = eager_master_recipe(torch.bfloat16, data, clip=0.5)
    wrapped = hetero.wrap(make(), device="cpu", chunk_size="8KiB",
                          mixed_precision=hetero.MixedPrecision(param_dtype=torch.bfloat16))
    opt = hetero.optim.AdamW(wrapped.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in data:
        wrapped(x, y).backward()
        wrapped.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
    sd = wrapped.state_dict()
    for k, v in master.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=1e-3, atol=1e-3)
    fresh = hetero.wrap(GPT(), device="cpu", mixed_precision=hetero.MixedPrecision(param_dtype=torch.bfloat16))
    fresh.load_state_dict(sd)
    for k, v in fresh.state_dict().items():
        torch.testing.assert_close(v, sd[k], rtol=0, atol=0)
    x, y = data[0]
    torch.testing.assert_close(fresh(x, y), wrapped(x, y))


def test_the_gpu_diagnostic_reports_differences_only_where_there_are(monkeypatch) -> None:
    """``benchmarks/mp_diag.py`` (run by gpu_check.sh) on the CPU: hetero and the recipe end
    identical in every variant it tries, and a real difference (the recipe with another Adam
    eps) shows up, weight by weight."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    import mp_diag

    for variant in mp_diag.VARIANTS:
        (row,) = mp_diag.compare(torch.bfloat16, "cpu", variant)
        assert row.endswith("every weight identical"), row
    real = mp_diag.eager_master_recipe
    monkeypatch.setattr(mp_diag, "eager_master_recipe", lambda *a, **kw: real(*a, **kw | {"eps": 1e-3}))
    rows = mp_diag.compare(torch.bfloat16, "cpu", "base")
    assert len(rows) > 1 and any(r.strip().startswith("wte.weight") for r in rows[1:])


def test_buffers_come_back_in_their_own_dtypes() -> None:
    """``buffer_dtype`` casts buffers for compute; the full state dict gives them in the dtypes
    they had (as FSDP's), their values rounded to ``buffer_dtype``; integer buffers untouched."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    net.register_buffer("wide", torch.tensor(1.2345678901234567, dtype=torch.float64))
    want = net.state_dict()
    wrapped = hetero.wrap(net, device="cpu", mixed_precision=hetero.MixedPrecision(
        param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16))
    assert net[1].running_var.dtype == torch.bfloat16  # what compute uses
    got = wrapped.state_dict()
    assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in want.items()}
    assert got["wide"].item() == torch.tensor(1.2345678901234567).to(torch.bfloat16).item()
    assert torch.equal(got["1.num_batches_tracked"], want["1.num_batches_tracked"])
    wrapped.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm, refused", [
    (lambda: torch.nn.BatchNorm1d(8), True),
    (lambda: torch.nn.InstanceNorm1d(8, affine=True, track_running_stats=True), True),
    (lambda: torch.nn.BatchNorm1d(8, affine=False), True),
    (lambda: torch.nn.BatchNorm1d(8, track_running_stats=False), False),  # no running statistics
    (lambda: torch.nn.LayerNorm(8), False)],
    ids=["batchnorm", "instancenorm", "batchnorm_not_affine", "batchnorm_without_stats", "layernorm"])
def test_a_norm_layer_with_fp32_running_stats_is_refused_up_front(dtype, norm, refused) -> None:
    """Found in review: with hetero's own MixedPrecision (no classes to ignore) a BatchNorm's
    fp32 running stats failed the first forward with a bare 'expected scalar type BFloat16 but
    found Float', in training and in eval; only torch's MixedPrecision was refused up front. With
    buffer_dtype the compute dtype, or without running statistics, it trains."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), norm(), torch.nn.Linear(8, 1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mp = hetero.MixedPrecision(param_dtype=dtype)
    if refused:
        with pytest.raises(hetero.HeteroConfigError, match=rf"module '1' \(\w+Norm1d\).*buffer_dtype={dtype}"):
            hetero.wrap(model, device="cpu", mixed_precision=mp)
        assert all(torch.equal(v, before[k]) and v.dtype == before[k].dtype for k, v in model.state_dict().items())
        mp = hetero.MixedPrecision(param_dtype=dtype, buffer_dtype=dtype)
    wrapped = hetero.wrap(model, device="cpu", mixed_precision=mp)
    x = torch.randn(4, 8, 8) if isinstance(model[1], torch.nn.InstanceNorm1d) else torch.randn(4, 8)
    wrapped(x).float().sum().backward()
    wrapped.eval()
    with torch.no_grad():
        assert torch.isfinite(wrapped(x).float()).all()
    wrapped.close()


def test_torch_s_mixed_precision_with_batchnorm_is_refused_up_front():
    """torch's MixedPrecision keeps BatchNorm in fp32 (_module_classes_to_ignore); hetero runs it
    in param_dtype, and with fp32 running stats the first forward failed with a bare
    'expected scalar type BFloat16 but found Float'. With buffer_dtype the compute dtype it trains."""
    from torch.distributed.fsdp import MixedPrecision as TorchMP

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    with pytest.raises(hetero.HeteroConfigError, match="'1'.*BatchNorm1d.*buffer_dtype"):
        hetero.wrap(model, device="cpu", mixed_precision=TorchMP(param_dtype=torch.bfloat16))
    wrapped = hetero.wrap(model, device="cpu", mixed_precision=TorchMP(param_dtype=torch.bfloat16,
                                                                       buffer_dtype=torch.bfloat16))
    wrapped(torch.randn(4, 8)).float().sum().backward()
