"""Tests of hetero.copies, the copy engine, on both backends (host copies; CUDA ones: test_cuda.py)."""

from __future__ import annotations

import gc
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from hetero import copies
from helpers import copy_engine

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.bool, torch.complex64]
SIZES = [0, 1, 3, 7, 64, 4095, 4096, 4097, 65_537, 1 << 20, (9 << 20) + 13, (17 << 20) + 1]


@pytest.fixture(params=["extension", "python"])
def engine(request, monkeypatch):
    eng = copy_engine(request.param, monkeypatch)
    yield eng
    eng.shutdown()


def random_tensor(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """n elements of ``dtype`` with random bytes (NaN payloads included: compared bytewise)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_is_byte_exact_for_every_dtype(engine, dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    for n in (0, 1, 1000, 33_333):
        src = random_tensor(n, dtype, gen)
        dst = torch.empty_like(src)
        h = engine.copy(dst, src)
        h.wait()
        assert h.done() and h.nbytes == src.nbytes and h.kind == "h2h"
        assert same_bytes(dst, src)


@pytest.mark.parametrize("nbytes", SIZES)
def test_copy_is_byte_exact_for_many_sizes(engine, nbytes) -> None:
    """Sizes around pages and the native engine's split threshold (pieces of >= 4 MiB)."""
    gen = torch.Generator().manual_seed(nbytes)
    src = random_tensor(nbytes, torch.uint8, gen)
    guard = torch.full((nbytes + 128,), 0xA5, dtype=torch.uint8)
    dst = guard[64:64 + nbytes]  # a view: the bytes around it must stay untouched
    engine.copy(dst, src).wait()
    assert same_bytes(dst, src)
    assert bool((guard[:64] == 0xA5).all()) and bool((guard[64 + nbytes:] == 0xA5).all())


def test_shapes_may_differ_and_views_are_copied_in_place(engine) -> None:
    src = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    base = torch.zeros(10, 12)
    dst = base[2:4]  # contiguous rows of a larger tensor
    engine.copy(dst, src).wait()
    assert torch.equal(base[2:4].reshape(-1), src.reshape(-1))
    assert bool((base[:2] == 0).all()) and bool((base[4:] == 0).all())


def test_requires_grad_tensors_are_copied_without_autograd(engine) -> None:
    src = torch.randn(100, requires_grad=True)
    dst = torch.zeros(100, requires_grad=True)
    engine.copy(dst, src).wait()
    assert torch.equal(dst.detach(), src.detach()) and dst.grad_fn is None


def test_many_concurrent_copies(engine) -> None:
    gen = torch.Generator().manual_seed(7)
    pairs = []
    for i in range(300):
        n = int(torch.randint(0, 200_000, (1,), generator=gen)) if i % 50 else (5 << 20)
        src = random_tensor(n, torch.uint8, gen)
        pairs.append((torch.empty_like(src), src))
    handles = [engine.copy(dst, src) for dst, src in pairs]
    for h in reversed(handles):  # waiting out of order is fine
        h.wait()
    assert all(h.done() for h in handles)
    assert all(same_bytes(dst, src) for dst, src in pairs)


def test_copies_from_many_python_threads(engine) -> None:
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        try:
            gen = torch.Generator().manual_seed(seed)
            for _ in range(30):
                src = random_tensor(int(torch.randint(1, 300_000, (1,), generator=gen)),
                                    torch.uint8, gen)
                dst = torch.empty_like(src)
                engine.copy(dst, src).wait()
                assert same_bytes(dst, src)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_dropping_tensors_and_handles_before_completion_is_safe(engine) -> None:
    """The engine keeps dst/src alive until the copy ran; unwaited handles are fine."""
    gen = torch.Generator().manual_seed(3)
    keep = []
    for _ in range(50):
        src = random_tensor(300_000, torch.uint8, gen)
        engine.copy(torch.empty_like(src), src)  # neither the handle nor dst is kept
        keep.append(src)
        del src
        gc.collect(0)
    src = random_tensor(1000, torch.uint8, gen)
    dst = torch.empty_like(src)
    engine.copy(dst, src).wait()
    assert same_bytes(dst, src)


def test_wait_and_done_semantics(engine) -> None:
    src = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    h = engine.copy(dst, src)
    h.wait()
    assert h.done()
    h.wait()  # waiting again returns at once
    assert h.done()
    assert torch.equal(dst, src)
    empty = engine.copy(torch.empty(0), torch.empty(0))
    assert empty.done() and empty.nbytes == 0
    empty.wait()
    assert "CopyHandle" in repr(h) and "done" in repr(h)


def test_submit_returns_before_a_large_copy_completes_and_python_runs_meanwhile(engine) -> None:
    """Overlap is real: the copy runs on a worker while the submitting thread keeps computing."""
    src = torch.randint(0, 256, (256 << 20,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    engine.copy(dst[: 1 << 20], src[: 1 << 20]).wait()  # threads warm
    t0 = time.perf_counter()
    h = engine.copy(dst, src)
    t_submit = time.perf_counter() - t0
    pending_after_submit = not h.done()
    python_iterations = 0
    while not h.done():  # the Python thread is free while the copy runs
        sum(range(100))
        python_iterations += 1
    t_total = time.perf_counter() - t0
    h.wait()
    assert torch.equal(dst, src)
    assert pending_after_submit, f"a 256 MiB copy was already done {t_submit * 1e3:.2f} ms after submit"
    assert python_iterations > 0
    assert t_submit < 0.25 * t_total, (t_submit, t_total)


def test_shutdown_finishes_queued_copies_and_is_idempotent(engine) -> None:
    gen = torch.Generator().manual_seed(5)
    pairs = [(torch.empty(2 << 20, dtype=torch.uint8), random_tensor(2 << 20, torch.uint8, gen))
             for _ in range(20)]
    handles = [engine.copy(d, s) for d, s in pairs]
    engine.shutdown()
    assert all(h.done() for h in handles)
    for h in handles:
        h.wait()  # still waitable
    assert all(same_bytes(d, s) for d, s in pairs)
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.copy(torch.empty(4), torch.ones(4))


def test_context_manager_shuts_down(monkeypatch) -> None:
    monkeypatch.setenv("HETERO_FORCE_PYTHON_COPY", "1")
    with copies.CopyEngine(1) as eng:
        h = eng.copy(torch.empty(10), torch.ones(10))
    assert h.done()
    with pytest.raises(RuntimeError, match="shut down"):
        eng.copy(torch.empty(10), torch.ones(10))


@pytest.mark.parametrize("dst, src, match", [
    (torch.empty(10), torch.empty(11), r"dst has 10 elements but src has 11"),
    (torch.empty(10), torch.empty(10, dtype=torch.float64), r"dst has dtype .* but src has dtype"),
    (torch.empty(10, dtype=torch.int32), torch.empty(10), r"dtype"),  # same nbytes, other dtype
    (torch.empty(4, 4).t(), torch.empty(16), r"dst is not contiguous"),
    (torch.empty(16), torch.empty(4, 8)[:, :4], r"src is not contiguous"),
    (torch.empty(10, device="meta"), torch.empty(10), r"dst is on device meta"),
    (torch.empty(10), torch.empty(10, device="meta"), r"src is on device meta"),
    (torch.empty(4), torch.eye(2).to_sparse(), r"src has layout"),
])
def test_argument_errors_are_value_errors_at_submit(engine, dst, src, match) -> None:
    with pytest.raises(ValueError, match=match):
        engine.copy(dst, src)


def test_overlapping_tensors_are_rejected(engine) -> None:
    base = torch.arange(100, dtype=torch.float32)
    with pytest.raises(ValueError, match="overlap"):
        engine.copy(base[10:60], base[:50])
    with pytest.raises(ValueError, match="overlap"):
        engine.copy(base, base)
    engine.copy(base[50:], base[:50]).wait()  # adjacent, not overlapping
    assert torch.equal(base[50:], base[:50])


def test_non_tensors_and_bad_streams(engine) -> None:
    with pytest.raises(TypeError, match="dst must be a torch.Tensor"):
        engine.copy([1, 2], torch.empty(2))
    with pytest.raises(TypeError, match="src must be a torch.Tensor"):
        engine.copy(torch.empty(2), None)
    with pytest.raises(TypeError, match="after_stream"):
        engine.copy(torch.empty(2), torch.empty(2), after_stream="stream")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the build without CUDA")
def test_after_stream_without_cuda_is_a_value_error(engine) -> None:
    with pytest.raises(ValueError, match="after_stream needs CUDA"):
        engine.copy(torch.empty(2), torch.empty(2), after_stream=0)


def test_num_threads_is_validated() -> None:
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="num_threads"):
            copies.CopyEngine(bad)


def test_backend_choice(monkeypatch) -> None:
    monkeypatch.setenv("HETERO_FORCE_PYTHON_COPY", "1")
    eng = copies.CopyEngine()
    assert eng.backend == "python" and eng.num_threads == 2
    eng.shutdown()
    monkeypatch.setenv("HETERO_FORCE_PYTHON_COPY", "0")
    eng = copies.CopyEngine()
    native = copies._C is not None and (copies._C.COPY_CUDA or not torch.cuda.is_available())
    assert eng.backend == ("extension" if native else "python")
    eng.shutdown()


@pytest.mark.skipif(copies._C is None, reason="needs hetero._C")
def test_native_engine_splits_large_copies_across_threads() -> None:
    """Pieces of one copy run on several workers; the result is exact at every piece boundary."""
    eng = copies._C.CopyEngine(4)
    n = (37 << 20) + 4097  # 4 pieces, one per worker, the last one shorter
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    h = eng.copy(dst, src)
    h.wait()
    assert torch.equal(dst, src) and h.kind == "h2h" and h.nbytes == n
    eng.shutdown()
    eng.shutdown()


@pytest.mark.parametrize("backend", ["extension", "python"])
def test_inline_bytes_sets_which_host_copies_are_done_in_the_calling_thread(backend, monkeypatch) -> None:
    """inline_bytes=0 hands every host copy to a worker (tests use it to have copies in flight
    with small blocks); the module's INLINE_BYTES is the default when the engine is made; bad
    values are refused, naming the argument."""
    copy_engine(backend, monkeypatch).shutdown()  # skips where the backend is not built
    monkeypatch.setattr(copies, "INLINE_BYTES", 0)
    src = torch.randint(0, 256, (1000,), dtype=torch.uint8)
    for eng in (copies.CopyEngine(2), copies.CopyEngine(2, inline_bytes=0)):
        assert eng.inline_bytes == 0
        dst = torch.zeros_like(src)
        eng.copy(dst, src).wait()
        assert torch.equal(dst, src)
        eng.shutdown()
    big = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)  # above the default
    eng = copies.CopyEngine(2, inline_bytes=1 << 20)
    dst = torch.zeros_like(big)
    assert eng.copy(dst, big).done() and torch.equal(dst, big)
    eng.shutdown()
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="inline_bytes"):
            copies.CopyEngine(2, inline_bytes=bad)


