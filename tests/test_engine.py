"""Tests of hetero.engine, the NVMe tier's swap-file I/O, on every backend.

Files go under pytest's tmp_path, which must be a real disk file system (not tmpfs) for the
O_DIRECT paths to run; tests that need O_DIRECT skip where the file system refuses it. The
fixture's engines use a small block size and queue depth, so even small requests are split into
several sub-requests with many in flight; tests/conftest.py turns checksums on.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import re
import shutil
import stat
import subprocess
import threading
import time
import warnings

import pytest
import torch

from hetero import engine
from hetero.errors import HeteroConfigError, HeteroIOError

PAGE = engine.ALIGNMENT
NATIVE = ("io_uring", "threads")
BLOCK, DEPTH = 4 * PAGE, 8  # 16 KiB sub-requests, 8 in flight


def make_io(backend: str, **kwargs) -> engine.SwapIO:
    if backend in NATIVE and not engine.has_extension():
        pytest.skip(f"hetero._C not built: {engine.EXTENSION_ERROR}")
    if backend not in engine.available_backends():
        pytest.skip(f"backend {backend} unavailable here")
    kwargs.setdefault("block_size", BLOCK)
    kwargs.setdefault("queue_depth", DEPTH)
    return engine.SwapIO(4, backend=backend, **kwargs)


@pytest.fixture(params=["io_uring", "threads", "python"])
def io(request, monkeypatch):
    swap_io = make_io(request.param)
    assert swap_io.backend == request.param and swap_io.checksum
    yield swap_io
    swap_io.shutdown()


@pytest.fixture(autouse=True)
def _disarm_faults():
    engine.inject_fault("none")
    yield
    engine.inject_fault("none")


def random_buffer(nbytes: int, gen: torch.Generator) -> torch.Tensor:
    buf = engine.aligned_empty(nbytes)
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen))
    return buf


def assert_round_trip(io: engine.SwapIO, f: engine.SwapFile, offs: list[int], bufs: list[torch.Tensor]) -> None:
    """Write every buffer at its offset (all in flight at once), read them all back into fresh
    buffers the same way, and compare byte for byte."""
    for h in [io.write(f, o, b) for o, b in zip(offs, bufs)]:
        h.wait()
    outs = [engine.aligned_empty(b.numel()) for b in bufs]
    for h in [io.read(f, o, b) for o, b in zip(offs, outs)]:
        h.wait()
    assert all(torch.equal(o, b) for o, b in zip(outs, bufs))


def open_direct(io: engine.SwapIO, path, size: int) -> engine.SwapFile:
    f = io.open(path, size)
    if not f.direct:
        io.close(f)
        pytest.skip(f"{path} is on a file system without O_DIRECT")
    return f


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_round_trip_random_sizes_and_offsets(io, tmp_path, seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    extents, pos = [], 0
    for _ in range(48):  # non-overlapping page-aligned extents with random gaps
        pos += rng.randrange(0, 8) * PAGE
        size = rng.randrange(1, 65) * PAGE
        extents.append((pos, random_buffer(size, gen)))
        pos += size
    f = io.open(tmp_path / "swap.bin", pos)
    rng.shuffle(extents)
    writes = [io.write(f, off, buf) for off, buf in extents]  # all in flight at once
    for h in reversed(writes):
        h.wait()
    outs = [(off, buf, engine.aligned_empty(buf.numel())) for off, buf in extents]
    reads = [io.read(f, off, out) for off, _, out in outs]
    for h in reads:
        h.wait()
        assert h.done()
    io.close(f)
    with open(f.path, "rb") as plain:  # independent check that each extent really is at `off`
        for off, buf, out in outs:
            assert torch.equal(out, buf)
            plain.seek(off)
            assert plain.read(buf.numel()) == buf.numpy().tobytes()


def test_many_requests_in_flight(io, tmp_path):
    gen = torch.Generator().manual_seed(7)
    bufs = [random_buffer(PAGE * (1 + i % 5), gen) for i in range(256)]
    f = io.open(tmp_path / "many.bin", 256 * 5 * PAGE)
    handles = [io.write(f, i * 5 * PAGE, b) for i, b in enumerate(bufs)]
    while not all(h.done() for h in handles):
        time.sleep(0.001)
    for h in handles:
        h.wait()
    outs = [engine.aligned_empty(b.numel()) for b in bufs]
    handles = [io.read(f, i * 5 * PAGE, o) for i, o in enumerate(outs)]
    for h in handles:
        h.wait()
    assert all(torch.equal(o, b) for o, b in zip(outs, bufs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_any_dtype_round_trip(io, tmp_path, dtype):
    src = engine.aligned_empty(4 * PAGE).view(dtype)
    src.copy_(torch.randn(src.numel()) > 0 if dtype == torch.bool else torch.randn(src.numel()))
    dst = torch.zeros_like(src)  # torch.empty need not be page aligned: plain buffered file
    f = io.open(tmp_path / "dtype.bin", 0, direct=False)
    io.write(f, 3 * PAGE, src).wait()
    io.read(f, 3 * PAGE, dst).wait()
    assert not f.direct and torch.equal(dst, src)


def test_buffered_file_allows_unaligned_io(io, tmp_path):
    f = io.open(tmp_path / "buffered.bin", 100, direct=False)
    src = torch.arange(125, dtype=torch.float64)  # 1000 bytes at an odd offset
    io.write(f, 13, src).wait()
    dst = torch.empty_like(src)
    io.read(f, 13, dst).wait()
    assert torch.equal(dst, src)
    assert os.fstat(f.fd).st_size == 1013


@pytest.mark.parametrize("which", ["data_ptr", "offset", "nbytes"])
def test_direct_misalignment_is_a_clear_value_error(io, tmp_path, which):
    f = open_direct(io, tmp_path / "direct.bin", 4 * PAGE)
    raw = engine.aligned_empty(3 * PAGE)
    buf, offset = raw[:PAGE], 0
    if which == "data_ptr":
        buf = raw[1:PAGE + 1]
    elif which == "offset":
        offset = 100
    else:
        buf = raw[:PAGE + 1]
    for submit in (io.write, io.read):
        with pytest.raises(ValueError, match=rf"O_DIRECT.*4096.*misaligned: {which} \("):
            submit(f, offset, buf)
    io.write(f, 0, raw[:PAGE]).wait()  # aligned still fine


def test_tensor_argument_errors(io, tmp_path):
    f = io.open(tmp_path / "args.bin", PAGE, direct=False)
    with pytest.raises(ValueError, match="contiguous"):
        io.write(f, 0, torch.zeros(8, 8).t())
    with pytest.raises(ValueError, match="offset"):
        io.write(f, -1, torch.zeros(8))


@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("kind, err, moved", [("eio", errno.EIO, 0), ("enospc", errno.ENOSPC, 0),
                                              ("short", errno.EIO, 32768)])
def test_injected_fault_raises_then_engine_recovers(io, tmp_path, op, kind, err, moved):
    gen = torch.Generator().manual_seed(3)
    data = random_buffer(16 * PAGE, gen)
    f = io.open(tmp_path / "fault.bin", 16 * PAGE)
    io.write(f, 0, data).wait()
    engine.inject_fault(kind)
    h = getattr(io, op)(f, 0, engine.aligned_empty(16 * PAGE))
    with pytest.raises(HeteroIOError) as info:
        h.wait()
    assert isinstance(info.value, OSError) and info.value.errno == err
    assert info.value.filename == str(tmp_path / "fault.bin")
    assert f"{moved} of 65536 bytes transferred" in str(info.value)
    assert ("short" if kind == "short" else os.strerror(err)) in str(info.value)
    with pytest.raises(HeteroIOError):
        h.wait()  # a second wait repeats the outcome
    out = engine.aligned_empty(16 * PAGE)  # the engine still works
    io.write(f, 0, data).wait()
    io.read(f, 0, out).wait()
    assert torch.equal(out, data)


def test_fault_after_skips_requests(io, tmp_path):
    f = io.open(tmp_path / "after.bin", 4 * PAGE)
    buf = engine.aligned_empty(PAGE)
    engine.inject_fault("eio", after=2)
    handles = [io.write(f, i * PAGE, buf) for i in range(4)]
    outcomes = []
    for h in handles:
        try:
            h.wait()
            outcomes.append("ok")
        except HeteroIOError:
            outcomes.append("eio")
    assert outcomes == ["ok", "ok", "eio", "ok"]
    with pytest.raises(ValueError):
        engine.inject_fault("ebadf")


def test_short_read_past_end_of_file(io, tmp_path):
    f = io.open(tmp_path / "eof.bin", 2 * PAGE)
    with pytest.raises(HeteroIOError, match=r"8192 of 16384 bytes transferred \(unexpected end"):
        io.read(f, 0, engine.aligned_empty(4 * PAGE)).wait()


def test_open_falls_back_when_o_direct_is_refused(io, tmp_path, monkeypatch):
    real = io._engine

    class RefusesDirect:  # a file system that rejects O_DIRECT with EINVAL (older tmpfs)
        def open(self, path: str, size: int, direct: bool, preallocate: bool = True) -> int:
            return -1 if direct else real.open(path, size, False, preallocate)

        def __getattr__(self, name: str):
            return getattr(real, name)

    monkeypatch.setattr(io, "_engine", RefusesDirect())
    f = io.open(tmp_path / "buffered.bin", PAGE)
    assert not f.direct
    io.write(f, 0, torch.ones(10)).wait()  # unaligned is fine without O_DIRECT
    io.close(f)
    with pytest.raises(HeteroIOError, match="does not support O_DIRECT"):
        io.open(tmp_path / "buffered.bin", PAGE, direct=True)


def test_files_are_mode_0600_and_grown_not_shrunk(io, tmp_path):
    path = tmp_path / "mode.bin"
    f = io.open(path, 3 * PAGE)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and os.path.getsize(path) == 3 * PAGE
    io.close(f)
    os.chmod(path, 0o644)
    f = io.open(path, PAGE)  # an existing file is narrowed to 0600 and never truncated down
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and os.path.getsize(path) == 3 * PAGE
    io.close(f)


def test_open_and_close_errors_are_hetero_io_errors(io, tmp_path):
    with pytest.raises(HeteroIOError) as info:
        io.open(tmp_path / "missing-dir" / "swap.bin", PAGE)
    assert info.value.errno == errno.ENOENT and "missing-dir" in info.value.filename
    f = io.open(tmp_path / "closed.bin", PAGE)
    io.close(f)
    with pytest.raises(HeteroIOError):
        io.close(f)


def test_a_closed_swap_file_is_refused(io, tmp_path):
    """The next open reuses a closed file's descriptor number: a stale SwapFile must not write
    into that file, nor close its descriptor."""
    f = io.open(tmp_path / "first.bin", PAGE)
    io.close(f)
    g = io.open(tmp_path / "second.bin", PAGE)
    zeros, sevens = engine.aligned_empty(PAGE), engine.aligned_empty(PAGE)
    zeros.zero_()
    sevens.fill_(7)
    io.write(g, 0, zeros).wait()
    for submit in (io.write, io.read):
        with pytest.raises(ValueError, match="first.bin.*is not open in this SwapIO"):
            submit(f, 0, sevens)
    with pytest.raises(HeteroIOError, match="not open") as info:
        io.close(f)
    assert info.value.errno == errno.EBADF and info.value.filename == f.path
    out = engine.aligned_empty(PAGE)
    io.read(g, 0, out).wait()  # g is untouched and still open
    assert torch.equal(out, zeros)
    with make_io("python") as other:  # nor is a file of another SwapIO accepted
        with pytest.raises(ValueError, match="not open in this SwapIO"):
            other.write(g, 0, zeros)
    io.close(g)


def test_a_file_with_transfers_in_flight_is_not_closed(io, tmp_path):
    """Closing a swap file whose transfers still run fails with EBUSY (workers would read or
    write a closed descriptor, or a file that reuses its number); once they are waited it closes."""
    n, size = 16, 8 << 20  # 128 MiB: far longer to write than a close call takes
    f = io.open(tmp_path / "busy.bin", n * size)
    buf = engine.aligned_empty(size)
    buf.fill_(7)
    handles = [io.write(f, i * size, buf) for i in range(n)]
    with pytest.raises(HeteroIOError) as info:
        io.close(f)
    assert info.value.errno == errno.EBUSY and "in flight" in str(info.value)
    for h in handles:
        h.wait()
    io.close(f)


def test_each_backend_handle_is_waited_once(io, tmp_path):
    f = io.open(tmp_path / "once.bin", PAGE)
    handle_id = io._engine.submit_write(f.fd, engine.aligned_empty(PAGE), 0)
    io._engine.wait(handle_id)
    with pytest.raises(ValueError, match="unknown or already waited"):
        io._engine.wait(handle_id)
    with pytest.raises(ValueError, match="unknown or already waited"):
        io._engine.poll(123456789)


def test_shutdown_keeps_results_and_refuses_new_work(io, tmp_path):
    f = io.open(tmp_path / "shutdown.bin", 64 * PAGE)
    handles = [io.write(f, i * PAGE, engine.aligned_empty(PAGE)) for i in range(64)]
    io.shutdown()
    for h in handles:
        assert h.done()
        h.wait()
    with pytest.raises(RuntimeError):
        io.write(f, 0, engine.aligned_empty(PAGE))
    io.shutdown()  # idempotent


def test_python_engine_shuts_down_from_its_own_worker(tmp_path):
    """A garbage collection in a python-backend worker can run a dropped model's finalizer,
    which shuts the engine down: that must not join the very thread it runs on."""
    io = make_io("python")
    f = io.open(tmp_path / "own-worker.bin", PAGE)
    io.write(f, 0, engine.aligned_empty(PAGE)).wait()
    io._engine._pool.submit(io.shutdown).result(timeout=10)
    io.close(f)


@pytest.mark.parametrize("backend", NATIVE)
def test_shutdown_with_work_queued_behind_the_queue_depth_does_not_hang(tmp_path, backend):
    """Regression: workers idled by queue_depth while work was queued must still see the end."""
    for i in range(5):
        io = make_io(backend, block_size=PAGE, queue_depth=1)  # threads: 4 workers, 1 busy
        f = io.open(tmp_path / f"queued{i}.bin", 8 * PAGE)
        handles = [io.read(f, 0, engine.aligned_empty(8 * PAGE)) for _ in range(8)]
        stopper = threading.Thread(target=io.shutdown, daemon=True)
        stopper.start()
        stopper.join(30)
        assert not stopper.is_alive(), "shutdown hung"
        for h in handles:
            h.wait()
        io.close(f)


def test_wait_releases_the_gil(io, tmp_path):
    """While the main thread waits on a large transfer, another Python thread keeps running."""
    f = io.open(tmp_path / "gil.bin", 0)
    stamps: list[float] = []
    stop = threading.Event()

    def ticker() -> None:  # runs only when it can take the GIL
        while not stop.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0.001)

    thread = threading.Thread(target=ticker, daemon=True)
    thread.start()
    try:
        nbytes = 16 << 20
        while True:  # grow the transfer until a wait lasts long enough to observe
            buf = engine.aligned_empty(nbytes)
            h = io.write(f, 0, buf)
            start = time.perf_counter()
            h.wait()
            end = time.perf_counter()
            if end - start >= 0.05:
                break
            if nbytes >= 1 << 30:
                pytest.skip("no transfer was slow enough to observe")
            nbytes *= 2
    finally:
        stop.set()
        thread.join()
    # A wait holding the GIL would leave the middle of the wait without a single tick.
    lo, hi = start + 0.25 * (end - start), start + 0.75 * (end - start)
    assert sum(lo <= s <= hi for s in stamps) >= 2


def test_aligned_empty():
    for nbytes, alignment in [(0, PAGE), (1, PAGE), (12345, PAGE), (1000, 64), (PAGE, 1 << 16)]:
        t = engine.aligned_empty(nbytes, alignment)
        assert t.dtype == torch.uint8 and t.device.type == "cpu" and t.is_contiguous()
        assert t.numel() == nbytes and t.data_ptr() % alignment == 0
    with pytest.raises(ValueError):
        engine.aligned_empty(-1)


def test_missing_extension_falls_back_with_one_warning(monkeypatch, tmp_path):
    monkeypatch.setattr(engine, "_C", None)
    monkeypatch.setattr(engine, "EXTENSION_ERROR", "ImportError: simulated")
    monkeypatch.setattr(engine, "_warned", False)
    with pytest.warns(RuntimeWarning, match="hetero._C is not available.*simulated"):
        io = engine.SwapIO(1)
    assert io.backend == "python" and not engine.has_extension()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.SwapIO(1).shutdown()  # warned once only
    io.shutdown()


@pytest.mark.skipif(not os.environ.get("CI"), reason="only CI guarantees a built extension")
def test_extension_is_built_in_ci(monkeypatch):
    assert engine.has_extension(), engine.EXTENSION_ERROR
    assert engine.EXTENSION_ERROR is None
    with engine.SwapIO(1) as io:
        assert io.backend in NATIVE
    if engine.available_backends()[0] != "io_uring":  # .ci/run installs liburing-dev, best effort
        warnings.warn(f"CI runs without io_uring: {engine._C.io_uring_available()[1]}", stacklevel=1)


# ---- splitting, concurrency, buffered I/O ----------------------------------------------------


def test_unaligned_round_trips_on_a_buffered_file(io, tmp_path):
    rng, gen = random.Random(11), torch.Generator().manual_seed(11)
    f = io.open(tmp_path / "buffered-random.bin", 0, direct=False)
    extents, pos = [], 0
    for _ in range(64):  # byte-granular sizes and offsets, many spanning several sub-requests
        pos += rng.randrange(0, 5000)
        size = rng.randrange(1, 100_000)
        extents.append((pos, torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)))
        pos += size
    assert_round_trip(io, f, [off for off, _ in extents], [buf for _, buf in extents])
    with open(f.path, "rb") as plain:
        for off, buf in extents:
            plain.seek(off)
            assert plain.read(buf.numel()) == buf.numpy().tobytes()


def test_concurrent_submitters(io, tmp_path):
    """Several Python threads drive one SwapIO at once; every extent round-trips."""
    nthreads, per_thread, size = 6, 24, 12 * PAGE  # 3 sub-requests each
    f = io.open(tmp_path / "threads.bin", nthreads * per_thread * size)
    errors: list[BaseException] = []

    def client(t: int) -> None:
        try:
            gen = torch.Generator().manual_seed(t)
            bufs = [random_buffer(size, gen) for _ in range(per_thread)]
            assert_round_trip(io, f, [(t * per_thread + i) * size for i in range(per_thread)], bufs)
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)

    workers = [threading.Thread(target=client, args=(t,)) for t in range(nthreads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize("block_size, queue_depth", [(PAGE, 1), (PAGE, 256), (3 * PAGE, 5),
                                                     (1 << 20, 32)])
def test_split_requests_round_trip(tmp_path, backend, block_size, queue_depth):
    """One request per extent, split in sub-requests of any size, with few or many in flight;
    the last sub-request of a request is shorter when block_size does not divide it."""
    with make_io(backend, block_size=block_size, queue_depth=queue_depth) as io:
        assert (io.block_size, io.queue_depth) == (block_size, queue_depth)
        gen = torch.Generator().manual_seed(block_size + queue_depth)
        sizes = [PAGE, 7 * PAGE, 64 * PAGE, 300 * PAGE]
        offs = [sum(sizes[:i]) for i in range(len(sizes))]
        f = io.open(tmp_path / "split.bin", sum(sizes))
        assert_round_trip(io, f, offs, [random_buffer(n, gen) for n in sizes])
        io.close(f)


def test_zero_byte_transfer_is_done_at_once(io, tmp_path):
    f = io.open(tmp_path / "empty.bin", PAGE)
    h = io.write(f, 0, engine.aligned_empty(0))
    h.wait()
    assert h.done()
    io.read(f, PAGE, engine.aligned_empty(0)).wait()


def test_wait_with_timeout(io, tmp_path):
    f = io.open(tmp_path / "timeout.bin", 256 * PAGE)
    h = io.write(f, 0, engine.aligned_empty(256 * PAGE))
    h.wait(timeout=30)  # plenty
    assert h.done()
    h.wait(timeout=0)  # already waited: repeats the outcome at once


def test_wait_timeout_raises_and_handle_stays_valid(monkeypatch, tmp_path):
    """A deterministic TimeoutError: the python backend's transfer is held on a gate."""
    io = make_io("python")
    gate = threading.Event()
    real = engine._PyIOEngine._transfer

    def gated(self, *args):
        gate.wait(10)
        return real(self, *args)

    monkeypatch.setattr(engine._PyIOEngine, "_transfer", gated)
    f = io.open(tmp_path / "gated.bin", PAGE)
    h = io.write(f, 0, engine.aligned_empty(PAGE))
    with pytest.raises(TimeoutError, match="still running"):
        h.wait(timeout=0.01)
    assert not h.done()
    gate.set()
    h.wait()
    assert h.done()
    io.shutdown()


