"""Tests of hetero.engine, the NVMe tier's swap-file I/O, on both backends.

Files go under pytest's tmp_path, which must be a real disk file system (not tmpfs) for the
O_DIRECT paths to run; tests that need O_DIRECT skip where the file system refuses it.
"""

from __future__ import annotations

import errno
import os
import random
import stat
import threading
import time
import warnings

import pytest
import torch

from hetero import engine
from hetero.errors import HeteroIOError

PAGE = engine.ALIGNMENT


@pytest.fixture(params=["extension", "python"])
def io(request, monkeypatch):
    if request.param == "extension":
        if not engine.has_extension():
            pytest.skip(f"hetero._C not built: {engine.EXTENSION_ERROR}")
        monkeypatch.delenv("HETERO_FORCE_PYTHON_IO", raising=False)
    else:
        monkeypatch.setenv("HETERO_FORCE_PYTHON_IO", "1")
    swap_io = engine.SwapIO(num_threads=4)
    assert swap_io.backend == request.param
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
        def open(self, path: str, size: int, direct: bool) -> int:
            return -1 if direct else real.open(path, size, False)

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
    monkeypatch.delenv("HETERO_FORCE_PYTHON_IO", raising=False)
    with pytest.warns(RuntimeWarning, match="hetero._C is not built.*simulated"):
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
    monkeypatch.delenv("HETERO_FORCE_PYTHON_IO", raising=False)
    with engine.SwapIO(1) as io:
        assert io.backend == "extension"
