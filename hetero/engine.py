"""Swap-file I/O of the NVMe tier: positional reads and writes of whole CPU tensors.

Public API::

    SwapIO(num_threads=4)                  a pool of I/O worker threads
        .open(path, size, *, direct=None) -> SwapFile
        .write(file, offset, tensor)      -> Handle    (queued; returns at once)
        .read(file, offset, tensor)       -> Handle
        .close(file)    .shutdown()    .backend ("extension" | "python")    context manager
    SwapFile(path, fd, size, direct)       an open swap file (``direct``: opened with O_DIRECT)
    Handle.wait() -> None                  blocks without the GIL; HeteroIOError on failure
    Handle.done() -> bool
    aligned_empty(nbytes, alignment=4096, pin=False) -> torch.Tensor  (uint8, aligned data_ptr)
    inject_fault(kind, after=0)            test hook: simulated disk faults
    has_extension() -> bool, EXTENSION_ERROR: str | None, ALIGNMENT = 4096

Contract: a transfer moves all ``tensor.nbytes`` bytes of a contiguous CPU tensor (any dtype) at
byte ``offset``; the tensor must not be touched until its handle is waited, and every handle
should be waited (that is where errors surface; an unwaited handle pins its tensor until the
SwapIO is garbage-collected). Swap files are created with mode 0600 and opened with O_DIRECT when
the file system allows it, to keep swapped state out of the page cache; O_DIRECT transfers need
``data_ptr``, ``offset`` and ``nbytes`` to be multiples of 4096 (ValueError at submit otherwise),
which ``aligned_empty`` buffers satisfy. A short transfer (EOF, no progress) is an error.

Backends: the C++ extension ``hetero._C`` (worker threads outside Python) or, when it is not
built, a pure-Python pool of ``os.pread``/``os.pwrite`` calls with the same semantics and a
one-time RuntimeWarning. ``HETERO_FORCE_PYTHON_IO=1`` (read when a SwapIO is created) forces the
Python backend, so tests can cover both.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from hetero.errors import HeteroIOError

try:
    from hetero import _C
except (ImportError, OSError) as _exc:  # not built, or built against another torch
    _C = None
    EXTENSION_ERROR: str | None = f"{type(_exc).__name__}: {_exc}"
else:
    EXTENSION_ERROR = None

ALIGNMENT = 4096
_FAULT_KINDS = ("none", "eio", "enospc", "short")


def has_extension() -> bool:
    """Whether the native I/O engine ``hetero._C`` imported (see EXTENSION_ERROR if not)."""
    return _C is not None


def aligned_empty(nbytes: int, alignment: int = ALIGNMENT, pin: bool = False) -> torch.Tensor:
    """Uninitialised uint8 CPU tensor of ``nbytes`` whose data_ptr is a multiple of ``alignment``.

    O_DIRECT needs aligned buffers and torch's allocator only promises 64 bytes, so this
    over-allocates by ``alignment`` and slices. ``pin`` page-locks it when CUDA is available.
    """
    if nbytes < 0 or alignment < 1:
        raise ValueError(f"aligned_empty needs nbytes >= 0 and alignment >= 1, "
                         f"got {nbytes} and {alignment}")
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8,
                      pin_memory=pin and torch.cuda.is_available())
    start = -raw.data_ptr() % alignment
    return raw[start:start + nbytes]


_fault_lock = threading.Lock()
_fault = ["none", 0]  # kind, requests to let through first


def inject_fault(kind: str, after: int = 0) -> None:
    """Test hook: the ``after``-th next swap request in this process (0 = the next), on any SwapIO
    and either backend, fails: "eio" / "enospc" with that errno and nothing transferred, "short"
    after moving half the bytes. One-shot; "none" disarms."""
    if kind not in _FAULT_KINDS or after < 0:
        raise ValueError(f"inject_fault: kind must be one of {_FAULT_KINDS} and after >= 0")
    with _fault_lock:
        _fault[:] = [kind, after]


def _take_fault() -> str:
    with _fault_lock:
        kind, after = _fault
        if kind == "none":
            return "none"
        if after > 0:
            _fault[1] = after - 1
            return "none"
        _fault[0] = "none"
        return kind


@dataclass(frozen=True)
class SwapFile:
    """An open swap file; ``direct`` says whether it bypasses the page cache (O_DIRECT)."""

    path: str
    fd: int
    size: int
    direct: bool


class Handle:
    """One queued transfer. Wait it from one thread; later waits repeat the first outcome."""

    __slots__ = ("_engine", "_id", "_file", "_tensor", "_op", "_waited", "_error")

    def __init__(self, engine, handle_id: int, file: SwapFile, tensor: torch.Tensor, op: str):
        self._engine, self._id, self._file, self._op = engine, handle_id, file, op
        self._tensor = tensor  # keeps the buffer alive on the Python side too
        self._waited = False
        self._error: HeteroIOError | None = None

    def done(self) -> bool:
        """Whether the transfer has finished (successfully or not); never blocks."""
        return self._waited or self._engine.poll(self._id)

    def wait(self) -> None:
        """Block until the transfer finished; raise HeteroIOError (errno, path) if it failed."""
        if not self._waited:
            try:
                self._engine.wait(self._id)
            except OSError as e:
                self._error = HeteroIOError(e.errno, f"swap {self._op} failed: {e.strerror}",
                                            self._file.path)
            finally:
                self._waited, self._tensor = True, None
        if self._error is not None:
            raise self._error

    def __repr__(self) -> str:
        return f"<Handle {self._op} {self._file.path!r} #{self._id}>"


class SwapIO:
    """Pool of I/O threads doing the NVMe tier's swap-file transfers (see module docstring)."""

    def __init__(self, num_threads: int = 4) -> None:
        forced = os.environ.get("HETERO_FORCE_PYTHON_IO", "") not in ("", "0")
        if _C is not None and not forced:
            self._engine = _C.IOEngine(num_threads)
            self.backend = "extension"
        else:
            if _C is None:
                _warn_fallback()
            self._engine = _PyIOEngine(num_threads)
            self.backend = "python"
        self.num_threads = num_threads

    def open(self, path: str | os.PathLike[str], size: int, *,
             direct: bool | None = None) -> SwapFile:
        """Create/open ``path`` (mode 0600), growing it to ``size`` bytes if smaller.

        ``direct``: None tries O_DIRECT and falls back to buffered I/O where the file system
        refuses it (tmpfs); True requires O_DIRECT; False never uses it.
        """
        path = os.fspath(path)
        try:
            fd = -1
            if direct is not False and hasattr(os, "O_DIRECT"):
                fd = self._engine.open(path, size, True)
                if fd < 0 and direct:
                    raise OSError(errno.EINVAL, "the file system does not support O_DIRECT")
            is_direct = fd >= 0
            if fd < 0:
                fd = self._engine.open(path, size, False)
        except OSError as e:
            raise HeteroIOError(e.errno, f"cannot open swap file: {e.strerror}", path) from e
        return SwapFile(path, fd, size, is_direct)

    def write(self, file: SwapFile, offset: int, tensor: torch.Tensor) -> Handle:
        """Queue writing all of ``tensor``'s bytes to ``file`` at byte ``offset``."""
        return self._submit(True, file, offset, tensor)

    def read(self, file: SwapFile, offset: int, tensor: torch.Tensor) -> Handle:
        """Queue filling all of ``tensor``'s bytes from ``file`` at byte ``offset``."""
        return self._submit(False, file, offset, tensor)

    def _submit(self, write: bool, file: SwapFile, offset: int, tensor: torch.Tensor) -> Handle:
        submit = self._engine.submit_write if write else self._engine.submit_read
        handle_id = submit(file.fd, tensor, offset, _take_fault())
        return Handle(self._engine, handle_id, file, tensor, "write" if write else "read")

    def close(self, file: SwapFile) -> None:
        """Close ``file``; its transfers must have been waited."""
        try:
            self._engine.close(file.fd)
        except OSError as e:
            raise HeteroIOError(e.errno, f"cannot close swap file: {e.strerror}", file.path) from e

    def shutdown(self) -> None:
        """Finish queued transfers and stop the threads (handles stay waitable). Idempotent."""
        self._engine.shutdown()

    def __enter__(self) -> SwapIO:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