@pytest.mark.parametrize("timeout", [float("inf"), 1e300, 10**400], ids=["inf", "1e300", "10**400"])
def test_a_huge_timeout_waits_for_the_transfer(io, tmp_path, timeout):
    """inf or a deadline centuries away overflowed the engines' clocks: an instant TimeoutError
    (native) or OverflowError (python). They wait as long as it takes."""
    size = 32 << 20  # still running when waited
    f = io.open(tmp_path / "huge-timeout.bin", size)
    h = io.write(f, 0, engine.aligned_empty(size))
    h.wait(timeout=timeout)
    assert h.done()
    io.close(f)


def test_wait_timeout_errors_leave_the_handle_pending(io, tmp_path):
    """A bad timeout is refused before waiting and does not settle the handle: the transfer's
    own error still surfaces on the next wait."""
    f = io.open(tmp_path / "bad-timeout.bin", 16 * PAGE)
    engine.inject_fault("eio")
    h = io.write(f, 0, engine.aligned_empty(16 * PAGE))
    with pytest.raises(TypeError, match="timeout='x' is not accepted"):
        h.wait(timeout="x")
    with pytest.raises(TypeError, match="timeout=True"):
        h.wait(timeout=True)
    with pytest.raises(ValueError, match="timeout=nan"):
        h.wait(timeout=float("nan"))
    with pytest.raises(HeteroIOError) as info:
        h.wait(timeout=30)
    assert info.value.errno == errno.EIO
    with pytest.raises(HeteroIOError):  # and again: the outcome is kept
        h.wait()
    io.close(f)


