"""The fused C++ CPU Adam kernel (csrc/cpu_adam.cpp via hetero.optim.kernel) against torch.

The kernel's contract is torch's single-tensor Adam op for op, so the comparisons here are exact
(``torch.equal``), not approximate: with ``sqrt="torch"`` against ``torch.optim.Adam/AdamW`` itself,
with ``sqrt="ieee"`` against the same op sequence with a correctly rounded square root (and, to
float32 rounding, against torch's fused AdamW). Every code path is forced in turn. On a CPU without
AVX-512 the AVX-512 path runs emulated: the tests taking ``isa="avx512"`` then call a second build
of csrc/cpu_adam.cpp whose AVX-512 intrinsics are emulated on AVX2 (tests/native/avx512_emulation.h,
on SIMDe: ``apt-get install libsimde-dev``). The path's own code runs, each 512-bit instruction
replaced by AVX2/FMA/F16C instructions with the same lane results. With HETERO_REQUIRE_AVX512_TESTS=1
(set by .ci/run) a missing prerequisite fails these tests instead of skipping them.
"""

from __future__ import annotations

import functools
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from hetero.optim import kernel as K

pytestmark = pytest.mark.skipif(not K.has_kernel(), reason="hetero._C built without the CPU Adam kernel")

ISAS = ["avx512", "avx2", "scalar"]
# Odd lengths, tails shorter than an AVX2 (8) or AVX-512 (16) vector, empty, a thread split.
SIZES = [0, 1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 100, 1023, 4097, 70001]
HYPER = {
    "default": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0),
    "wd": dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
    "big_eps_low_betas": dict(lr=3e-2, betas=(0.3, 0.6), eps=1e-3, weight_decay=0.05),  # lerp w >= 0.5
    "beta1_zero": dict(lr=5e-3, betas=(0.0, 0.95), eps=1e-6, weight_decay=0.01),
}


ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def emulated_avx512():
    """The kernel's Python functions from a build of csrc/cpu_adam.cpp with -DHETERO_EMULATE_AVX512,
    or the reason it cannot be built here (a string). Built once per machine and torch version in
    torch's extension cache (about a minute on two cores), rebuilt when a source changes."""
    if "avx2" not in K.available_isas():
        return f"the emulation runs on AVX2 + FMA + F16C; this CPU has {K.available_isas()}"
    if not cpp_extension.is_ninja_available():
        return "torch.utils.cpp_extension.load needs ninja (apt-get install ninja-build)"
    probe = subprocess.run(["c++", "-fsyntax-only", "-x", "c++", "-"], input="#include <simde/x86/avx512.h>\n",
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return "SIMDe is not installed (apt-get install libsimde-dev)"
    openmp = ["-fopenmp"] if "parallel backend: OpenMP" in torch.__config__.parallel_info() else []
    return cpp_extension.load(
        name="hetero_adam_avx512_emulated",
        sources=[str(ROOT / "csrc/cpu_adam.cpp"), str(ROOT / "csrc/cpu_adam_bindings.cpp"),
                 str(ROOT / "tests/native/avx512_emulated.cpp")],
        extra_include_paths=[str(ROOT / "csrc"), str(ROOT / "tests/native")],
        extra_cflags=["-O2", "-ffp-contract=off", "-mavx2", "-mfma", "-mf16c", "-DHETERO_EMULATE_AVX512",
                      *openmp],
        extra_ldflags=openmp)


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch) -> str:
    """Each code path in turn; AVX-512 emulated (the kernel module swapped) where the CPU lacks it."""
    name = request.param
    if name in K.available_isas():
        return name
    if name != "avx512":
        pytest.skip(f"this CPU lacks {name} (has {K.available_isas()})")
    ext = emulated_avx512()
    if isinstance(ext, str):
        if os.environ.get("HETERO_REQUIRE_AVX512_TESTS", "") not in ("", "0"):
            pytest.fail(f"the AVX-512 path cannot be tested here: {ext}")
        pytest.skip(f"this CPU lacks avx512 and {ext}")
    monkeypatch.setattr(K, "_ext", ext)
    assert K.selected_isa("avx512") == "avx512"
    return name


def kw_of(hp: dict, step: int, lr: float, decoupled: bool) -> dict:
    return dict(step=step, lr=lr, beta1=hp["betas"][0], beta2=hp["betas"][1], eps=hp["eps"],
                weight_decay=hp["weight_decay"], decoupled=decoupled)


