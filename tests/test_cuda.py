"""The CUDA device tier: the same placement paths with a real GPU (skipped without CUDA)."""

from __future__ import annotations

import copy
import time

import pytest
import torch

import hetero
import helpers
from helpers import assert_within_budgets, default_step, failed_step
from models import GPT, batches, state_bytes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make() -> GPT:
    """The test GPT without the q/k/v bias: hetero steps host-resident chunks with the CPU kernel
    and eager torch steps on the GPU, whose last bits differ, and the key bias amplifies any such
    difference to ~lr (see models.GPT)."""
    torch.manual_seed(0)
    return GPT(qkv_bias=False)


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


def test_cuda_swap_fault_mid_step_changes_nothing(tmp_path) -> None:
    """An I/O error in the middle of a step on the GPU (transfers in flight on the copy streams)
    raises HeteroIOError, leaves every parameter and optimizer state as before, and training then
    matches eager."""
    total = state_bytes(make())
    for k, after in enumerate((5, 40, 120)):
        model = hetero.wrap(make(), device="cuda", chunk_size="8KiB", device_budget=int(total * 0.2),
                            host_budget=int(total * 0.3), nvme_path=str(tmp_path / str(k)))
        opt = hetero.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        ref = make().cuda()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
        data = [(x.cuda(), y.cuda()) for x, y in batches(5, seed=3)]
        for b in data[:2]:
            default_step(model, opt, b)
            default_step(ref, ref_opt, b)
        if failed_step(model, opt, data[2], "eio", after):  # the step is made (rolled forward)
            default_step(ref, ref_opt, data[2])
            rest = data[3:]
        else:
            rest = data[2:]
        for b in rest:
            assert default_step(model, opt, b) == pytest.approx(default_step(ref, ref_opt, b), rel=1e-4)
        sd = model.state_dict()
        for name, v in ref.state_dict().items():
            torch.testing.assert_close(sd[name], v.cpu(), rtol=1e-4, atol=1e-5)
        assert_within_budgets(model)
        model.close()


def test_host_arena_is_pinned() -> None:
    wrapped = hetero.wrap(make(), device="cuda", chunk_size="8KiB")
    assert wrapped._hetero_state.runtime.storage.arena.buffer.is_pinned()


@pytest.mark.skipif(not hetero.engine.has_extension() or not hetero.engine._C.COPY_CUDA,
                    reason="needs hetero._C built with CUDA")
def test_pinned_buffers_lock_exactly_their_bytes_outside_torchs_cache() -> None:
    """torch's pinned allocator rounds each request up to a power of two (an arena of 33 MiB
    locked 64) and keeps it cached after: the arena's buffer is registered memory instead,
    page-aligned, as usable for asynchronous copies, and let go with the tensor."""
    from hetero import engine

    cached = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    n = (33 << 20) + 5
    buf = engine.aligned_empty(n, pin=True)
    assert buf.numel() == n and buf.data_ptr() % 4096 == 0 and buf.is_pinned()
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == cached
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    buf.copy_(src)
    on_gpu = buf.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(on_gpu.cpu(), src)
    del buf
    torch.cuda.synchronize()


# ---- the copy engine (hetero.copies) on the GPU


@pytest.fixture(params=["extension", "python"])
def copy_engine(request, monkeypatch):
    eng = helpers.copy_engine(request.param, monkeypatch, cuda=True)
    yield eng
    eng.shutdown()