@pytest.mark.parametrize("timeout", [None, 30])
def test_an_interrupted_wait_leaves_the_handle_pending(monkeypatch, tmp_path, timeout):
    """A wait interrupted (KeyboardInterrupt) before the transfer ended must neither settle the
    handle nor lose it in the engine: the next wait reports the transfer's failure."""
    io = make_io("python")
    f = io.open(tmp_path / "interrupted.bin", PAGE)
    real = engine.futures_wait
    interrupts = [KeyboardInterrupt()]

    def interrupted(*args, **kwargs):
        if interrupts:
            raise interrupts.pop()
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "futures_wait", interrupted)
    engine.inject_fault("eio")
    h = io.write(f, 0, engine.aligned_empty(PAGE))
    with pytest.raises(KeyboardInterrupt):
        h.wait(timeout=timeout)
    with pytest.raises(HeteroIOError) as info:
        h.wait()
    assert info.value.errno == errno.EIO
    io.close(f)
    io.shutdown()


# ---- backend selection and argument errors ----------------------------------------------------


def test_backend_selection(monkeypatch):
    monkeypatch.delenv("HETERO_IO_BACKEND", raising=False)
    native = engine.has_extension()
    with engine.SwapIO(1, block_size=BLOCK, queue_depth=DEPTH) as io:
        assert io.backend == engine.available_backends()[0]
    for name in engine.available_backends():
        monkeypatch.setenv("HETERO_IO_BACKEND", name)
        with engine.SwapIO(1, block_size=BLOCK, queue_depth=DEPTH) as io:
            assert io.backend == name
    monkeypatch.setenv("HETERO_IO_BACKEND", "python")
    with engine.SwapIO(1, backend="threads" if native else "python") as io:  # the argument wins
        assert io.backend == ("threads" if native else "python")
    monkeypatch.setenv("HETERO_FORCE_PYTHON_IO", "1")  # (an older switch, gone: not read)
    monkeypatch.setenv("HETERO_IO_BACKEND", "threads" if native else "python")
    with engine.SwapIO(1) as io:
        assert io.backend == ("threads" if native else "python")
    monkeypatch.setenv("HETERO_IO_BACKEND", "spdk")
    with pytest.raises(HeteroConfigError, match="environment variable HETERO_IO_BACKEND='spdk' is "
                       "not accepted; expected one of auto, io_uring, threads, python"):
        engine.SwapIO(1)
    with pytest.raises(HeteroConfigError, match=r"SwapIO\(backend=...\): backend='aio' is not "
                       "accepted; expected one of"):
        engine.SwapIO(1, backend="aio")


