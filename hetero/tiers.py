"""The three memory tiers and their hard budgets.

A :class:`Tier` is pure accounting: capacity, bytes in use, and the peak it ever reached. It
refuses (with an AssertionError, since the runtime must never ask) any reservation that would take
it over capacity, so "a budget is a hard cap" is enforced in one place.

The host tier stores blocks in one :class:`HostArena` (pinned when CUDA is present) carved into
4 KiB-aligned slots; the NVMe tier stores them in a few large swap files (:class:`SwapSpace`) in a
private directory. Both carve space with the same first-fit :class:`FreeList`.
"""

from __future__ import annotations

import atexit
import bisect
import logging
import os
import shutil
import tempfile
import weakref
from typing import Optional

import torch

from . import engine
from .errors import HeteroConfigError

log = logging.getLogger(__name__)

DEVICE, HOST, NVME = "device", "host", "nvme"
TIER_ORDER = (DEVICE, HOST, NVME)  # fastest first
ALIGN = 4096  # O_DIRECT needs buffers, offsets and sizes aligned to the logical block size


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class Tier:
    """Byte accounting of one tier against its budget."""

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self.used = 0
        self.peak = 0

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def reserve(self, nbytes: int) -> None:
        assert self.used + nbytes <= self.capacity, (
            f"runtime bug: {self.name} tier would exceed its budget "
            f"({self.used} + {nbytes} > {self.capacity})")
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def release(self, nbytes: int) -> None:
        assert nbytes <= self.used, f"runtime bug: {self.name} tier releases more than it holds"
        self.used -= nbytes

    def as_dict(self) -> dict:
        return {"capacity": self.capacity, "used": self.used, "peak": self.peak}


class FreeList:
    """First-fit allocator over ``[0, size)`` with coalescing of neighbouring free ranges.

    Pure bookkeeping (no memory): used for slots in the host arena and in each swap file.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._starts: list[int] = [0] if size > 0 else []
        self._ends: dict[int, int] = {0: size} if size > 0 else {}

    def alloc(self, nbytes: int) -> Optional[int]:
        """Offset of a free range of ``nbytes`` (first fit), or None when no range is big enough."""
        for i, start in enumerate(self._starts):
            end = self._ends[start]
            if end - start >= nbytes:
                del self._ends[start]
                if end - start == nbytes:
                    del self._starts[i]
                else:
                    self._starts[i] = start + nbytes
                    self._ends[start + nbytes] = end
                return start
        return None

    def free(self, offset: int, nbytes: int) -> None:
        start, end = offset, offset + nbytes
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts):
            assert end <= self._starts[i], "double free or overlap in FreeList"
            if end == self._starts[i]:  # merge with the following range
                end = self._ends.pop(self._starts[i])
                del self._starts[i]
        if i > 0:
            prev = self._starts[i - 1]
            assert self._ends[prev] <= start, "double free or overlap in FreeList"
            if self._ends[prev] == start:  # merge with the preceding range
                self._ends[prev] = end
                return
        self._starts.insert(i, start)
        self._ends[start] = end

    @property
    def largest_free(self) -> int:
        return max((self._ends[s] - s for s in self._starts), default=0)


class HostArena:
    """One host allocation, carved into aligned slots; pinned when CUDA is present.

    The arena is sized to what the host tier can ever hold (``min(budget, model state)``), so the
    pages a small model never touches are never committed.
    """

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.nbytes = align_up(max(nbytes, ALIGN))
        self.buffer = engine.aligned_empty(self.nbytes, ALIGN, pin=pin)
        self._free = FreeList(self.nbytes)

    def alloc(self, nbytes: int) -> Optional[int]:
        return self._free.alloc(align_up(nbytes))

    def free(self, offset: int, nbytes: int) -> None:
        self._free.free(offset, align_up(nbytes))

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """The uint8 slot at ``offset`` (its full aligned size, as swap I/O needs)."""
        return self.buffer[offset:offset + align_up(nbytes)]


def make_private_dir(parent: str) -> str:
    """Create ``parent`` if needed and a fresh 0700 directory inside it for this module's swap."""
    try:
        os.makedirs(parent, exist_ok=True)
        path = tempfile.mkdtemp(prefix="hetero-swap-", dir=parent)
        os.chmod(path, 0o700)
    except OSError as exc:
        raise HeteroConfigError(f"nvme_path={parent!r} cannot hold swap files ({exc}); expected a "
                                "writable directory on a local file system") from exc
    return path


def _remove_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


class SwapSpace:
    """Swap files for the NVMe tier: a few large files in a private directory.

    Files are created 0600 inside a 0700 directory made just for this module; the directory is
    removed by :meth:`close`, when the object is garbage collected, and at interpreter exit, so
    swap never outlives the process that wrote it (an exception in a training step included).
    """

    MAX_FILES = 4

    def __init__(self, parent: str, capacity: int, largest_block: int, num_threads: int = 4) -> None:
        self.dir = make_private_dir(parent)
        # Remove the directory even if close() is never reached (exceptions, interpreter exit).
        self._finalizer = weakref.finalize(self, _remove_dir, self.dir)
        atexit.register(self._finalizer)
        file_size = max(align_up(-(-capacity // self.MAX_FILES)), align_up(largest_block))
        nfiles = max(1, min(self.MAX_FILES, -(-capacity // file_size)))
        self.io = engine.SwapIO(num_threads=num_threads)
        self.files = [self.io.open(os.path.join(self.dir, f"swap-{i}.bin"), file_size)
                      for i in range(nfiles)]
        self._free = [FreeList(file_size) for _ in range(nfiles)]
        log.info("NVMe tier: %d swap file(s) of %d bytes in %s (direct I/O: %s)", nfiles, file_size,
                 self.dir, all(f.direct for f in self.files))

    def alloc(self, nbytes: int) -> Optional[tuple[int, int]]:
        """``(file index, offset)`` of a free aligned range, or None."""
        for i, fl in enumerate(self._free):
            off = fl.alloc(align_up(nbytes))
            if off is not None:
                return i, off
        return None

    def free(self, loc: tuple[int, int], nbytes: int) -> None:
        self._free[loc[0]].free(loc[1], align_up(nbytes))

    def write(self, loc: tuple[int, int], src: torch.Tensor) -> engine.Handle:
        return self.io.write(self.files[loc[0]], loc[1], src)

    def read(self, loc: tuple[int, int], dst: torch.Tensor) -> engine.Handle:
        return self.io.read(self.files[loc[0]], loc[1], dst)

    def close(self) -> None:
        if self._finalizer.alive:
            for f in self.files:
                self.io.close(f)
            self.io.shutdown()
            self._finalizer()
            atexit.unregister(self._finalizer)
