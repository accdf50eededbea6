"""Swap-file I/O of the NVMe tier: positional reads and writes of whole CPU tensors.

Public API::

    SwapIO(num_threads=4, *, backend=None, block_size=None, queue_depth=None, checksum=None,
           autotune=None)
        .open(path, size, *, direct=None, preallocate=True) -> SwapFile
        .tune(directory, *, max_bytes=None) -> Tuning   settle the tuning now (bounded probe)
        .write(file, offset, tensor)      -> Handle    (queued; returns at once)
        .read(file, offset, tensor)       -> Handle
        .close(file)    .shutdown()    context manager
        .backend ("io_uring" | "threads" | "python")    .block_size    .queue_depth
        .checksum (bool)    .tuning (Tuning | None: what the first open decided)
    SwapFile(path, fd, size, direct)       an open swap file (``direct``: opened with O_DIRECT)
    Handle.wait(timeout=None) -> None      blocks without the GIL; HeteroIOError on failure,
                                           TimeoutError if ``timeout`` seconds pass first (inf:
                                           no limit)
    Handle.done() -> bool
    aligned_empty(nbytes, alignment=4096, pin=False) -> torch.Tensor  (uint8, aligned data_ptr)
    inject_fault(kind, after=0)            test hook: simulated disk faults
    tune(directory, *, backend="auto", refresh=False, max_bytes=None) -> Tuning
                                           block size / queue depth probe
    check_environment()                    HeteroConfigError for a bad HETERO_IO_* value
    Tuning(block_size, queue_depth, source, read_GBps, write_GBps, key)
    tuning_cache_path() -> Path            where probe results are kept
    available_backends() -> list[str]      has_extension() -> bool
    EXTENSION_ERROR: str | None, ALIGNMENT = 4096, BACKENDS

Contract: a transfer moves all ``tensor.nbytes`` bytes of a contiguous CPU tensor (any dtype) at
byte ``offset``; the tensor must not be touched until its handle is waited, and every handle
should be waited (that is where errors surface; an unwaited handle pins its tensor until the
SwapIO is garbage-collected). Swap files are created with mode 0600, their space is reserved when
they are opened (``fallocate``: a full disk is a HeteroIOError(ENOSPC) at open, i.e. at wrap
time, not in the middle of a training step), and they are opened with O_DIRECT when the file
system allows it, to keep swapped state out of the page cache; O_DIRECT transfers need
``data_ptr``, ``offset`` and ``nbytes`` to be multiples of 4096 (ValueError at submit otherwise),
which ``aligned_empty`` buffers (and the host arena carved from one) satisfy. A short transfer
(EOF, no progress) is an error, as are disk full, I/O errors and checksum mismatches: all
surface as :class:`~hetero.errors.HeteroIOError` (an OSError with errno and the file's path).
A closed SwapFile is refused (its descriptor number goes to the next file opened): ValueError
from ``read``/``write``, HeteroIOError(EBADF) from ``close``. Invalid settings (arguments or
``HETERO_IO_*``) are :class:`~hetero.errors.HeteroConfigError` (a ValueError) naming them.

Backends (``backend=`` or ``HETERO_IO_BACKEND``; ``auto`` by default):

- ``io_uring``: the C++ extension ``hetero._C`` on one io_uring ring (liburing). Each request is
  split into ``block_size`` sub-requests and up to ``queue_depth`` of them are in flight across
  all requests; one completion thread outside Python submits, reaps and resubmits short
  transfers. ``auto`` picks it when the extension was built with liburing and the kernel lets us
  create a ring.
- ``threads``: the same engine on a pool of ``max(num_threads, queue_depth)`` workers doing
  blocking pread/pwrite of one sub-request each, at most ``queue_depth`` at once (what ``auto``
  falls back to).
- ``python``: a pure-Python pool of ``os.pread``/``os.pwrite``, used when the extension is not
  built (one RuntimeWarning) or chosen (``HETERO_IO_BACKEND=python``, or ``backend="python"``);
  whole requests, no splitting.

Tuning: the first ``open`` of a SwapIO whose ``block_size``/``queue_depth`` were not both given
calls :func:`tune` on the file's directory (``SwapIO.tune`` does it before, bounding the bytes
the probe may write): a short probe (about a second, a temporary file of at most 64 MiB and half
the free space in that directory, removed after; skipped below 16 MiB) measures read and write
throughput of a few block size / queue depth pairs and keeps the best; the result is cached per
file system (``st_dev`` and mount point) in :func:`tuning_cache_path`, if that is a regular file
or missing, and reused by later processes; a failed probe is not retried in the process.
``HETERO_IO_BLOCK_SIZE`` / ``HETERO_IO_QUEUE_DEPTH`` override it (arguments override those), and
``HETERO_IO_AUTOTUNE=0`` skips the probe (1 MiB, 32 unless overridden).

Checksums (``checksum=True`` or ``HETERO_IO_CHECKSUM=1``, off by default): a CRC32C of every
sub-request written is kept in memory under (file, offset) and every read verifies the records
inside it, failing with HeteroIOError(EIO, "checksum mismatch ...") when the disk returned other
bytes than were written. Costs one pass over the bytes (~8 GB/s per core with SSE4.2). The
python backend keeps zlib's CRC32 instead (no CRC32C without the extension); records live in the
engine that wrote the bytes and only it verifies them, so the two kinds are never compared.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import fcntl
import json
import logging
import math
import numbers
import os
import stat
import tempfile
import threading
import time
import warnings
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Optional

import torch

from hetero.errors import HeteroConfigError, HeteroIOError, HeteroStateError

from hetero.native import ERROR as EXTENSION_ERROR, _C, register_engine

log = logging.getLogger(__name__)

ALIGNMENT = 4096
BACKENDS = ("auto", "io_uring", "threads", "python")
_FAULT_KINDS = ("none", "eio", "enospc", "short", "corrupt")
DEFAULT_BLOCK_SIZE = 1 << 20
DEFAULT_QUEUE_DEPTH = 32
MAX_QUEUE_DEPTH = 256
MAX_BLOCK_SIZE = 64 << 20


def has_extension() -> bool:
    """Whether the native I/O engine ``hetero._C`` imported (see EXTENSION_ERROR if not)."""
    return _C is not None


def available_backends() -> list[str]:
    """The backends a SwapIO can run here, best first (``python`` always)."""
    found = []
    if _C is not None:
        if _C.io_uring_available()[0]:
            found.append("io_uring")
        found.append("threads")
    return found + ["python"]


def aligned_empty(nbytes: int, alignment: int = ALIGNMENT, pin: "bool | torch.device" = False) -> torch.Tensor:
    """Uninitialised uint8 CPU tensor of ``nbytes`` whose data_ptr is a multiple of ``alignment``.

    O_DIRECT needs aligned buffers and torch's allocator only promises 64 bytes, so this
    over-allocates by ``alignment`` and slices. ``pin`` page-locks it when CUDA is available:
    exactly ``nbytes`` (page-aligned, :func:`hetero._C.pinned_empty`) where the extension has
    CUDA, for torch's pinned allocator rounds each request up to a power of two (nearly twice
    the host budget locked) and keeps it locked after the tensor is freed; that allocator only
    where the extension was built without CUDA. ``pin`` a CUDA device: the memory is registered
    with that device current (else the current one, which would get a CUDA context of its own).
    RuntimeError where the memory cannot be locked.
    """
    if nbytes < 0 or alignment < 1:
        raise ValueError(f"aligned_empty needs nbytes >= 0 and alignment >= 1, "
                         f"got {nbytes} and {alignment}")
    device = pin if isinstance(pin, torch.device) and pin.type == "cuda" else None
    pin = bool(pin) and torch.cuda.is_available()
    if pin and _C is not None and _C.COPY_CUDA and os.sysconf("SC_PAGESIZE") % alignment == 0:
        with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
            return _C.pinned_empty(nbytes)
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8, pin_memory=pin)
    start = -raw.data_ptr() % alignment
    return raw[start:start + nbytes]


# ------------------------------------------------------------------------------------------------
# Fault injection (tests)

_fault_lock = threading.Lock()
_fault = ["none", 0]  # kind, requests to let through first


def inject_fault(kind: str, after: int = 0) -> None:
    """Test hook: the ``after``-th next swap request in this process (0 = the next), on any SwapIO
    and any backend, fails as the disk would: "eio" / "enospc" with that errno and nothing
    transferred, "short" after moving the first half (page aligned) of the bytes, "corrupt" moves
    every byte but one arrives flipped (on disk for a write, in the tensor for a read), which only
    checksums catch. One-shot; "none" disarms."""
    if kind not in _FAULT_KINDS or not isinstance(after, int) or after < 0:
        raise ValueError(f"inject_fault: kind must be one of {_FAULT_KINDS} and after an int >= 0, "
                         f"got kind={kind!r}, after={after!r}")
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


# ------------------------------------------------------------------------------------------------
# Settings from the environment

_ENV = "environment variable "
_FLAG_VALUES = "1, true, yes or on (0, false, no or off to turn it off)"
_BLOCK_SIZES = f"a multiple of {ALIGNMENT} between {ALIGNMENT} and {MAX_BLOCK_SIZE} bytes"
_QUEUE_DEPTHS = f"an int between 1 and {MAX_QUEUE_DEPTH}"


def _env_value(name: str) -> Optional[str]:
    value = os.environ.get(name, "").strip()
    return value or None


def env_flag(name: str) -> Optional[bool]:
    """The boolean environment variable ``name`` (None: unset or empty); HeteroConfigError naming
    it for a value that is not one."""
    value = _env_value(name)
    if value is None:
        return None
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise HeteroConfigError(f"{_ENV}{name}={value!r} is not accepted; expected {_FLAG_VALUES}")


def _env_block_size() -> Optional[int]:
    value = _env_value("HETERO_IO_BLOCK_SIZE")
    if value is None:
        return None
    from hetero.config import parse_size
    try:
        nbytes = parse_size(value, f"{_ENV}HETERO_IO_BLOCK_SIZE", allow_none=False)
        _check_block_size(nbytes, "")
    except ValueError:
        raise HeteroConfigError(f"{_ENV}HETERO_IO_BLOCK_SIZE={value!r} is not accepted; expected "
                                f"{_BLOCK_SIZES} (a size such as 256KiB or 1MiB)") from None
    return nbytes


def _env_queue_depth() -> Optional[int]:
    value = _env_value("HETERO_IO_QUEUE_DEPTH")
    if value is None:
        return None
    try:
        depth = int(value)
        _check_queue_depth(depth, "")
    except ValueError:
        raise HeteroConfigError(f"{_ENV}HETERO_IO_QUEUE_DEPTH={value!r} is not accepted; expected "
                                f"{_QUEUE_DEPTHS}") from None
    return depth


def check_environment() -> None:
    """Raise HeteroConfigError, naming the variable, its value and what is accepted, for any
    invalid ``HETERO_IO_*`` setting a SwapIO would read: ``wrap`` calls it with an NVMe tier,
    before anything moves, rather than failing once it has started making swap files."""
    _resolve_backend(None)
    _env_block_size()
    _env_queue_depth()
    env_flag("HETERO_IO_CHECKSUM")
    env_flag("HETERO_IO_AUTOTUNE")


def _check_block_size(value: object, name: str) -> None:
    if (not isinstance(value, int) or isinstance(value, bool) or not
            ALIGNMENT <= value <= MAX_BLOCK_SIZE or value % ALIGNMENT):
        raise HeteroConfigError(f"{name}block_size={value!r} must be {_BLOCK_SIZES}")


def _check_queue_depth(value: object, name: str) -> None:
    if (not isinstance(value, int) or isinstance(value, bool)
            or not 1 <= value <= MAX_QUEUE_DEPTH):
        raise HeteroConfigError(f"{name}queue_depth={value!r} must be {_QUEUE_DEPTHS}")


def _check_tuning(block_size: int, queue_depth: int, source: str) -> None:
    _check_block_size(block_size, f"{source}: ")
    _check_queue_depth(queue_depth, f"{source}: ")


def _resolve_backend(backend: Optional[str]) -> str:
    """The backend to run: the argument, else HETERO_IO_BACKEND, else auto, resolved against
    what this build and kernel offer. HeteroConfigError for a backend that is unknown or
    unavailable here."""
    source = f"SwapIO(backend=...): backend={backend!r}"
    if backend is None:
        backend = _env_value("HETERO_IO_BACKEND") or "auto"
        source = f"{_ENV}HETERO_IO_BACKEND={backend!r}"
    if backend not in BACKENDS:
        raise HeteroConfigError(f"{source} is not accepted; expected one of {', '.join(BACKENDS)}")
    if backend == "auto":
        if _C is None:
            _warn_fallback()
            return "python"
        ok, why = _C.io_uring_available()
        if not ok:
            log.info("swap I/O: io_uring unavailable (%s); using the thread-pool backend", why)
        return "io_uring" if ok else "threads"
    if backend in ("io_uring", "threads"):
        if _C is None:
            raise HeteroConfigError(f"{source} needs the C++ extension hetero._C, which did not "
                                    f"import ({EXTENSION_ERROR}); expected one of "
                                    f"{available_backends()} or auto")
        if backend == "io_uring" and not _C.io_uring_available()[0]:
            raise HeteroConfigError(f"{source}: io_uring is unavailable here "
                                    f"({_C.io_uring_available()[1]}); expected one of "
                                    f"{available_backends()} or auto")
    return backend


# ------------------------------------------------------------------------------------------------
# Auto-tuning

@dataclass(frozen=True)
class Tuning:
    """Block size and queue depth of a SwapIO, and where they came from.

    ``source``: "probe" (measured now), "cache" (an earlier probe on this file system),
    "default" (no probe: disabled or failed), "override" (arguments / environment).
    ``read_GBps`` / ``write_GBps``: what the probe measured with these settings (None otherwise).
    """

    block_size: int
    queue_depth: int
    source: str
    read_GBps: Optional[float] = None
    write_GBps: Optional[float] = None
    key: Optional[str] = None


#: (block size, queue depth) pairs the probe tries; the default pair first.
PROBE_CANDIDATES = ((1 << 20, 32), (256 << 10, 32), (1 << 20, 8), (1 << 20, 64), (4 << 20, 16))
PROBE_FILE_BYTES = 64 << 20
#: the probe is skipped (defaults, uncached) where it may write less: too few passes to measure
PROBE_MIN_BYTES = 16 << 20
_PROBE_REQUEST = 8 << 20  # bytes per probe request, as the runtime's chunk-sized ones
_PROBE_BUDGET_S = 1.5
_PROBE_PASS_S = 0.05  # target duration of one measured pass
_tune_lock = threading.Lock()
_tune_memo: dict[tuple[str, str], Tuning] = {}


def tuning_cache_path() -> Path:
    """The JSON file of probe results: ``$HETERO_IO_TUNING_CACHE``, else
    ``$XDG_CACHE_HOME/hetero/io_tuning.json``, else ``~/.cache/hetero/io_tuning.json``."""
    explicit = os.environ.get("HETERO_IO_TUNING_CACHE", "").strip()
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(
        os.path.expanduser("~"), ".cache")
    return Path(base, "hetero", "io_tuning.json")


def _fs_key(directory: str, backend: str) -> str:
    """Identifies the file system holding ``directory``: device number and mount point."""
    path = os.path.realpath(directory)
    dev = os.stat(path).st_dev
    mount = path
    while mount != "/":
        parent = os.path.dirname(mount)
        if os.stat(parent).st_dev != dev:
            break
        mount = parent
    return f"{backend}:{dev}:{mount}"


def _cache_problem(path: Path) -> Optional[str]:
    """Why ``path`` cannot be the tuning cache, or None: only a regular file (or nothing yet) is
    read or replaced. A FIFO there would block the first open for ever, and replacing a device
    (``HETERO_IO_TUNING_CACHE=/dev/null``, as root) with a JSON file would break the system."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        return str(exc)
    return None if stat.S_ISREG(mode) else f"not a regular file (mode {stat.filemode(mode)})"