@pytest.mark.skipif(not engine.has_extension(), reason="needs hetero._C")
def test_io_uring_unavailable_falls_back_to_threads(monkeypatch):
    monkeypatch.delenv("HETERO_IO_BACKEND", raising=False)
    monkeypatch.setattr(engine._C, "io_uring_available", lambda: (False, "simulated: ENOSYS"))
    assert engine.available_backends() == ["threads", "python"]
    with engine.SwapIO(1, block_size=BLOCK, queue_depth=DEPTH) as io:
        assert io.backend == "threads"
    with pytest.raises(ValueError, match="io_uring.*unavailable.*simulated: ENOSYS"):
        engine.SwapIO(1, backend="io_uring")


@pytest.mark.skipif(not engine.has_extension(), reason="needs hetero._C")
def test_native_engine_constructor_errors():
    with pytest.raises(ValueError, match="unknown I/O backend 'aio'"):
        engine._C.IOEngine(1, "aio")
    with pytest.raises(ValueError, match="block_size must be a multiple of 4096.*got 5000"):
        engine._C.IOEngine(1, "threads", 5000)
    with pytest.raises(ValueError, match="queue_depth must be between 1 and 256, got 0"):
        engine._C.IOEngine(1, "threads", PAGE, 0)
    e = engine._C.IOEngine(1, "threads", PAGE, 4)
    with pytest.raises(ValueError, match="block_size"):
        e.set_tuning(PAGE + 1, 4)
    e.set_tuning(2 * PAGE, 16)
    assert (e.block_size, e.queue_depth, e.backend) == (2 * PAGE, 16, "threads")