def torch_run(p0: torch.Tensor, grads: list[torch.Tensor], lrs: list[float], hp: dict, decoupled: bool,
              **opt_kw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.optim.Adam/AdamW over the gradients, the lr changed between steps through param_groups."""
    p = torch.nn.Parameter(p0.clone())
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([p], **hp, **opt_kw)
    for g, lr in zip(grads, lrs):
        opt.param_groups[0]["lr"] = lr
        p.grad = g.clone()
        opt.step()
    if not opt.state:
        return p.detach(), torch.zeros_like(p0), torch.zeros_like(p0)
    st = opt.state[p]
    return p.detach(), st["exp_avg"], st["exp_avg_sq"]


def kernel_run(p0: torch.Tensor, grads: list[torch.Tensor], lrs: list[float], hp: dict, decoupled: bool,
               **step_kw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    for step, (g, lr) in enumerate(zip(grads, lrs), 1):
        K.adam_step_(p, g, m, v, **kw_of(hp, step, lr, decoupled), **step_kw)
    return p, m, v


def ieee_reference(p0, grads, lrs, hp, decoupled):
    """torch's single-tensor Adam op for op, but with a correctly rounded square root."""
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    beta1, beta2 = hp["betas"]
    for step, (g, lr) in enumerate(zip(grads, lrs), 1):
        wd = hp["weight_decay"]
        if wd != 0:
            if decoupled:
                p.mul_(1 - lr * wd)
            else:
                g = g.add(p, alpha=wd)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.double().sqrt().float() / (1 - beta2 ** step) ** 0.5).add_(hp["eps"])
        p.addcdiv_(m, denom, value=-(lr / (1 - beta1 ** step)))
    return p, m, v


def problem(n: int, steps: int = 3, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor], list[float]]:
    gen = torch.Generator().manual_seed(seed + n)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) * 10 ** (-k) for k in range(steps)]  # shrinking, as late training
    lrs = [0.5 ** k for k in range(steps)]  # a schedule, scaled by the group's lr below
    return p0, grads, lrs


def assert_same(got, want, what: str) -> None:
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, want):
        assert a.shape == b.shape
        if not torch.equal(a, b):
            bad = (a != b).nonzero().flatten()
            raise AssertionError(f"{what}: {name} differs at {bad.numel()} of {a.numel()} elements, "
                                 f"first {bad[:5].tolist()}: {a[bad[:5]].tolist()} vs {b[bad[:5]].tolist()}")


# ------------------------------------------------------------------------------- fp32, exactness


@pytest.mark.parametrize("hyper", list(HYPER))
@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
def test_equals_torch_optim_bit_for_bit(isa: str, decoupled: bool, hyper: str) -> None:
    hp = HYPER[hyper]
    for n in SIZES:
        p0, grads, lrs = problem(n)
        lrs = [hp["lr"] * f for f in lrs]
        want = torch_run(p0, grads, lrs, hp, decoupled, foreach=False)
        got = kernel_run(p0, grads, lrs, hp, decoupled, isa=isa)
        assert_same(got, want, f"n={n}")


@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
def test_ieee_sqrt_is_torch_op_order_with_correct_rounding(isa: str, decoupled: bool) -> None:
    for hyper, hp in HYPER.items():
        for n in SIZES:
            p0, grads, lrs = problem(n, seed=1)
            lrs = [hp["lr"] * f for f in lrs]
            got = kernel_run(p0, grads, lrs, hp, decoupled, isa=isa, sqrt="ieee")
            assert_same(got, ieee_reference(p0, grads, lrs, hp, decoupled), f"{hyper} n={n}")
            # ... which is torch's fused CPU AdamW to float32 rounding
            fused = torch_run(p0, grads, lrs, hp, decoupled, fused=True)
            for a, b in zip(got, fused):
                torch.testing.assert_close(a, b)


def test_all_code_paths_agree_on_large_input() -> None:
    p0, grads, lrs = problem(1 << 17, steps=4, seed=2)
    hp = HYPER["wd"]
    results = {isa: kernel_run(p0, grads, lrs, hp, True, isa=isa) for isa in K.available_isas()}
    first = next(iter(results.values()))
    for isa, got in results.items():
        assert_same(got, first, isa)