def random_bytes(n: int, seed: int, pin: bool = True) -> torch.Tensor:
    t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return t.pin_memory() if pin else t


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 1 << 20, (32 << 20) + 3])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16])
def test_copy_engine_round_trips_are_byte_exact(copy_engine, nbytes, dtype) -> None:
    size = torch.empty(0, dtype=dtype).element_size()
    n = max(1, nbytes // size)
    host = random_bytes(n * size, nbytes).view(dtype)
    after = torch.cuda.current_stream().cuda_stream
    dev = torch.empty(n, dtype=dtype, device="cuda")
    h = copy_engine.copy(dev, host, after_stream=after)
    assert h.kind == "h2d" and h.nbytes == n * size
    h.wait()
    assert h.done()
    assert torch.equal(dev.cpu().view(torch.uint8), host.view(torch.uint8))
    dev2 = torch.empty_like(dev)
    hd = copy_engine.copy(dev2, dev, after_stream=after)
    assert hd.kind == "d2d"
    hd.wait()
    back = torch.empty(n, dtype=dtype).pin_memory()
    hb = copy_engine.copy(back, dev2, after_stream=after)
    assert hb.kind == "d2h"
    hb.wait()
    assert torch.equal(back.view(torch.uint8), host.view(torch.uint8))


def test_copy_engine_pageable_host_memory(copy_engine) -> None:
    host = random_bytes(3 << 20, 1, pin=False)
    dev = torch.empty_like(host, device="cuda")
    copy_engine.copy(dev, host, after_stream=torch.cuda.current_stream()).wait()
    back = torch.empty_like(host)
    copy_engine.copy(back, dev).wait()
    assert torch.equal(back, host)


def test_after_stream_orders_a_d2h_after_the_kernel_that_wrote_it(copy_engine) -> None:
    """The compute stream is kept busy, then writes x; the D2H must see the written values."""
    for stream in (torch.cuda.current_stream(), torch.cuda.Stream()):
        x = torch.zeros(8 << 20, device="cuda")
        torch.cuda.synchronize()
        out = torch.empty(8 << 20).pin_memory()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time (at 2 GHz) before the write
            x.fill_(3.0)
        t0 = time.perf_counter()
        h = copy_engine.copy(out, x, after_stream=stream.cuda_stream)
        submit_s = time.perf_counter() - t0
        assert not h.done()  # the GPU is still sleeping: the wait is on the GPU, not the host
        h.wait()
        assert bool((out == 3.0).all()), "the D2H ran before the kernel that wrote its source"
        assert submit_s < 0.03, f"copy() blocked the host for {submit_s:.3f} s"
    out2 = torch.empty(8 << 20).pin_memory()
    x2 = torch.zeros(8 << 20, device="cuda")
    torch.cuda._sleep(50_000_000)
    x2.fill_(5.0)
    copy_engine.copy(out2, x2, after_stream=torch.cuda.current_stream()).wait()  # a Stream object
    assert bool((out2 == 5.0).all())


def test_after_stream_orders_a_host_copy_after_a_d2h_on_that_stream(copy_engine) -> None:
    x = torch.full((1 << 20,), 7.0, device="cuda")
    pinned = torch.zeros(1 << 20).pin_memory()
    final = torch.zeros(1 << 20)
    s = torch.cuda.current_stream()
    torch.cuda._sleep(50_000_000)
    pinned.copy_(x, non_blocking=True)  # queued on the current stream behind the sleep
    h = copy_engine.copy(final, pinned, after_stream=s.cuda_stream)
    assert h.kind == "h2h"
    h.wait()
    assert bool((final == 7.0).all())


def test_wait_on_stream_orders_compute_after_an_h2d(copy_engine) -> None:
    host = torch.full((64 << 20,), 2.0).pin_memory()
    dev = torch.empty(64 << 20, device="cuda")
    stream = torch.cuda.current_stream()
    h = copy_engine.copy(dev, host, after_stream=stream.cuda_stream)
    h.wait_on_stream(stream)  # the host does not block; the compute stream waits
    all_written = (dev == 2.0).all()  # queued on the compute stream, behind the copy
    assert bool(all_written)
    h.wait()


def test_many_concurrent_cuda_copies(copy_engine) -> None:
    gen = torch.Generator().manual_seed(11)
    after = torch.cuda.current_stream().cuda_stream
    jobs = []
    for i in range(120):
        n = int(torch.randint(1, 3 << 20, (1,), generator=gen))
        host = random_bytes(n, i)
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        jobs.append((host, dev, torch.empty(n, dtype=torch.uint8).pin_memory()))
    h2d = [copy_engine.copy(dev, host, after_stream=after) for host, dev, _ in jobs]
    for h in h2d:
        h.wait_on_stream(torch.cuda.current_stream())
    d2h = [copy_engine.copy(back, dev, after_stream=after) for _, dev, back in jobs]
    for h in reversed(d2h):
        h.wait()
    assert all(h.done() for h in h2d + d2h)
    for host, _, back in jobs:
        assert torch.equal(back, host)


def test_shutdown_synchronizes_cuda_copies(copy_engine) -> None:
    host = random_bytes(16 << 20, 3)
    devs = [torch.empty(16 << 20, dtype=torch.uint8, device="cuda") for _ in range(8)]
    handles = [copy_engine.copy(d, host, after_stream=torch.cuda.current_stream()) for d in devs]
    copy_engine.shutdown()
    assert all(h.done() for h in handles)
    for h in handles:
        h.wait()
    assert all(torch.equal(d.cpu(), host) for d in devs)
    with pytest.raises(RuntimeError, match="shut down"):
        copy_engine.copy(devs[0], host)


def test_copy_engine_cuda_argument_errors(copy_engine) -> None:
    with pytest.raises(ValueError, match="elements"):
        copy_engine.copy(torch.empty(10, device="cuda"), torch.empty(11).pin_memory())
    with pytest.raises(ValueError, match="not contiguous"):
        copy_engine.copy(torch.empty(4, 4, device="cuda").t(), torch.empty(16))
    with pytest.raises(ValueError, match="dtype"):
        copy_engine.copy(torch.empty(4, device="cuda"), torch.empty(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="after_stream"):
        copy_engine.copy(torch.empty(4, device="cuda"), torch.empty(4), after_stream=-1)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_copy_engine_across_devices(copy_engine) -> None:
    host = random_bytes(5 << 20, 4)
    a = host.to("cuda:0")
    b = torch.empty_like(host, device="cuda:1")
    h = copy_engine.copy(b, a)
    assert h.kind == "d2d"
    h.wait()
    assert torch.equal(b.cpu(), host)