_warned = False


def _warn_fallback() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"hetero._C is not built ({EXTENSION_ERROR}); swap I/O falls back to a "
                      "slower pure-Python engine. Build it: pip install --no-build-isolation -e .",
                      RuntimeWarning, stacklevel=3)


def _failure(op: str, nbytes: int, offset: int, done: int, why: str) -> str:
    # Same wording as csrc/aio.cpp.
    return (f"{op} of {nbytes} bytes at offset {offset} failed: "
            f"{done} of {nbytes} bytes transferred ({why})")


class _PyIOEngine:
    """Pure-Python stand-in for ``hetero._C.IOEngine``: same methods, errors and semantics."""

    def __init__(self, num_threads: int) -> None:
        if num_threads < 1:
            raise ValueError("IOEngine needs num_threads >= 1")
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="hetero-io")
        self._lock = threading.Lock()
        self._futures: dict[int, Future[None]] = {}
        self._next = 1

    @staticmethod
    def open(path: str, size: int, direct: bool) -> int:
        if size < 0:
            raise ValueError("swap file size must be >= 0")
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as e:
            if direct and e.errno == errno.EINVAL:
                return -1
            raise
        try:
            os.fchmod(fd, 0o600)
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return fd

    @staticmethod
    def close(fd: int) -> None:
        os.close(fd)

    def submit_write(self, fd: int, tensor: torch.Tensor, offset: int, fault: str = "none") -> int:
        return self._submit(True, fd, tensor, offset, fault)

    def submit_read(self, fd: int, tensor: torch.Tensor, offset: int, fault: str = "none") -> int:
        return self._submit(False, fd, tensor, offset, fault)

    def _submit(self, write: bool, fd: int, tensor: torch.Tensor, offset: int, fault: str) -> int:
        if fault not in _FAULT_KINDS:
            raise ValueError(f"unknown fault kind '{fault}' (expected none, eio, enospc or short)")
        if tensor.device.type != "cpu":
            raise ValueError("swap I/O needs a CPU tensor")
        if not tensor.is_contiguous():
            raise ValueError("swap I/O needs a contiguous tensor")
        if offset < 0:
            raise ValueError("swap I/O offset must be >= 0")
        try:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        except OSError:
            raise ValueError(f"bad file descriptor {fd}") from None
        if flags & getattr(os, "O_DIRECT", 0):
            ptr, nbytes = tensor.data_ptr(), tensor.nbytes
            bad = [f"{name} ({value})" for name, value, misaligned in (
                ("data_ptr", hex(ptr), ptr % ALIGNMENT), ("offset", offset, offset % ALIGNMENT),
                ("nbytes", nbytes, nbytes % ALIGNMENT)) if misaligned]
            if bad:
                raise ValueError("O_DIRECT swap I/O needs 4096-byte alignment; misaligned: "
                                 + " ".join(bad))
        buf = memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())
        future = self._pool.submit(_transfer, write, fd, buf, offset, fault)
        with self._lock:
            handle, self._next = self._next, self._next + 1
            self._futures[handle] = future
        return handle

    def _future(self, handle: int, pop: bool) -> Future[None]:
        with self._lock:
            future = self._futures.pop(handle, None) if pop else self._futures.get(handle)
        if future is None:
            raise ValueError(f"unknown or already waited I/O handle {handle}")
        return future

    def wait(self, handle: int) -> None:
        self._future(handle, pop=True).result()

    def poll(self, handle: int) -> bool:
        return self._future(handle, pop=False).done()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def _transfer(write: bool, fd: int, buf: memoryview, offset: int, fault: str) -> None:
    op, n = ("pwrite" if write else "pread"), len(buf)
    if fault in ("eio", "enospc"):
        err = errno.EIO if fault == "eio" else errno.ENOSPC
        raise OSError(err, _failure(op, n, offset, 0, "injected: " + os.strerror(err)))
    limit = (n // 2) & ~(ALIGNMENT - 1) if fault == "short" else n
    done = 0
    while done < limit:  # os.pread/pwrite retry EINTR themselves (PEP 475)
        try:
            k = (os.pwrite(fd, buf[done:limit], offset + done) if write
                 else os.preadv(fd, [buf[done:limit]], offset + done))
        except OSError as e:
            raise OSError(e.errno, _failure(op, n, offset, done, e.strerror)) from None
        if k == 0:
            break
        done += k
    if done < n:
        why = ("injected short transfer" if fault == "short"
               else "write made no progress" if write else "unexpected end of file")
        raise OSError(errno.EIO, _failure(op, n, offset, done, why))