def _read_cache(path: Path) -> Optional[dict]:
    """The cache's entries ({} when there is none yet, or it is damaged: the next probe rewrites
    it), or None when ``path`` is not a regular file: then the cache is not used at all."""
    problem = _cache_problem(path)
    if problem is not None:
        log.warning("swap I/O tuning cache %s is not usable (%s); tuning without it", path, problem)
        return None
    try:  # O_NONBLOCK: a FIFO put there since the check must not block the open
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        log.warning("ignoring unreadable swap I/O tuning cache %s (%s)", path, exc)
        return {}
    with os.fdopen(fd) as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            log.warning("swap I/O tuning cache %s is not a regular file; tuning without it", path)
            return None
        try:
            data = json.load(f)
        except (OSError, ValueError, RecursionError) as exc:  # (RecursionError: nesting too deep)
            log.warning("ignoring unreadable swap I/O tuning cache %s (%s)", path, exc)
            return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, key: str, tuning: Tuning) -> None:
    """Add ``tuning`` under ``key`` to the cache file, replacing it atomically (concurrent
    processes see the old or the new file), unless it is not a regular file. Never raises for
    an I/O problem and never leaves its temporary file behind."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_cache(path)
        if data is None:
            return
        data[key] = {k: v for k, v in asdict(tuning).items() if k not in ("source", "key")}
        data[key]["probed_at"] = time.time()
        fd, tmp = tempfile.mkstemp(prefix=".io_tuning-", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:
        log.warning("could not save swap I/O tuning to %s (%s)", path, exc)


def _probe_bytes(directory: str, max_bytes: Optional[int]) -> int:
    """Bytes the probe may write in ``directory``: PROBE_FILE_BYTES, at most ``max_bytes`` (the
    caller's budget: the NVMe tier's swap files) and half the free space (the rest is other
    writers'), in whole probe requests."""
    free = os.statvfs(directory)
    limit = min(PROBE_FILE_BYTES, free.f_bavail * free.f_frsize // 2)
    if max_bytes is not None:
        limit = min(limit, max_bytes)
    return limit // _PROBE_REQUEST * _PROBE_REQUEST


def _defaults(key: Optional[str] = None) -> Tuning:
    return Tuning(DEFAULT_BLOCK_SIZE, DEFAULT_QUEUE_DEPTH, "default", key=key)


def _cached(cache: Path, entries: Optional[dict], key: str) -> Optional[Tuning]:
    """The valid cache entry for ``key``, or None."""
    entry = (entries or {}).get(key)
    try:
        hit = Tuning(int(entry["block_size"]), int(entry["queue_depth"]), "cache",
                     entry.get("read_GBps"), entry.get("write_GBps"), key)
        _check_tuning(hit.block_size, hit.queue_depth, f"tuning cache {cache}")
    except (TypeError, KeyError, ValueError, OverflowError):  # (JSON reads 1e999 as infinity)
        return None
    return hit


def tune(directory: str | os.PathLike[str], *, backend: str = "auto", refresh: bool = False,
         max_bytes: Optional[int] = None) -> Tuning:
    """Block size and queue depth for swap I/O in ``directory`` on ``backend``.

    Returns the result known for the directory's file system when there is one: from this
    process, else from the cache file (``refresh`` re-probes); else runs :func:`probe` there,
    writing at most ``max_bytes`` (and half the free space; PROBE_FILE_BYTES at most), and
    caches it. Never raises for an I/O problem: where fewer than PROBE_MIN_BYTES may be written
    the probe is skipped, and a probe that fails (full disk, unwritable directory) logs a
    warning; both return the defaults, uncached, and a failed probe is not retried in this
    process. Only the native backends are tuned; ``python`` gets the defaults.
    """
    backend = _resolve_backend(backend)
    if backend == "python":
        return _defaults()
    directory = os.fspath(directory)
    cache = tuning_cache_path()
    try:
        key = _fs_key(directory, backend)
    except OSError as exc:
        log.warning("swap I/O tuning: cannot stat %s (%s); using defaults", directory, exc)
        return _defaults()
    with _tune_lock:
        memo = (str(cache), key)
        if not refresh and memo in _tune_memo:
            return _tune_memo[memo]
        entries = _read_cache(cache)
        hit = None if refresh else _cached(cache, entries, key)
        if hit is not None:
            _tune_memo[memo] = hit
            return hit
        try:
            nbytes = _probe_bytes(directory, max_bytes)
            if nbytes < PROBE_MIN_BYTES:
                log.info("swap I/O tuning in %s skipped: the probe needs %d bytes and may write "
                         "only %d there (budget, free space); using block size %d, queue depth "
                         "%d", directory, PROBE_MIN_BYTES, nbytes, DEFAULT_BLOCK_SIZE,
                         DEFAULT_QUEUE_DEPTH)
                return _defaults(key)
            found = probe(directory, backend=backend, file_bytes=nbytes)
        except (OSError, ValueError) as exc:
            log.warning("swap I/O tuning probe in %s failed (%s); using block size %d, queue depth "
                        "%d (not probed again in this process)", directory, exc,
                        DEFAULT_BLOCK_SIZE, DEFAULT_QUEUE_DEPTH)
            _tune_memo[memo] = _defaults(key)
            return _tune_memo[memo]
        found = Tuning(found.block_size, found.queue_depth, "probe", found.read_GBps,
                       found.write_GBps, key)
        if entries is not None:
            _write_cache(cache, key, found)
        _tune_memo[memo] = replace(found, source="cache")  # for later callers
        return found


def probe(directory: str | os.PathLike[str], *, backend: str = "auto",
          candidates: tuple[tuple[int, int], ...] = PROBE_CANDIDATES,
          file_bytes: int = PROBE_FILE_BYTES, budget_s: float = _PROBE_BUDGET_S) -> Tuning:
    """Measure swap throughput in ``directory`` for each (block size, queue depth) candidate and
    return the best (no cache). About ``budget_s`` seconds; a temporary file of ``file_bytes``
    (reserved like a swap file, opened like one) is removed afterwards.

    Each candidate writes then reads a stretch of the file in 8 MiB requests, all in flight, as
    the runtime issues chunk-sized requests; the stretch is sized from a first full write so one
    pass takes ~50 ms. Candidates are measured twice, interleaved, and keep their better pass to
    damp noise; the score is the harmonic mean of read and write GB/s. The first candidate (the
    default) wins unless another beats it by more than 3%, so noise alone does not move the
    settings away from a known-good point. Raises OSError when the directory cannot hold the file.
    """
    backend = _resolve_backend(backend)
    if backend == "python":
        raise ValueError("probe needs a native backend (io_uring or threads)")
    start = time.perf_counter()
    engine = _C.IOEngine(4, backend, candidates[0][0], candidates[0][1], False)
    fd_path = tempfile.NamedTemporaryFile(prefix=".hetero-probe-", dir=directory, delete=False)
    path = fd_path.name
    fd_path.close()
    fd = -1
    try:
        fd = engine.open(path, file_bytes, True)
        if fd < 0:
            fd = engine.open(path, file_bytes, False)
        buf = aligned_empty(file_bytes)
        buf.view(torch.int64).copy_(torch.arange(file_bytes // 8, dtype=torch.int64))
        request = _PROBE_REQUEST

        def run(write: bool, nbytes: int) -> float:
            submit = engine.submit_write if write else engine.submit_read
            t0 = time.perf_counter()
            handles = [submit(fd, buf[off:off + min(request, nbytes - off)], off)
                       for off in range(0, nbytes, request)]
            for h in handles:
                engine.wait(h)
            return nbytes / max(time.perf_counter() - t0, 1e-9) / 1e9

        first = run(True, file_bytes)  # also turns the reserved extents into written ones
        stretch = int(min(file_bytes, max(8 << 20, first * 1e9 * _PROBE_PASS_S)))
        stretch = max(request, stretch // request * request)
        best: dict[tuple[int, int], tuple[float, float]] = {}
        for _round in range(2):
            for bs, qd in candidates:
                if best and time.perf_counter() - start > budget_s:
                    break
                engine.set_tuning(bs, qd)
                w, r = run(True, stretch), run(False, stretch)
                old = best.get((bs, qd), (0.0, 0.0))
                best[(bs, qd)] = (max(old[0], r), max(old[1], w))
    finally:
        engine.shutdown()  # first: requests still queued after a failure must not outlive the fd
        if fd >= 0:
            engine.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass

    def score(rw: tuple[float, float]) -> float:
        return 2.0 / (1.0 / max(rw[0], 1e-9) + 1.0 / max(rw[1], 1e-9))

    default = candidates[0]
    choice = max(best, key=lambda c: score(best[c]))
    if default in best and score(best[default]) >= 0.97 * score(best[choice]):
        choice = default
    read, write = best[choice]
    log.info("swap I/O tuning in %s (%s): block size %d, queue depth %d (read %.2f GB/s, write "
             "%.2f GB/s; %d candidates in %.2f s)", directory, backend, choice[0], choice[1], read,
             write, len(best), time.perf_counter() - start)
    return Tuning(choice[0], choice[1], "probe", round(read, 3), round(write, 3))


# ------------------------------------------------------------------------------------------------
# SwapIO

@dataclass(frozen=True)
class SwapFile:
    """An open swap file; ``direct`` says whether it bypasses the page cache (O_DIRECT)."""

    path: str
    fd: int
    size: int
    direct: bool


_WAIT_SLICE_S = 3600.0  # longest single wait_for: far below what the engines' clocks can add


def _check_timeout(timeout: object) -> float:
    """``timeout`` as float seconds: TypeError unless a real number, ValueError for NaN (which
    no clock can wait). Negative is 0 (poll); inf waits as long as it takes."""
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"Handle.wait: timeout={timeout!r} is not accepted; expected None or a "
                        "number of seconds")
    try:
        seconds = float(timeout)
    except OverflowError:  # an int beyond any float: as long as it takes
        seconds = math.inf
    if math.isnan(seconds):
        raise ValueError("Handle.wait: timeout=nan is not accepted; expected None or a number of "
                         "seconds")
    return max(seconds, 0.0)


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

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block (without the GIL) until the transfer finished; raise HeteroIOError (errno, path)
        if it failed. With ``timeout`` (seconds, a real number; inf is no limit), raise
        TimeoutError if it is still running then (the handle stays valid and can be waited
        again). Only the transfer's end settles the handle: any other exception (a bad timeout,
        KeyboardInterrupt) leaves it to be waited again."""
        if timeout is not None:
            timeout = _check_timeout(timeout)
        if not self._waited:
            try:
                finished = self._wait(timeout)
            except OSError as e:  # (raised by the engines only for a finished transfer)
                finished = True
                self._error = HeteroIOError(e.errno, f"swap {self._op} failed: {e.strerror}",
                                            self._file.path)
            if not finished:
                raise TimeoutError(f"swap {self._op} of {self._file.path!r} still running after "
                                   f"{timeout} s")
            self._waited, self._tensor = True, None
        if self._error is not None:
            raise self._error

    def _wait(self, timeout: Optional[float]) -> bool:
        """Whether the transfer finished within ``timeout`` (None: it has, waited for). Waits in
        slices of at most _WAIT_SLICE_S: a deadline far away (inf, 1e300) overflows both
        engines' clocks (an instant timeout natively, OverflowError in Python's)."""
        if timeout is None:
            self._engine.wait(self._id)
            return True
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if self._engine.wait_for(self._id, min(max(left, 0.0), _WAIT_SLICE_S)):
                return True
            if left <= _WAIT_SLICE_S:
                return False

    def __repr__(self) -> str:
        return f"<Handle {self._op} {self._file.path!r} #{self._id}>"


class SwapIO:
    """The NVMe tier's swap-file transfers (see the module docstring for backends and tuning).

    ``num_threads``: workers of the python backend, and the least the threads backend starts
    (it runs ``max(num_threads, queue_depth)``). ``backend``: None reads
    HETERO_IO_BACKEND, default "auto". ``block_size`` / ``queue_depth``:
    None takes HETERO_IO_BLOCK_SIZE / HETERO_IO_QUEUE_DEPTH, else the auto-tuned value (probe or
    cache, on the first open). ``checksum``: None reads HETERO_IO_CHECKSUM (default off).
    ``autotune``: None reads HETERO_IO_AUTOTUNE (default on); off keeps 1 MiB / 32.
    """

    def __init__(self, num_threads: int = 4, *, backend: Optional[str] = None,
                 block_size: Optional[int] = None, queue_depth: Optional[int] = None,
                 checksum: Optional[bool] = None, autotune: Optional[bool] = None) -> None:
        if not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"SwapIO: num_threads={num_threads!r} must be an int >= 1")
        self.backend = _resolve_backend(backend)
        self._block_size = block_size if block_size is not None else _env_block_size()
        self._queue_depth = queue_depth if queue_depth is not None else _env_queue_depth()
        bs = self._block_size if self._block_size is not None else DEFAULT_BLOCK_SIZE
        qd = self._queue_depth if self._queue_depth is not None else DEFAULT_QUEUE_DEPTH
        _check_tuning(bs, qd, "SwapIO")
        self.checksum = bool(checksum if checksum is not None
                             else env_flag("HETERO_IO_CHECKSUM") or False)
        autotune = autotune if autotune is not None else env_flag("HETERO_IO_AUTOTUNE")
        self.num_threads = num_threads
        self.tuning: Optional[Tuning] = None
        self._lock = threading.Lock()
        self._files_lock = threading.Lock()
        self._files: dict[int, SwapFile] = {}  # fd -> the open SwapFile holding it
        overridden = self._block_size is not None or self._queue_depth is not None
        if self.backend == "python":  # (never probed: whole requests, no splitting)
            self._engine = _PyIOEngine(num_threads, checksum=self.checksum)
            self._engine.set_tuning(bs, qd)
            self.tuning = Tuning(bs, qd, "override" if overridden else "default")
        else:
            self._engine = _C.IOEngine(num_threads, self.backend, bs, qd, self.checksum)
            if self._block_size is not None and self._queue_depth is not None:
                self.tuning = Tuning(bs, qd, "override")
            elif autotune is False:
                self.tuning = Tuning(bs, qd, "default")
        register_engine(self)  # (in a forked child, refused and never destroyed)

    @property
    def block_size(self) -> int:
        """Sub-request size in bytes (requests are split into pieces of this size)."""
        return self._engine.block_size

    @property
    def queue_depth(self) -> int:
        """Sub-requests in flight at most, across requests."""
        return self._engine.queue_depth

    def tune(self, directory: str | os.PathLike[str], *, max_bytes: Optional[int] = None) -> Tuning:
        """Settle block size and queue depth for swap files in ``directory`` now, unless they
        are already (arguments, HETERO_IO_AUTOTUNE=0, an earlier call or open): the probe (see
        :func:`tune`) writes at most ``max_bytes`` there, so a caller with a byte budget for
        the directory (the NVMe tier) stays within it. The first open calls it otherwise, with
        no bound but the free space."""
        with self._lock:
            if self.tuning is None:
                self._tune_for(os.fspath(directory), max_bytes)
            return self.tuning

    def _tune_for(self, directory: str, max_bytes: Optional[int]) -> None:
        found = tune(directory, backend=self.backend, max_bytes=max_bytes)
        bs = self._block_size if self._block_size is not None else found.block_size
        qd = self._queue_depth if self._queue_depth is not None else found.queue_depth
        self._engine.set_tuning(bs, qd)
        overridden = self._block_size is not None or self._queue_depth is not None
        self.tuning = Tuning(bs, qd, "override" if overridden else found.source,
                             found.read_GBps, found.write_GBps, found.key)
        log.debug("swap I/O in %s: %s backend, block size %d, queue depth %d (%s)", directory,
                  self.backend, bs, qd, self.tuning.source)

    def open(self, path: str | os.PathLike[str], size: int, *,
             direct: bool | None = None, preallocate: bool = True) -> SwapFile:
        """Create/open ``path`` (mode 0600) and reserve its first ``size`` bytes on disk.

        ``direct``: None tries O_DIRECT and falls back to buffered I/O where the file system
        refuses it; True requires O_DIRECT; False never uses it. ``preallocate``: reserve the
        space now (fallocate), so a disk without room for ``size`` bytes raises
        HeteroIOError(ENOSPC) here; False only grows the file (sparse). Files are never shrunk.
        The first open of a SwapIO without explicit tuning runs (or reads) the tuning probe of
        the file's directory (:meth:`tune`).
        """
        path = os.fspath(path)
        if not isinstance(size, int) or size < 0:
            raise ValueError(f"SwapIO.open: size={size!r} must be an int >= 0")
        self.tune(os.path.dirname(os.path.abspath(path)))
        try:
            fd = -1
            if direct is not False and hasattr(os, "O_DIRECT"):
                fd = self._engine.open(path, size, True, preallocate)
                if fd < 0 and direct:
                    raise OSError(errno.EINVAL, "the file system does not support O_DIRECT")
            is_direct = fd >= 0
            if fd < 0:
                fd = self._engine.open(path, size, False, preallocate)
        except OSError as e:
            raise HeteroIOError(e.errno, f"cannot open swap file of {size} bytes: {e.strerror}",
                                path) from e
        file = SwapFile(path, fd, size, is_direct)
        with self._files_lock:
            self._files[fd] = file
        return file

    def write(self, file: SwapFile, offset: int, tensor: torch.Tensor) -> Handle:
        """Queue writing all of ``tensor``'s bytes to ``file`` at byte ``offset``."""
        return self._submit(True, file, offset, tensor)

    def read(self, file: SwapFile, offset: int, tensor: torch.Tensor) -> Handle:
        """Queue filling all of ``tensor``'s bytes from ``file`` at byte ``offset``."""
        return self._submit(False, file, offset, tensor)

    def _is_open(self, file: SwapFile) -> bool:
        """Whether ``file`` is open in this SwapIO (call with _files_lock held). Once closed, its
        descriptor number belongs to whatever file is opened next, so a stale SwapFile would
        read, write or close another file."""
        return self._files.get(file.fd) is file

    def _submit(self, write: bool, file: SwapFile, offset: int, tensor: torch.Tensor) -> Handle:
        op = "write" if write else "read"
        submit = self._engine.submit_write if write else self._engine.submit_read
        with self._files_lock:  # (a close in another thread must not free the fd in between)
            if not self._is_open(file):
                raise ValueError(f"SwapIO.{op}: swap file {file.path!r} is not open in this "
                                 "SwapIO (closed, or opened by another)")
            handle_id = submit(file.fd, tensor, offset, _take_fault())
        return Handle(self._engine, handle_id, file, tensor, op)

    def close(self, file: SwapFile) -> None:
        """Close ``file``: HeteroIOError (EBUSY) while transfers on it are still running (a
        worker would read or write a closed descriptor, or a file reusing its number). A
        closed file is refused: HeteroIOError (EBADF) by ``close``, ValueError by ``read`` and
        ``write``; no descriptor is touched."""
        with self._files_lock:
            if not self._is_open(file):
                raise HeteroIOError(errno.EBADF, "cannot close swap file: it is not open in this "
                                    "SwapIO (closed, or opened by another)", file.path)
            try:
                self._engine.close(file.fd)
            except OSError as e:
                if e.errno != errno.EBUSY:  # (Linux releases the fd even when close fails)
                    del self._files[file.fd]
                raise HeteroIOError(e.errno, f"cannot close swap file: {e.strerror}",
                                    file.path) from e
            del self._files[file.fd]

    def shutdown(self) -> None:
        """Finish queued transfers and stop the backend (handles stay waitable). Idempotent."""
        self._engine.shutdown()

    def release(self) -> None:
        """Shut down and let the backend go now (an io_uring and its eventfd, else kept as long
        as this object), for an owner done with it; every later call raises HeteroStateError."""
        self.shutdown()
        self._engine = _Released()

    def __enter__(self) -> SwapIO:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return (f"<SwapIO {self.backend} block_size={self.block_size} "
                f"queue_depth={self.queue_depth} checksum={self.checksum}>")


class _Released:
    """The backend of a released SwapIO (see :meth:`SwapIO.release`)."""

    def shutdown(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        raise HeteroStateError("this swap engine was released (its model was closed); expected no "
                               "use of it after close()")


_warned = False


def _warn_fallback() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"hetero._C is not available ({EXTENSION_ERROR}); swap I/O falls back to a "
                      "slower pure-Python engine. Build it: pip install --no-build-isolation -e .",
                      RuntimeWarning, stacklevel=4)


# ------------------------------------------------------------------------------------------------
# Pure-Python backend

def _failure(op: str, nbytes: int, offset: int, done: int, why: str) -> str:
    # Same wording as csrc/aio.cpp.
    return (f"{op} of {nbytes} bytes at offset {offset} failed: "
            f"{done} of {nbytes} bytes transferred ({why})")


class _Checksums:
    """Per-fd records of non-overlapping written extents: offset -> (length, crc32)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: dict[int, tuple[list[int], dict[int, tuple[int, int]]]] = {}

    def forget_fd(self, fd: int) -> None:
        with self._lock:
            self._files.pop(fd, None)

    def forget(self, fd: int, off: int, length: int) -> None:
        with self._lock:
            self._forget(fd, off, length)

    def _forget(self, fd: int, off: int, length: int) -> None:
        starts, recs = self._files.get(fd, ([], {}))
        i = bisect.bisect_left(starts, off)
        if i > 0 and starts[i - 1] + recs[starts[i - 1]][0] > off:
            i -= 1
        j = i
        while j < len(starts) and starts[j] < off + length:
            del recs[starts[j]]
            j += 1
        del starts[i:j]

    def record(self, fd: int, off: int, length: int, crc: int) -> None:
        with self._lock:
            self._forget(fd, off, length)
            starts, recs = self._files.setdefault(fd, ([], {}))
            bisect.insort(starts, off)
            recs[off] = (length, crc)

    def verify(self, fd: int, off: int, data: memoryview) -> Optional[str]:
        with self._lock:
            starts, recs = self._files.get(fd, ([], {}))
            i = bisect.bisect_left(starts, off)
            inside = []
            while i < len(starts) and starts[i] + recs[starts[i]][0] <= off + len(data):
                inside.append((starts[i], *recs[starts[i]]))
                i += 1
        for pos, length, crc in inside:
            got = zlib.crc32(data[pos - off:pos - off + length])
            if got != crc:
                return (f"checksum mismatch in the {length} bytes at file offset {pos}: written "
                        f"with crc32 0x{crc:08x}, read back 0x{got:08x}")
        return None


def _note_worker(workers: set[int]) -> None:
    workers.add(threading.get_ident())


class _PyIOEngine:
    """Pure-Python stand-in for ``hetero._C.IOEngine``: same methods, errors and semantics
    (whole requests on a thread pool; block size and queue depth are recorded, not used)."""

    backend = "python"

    def __init__(self, num_threads: int, checksum: bool = False) -> None:
        if num_threads < 1:
            raise ValueError("IOEngine needs num_threads >= 1")
        self._workers: set[int] = set()  # thread idents of the pool's workers
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="hetero-io",
                                        initializer=_note_worker, initargs=(self._workers,))
        self._lock = threading.Lock()
        self._futures: dict[int, tuple[Future[None], int]] = {}  # handle -> (future, its file)
        self._next = 1
        self.checksum = checksum
        self._csums = _Checksums()
        self.block_size, self.queue_depth = DEFAULT_BLOCK_SIZE, DEFAULT_QUEUE_DEPTH

    def set_tuning(self, block_size: int, queue_depth: int) -> None:
        _check_tuning(block_size, queue_depth, "set_tuning")
        self.block_size, self.queue_depth = block_size, queue_depth

    def open(self, path: str, size: int, direct: bool, preallocate: bool = True) -> int:
        if size < 0:
            raise ValueError("swap file size must be >= 0")
        existed = os.path.exists(path)
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as e:
            if direct and e.errno == errno.EINVAL:
                return -1
            raise
        old_size = -1
        try:
            os.fchmod(fd, 0o600)
            old_size = os.fstat(fd).st_size
            if preallocate and size > 0:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                        raise OSError(e.errno, f"cannot reserve {size} bytes (fallocate): "
                                               f"{os.strerror(e.errno)}") from None
                    log.warning("%s: the file system cannot reserve space; the swap file is "
                                "sparse", path)
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
        except BaseException:
            if not existed:
                os.unlink(path)
            elif old_size >= 0:
                try:
                    os.ftruncate(fd, old_size)
                except OSError:
                    pass
            os.close(fd)
            raise
        self._csums.forget_fd(fd)
        return fd

    def close(self, fd: int) -> None:
        with self._lock:
            busy = sum(1 for f, f_fd in self._futures.values() if f_fd == fd and not f.done())
        if busy:
            raise OSError(errno.EBUSY, f"close: {busy} request(s) on this file are still in flight")
        self._csums.forget_fd(fd)
        os.close(fd)

    def submit_write(self, fd: int, tensor: torch.Tensor, offset: int, fault: str = "none") -> int:
        return self._submit(True, fd, tensor, offset, fault)

    def submit_read(self, fd: int, tensor: torch.Tensor, offset: int, fault: str = "none") -> int:
        return self._submit(False, fd, tensor, offset, fault)

    def _submit(self, write: bool, fd: int, tensor: torch.Tensor, offset: int, fault: str) -> int:
        if fault not in _FAULT_KINDS:
            raise ValueError(f"unknown fault kind '{fault}' (expected none, eio, enospc, short or "
                             "corrupt)")
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
        if write and self.checksum:
            self._csums.forget(fd, offset, len(buf))
        future = self._pool.submit(self._transfer, write, fd, buf, offset, fault)
        with self._lock:
            handle, self._next = self._next, self._next + 1
            self._futures[handle] = (future, fd)
        return handle

    def _future(self, handle: int, pop: bool) -> Future[None]:
        with self._lock:
            entry = self._futures.pop(handle, None) if pop else self._futures.get(handle)
        if entry is None:
            raise ValueError(f"unknown or already waited I/O handle {handle}")
        return entry[0]

    def wait(self, handle: int) -> None:
        futures_wait([self._future(handle, pop=False)])  # (interrupted: the handle is kept)
        self._future(handle, pop=True).result()

    def wait_for(self, handle: int, timeout: float) -> bool:
        future = self._future(handle, pop=False)
        if not futures_wait([future], timeout=max(0.0, timeout)).done:
            return False
        self.wait(handle)
        return True

    def poll(self, handle: int) -> bool:
        return self._future(handle, pop=False).done()

    def shutdown(self) -> None:
        # Not waited from one of the pool's own workers, which would join itself: a garbage
        # collection there can run a SwapSpace's finalizer (tiers._release), which shuts down.
        self._pool.shutdown(wait=threading.get_ident() not in self._workers)

    def _transfer(self, write: bool, fd: int, buf: memoryview, offset: int, fault: str) -> None:
        op, n = ("pwrite" if write else "pread"), len(buf)
        if fault in ("eio", "enospc"):
            err = errno.EIO if fault == "eio" else errno.ENOSPC
            raise OSError(err, _failure(op, n, offset, 0, "injected: " + os.strerror(err)))
        crc = zlib.crc32(buf) if write and self.checksum else None
        flipped = fault == "corrupt" and write and n > 0
        if flipped:
            buf[0] ^= 0x5a
        limit = (n // 2) & ~(ALIGNMENT - 1) if fault == "short" else n
        done = 0
        try:
            while done < limit:  # os.pread/pwrite retry EINTR themselves (PEP 475)
                try:
                    k = (os.pwrite(fd, buf[done:limit], offset + done) if write
                         else os.preadv(fd, [buf[done:limit]], offset + done))
                except OSError as e:
                    raise OSError(e.errno, _failure(op, n, offset, done, e.strerror)) from None
                if k == 0:
                    break
                done += k
        finally:
            if flipped:
                buf[0] ^= 0x5a
        if done < n:
            why = ("injected short transfer" if fault == "short"
                   else "write made no progress" if write else "unexpected end of file")
            raise OSError(errno.EIO, _failure(op, n, offset, done, why))
        if crc is not None:
            self._csums.record(fd, offset, n, crc)
        if not write:
            if fault == "corrupt" and n > 0:
                buf[0] ^= 0x5a
            if self.checksum:
                bad = self._csums.verify(fd, offset, buf)
                if bad:
                    raise OSError(errno.EIO, _failure(op, n, offset, n, bad))
