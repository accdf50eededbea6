"""Asynchronous tensor copies between tiers: host <-> device, host -> host, device -> device.

Public API::

    CopyEngine(num_threads=2, inline_bytes=None)
        .copy(dst, src, *, after_stream=None) -> CopyHandle   (queued; returns at once)
        .shutdown()    .backend ("extension" | "python")    .num_threads    .inline_bytes
        context manager
    CopyHandle.wait() -> None          blocks (GIL released) until the copy is complete
    CopyHandle.done() -> bool          never blocks
    CopyHandle.wait_on_stream(stream)  makes a CUDA stream wait for the copy, on the GPU
    CopyHandle.nbytes, CopyHandle.kind ("h2h" | "h2d" | "d2h" | "d2d")
    EXTENSION_ERROR: str | None        why the native engine is not used, if it is not

Why: the runtime prefetches the blocks of the next unit while the current one computes. That only
overlaps if the copy runs elsewhere than the compute: on a GPU, on a stream of its own (a copy on
the compute stream serializes with the kernels); on the CPU, on a thread that does not need the
GIL (a copy in the Python thread serializes with the Python that drives compute).

Contract of ``copy(dst, src)``: ``dst`` receives all ``src.nbytes`` bytes of ``src``. Both must be
contiguous strided tensors with the same dtype and numel (shapes may differ; nothing is converted,
autograd is not involved), each on the CPU or a CUDA device; same-device tensors must not overlap.
Violations raise ValueError at submit (TypeError for a non-tensor), naming the argument; so does a
CUDA tensor in an extension built without CUDA. After :meth:`CopyEngine.shutdown`, copy raises
RuntimeError. The caller must not write ``src`` or touch ``dst`` until the handle is complete; the
engine keeps both alive until then, so dropping them early is safe.

- CPU -> CPU: memcpy on the engine's worker threads (the native engine splits copies of more
  than 8 MiB across its threads). A copy of at most ``inline_bytes`` (None: ``INLINE_BYTES``,
  64 KiB, as it is when the engine is made; tests set 0) without ``after_stream`` is done in the
  calling thread, since it takes less time than waking a worker: its handle is already done.
- Involving a CUDA tensor: cudaMemcpyAsync on a non-blocking stream the engine owns (one per
  device and direction: H2D, D2H, D2D), followed by an event that ``wait``/``done`` use. Copies
  in one direction on one device run in submission order. Host memory should be pinned
  (``torch.empty(..., pin_memory=True)``): from pageable memory CUDA stages the copy and ``copy``
  blocks until the source has been read.
- ``after_stream``: a ``cudaStream_t`` as an int (``torch.cuda.current_stream().cuda_stream``;
  0 is the legacy default stream) or a ``torch.cuda.Stream``. The copy first waits for the work
  already queued on that stream when ``copy`` is called: on the GPU for a CUDA copy (the host does
  not block), on the worker for a host copy. Pass the compute stream whenever it wrote ``src`` or
  allocated ``dst``/``src`` (the caching allocator only orders reuse within a stream); e.g. a D2H
  of a block the compute stream just wrote. Needs CUDA (ValueError otherwise).
- To consume an H2D copy on the GPU without blocking the host, call
  ``handle.wait_on_stream(compute_stream)`` instead of ``handle.wait()``.

Backends: the C++ extension ``hetero._C.CopyEngine`` (worker threads and CUDA calls outside
Python), or a pure-Python engine (a ThreadPoolExecutor running ``Tensor.copy_``, which releases
the GIL; torch streams and events for CUDA copies) with the same semantics. The Python engine is
used when the extension is not built, when it was built without CUDA while torch has CUDA, or
when ``HETERO_FORCE_PYTHON_COPY=1`` (read when a CopyEngine is created), so tests cover both.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from hetero.native import ERROR as EXTENSION_ERROR, _C, register_engine

logger = logging.getLogger(__name__)

INLINE_BYTES = 64 << 10  # host copies up to this size run in the calling thread (csrc/copy.h's default)
_KINDS = {(False, False): "h2h", (False, True): "h2d", (True, False): "d2h", (True, True): "d2d"}


class CopyHandle:
    """One queued copy (see the module docstring). Can be waited any number of times."""

    __slots__ = ("_h",)

    def __init__(self, backend_handle: Any) -> None:
        self._h = backend_handle

    def wait(self) -> None:
        """Block, with the GIL released, until the copy is complete (CUDA: its event synchronized).

        Raises RuntimeError if the copy failed (an asynchronous CUDA error)."""
        self._h.wait()

    def done(self) -> bool:
        """Whether the copy is complete (or failed, which ``wait`` then reports). Never blocks."""
        return self._h.done()

    def wait_on_stream(self, stream: int | Any) -> None:
        """Make ``stream`` (cudaStream_t as int, or a torch.cuda.Stream) wait for this copy on the
        GPU without blocking the host. For a host-to-host copy it is ``wait()``."""
        self._h.wait_on_stream(_stream_int(stream, "stream"))

    @property
    def nbytes(self) -> int:
        return self._h.nbytes

    @property
    def kind(self) -> str:
        """ "h2h", "h2d", "d2h" or "d2d"."""
        return self._h.kind

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<CopyHandle {self.kind} {self.nbytes} bytes {state}>"


class CopyEngine:
    """Asynchronous copies on worker threads and dedicated CUDA streams (module docstring)."""

    def __init__(self, num_threads: int = 2, inline_bytes: int | None = None) -> None:
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"CopyEngine: num_threads must be an int >= 1, got {num_threads!r}")
        if inline_bytes is None:
            inline_bytes = INLINE_BYTES
        if isinstance(inline_bytes, bool) or not isinstance(inline_bytes, int) or inline_bytes < 0:
            raise ValueError(f"CopyEngine: inline_bytes must be an int >= 0 or None, got {inline_bytes!r}")
        forced = os.environ.get("HETERO_FORCE_PYTHON_COPY", "") not in ("", "0")
        if forced:
            why = "HETERO_FORCE_PYTHON_COPY is set"
        elif _C is None:
            why = f"hetero._C is not available ({EXTENSION_ERROR})"
        elif torch.cuda.is_available() and not _C.COPY_CUDA:
            why = "hetero._C was built without CUDA but torch has CUDA"
        else:
            why = None
        if why is None:
            self._engine = _C.CopyEngine(num_threads, inline_bytes)
            self.backend = "extension"
        else:
            self._engine = _PyCopyEngine(num_threads, inline_bytes)
            self.backend = "python"
            _log_fallback(why, forced)
        self.num_threads, self.inline_bytes = num_threads, inline_bytes
        register_engine(self)  # (in a forked child, refused and never destroyed)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *,
             after_stream: int | Any | None = None) -> CopyHandle:
        """Queue ``dst`` <- ``src`` and return at once (contract: module docstring)."""
        for name, t in (("dst", dst), ("src", src)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"CopyEngine.copy: {name} must be a torch.Tensor, "
                                f"got {type(t).__name__}")
        stream = None if after_stream is None else _stream_int(after_stream, "after_stream")
        return CopyHandle(self._engine.copy(dst, src, after_stream=stream))

    def shutdown(self) -> None:
        """Finish the queued copies and stop the workers; handles stay waitable, later copies
        raise RuntimeError. Idempotent."""
        self._engine.shutdown()

    def __enter__(self) -> CopyEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"<CopyEngine backend={self.backend} num_threads={self.num_threads}>"


_fallback_logged = False


def _log_fallback(why: str, forced: bool) -> None:
    global _fallback_logged
    if forced:
        logger.debug("copy engine: pure-Python backend (%s)", why)
    elif not _fallback_logged:
        _fallback_logged = True
        logger.warning("copy engine: using the slower pure-Python backend: %s. Build the "
                       "extension: pip install --no-build-isolation -e .", why)


def _stream_int(stream: int | Any, name: str) -> int:
    """A cudaStream_t as int, from an int or anything with ``cuda_stream`` (torch.cuda.Stream)."""
    value = getattr(stream, "cuda_stream", stream)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a cudaStream_t as an int or a torch.cuda.Stream, "
                        f"got {type(stream).__name__}")
    return value


# ---- the pure-Python backend: same methods, checks and messages as hetero._C.CopyEngine


def _check(dst: torch.Tensor, src: torch.Tensor, after_stream: int | None) -> str:
    """Validates a copy as csrc/copy.cpp does; returns its kind."""
    for name, t in (("dst", dst), ("src", src)):
        if t.layout != torch.strided:
            raise ValueError(f"{name} has layout {t.layout}; the copy engine copies strided "
                             "(dense) tensors")
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name} is on device {t.device}; the copy engine copies between "
                             "the CPU and CUDA devices")
        if not t.is_contiguous():
            raise ValueError(f"{name} is not contiguous; the copy engine moves one flat byte "
                             "range (pass a contiguous tensor or view)")
    if dst.dtype != src.dtype:
        raise ValueError(f"dst has dtype {dst.dtype} but src has dtype {src.dtype}; the copy "
                         "engine does not convert")
    if dst.numel() != src.numel():
        raise ValueError(f"dst has {dst.numel()} elements but src has {src.numel()}")
    if after_stream is not None:
        if not torch.cuda.is_available():
            raise ValueError("after_stream needs CUDA, but torch has no CUDA here")
        if after_stream < 0:
            raise ValueError("after_stream must be a cudaStream_t as a non-negative integer, "
                             f"got {after_stream}")
    n = dst.nbytes
    if n and dst.device == src.device:
        d, s = dst.data_ptr(), src.data_ptr()
        if d < s + n and s < d + n:
            raise ValueError("dst and src overlap in memory")
    return _KINDS[(src.device.type == "cuda", dst.device.type == "cuda")]


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(-1)


def _torch_stream(stream: int, device: torch.device | None = None) -> torch.cuda.Stream:
    """torch's stream object for the cudaStream_t ``stream``. 0, the legacy default stream, is
    the device's default stream: ``torch.cuda.ExternalStream(0)`` does not order anything after
    the work queued there (seen on an H200 with torch 2.11: a copy overtook the kernel that wrote
    its source)."""
    if stream == 0:
        return torch.cuda.default_stream(device)
    return torch.cuda.ExternalStream(stream, device=device)


def _record_on(stream: int, device: torch.device) -> torch.cuda.Event:
    """An event recorded now on ``stream`` (assumed to belong to ``device``)."""
    event = torch.cuda.Event()
    event.record(_torch_stream(stream, device))
    return event


def _host_copy(dst: torch.Tensor, src: torch.Tensor, order: torch.cuda.Event | None) -> None:
    if order is not None:
        order.synchronize()
    _flat(dst).copy_(_flat(src))  # releases the GIL for the memcpy


class _PyHandle:
    """A Python-backend copy: a worker's future (host copies) or a CUDA event."""

    __slots__ = ("nbytes", "kind", "_future", "_event", "_keep")

    def __init__(self, nbytes: int, kind: str, future: Future[None] | None = None,
                 event: torch.cuda.Event | None = None, keep: tuple = ()) -> None:
        self.nbytes, self.kind = nbytes, kind
        self._future, self._event = future, event
        self._keep = keep  # dst and src of a CUDA copy, alive until waited

    def done(self) -> bool:
        if self._future is not None:
            return self._future.done()
        return self._event is None or self._event.query()

    def wait(self) -> None:
        if self._future is not None:
            self._future.result()
        elif self._event is not None:
            self._event.synchronize()  # releases the GIL
            self._keep = ()

    def wait_on_stream(self, stream: int) -> None:
        if self._event is None:
            self.wait()
        else:
            _torch_stream(stream).wait_event(self._event)