def test_thread_counts_give_identical_results() -> None:
    n = 5 * (1 << 16) + 77  # pieces for 3 threads to share, with a ragged last one
    p0, grads, lrs = problem(n, seed=3)
    hp = HYPER["big_eps_low_betas"]
    gb = [g.bfloat16() for g in grads]
    runs = []
    before = torch.get_num_threads()
    # 1: inline; 2, 3: threads of the kernel's own; None with torch at 2 threads: torch's pool
    for threads, torch_threads in ((1, before), (2, before), (3, before), (None, 2)):
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        out = torch.empty(n, dtype=torch.bfloat16)
        torch.set_num_threads(torch_threads)
        try:
            for step, (g, lr) in enumerate(zip(gb, lrs), 1):
                K.adam_step_(p, g, m, v, **kw_of(hp, step, lr, False), grad_scale=0.5, param_out=out,
                             threads=threads)
        finally:
            torch.set_num_threads(before)
        runs.append((p, m, v, out))
    for other in runs[1:]:
        for a, b in zip(other, runs[0]):
            assert torch.equal(a, b)


# ------------------------------------------------------------------ mixed precision and scaling


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, None], ids=["bf16_out", "fp16_out", "no_out"])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16_g", "fp16_g", "fp32_g"])
def test_mixed_precision_equals_torch_recipe(isa: str, grad_dtype: torch.dtype, out_dtype) -> None:
    """Low-precision grad in, fp32 master/m/v, low-precision param out, clip scale folded in:
    equals converting the grad with torch, scaling it, stepping torch's AdamW on the fp32 master
    and casting the master with torch."""
    hp = HYPER["wd"]
    scale = torch.tensor(0.37)  # e.g. a clipping coefficient
    for n in SIZES:
        p0, grads, lrs = problem(n, seed=4)
        low = [g.to(grad_dtype) for g in grads]
        want = torch_run(p0, [(g.float() * scale) for g in low], lrs, hp, True, foreach=False)
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        out = None if out_dtype is None else torch.full((n,), 7.0, dtype=out_dtype)
        for step, (g, lr) in enumerate(zip(low, lrs), 1):
            K.adam_step_(p, g, m, v, **kw_of(hp, step, lr, True), grad_scale=scale, param_out=out, isa=isa)
        assert_same((p, m, v), want, f"n={n}")
        if out is not None:
            assert torch.equal(out, want[0].to(out_dtype))


def test_grad_scale_multiplies_the_gradient_first(isa: str) -> None:
    hp = HYPER["wd"]  # L2 decay: the scaled gradient gets wd * p added, as in torch
    p0, grads, lrs = problem(4097, seed=5)
    for scale in (0.25, 3.0, 1e-3):
        want = torch_run(p0, [g * torch.tensor(scale) for g in grads], lrs, hp, False, foreach=False)
        assert_same(kernel_run(p0, grads, lrs, hp, False, isa=isa, grad_scale=scale), want, f"scale={scale}")
    # a one-element tensor (as clip_grad_norm_ leaves in chunk.grad_scale) works the same way
    want = torch_run(p0, [g * torch.tensor(0.25) for g in grads], lrs, hp, False, foreach=False)
    assert_same(kernel_run(p0, grads, lrs, hp, False, isa=isa, grad_scale=torch.tensor(0.25)), want, "tensor")


# ------------------------------------------------------------------ low-precision conversions