@pytest.mark.parametrize("kwargs, match", [
    ({"block_size": 1000}, r"SwapIO: block_size=1000 must be a multiple of 4096"),
    ({"block_size": 128 << 20}, r"block_size=134217728 must be a multiple of 4096 between"),
    ({"queue_depth": 0}, r"SwapIO: queue_depth=0 must be an int between 1 and 256"),
    ({"queue_depth": 1000}, r"queue_depth=1000"),
    ({"num_threads": 0}, r"SwapIO: num_threads=0 must be an int >= 1"),
])
def test_swapio_argument_errors_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        engine.SwapIO(**kwargs)


def test_python_backend_reports_the_tuning_it_was_given():
    with engine.SwapIO(1, backend="python", block_size=64 << 10, queue_depth=8) as io:
        assert (io.block_size, io.queue_depth, io.tuning.source) == (64 << 10, 8, "override")
        assert repr(io) == "<SwapIO python block_size=65536 queue_depth=8 checksum=True>"
    with engine.SwapIO(1, backend="python", queue_depth=8) as io:
        assert (io.block_size, io.queue_depth, io.tuning.source) == (1 << 20, 8, "override")
    with engine.SwapIO(1, backend="python") as io:
        assert (io.block_size, io.queue_depth, io.tuning.source) == (1 << 20, 32, "default")


@pytest.mark.parametrize("name, value, accepted", [
    ("HETERO_IO_BACKEND", "uring", "one of auto, io_uring, threads, python"),
    ("HETERO_IO_BLOCK_SIZE", "1000", "a multiple of 4096 between 4096 and 67108864 bytes"),
    ("HETERO_IO_BLOCK_SIZE", "garbage", "a multiple of 4096"),
    ("HETERO_IO_BLOCK_SIZE", "128MiB", "a multiple of 4096"),
    ("HETERO_IO_QUEUE_DEPTH", "0", "an int between 1 and 256"),
    ("HETERO_IO_QUEUE_DEPTH", "deep", "an int between 1 and 256"),
    ("HETERO_IO_CHECKSUM", "yes please", "1, true, yes or on"),
    ("HETERO_IO_AUTOTUNE", "2", "1, true, yes or on"),
])
def test_bad_io_environment_values_are_config_errors(monkeypatch, name, value, accepted):
    """Every invalid HETERO_IO_* value is a HeteroConfigError naming the variable, the value and
    what is accepted (they were plain ValueErrors, some naming only SwapIO's argument)."""
    monkeypatch.setenv(name, value)
    expected = f"environment variable {name}={value!r} is not accepted; expected {accepted}"
    with pytest.raises(HeteroConfigError, match=re.escape(expected)):
        engine.check_environment()
    with pytest.raises(HeteroConfigError, match=re.escape(expected)):
        engine.SwapIO(1)