class _PyCopyEngine:
    """Pure-Python stand-in for ``hetero._C.CopyEngine``."""

    def __init__(self, num_threads: int, inline_bytes: int) -> None:
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="hetero-copy")
        self._inline_bytes = inline_bytes
        self._lock = threading.Lock()
        self._closed = False
        self._streams: dict[tuple[int, str], torch.cuda.Stream] = {}
        self.num_threads = num_threads

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after_stream: int | None = None
             ) -> _PyHandle:
        kind = _check(dst, src, after_stream)
        with self._lock:
            if self._closed:
                raise RuntimeError("CopyEngine is shut down")
            if dst.nbytes == 0:
                return _PyHandle(0, kind)
            if kind == "h2h" and dst.nbytes <= self._inline_bytes and after_stream is None:
                _host_copy(dst, src, None)
                return _PyHandle(dst.nbytes, kind)
            if kind == "h2h":
                order = (None if after_stream is None
                         else _record_on(after_stream, torch.device("cuda",
                                                                    torch.cuda.current_device())))
                future = self._pool.submit(_host_copy, dst, src, order)
                return _PyHandle(dst.nbytes, kind, future=future)
            return self._cuda_copy(dst, src, kind, after_stream)

    def _cuda_copy(self, dst: torch.Tensor, src: torch.Tensor, kind: str,
                   after_stream: int | None) -> _PyHandle:
        device = dst.device if kind == "h2d" else src.device
        stream = self._streams.get((device.index, kind))
        if stream is None:
            stream = self._streams[(device.index, kind)] = torch.cuda.Stream(device)
        with torch.cuda.device(device):
            if after_stream is not None:
                stream.wait_event(_record_on(after_stream, device))
            with torch.cuda.stream(stream):
                _flat(dst).copy_(_flat(src), non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
        for t in (dst, src):  # the caching allocator must not reuse them before the copy ran
            if t.is_cuda:
                t.record_stream(stream)
        return _PyHandle(dst.nbytes, kind, event=event, keep=(dst, src))

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            streams = list(self._streams.values())
        self._pool.shutdown(wait=True)
        for stream in streams:
            stream.synchronize()