def special_floats() -> torch.Tensor:
    """fp32 values that exercise rounding to bf16 and fp16: signed zeros, infinities, NaNs (quiet,
    signalling, negative), float denormals, exact ties (odd and even), values just beside ties, the
    fp16 overflow threshold (65504 / 65520), fp16 subnormals and their ties, the smallest values
    that still round to a nonzero fp16, and random bit patterns of every kind."""
    bits = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
            0x7FA00000, 0xFFBFFFFF, 0x00000001, 0x807FFFFF, 0x00400000, 0x7F7FFFFF, 0xFF7FFFFF,
            0x7F7F8000, 0x7F7F7FFF]
    for base in (0x3F800000, 0x3F810000, 0xC0490000, 0x3F808000, 0x40000000):  # bf16 ties
        bits += [base | 0x8000, (base | 0x8000) - 1, (base | 0x8000) + 1, base | 0x18000, base | 0x7FFF]
    for base in (0x3F800000, 0x3F802000, 0x477FE000, 0x38800000):  # fp16 ties at the 13-bit boundary
        bits += [base | 0x1000, (base | 0x1000) - 1, (base | 0x1000) + 1, base | 0x3000]
    values = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    more = torch.tensor([65504.0, 65519.99, 65520.0, 65520.01, -65520.0, 1e5, 6.103515625e-05,
                         6.1e-05, 5.960464477539063e-08, 2.98023223876953125e-08, 2.9802326e-08,
                         8.940696716308594e-08, 1.4901161193847656e-07, 3e-08, 1e-09, -1e-09,
                         1.0 / 3, -2.0 / 3, math.pi, -math.e, 0.1, 1e-40, -1e-40])
    gen = torch.Generator().manual_seed(7)
    rand = torch.randint(-2 ** 31, 2 ** 31, (4096,), generator=gen, dtype=torch.int64).to(torch.int32)
    return torch.cat([values, more, rand.view(torch.float32)])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def same_bits_or_both_nan(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal bit patterns (so -0.0 != 0.0), except that any NaN matches any NaN."""
    nan = torch.isnan(want)
    return torch.equal(torch.isnan(got), nan) and torch.equal(bits(got)[~nan], bits(want)[~nan])


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_param_out_rounds_like_torch(isa: str, out_dtype: torch.dtype) -> None:
    """lr = 0 and a zero gradient leave the param unchanged, so param_out is exactly the cast of
    each special value; NaN stays NaN with its sign."""
    x = special_floats()
    for n in (x.numel(), 1, 7, 13, 17, 33):
        p = x[:n].clone()
        out = torch.zeros(n, dtype=out_dtype)
        K.adam_step_(p, torch.zeros(n), torch.zeros(n), torch.zeros(n), step=1, lr=0.0, beta1=0.9,
                     beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True, param_out=out, isa=isa)
        assert same_bits_or_both_nan(p, x[:n])
        want = x[:n].to(out_dtype)
        diff = bits(out) != bits(want)
        assert same_bits_or_both_nan(out, want), (x[:n][diff], out[diff], want[diff])
        nan = torch.isnan(x[:n])
        assert torch.equal(torch.signbit(out[nan]), torch.signbit(x[:n][nan]))  # sign kept


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_grads_are_read_exactly(isa: str, grad_dtype: torch.dtype) -> None:
    """Every bf16/fp16 bit pattern (subnormals, inf, NaN included) read as torch's .float() reads it:
    with beta1 = 0.5 exp_avg becomes grad/2 (exact), and exp_avg_sq a function of grad*grad."""
    g = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(grad_dtype)
    n = g.numel()
    hp = dict(lr=1e-3, betas=(0.5, 0.999), eps=1e-8, weight_decay=0.0)
    want = torch_run(torch.ones(n), [g.float()], [1e-3], hp, False, foreach=False)
    got = kernel_run(torch.ones(n), [g], [1e-3], hp, False, isa=isa)
    for a, b in zip(got, want):
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        assert torch.equal(a[~torch.isnan(a)], b[~torch.isnan(b)])


# ------------------------------------------------------------------------ selection and errors


def test_torch_numerics_are_reported() -> None:
    tn = K.torch_numerics()
    assert tn["sqrt"] in ("mkl", "ieee") and isinstance(tn["fma"], bool)


def test_code_path_selection(monkeypatch) -> None:
    isas = K.available_isas()
    assert isas[-1] == "scalar" and set(isas) <= set(ISAS)
    monkeypatch.delenv("HETERO_ADAM_ISA", raising=False)
    assert K.selected_isa() == isas[0]
    for isa in isas:
        monkeypatch.setenv("HETERO_ADAM_ISA", isa)
        assert K.selected_isa() == isa
        assert K.selected_isa("scalar") == "scalar"  # the argument wins over the environment
    monkeypatch.setenv("HETERO_ADAM_ISA", "sse9")
    with pytest.raises(ValueError, match="HETERO_ADAM_ISA='sse9'"):
        K.adam_step_(torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.zeros(4), step=1, lr=1e-3,
                     beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0, decoupled=True)
    for missing in set(ISAS) - set(isas):
        with pytest.raises(ValueError, match="not supported by this CPU"):
            K.selected_isa(missing)


def test_bad_arguments_are_refused() -> None:
    z = torch.zeros(8)
    base = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    with pytest.raises(ValueError, match="elements"):
        K.adam_step_(z.clone(), torch.zeros(7), z.clone(), z.clone(), **base)
    with pytest.raises(TypeError, match="bfloat16 or float16"):  # the extension checks dtypes itself
        K._ext.adam_step(z.clone(), z.clone(), z.clone(), z.clone(), torch.zeros(8, dtype=torch.int32), **base)
    with pytest.raises(ValueError, match="step"):
        K.adam_step_(z.clone(), z.clone(), z.clone(), z.clone(), **dict(base, step=0))
    with pytest.raises(ValueError, match="sqrt"):
        K.adam_step_(z.clone(), z.clone(), z.clone(), z.clone(), **base, sqrt="fast")
    with pytest.raises(RuntimeError, match="isa='avx2'"):  # the kernel cannot take a strided view
        K.adam_step_(torch.zeros(16)[::2], z.clone(), z.clone(), z.clone(), **base, isa="avx2")


def test_torch_path_for_views_and_without_the_kernel(monkeypatch) -> None:
    """Strided views (and a build without the kernel) take torch ops, with the same results."""
    hp = HYPER["wd"]
    n = 1001
    p0, grads, lrs = problem(n, seed=8)
    want = kernel_run(p0, grads, lrs, hp, True, grad_scale=0.5)
    state = torch.zeros(n, 3)
    state[:, 0] = p0
    p, m, v = state[:, 0], state[:, 1], state[:, 2]  # stride 3: not the kernel's
    for step, (g, lr) in enumerate(zip(grads, lrs), 1):
        K.adam_step_(p, g, m, v, **kw_of(hp, step, lr, True), grad_scale=0.5)
    assert_same((p, m, v), want, "strided")
    monkeypatch.setattr(K, "_ext", None)
    assert not K.has_kernel() and K.available_isas() == []
    got = kernel_run(p0, grads, lrs, hp, True, grad_scale=torch.tensor(0.5))
    assert_same(got, want, "without the kernel")


def test_stream_probe_moves_and_counts_bytes() -> None:
    n = 100003
    g, p, m, v = (torch.full((n,), float(i + 1)) for i in range(4))
    moved = K.stream_update_([g], [p, m, v], threads=2)
    assert moved == n * 4 * (1 + 2 * 3)
    assert torch.equal(p, torch.full((n,), 3.0)) and torch.equal(v, torch.full((n,), 5.0))
    assert torch.equal(g, torch.full((n,), 1.0))
    for k, isa in enumerate(K.available_isas()):
        assert K.stream_update_([g, m], [p, v], scale=0.0, isa=isa, threads=1) == n * 4 * 6  # no change
        assert torch.equal(p, torch.full((n,), 3.0 + 0.5 * k)) and torch.equal(v, torch.full((n,), 5.0))
        K.stream_update_([g], [p], scale=0.5, isa=isa)


# ------------------------------------------------------------------------ through hetero.optim


@pytest.mark.parametrize("fused", [False, True], ids=["default", "fused"])
def test_hetero_optim_steps_host_chunks_with_the_kernel(fused: bool, monkeypatch) -> None:
    """hetero.optim.AdamW on a CPU tier steps through the kernel: bit-identical to torch's default
    AdamW, and with fused=True (IEEE sqrt) equal to torch's fused AdamW to float32 rounding."""
    import copy

    import hetero

    sqrt_modes: list[str] = []
    real = K._ext.adam_step

    def spy(*args, **kwargs):
        sqrt_modes.append(kwargs["sqrt"] if "sqrt" in kwargs else args[15])  # (its last argument)
        return real(*args, **kwargs)

    monkeypatch.setattr(K._ext, "adam_step", spy)
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    wrapped = hetero.wrap(copy.deepcopy(eager), device="cpu", chunk_size="4KiB")
    hp = dict(lr=1e-2, weight_decay=0.1, fused=fused)
    opts = (torch.optim.AdamW(eager.parameters(), **hp), hetero.optim.AdamW(wrapped.parameters(), **hp))
    for step in range(3):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
        for model, opt in zip((eager, wrapped), opts):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert sqrt_modes and set(sqrt_modes) == {"ieee" if fused else "torch"}
    want, got = eager.state_dict(), wrapped.state_dict()
    for k in want:
        if fused:
            torch.testing.assert_close(got[k], want[k])
        else:
            assert torch.equal(got[k], want[k]), k