@pytest.mark.parametrize("backend", ["io_uring", "threads", "python"])
def test_environment_overrides(monkeypatch, backend):
    make_io(backend).shutdown()  # (skips an unavailable backend)
    monkeypatch.setenv("HETERO_IO_BLOCK_SIZE", "256KiB")
    monkeypatch.setenv("HETERO_IO_QUEUE_DEPTH", "12")
    with engine.SwapIO(1, backend=backend) as io:
        assert (io.block_size, io.queue_depth, io.tuning.source) == (256 << 10, 12, "override")
        assert "block_size=262144 queue_depth=12" in repr(io)
    with engine.SwapIO(1, backend=backend, queue_depth=3) as io:  # an argument beats the env
        assert io.queue_depth == 3
    monkeypatch.setenv("HETERO_IO_QUEUE_DEPTH", "deep")
    with pytest.raises(HeteroConfigError, match="HETERO_IO_QUEUE_DEPTH='deep' is not accepted"):
        engine.SwapIO(1)
    monkeypatch.setenv("HETERO_IO_QUEUE_DEPTH", "12")
    monkeypatch.setenv("HETERO_IO_CHECKSUM", "maybe")
    with pytest.raises(ValueError, match="HETERO_IO_CHECKSUM"):
        engine.SwapIO(1)
    monkeypatch.setenv("HETERO_IO_CHECKSUM", "0")
    with engine.SwapIO(1, backend=backend) as io:
        assert not io.checksum


# ---- faults -----------------------------------------------------------------------------------


def test_corrupt_fault_is_caught_by_checksums(io, tmp_path):
    gen = torch.Generator().manual_seed(5)
    data = random_buffer(16 * PAGE, gen)
    f = io.open(tmp_path / "corrupt.bin", 32 * PAGE)
    # A write whose bytes reach the disk damaged: the next read of them fails.
    engine.inject_fault("corrupt")
    io.write(f, 0, data).wait()
    assert torch.equal(data, random_buffer(16 * PAGE, torch.Generator().manual_seed(5)))  # intact
    with pytest.raises(HeteroIOError, match="checksum mismatch") as info:
        io.read(f, 0, engine.aligned_empty(16 * PAGE)).wait()
    assert info.value.errno == errno.EIO and info.value.filename == f.path
    # Damage on the way back: that read fails, the next one is fine.
    io.write(f, 16 * PAGE, data).wait()
    engine.inject_fault("corrupt")
    with pytest.raises(HeteroIOError, match="checksum mismatch"):
        io.read(f, 16 * PAGE, engine.aligned_empty(16 * PAGE)).wait()
    out = engine.aligned_empty(16 * PAGE)
    io.read(f, 16 * PAGE, out).wait()
    assert torch.equal(out, data)


@pytest.mark.parametrize("backend", ["io_uring", "threads", "python"])
def test_checksum_detects_bytes_changed_behind_the_engine(tmp_path, backend):
    gen = torch.Generator().manual_seed(9)
    with make_io(backend, checksum=True) as io:
        f = io.open(tmp_path / "behind.bin", 64 * PAGE)
        a, b = random_buffer(20 * PAGE, gen), random_buffer(8 * PAGE, gen)
        io.write(f, 0, a).wait()
        io.write(f, 32 * PAGE, b).wait()
        fd = os.open(f.path, os.O_WRONLY)  # plain buffered pwrite, as another process could
        try:
            os.pwrite(fd, bytes([a[13 * PAGE + 7].item() ^ 0xFF]), 13 * PAGE + 7)
        finally:
            os.close(fd)
        with pytest.raises(HeteroIOError, match=r"checksum mismatch.*crc32") as info:
            io.read(f, 0, engine.aligned_empty(20 * PAGE)).wait()
        assert info.value.errno == errno.EIO
        out = engine.aligned_empty(8 * PAGE)
        io.read(f, 32 * PAGE, out).wait()  # other records are unaffected
        assert torch.equal(out, b)
        io.read(f, 16 * PAGE, engine.aligned_empty(4 * PAGE)).wait()  # no record inside: unchecked
        with pytest.raises(HeteroIOError, match="checksum mismatch"):  # a read containing it
            io.read(f, 0, engine.aligned_empty(64 * PAGE)).wait()
        io.write(f, 0, a).wait()  # rewriting through the engine renews the records
        io.read(f, 0, engine.aligned_empty(64 * PAGE)).wait()
        io.close(f)
    with make_io(backend, checksum=False) as io:  # off: the damage goes unnoticed
        f = io.open(tmp_path / "behind.bin", 64 * PAGE)
        fd = os.open(f.path, os.O_WRONLY)
        try:
            os.pwrite(fd, b"\0" * 16, PAGE)
        finally:
            os.close(fd)
        out = engine.aligned_empty(20 * PAGE)
        io.read(f, 0, out).wait()
        assert not torch.equal(out, a)
        io.close(f)