def test_small_host_copies_are_done_in_the_calling_thread(engine) -> None:
    """Up to INLINE_BYTES a hand-off to a worker costs more than the memcpy: done on return."""
    for n in (1, 1000, copies.INLINE_BYTES):
        src = torch.randint(0, 256, (n,), dtype=torch.uint8)
        dst = torch.zeros_like(src)
        h = engine.copy(dst, src)
        assert h.done() and torch.equal(dst, src)
        h.wait()


def test_an_extension_built_from_other_sources_is_not_used(monkeypatch) -> None:
    """A hetero._C built from other sources (another INTERFACE: an editable install not rebuilt
    after a pull) is refused at import with the reason, and every user of it falls back to its
    Python path instead of failing at its first call into a binding that changed."""
    import importlib
    import sys
    import types

    import hetero
    from hetero import engine, native
    from hetero.optim import kernel

    class OldCopyEngine:
        def __init__(self, num_threads: int = 2) -> None:
            pass

    fake = types.SimpleNamespace(CopyEngine=OldCopyEngine, COPY_CUDA=False, INTERFACE=native.INTERFACE - 1)
    monkeypatch.setitem(sys.modules, "hetero._C", fake)
    monkeypatch.setattr(hetero, "_C", fake, raising=False)
    modules = (native, copies, engine, kernel)
    try:
        for m in modules:
            importlib.reload(m)
        assert native._C is None and "rebuild" in native.ERROR and f"interface {native.INTERFACE - 1}" in native.ERROR
        assert copies._C is None and copies.EXTENSION_ERROR == native.ERROR
        assert not engine.has_extension() and not kernel.has_kernel()
        with copies.CopyEngine(1) as eng:
            assert eng.backend == "python"
    finally:
        monkeypatch.undo()
        for m in modules:
            importlib.reload(m)
    built = list((Path(hetero.__file__).parent).glob("_C*.so"))
    if built:  # the real build is used again once the fake is gone
        assert native._C is not None and copies._C is native._C, native.ERROR


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf (binutils)")
def test_the_extension_uses_the_processes_cpp_runtime() -> None:
    """hetero._C needs libstdc++.so, the C++ runtime torch loaded, rather than embedding a static
    copy: two runtimes in one process crash formatting the first number of an error message
    (SIGSEGV in locale facets; the first GPU machine's toolchain did this, see setup.py)."""
    import hetero

    built = sorted(Path(hetero.__file__).parent.glob("_C*.so"))
    if not built:
        pytest.skip("hetero._C is not built")
    dynamic = subprocess.run(["readelf", "-d", str(built[0])], capture_output=True, text=True, check=True)
    assert "libstdc++.so" in dynamic.stdout


def test_the_interface_number_is_the_one_the_sources_compile_in() -> None:
    """hetero/native.py and csrc/bindings.cpp name the same INTERFACE: raising one alone would
    send every native path to its Python fallback, silently except for a warning."""
    from hetero import native

    src = (Path(__file__).parent.parent / "csrc" / "bindings.cpp").read_text()
    found = re.findall(r'm\.attr\("INTERFACE"\) = (\d+);', src)
    assert found == [str(native.INTERFACE)]