@pytest.mark.skipif(not engine.has_extension(), reason="needs hetero._C")
def test_crc32c():
    data = torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)
    assert engine._C.crc32c(data) == 0xE3069283  # the standard check value of CRC-32C
    big = torch.randint(0, 256, (100_003,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    whole = engine._C.crc32c(big)
    assert engine._C.crc32c(big[50_001:], engine._C.crc32c(big[:50_001])) == whole  # continues
    assert engine._C.crc32c(torch.empty(0, dtype=torch.uint8)) == 0


# ---- preallocation and real disk-full ---------------------------------------------------------


def test_open_reserves_the_space(io, tmp_path):
    size = 64 * PAGE
    f = io.open(tmp_path / "reserved.bin", size)
    st = os.stat(f.path)
    assert st.st_size == size and st.st_blocks * 512 >= size
    sparse = io.open(tmp_path / "sparse.bin", size, preallocate=False)
    st = os.stat(sparse.path)
    assert st.st_size == size and st.st_blocks * 512 < size
    with pytest.raises(ValueError, match="size=-1"):
        io.open(tmp_path / "negative.bin", -1)


def test_failed_reservation_leaves_no_file(io, tmp_path):
    """An open that fails after creating the file removes it (ENOSPC at reservation)."""
    path = tmp_path / "huge.bin"
    with pytest.raises(HeteroIOError) as info:
        io.open(path, 1 << 62)  # no file system reserves 4 EiB
    assert info.value.errno in (errno.ENOSPC, errno.EFBIG, errno.EINVAL)
    assert str(1 << 62) in str(info.value) and info.value.filename == str(path)
    assert not path.exists()


@contextlib.contextmanager
def small_filesystem(path, size: str = "1m"):
    """A tmpfs of ``size`` mounted at ``path`` (skips when mounting is not permitted here)."""
    path.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                           str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(directory, chunk: int = PAGE) -> int:
    """Write a filler file until the file system is full; returns the bytes written."""
    written = 0
    with open(os.path.join(directory, "filler"), "wb", buffering=0) as f:
        while True:
            try:
                written += f.write(b"\xa5" * chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC
                return written


@pytest.mark.parametrize("backend", ["io_uring", "threads", "python"])
def test_disk_full_on_a_real_small_filesystem(tmp_path, backend):
    with make_io(backend) as io, small_filesystem(tmp_path / "fs") as fs:
        # Reservation: a swap file larger than the file system fails at open, naming path and
        # size, and leaves nothing behind.
        with pytest.raises(HeteroIOError) as info:
            io.open(fs / "too-big.bin", 4 << 20)
        assert info.value.errno == errno.ENOSPC and info.value.filename == str(fs / "too-big.bin")
        assert "4194304 bytes" in str(info.value) and not (fs / "too-big.bin").exists()
        # A reserved file keeps working after the file system fills up around it ...
        gen = torch.Generator().manual_seed(2)
        f = io.open(fs / "swap.bin", 64 * PAGE)
        sparse = io.open(fs / "sparse.bin", 0, preallocate=False)
        assert fill(fs) > 0
        data = random_buffer(64 * PAGE, gen)
        io.write(f, 0, data).wait()
        out = engine.aligned_empty(64 * PAGE)
        io.read(f, 0, out).wait()
        assert torch.equal(out, data)
        # ... while an unreserved one hits the full disk in the write itself.
        with pytest.raises(HeteroIOError) as info:
            io.write(sparse, 0, data).wait()
        assert info.value.errno == errno.ENOSPC and info.value.filename == sparse.path
        assert "No space left on device" in str(info.value)
        io.close(f)
        io.close(sparse)


# ---- tuning -----------------------------------------------------------------------------------


@pytest.fixture
def tuning_cache(tmp_path, monkeypatch):
    path = tmp_path / "cache" / "io_tuning.json"
    monkeypatch.setenv("HETERO_IO_TUNING_CACHE", str(path))
    for name in ("HETERO_IO_BLOCK_SIZE", "HETERO_IO_QUEUE_DEPTH", "HETERO_IO_AUTOTUNE",
                 "HETERO_IO_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(engine, "_tune_memo", {})
    return path


@pytest.fixture
def fake_probe(monkeypatch):
    calls = []

    def probe(directory, *, backend="auto", **kwargs):
        calls.append((directory, backend))
        return engine.Tuning(256 << 10, 12, "probe", 1.5, 2.5)

    monkeypatch.setattr(engine, "probe", probe)
    return calls


@pytest.mark.skipif(not engine.has_extension(), reason="only the native backends are tuned")
def test_tuning_cache_round_trip(tmp_path, tuning_cache, fake_probe):
    data = tmp_path / "data"
    data.mkdir()
    first = engine.tune(data)
    assert (first.block_size, first.queue_depth, first.source) == (256 << 10, 12, "probe")
    assert len(fake_probe) == 1
    saved = json.loads(tuning_cache.read_text())
    key = first.key
    assert key.startswith(engine.available_backends()[0] + f":{os.stat(data).st_dev}:")
    assert saved[key]["block_size"] == 256 << 10 and saved[key]["queue_depth"] == 12
    engine._tune_memo.clear()  # as a new process would: read back from the file
    other = tmp_path / "other-dir-same-fs"
    other.mkdir()
    again = engine.tune(other)
    assert (again.block_size, again.queue_depth, again.source) == (256 << 10, 12, "cache")
    assert len(fake_probe) == 1
    engine.tune(data, refresh=True)
    assert len(fake_probe) == 2
    # A damaged cache is ignored (and rewritten by the next probe).
    tuning_cache.write_text("{not json")
    engine._tune_memo.clear()
    assert engine.tune(data).source == "probe" and len(fake_probe) == 3
    assert json.loads(tuning_cache.read_text())[key]["queue_depth"] == 12
    # So is one that Python's JSON reads but no entry can come from: an infinite block size
    # (1e999) raised OverflowError from every wrap on the file system, nesting too deep a
    # RecursionError.
    for n, damaged in enumerate(('{"%s": {"block_size": 1e999, "queue_depth": 32}}' % key, "[" * 100000)):
        tuning_cache.write_text(damaged)
        engine._tune_memo.clear()
        assert engine.tune(data).source == "probe" and len(fake_probe) == 4 + n


@pytest.mark.skipif(not engine.has_extension(), reason="only the native backends are tuned")
def test_swapio_tunes_on_first_open_and_honours_overrides(tmp_path, tuning_cache, fake_probe,
                                                          monkeypatch):
    with engine.SwapIO(2) as io:
        assert io.tuning is None  # nothing known before a directory is used
        f = io.open(tmp_path / "a.bin", PAGE)
        assert (io.block_size, io.queue_depth) == (256 << 10, 12)
        assert io.tuning.source == "probe" and len(fake_probe) == 1
        io.close(io.open(tmp_path / "b.bin", PAGE))  # decided once per SwapIO
        io.close(f)
    with engine.SwapIO(2) as io:
        io.close(io.open(tmp_path / "c.bin", PAGE))
        assert io.tuning.source == "cache" and len(fake_probe) == 1
    with engine.SwapIO(2, queue_depth=5) as io:  # partial override: the rest from the tuning
        io.close(io.open(tmp_path / "d.bin", PAGE))
        assert (io.block_size, io.queue_depth, io.tuning.source) == (256 << 10, 5, "override")
    with engine.SwapIO(2, block_size=PAGE, queue_depth=3) as io:  # full override: no tuning
        assert io.tuning.source == "override"
        io.close(io.open(tmp_path / "e.bin", PAGE))
        assert (io.block_size, io.queue_depth) == (PAGE, 3)
    monkeypatch.setenv("HETERO_IO_AUTOTUNE", "0")
    with engine.SwapIO(2) as io:
        io.close(io.open(tmp_path / "f.bin", PAGE))
        assert (io.block_size, io.queue_depth, io.tuning.source) == (1 << 20, 32, "default")
    assert len(fake_probe) == 1


@pytest.mark.skipif(not engine.has_extension(), reason="only the native backends are tuned")
def test_failed_probe_falls_back_to_defaults_uncached(tmp_path, tuning_cache, monkeypatch, caplog):
    def broken(directory, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(engine, "probe", broken)
    found = engine.tune(tmp_path)
    assert (found.block_size, found.queue_depth, found.source) == (1 << 20, 32, "default")
    assert "probe" in caplog.text and not tuning_cache.exists()


@pytest.mark.parametrize("backend", NATIVE)
def test_real_probe_is_short_and_cleans_up(tmp_path, backend):
    if backend not in engine.available_backends():
        pytest.skip(f"{backend} unavailable")
    start = time.perf_counter()
    found = engine.probe(tmp_path, backend=backend, file_bytes=16 << 20, budget_s=0.3,
                         candidates=((1 << 20, 32), (256 << 10, 8)))
    assert time.perf_counter() - start < 5
    assert (found.block_size, found.queue_depth) in ((1 << 20, 32), (256 << 10, 8))
    assert found.read_GBps > 0 and found.write_GBps > 0
    assert os.listdir(tmp_path) == []


def special_file(directory, kind: str):
    """A FIFO, a character device (a private copy of /dev/null's numbers, made here: never the
    real one) or a directory at ``directory/kind``."""
    path = directory / kind
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "chardev":
        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("mknod needs CAP_MKNOD")
    else:
        path.mkdir()
    return path


def tune_in_thread(directory) -> engine.Tuning:
    """engine.tune, failing (not hanging, nor holding the tuning lock) when it blocks: a reader
    blocked on a FIFO is let go by opening its write end, as often as it opens it again."""
    found = []
    worker = threading.Thread(target=lambda: found.append(engine.tune(directory)), daemon=True)
    worker.start()
    worker.join(10)
    blocked = worker.is_alive()
    for _ in range(100):
        if not worker.is_alive():
            break
        with contextlib.suppress(OSError):  # (ENXIO: no reader at the moment)
            os.close(os.open(engine.tuning_cache_path(), os.O_WRONLY | os.O_NONBLOCK))
        worker.join(0.1)
    if blocked:
        pytest.fail(f"tune blocked opening the tuning cache {engine.tuning_cache_path()}")
    return found[0]


@pytest.mark.skipif(not engine.has_extension(), reason="only the native backends are tuned")
@pytest.mark.parametrize("kind", ["fifo", "chardev", "directory"])
def test_a_tuning_cache_that_is_not_a_regular_file_is_left_alone(tmp_path, tuning_cache,
                                                                 fake_probe, monkeypatch, caplog,
                                                                 kind):
    """Only a regular file is read or replaced: a FIFO blocked the first open for ever, and
    os.replace turned a device (HETERO_IO_TUNING_CACHE=/dev/null as root) into a JSON file."""
    path = special_file(tmp_path, kind)
    monkeypatch.setenv("HETERO_IO_TUNING_CACHE", str(path))
    mode = os.stat(path).st_mode
    found = tune_in_thread(tmp_path)
    assert (found.block_size, found.queue_depth, found.source) == (256 << 10, 12, "probe")
    assert os.stat(path).st_mode == mode  # still what it was
    assert "not usable" in caplog.text and "not a regular file" in caplog.text
    assert not list(tmp_path.glob(".io_tuning-*"))
    assert engine.tune(tmp_path).source == "cache" and len(fake_probe) == 1  # (in-process only)


def test_a_failed_cache_write_leaves_no_temporary_file(tmp_path, monkeypatch, caplog):
    path = tmp_path / "io_tuning.json"

    def refuse(src, dst):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(engine.os, "replace", refuse)
    engine._write_cache(path, "key", engine.Tuning(1 << 20, 32, "probe"))
    assert os.listdir(tmp_path) == [] and "could not save" in caplog.text


@pytest.mark.skipif(not engine.has_extension(), reason="only the native backends are tuned")
def test_probe_writes_within_max_bytes_and_free_space(tmp_path, tuning_cache, monkeypatch):
    """The probe's file is bounded by ``max_bytes`` (the NVMe tier passes what its swap files
    will hold) and half the free space, in whole requests; under PROBE_MIN_BYTES it is skipped
    (defaults, not cached: a larger budget may probe later)."""
    sizes = []

    def probe(directory, *, backend="auto", file_bytes=engine.PROBE_FILE_BYTES, **kwargs):
        sizes.append(file_bytes)
        return engine.Tuning(256 << 10, 12, "probe", 1.5, 2.5)

    monkeypatch.setattr(engine, "probe", probe)
    found = engine.tune(tmp_path, max_bytes=engine.PROBE_MIN_BYTES - 1)
    assert found.source == "default" and sizes == [] and not tuning_cache.exists()
    assert engine.tune(tmp_path, max_bytes=(40 << 20) + 5).source == "probe"
    assert sizes == [40 << 20]
    engine._tune_memo.clear()
    free = os.statvfs_result((4096, 4096, 0, 0, 12000, 0, 0, 0, 0, 255))  # 12000 pages free
    monkeypatch.setattr(engine.os, "statvfs", lambda directory: free)
    engine.tune(tmp_path, refresh=True)  # half the free space is 23.4 MiB: 16 MiB in 8 MiB requests
    assert sizes == [40 << 20, 16 << 20]
    engine._tune_memo.clear()
    tuning_cache.unlink()
    with engine.SwapIO(1) as io:  # the SwapIO method passes the bound on
        assert io.tune(tmp_path, max_bytes=1 << 20).source == "default"
        assert io.tuning.source == "default" and len(sizes) == 2


@pytest.mark.skipif(not engine.has_extension(), reason="only the native backends are tuned")
def test_a_failed_probe_is_not_retried_in_the_process(tmp_path, tuning_cache, monkeypatch):
    calls = []

    def broken(directory, **kwargs):
        calls.append(directory)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(engine, "probe", broken)
    assert engine.tune(tmp_path).source == "default"
    assert engine.tune(tmp_path).source == "default" and len(calls) == 1
    engine.tune(tmp_path, refresh=True)  # unless asked
    assert len(calls) == 2 and not tuning_cache.exists()
