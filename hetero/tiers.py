"""The three memory tiers and their hard budgets.

A :class:`Tier` is pure accounting: capacity, bytes in use, and the peak it ever reached. It
refuses (with an AssertionError, since the runtime must never ask) any reservation that would take
it over capacity, so "a budget is a hard cap" is enforced in one place.

The host tier stores blocks in one :class:`HostArena` (pinned when CUDA is present) and the NVMe
tier in a few large swap files (:class:`SwapSpace`) in a private directory. Both are carved into
fixed, 4 KiB-aligned slots of about the chunk size by the same :class:`SlotPool`; blocks of up to
half a slot share slots (:class:`Slab`), in units of a sixteenth of one.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import logging
import os
import shutil
import socket
import tempfile
import weakref
from typing import Any, Callable, Collection, Iterable, Optional

import torch

from . import copies, engine
from .config import format_size
from .errors import HeteroConfigError, HeteroIOError, HeteroOOMError
from .interrupts import critical

log = logging.getLogger(__name__)

DEVICE, HOST, NVME = "device", "host", "nvme"
TIER_ORDER = (DEVICE, HOST, NVME)  # fastest first
ALIGN = 4096  # O_DIRECT needs buffers, offsets and sizes aligned to the logical block size


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class Tier:
    """Byte accounting of one tier against its budget."""

    def __init__(self, name: str, capacity: int, room: Optional[int] = None) -> None:
        self.name = name
        self.capacity = capacity
        # What its memory holds of the budget (the swap files' whole slots), where that is less:
        # bytes of the budget past it are never free, or a placement would count on room that
        # is not there.
        self.room = capacity if room is None else min(capacity, room)
        self.used = 0
        self.peak = 0

    @property
    def free(self) -> int:
        return self.room - self.used

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


def slot_size_for(chunk_size: int, block_bytes: "list[int]") -> int:
    """Slot size of the host and NVMe tiers: the largest block that respects ``chunk_size``
    (aligned), so a full chunk's block fills one slot and only oversized parameters span several;
    rounded up to whole units (:func:`unit_for`, the same for both sizes), so that a slot shared
    by small blocks has no room past its last unit that no one can use."""
    slot = align_up(max((n for n in block_bytes if n <= chunk_size), default=min(block_bytes, default=ALIGN)))
    return align_up(slot, unit_for(slot))


def slots_for(nbytes: int, slot_size: int) -> int:
    return max(1, -(-nbytes // slot_size))


#: units a slot is split into for small blocks (rounded up to the alignment swap I/O needs)
UNITS_PER_SLOT = 16


def unit_for(slot_size: int) -> int:
    """Size of the units a slab slot is carved into (at least the O_DIRECT alignment)."""
    return align_up(-(-slot_size // UNITS_PER_SLOT))


def whole_units(slot_size: int) -> bool:
    """Whether a slot shared by small blocks is whole units (:func:`slot_size_for` makes it so):
    no room past its last unit that no one can use. True where no slot is shared."""
    unit = unit_for(slot_size)
    return slot_size // unit < 2 or slot_size % unit == 0


def is_small(nbytes: int, slot_size: int) -> bool:
    """Whether a block of ``nbytes`` shares a slot with others (a slab) instead of taking whole
    slots: at most half a slot, where a slot holds at least two units."""
    return 2 * nbytes <= slot_size and slot_size // unit_for(slot_size) >= 2


def slot_cost(nbytes: int, slot_size: int) -> int:
    """Bytes a block takes from a host or NVMe budget: its units in a slab when small, else
    its whole slots."""
    size = unit_for(slot_size) if is_small(nbytes, slot_size) else slot_size
    return slots_for(nbytes, size) * size


def packed_bytes(sizes: "Iterable[int]", slot_size: int) -> int:
    """Room blocks of ``sizes`` take together below the device: whole slots for a large block,
    and the slots small ones fill, placed largest first into a :class:`SlotPool`. More than the
    sum of their :func:`slot_cost` where units a shared slot keeps fit no block: three 3-unit
    blocks need three slots of 5 units. What the capacity checks count: closer than the units
    alone, not a guarantee, since blocks placed in another order, with frees between, may pack
    worse (room the checks keep for two of the largest blocks, and host compaction, take up the
    rest)."""
    sizes = list(sizes)
    small = sorted((n for n in sizes if is_small(n, slot_size)), reverse=True)
    pool = SlotPool(len(small), slot_size)  # (each opens at most one shared slot)
    for i, n in enumerate(small):
        pool.alloc(n, i)
    shared = sum(o is not None for o in pool.owner)
    return (shared + sum(slots_for(n, slot_size) for n in sizes if not is_small(n, slot_size))) * slot_size


class Slab:
    """A slot shared by small blocks, each in a run of contiguous units."""

    __slots__ = ("units", "free")

    def __init__(self, n: int) -> None:
        self.units: list[Optional[object]] = [None] * n
        self.free = (1 << n) - 1  # bit i set: unit i is free

    def owners(self) -> list[object]:
        return list({id(o): o for o in self.units if o is not None}.values())

    @property
    def empty(self) -> bool:
        return self.free == (1 << len(self.units)) - 1

    @staticmethod
    def starts(mask: int, k: int) -> int:
        """Bit i set where units i .. i+k-1 all have their bit set in ``mask``."""
        r = mask
        for j in range(1, k):
            r &= mask >> j
        return r

    def first_run(self, k: int) -> Optional[int]:
        """The first unit of the lowest run of ``k`` free units, or None."""
        r = self.starts(self.free, k)
        return (r & -r).bit_length() - 1 if r else None

    def cheapest_run(self, k: int, evictable: "Callable[[object], bool]") -> Optional[tuple[int, int]]:
        """``(occupied units, first unit)`` of the run of ``k`` units holding only free units and
        ``evictable`` owners with the fewest occupied units (the lowest such), or None."""
        movable = self.free
        for u, o in enumerate(self.units):
            if o is not None and evictable(o):
                movable |= 1 << u
        r = self.starts(movable, k)
        best = None
        run = (1 << k) - 1
        while r:
            u = (r & -r).bit_length() - 1
            occupied = ((~self.free >> u) & run).bit_count()
            if best is None or occupied < best[0]:
                best = (occupied, u)
            r &= r - 1
        return best

    def assign(self, u: int, k: int, owner: Optional[object]) -> None:
        self.units[u:u + k] = [owner] * k
        bits = ((1 << k) - 1) << u
        self.free = self.free | bits if owner is None else self.free & ~bits


class SlotPool:
    """Fixed-size slots. A block takes ``ceil(nbytes / slot_size)`` contiguous slots (first fit),
    except a small one (:func:`is_small`: at most half a slot), which takes contiguous units of a
    slot it shares with other small blocks (a :class:`Slab`).

    Pure bookkeeping (no memory), used for the host arena and each swap file. With the slot size
    set to the chunk size nearly every large block takes one slot, so free space is never too
    fragmented to use, and slabs keep a unit's biases and norms and a chunk's tail from each
    holding a whole slot (which doubled the memory a tier needed for some models and chunk
    sizes). A block larger than a slot (a parameter bigger than ``chunk_size``) needs a
    contiguous run, which :meth:`window` finds by naming the blocks to evict.
    """

    def __init__(self, nslots: int, slot_size: int) -> None:
        self.slot_size = slot_size
        self.unit = unit_for(slot_size)
        self.owner: list[Optional[object]] = [None] * nslots  # a block, a Slab, or None (free)
        self._slabs: dict[int, Slab] = {}  # slot index -> its slab
        self._low = 0  # no slot below this one is free: first fit starts looking here

    def slots_for(self, nbytes: int) -> int:
        return slots_for(nbytes, self.slot_size)

    def _units(self, nbytes: int) -> int:
        return slots_for(nbytes, self.unit)

    def _open_slab(self, i: int) -> Slab:
        """Make the free slot ``i`` a slab."""
        slab = self.owner[i] = self._slabs[i] = Slab(self.slot_size // self.unit)
        return slab

    def blocks(self) -> "list[tuple[int, object]]":
        """``(offset, owner)`` of every placement, slab members included."""
        out: list[tuple[int, object]] = []
        for i, o in enumerate(self.owner):
            if isinstance(o, Slab):
                seen: set[int] = set()
                for u, b in enumerate(o.units):
                    if b is not None and id(b) not in seen:
                        seen.add(id(b))
                        out.append((i * self.slot_size + u * self.unit, b))
            elif o is not None and (i == 0 or self.owner[i - 1] is not o):
                out.append((i * self.slot_size, o))
        return out

    def free_slots(self) -> "list[int]":
        """Indices of the slots no block or slab holds."""
        return [i for i in range(self._low, len(self.owner)) if self.owner[i] is None]

    def free_units(self) -> "list[tuple[int, int]]":
        """``(offset, bytes)`` of each longest run of free units in the slabs, lowest first."""
        out = []
        for i in sorted(self._slabs):
            slab = self._slabs[i]
            u, n = 0, len(slab.units)
            while u < n:
                if slab.free >> u & 1:
                    k = u
                    while k < n and slab.free >> k & 1:
                        k += 1
                    out.append((i * self.slot_size + u * self.unit, (k - u) * self.unit))
                    u = k
                else:
                    u += 1
        return out

    def fits(self, nbytes: int) -> bool:
        """Whether :meth:`alloc` would find room for ``nbytes`` now."""
        if is_small(nbytes, self.slot_size):
            k = self._units(nbytes)
            if any(slab.first_run(k) is not None for slab in self._slabs.values()):
                return True
            return self._first_fit(1)[0] is not None
        return self._first_fit(self.slots_for(nbytes))[0] is not None

    def _first_fit(self, n: int, avoid: range = range(0)) -> tuple[Optional[int], Optional[int]]:
        """The first slot of the lowest run of ``n`` free slots outside ``avoid`` (or None), and
        the lowest free slot (or None)."""
        owners = self.owner
        run, first = 0, None
        for i in range(self._low, len(owners)):
            if owners[i] is not None or i in avoid:
                run = 0
                continue
            if first is None:
                first = i
            run += 1
            if run == n:
                return i - n + 1, first
        return None, first

    def alloc(self, nbytes: int, owner: object, avoid: range = range(0)) -> Optional[int]:
        """Byte offset of free room for ``nbytes`` now owned by ``owner``, or None; not in the
        slots ``avoid``."""
        if is_small(nbytes, self.slot_size):
            k = self._units(nbytes)
            for i, slab in self._slabs.items():
                u = slab.first_run(k) if i not in avoid else None
                if u is not None:
                    slab.assign(u, k, owner)
                    return i * self.slot_size + u * self.unit
            i = self._take_slots(1, None, avoid)
            if i is None:
                return None
            self._open_slab(i).assign(0, k, owner)
            return i * self.slot_size
        i = self._take_slots(self.slots_for(nbytes), owner, avoid)
        return None if i is None else i * self.slot_size

    def _take_slots(self, n: int, owner: object, avoid: range) -> Optional[int]:
        """First fit of ``n`` free contiguous slots outside ``avoid``, given to ``owner``; their
        first index."""
        start, first = self._first_fit(n, avoid)
        if start is None:
            if not avoid:
                self._low = len(self.owner) if first is None else first
            return None
        self.owner[start:start + n] = [owner] * n
        if not avoid:
            self._low = start + n if start == first else first
        return start

    def free(self, offset: int, nbytes: int, shared: Optional[bool] = None) -> None:
        """Give back the room at ``offset``: units of a slab where ``shared`` (by default where
        ``nbytes`` is small), else whole slots."""
        start = offset // self.slot_size
        if is_small(nbytes, self.slot_size) if shared is None else shared:
            slab = self.owner[start]
            assert isinstance(slab, Slab), "bad free"
            u, k = offset % self.slot_size // self.unit, self._units(nbytes)
            run = slab.units[u:u + k]
            assert run and run[0] is not None and all(o is run[0] for o in run), "bad free"
            slab.assign(u, k, None)
            if not slab.empty:
                return
            del self._slabs[start]
            self.owner[start] = None
            self._low = min(self._low, start)
            return
        n = self.slots_for(nbytes)
        owners = self.owner[start:start + n]
        assert owners and owners[0] is not None and all(o is owners[0] for o in owners), "bad free"
        self.owner[start:start + n] = [None] * n
        self._low = min(self._low, start)

    def take(self, offset: int, nbytes: int, owner: object, shared: Optional[bool] = None) -> None:
        """Give the (free) room at ``offset`` to ``owner``: undoing a free, or taking room
        :meth:`free_units` named (``shared`` as in :meth:`free`)."""
        start = offset // self.slot_size
        if is_small(nbytes, self.slot_size) if shared is None else shared:
            slab = self.owner[start]
            if slab is None:
                slab = self._open_slab(start)
            assert isinstance(slab, Slab), "runtime bug: slot in use"
            u, k = offset % self.slot_size // self.unit, self._units(nbytes)
            assert all(o is None for o in slab.units[u:u + k]), "runtime bug: units in use"
            slab.assign(u, k, owner)
            return
        n = self.slots_for(nbytes)
        assert all(o is None for o in self.owner[start:start + n]), "runtime bug: slots in use"
        self.owner[start:start + n] = [owner] * n

    def unit_window(self, nbytes: int, evictable: "Callable[[object], bool]") -> Optional[list[object]]:
        """For a small block: the owners to evict for a run of its units in a slab, the run of
        free units and ``evictable`` owners with the fewest occupied units; else None."""
        if not is_small(nbytes, self.slot_size):
            return None
        k = self._units(nbytes)
        best = None
        for slab in self._slabs.values():
            found = slab.cheapest_run(k, evictable)
            if found is not None and (best is None or found[0] < best[0]):
                best = (found[0], slab.units[found[1]:found[1] + k])
        return None if best is None else list({id(o): o for o in best[1] if o is not None}.values())

    def window(self, nbytes: int, evictable: "Callable[[object], bool]") -> Optional[list[object]]:
        """The owners to evict for a run of ``slots_for(nbytes)`` slots (a small block needs one
        for a new slab), the run holding only free slots, ``evictable`` owners and slabs of
        evictable owners with the fewest occupied slots; None if there is none."""
        found = self.window_at(nbytes, evictable)
        return None if found is None else found[1]

    def window_at(self, nbytes: int, evictable: "Callable[[object], bool]",
                  skip: "Collection[int]" = ()) -> Optional[tuple[range, list[object]]]:
        """:meth:`window`, with the slots of its run; not a run starting at a slot in ``skip``."""
        n = self.slots_for(nbytes)
        owners = self.owner
        movable: dict[int, bool] = {}  # evictable() once per owner, not once per slot and run

        def ok(o: object) -> bool:
            found = movable.get(id(o))
            if found is None:
                found = movable[id(o)] = (all(evictable(b) for b in o.owners()) if isinstance(o, Slab)
                                          else bool(evictable(o)))
            return found

        best: Optional[tuple[int, int]] = None  # (occupied slots, first slot), the first cheapest
        occupied = blocked = 0  # in the run of n slots ending at slot i
        for i, o in enumerate(owners):
            if o is not None:
                occupied += 1
                blocked += not ok(o)
            if i >= n and owners[i - n] is not None:  # the slot leaving the run
                occupied -= 1
                blocked -= not ok(owners[i - n])
            if i >= n - 1 and not blocked and (best is None or occupied < best[0]) and i - n + 1 not in skip:
                best = (occupied, i - n + 1)
                if not occupied:
                    break  # a free run: nothing can be cheaper
        if best is None:
            return None
        out: dict[int, object] = {}
        for o in owners[best[1]:best[1] + n]:
            for b in (o.owners() if isinstance(o, Slab) else [o] if o is not None else []):
                out[id(b)] = b
        return range(best[1], best[1] + n), list(out.values())


class Scattered(tuple):
    """Where the NVMe copy of a block lies when no contiguous room held it: ``((file, offset,
    bytes), ...)`` in the order of the block's bytes, each a whole free slot or (once those run
    out) a run of free units of a slot small blocks share. A swap file needs no contiguity (only
    the host arena does: its copies are tensor views), so free NVMe room is never lost to
    fragmentation."""


def _scatter(pools: "list[SlotPool]", nbytes: int) -> "Optional[list[tuple[int, int, int]]]":
    """The extents :func:`swap_alloc` scatters a block of ``nbytes`` over (free slots first,
    then free units), or None where all the free room is not enough. They hold what the block
    takes from the budget (:func:`slot_cost`), no less: the free room stays what the budget has
    free. Takes nothing."""
    slot, unit = pools[0].slot_size, pools[0].unit
    nbytes = slot_cost(nbytes, slot)
    out: list[tuple[int, int, int]] = []
    got = 0
    for i, pool in enumerate(pools):
        for j in pool.free_slots():
            if got >= nbytes:
                return out
            out.append((i, j * slot, slot))
            got += slot
    for i, pool in enumerate(pools):
        for off, n in pool.free_units():
            if got >= nbytes:
                return out
            n = min(n, align_up(nbytes - got, unit))
            out.append((i, off, n))
            got += n
    return out if got >= nbytes else None


def swap_alloc(pools: "list[SlotPool]", nbytes: int, owner: object):
    """Room for ``nbytes`` in the swap files' ``pools`` (searched in order): ``(file, offset)``
    of a contiguous run (or units of a shared slot), else :class:`Scattered` free room; None
    when there is not enough."""
    for i, pool in enumerate(pools):
        off = pool.alloc(nbytes, owner)
        if off is not None:
            return i, off
    extents = _scatter(pools, nbytes) if pools else None
    if extents is None:
        return None
    for i, off, n in extents:
        pools[i].take(off, n, owner, shared=n < pools[i].slot_size)
    return Scattered(extents)


def swap_fits(pools: "list[SlotPool]", nbytes: int) -> bool:
    """Whether :func:`swap_alloc` would find room for ``nbytes`` now."""
    return any(p.fits(nbytes) for p in pools) or (bool(pools) and _scatter(pools, nbytes) is not None)


def swap_free(pools: "list[SlotPool]", loc, nbytes: int) -> None:
    """Give the room at ``loc`` (from :func:`swap_alloc`) back to the pools."""
    if isinstance(loc, Scattered):
        for i, off, n in loc:
            pools[i].free(off, n, shared=n < pools[i].slot_size)
    else:
        pools[loc[0]].free(loc[1], nbytes)


def swap_take(pools: "list[SlotPool]", loc, nbytes: int, owner: object) -> None:
    """Give the free room at ``loc`` to ``owner`` again (undoing :func:`swap_free`)."""
    if isinstance(loc, Scattered):
        for i, off, n in loc:
            pools[i].take(off, n, owner, shared=n < pools[i].slot_size)
    else:
        pools[loc[0]].take(loc[1], nbytes, owner)


class Handles:
    """The transfers of one scattered copy, waited as one: the first failure is raised once all
    have ended (none is left running on memory the caller may reuse)."""

    def __init__(self, handles: list) -> None:
        self.handles = handles

    def done(self) -> bool:
        return all(h.done() for h in self.handles)

    def wait(self) -> None:
        error = None
        for h in self.handles:
            try:
                h.wait()
            except BaseException as exc:  # noqa: BLE001 (re-raised below)
                error = error or exc
        if error is not None:
            raise error


class HostArena:
    """One host allocation, carved into fixed slots; pinned when CUDA is present.

    The arena is sized to what the host tier can ever hold (``min(budget, model state)``). Without
    CUDA the pages it never touches are never committed; pinned, all of it is locked at once
    (exactly its bytes: :func:`hetero.engine.aligned_empty`), and a failure to lock it is a
    HeteroOOMError naming the host budget.
    """

    def __init__(self, nslots: int, slot_size: int, pin: "bool | torch.device") -> None:
        self.pool = SlotPool(max(1, nslots), slot_size)
        self.nbytes = len(self.pool.owner) * slot_size
        try:
            self.buffer = engine.aligned_empty(self.nbytes, ALIGN, pin=pin)
        except RuntimeError as exc:
            if not pin:
                raise
            raise HeteroOOMError(
                f"cannot page-lock the host arena of {self.nbytes} bytes ({format_size(self.nbytes)}), "
                f"the host tier's room (host_budget, at most the model's state): {exc}; expected a "
                "smaller host_budget (pinned memory is committed whole; with an NVMe tier the rest "
                "of the state goes to swap) or a higher locked-memory limit (ulimit -l)") from exc

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """The uint8 bytes at ``offset`` (rounded up to the alignment swap I/O needs)."""
        return self.buffer[offset:offset + align_up(nbytes)]


#: Inside each swap directory: who made it (host name and process id), so that a later run can
#: tell a directory left by a process that was killed from one still in use; its owner holds a
#: lock on it while it lives (a process id alone cannot tell: another PID namespace on the same
#: host, a container sharing the directory, has its own).
OWNER_FILE = "owner"


#: Descriptors holding an owner file's lock in this process. A forked child (a DataLoader
#: worker) closes its copies at once: a lock lives while any descriptor of it is open, so a child
#: outliving a killed owner would keep its swap directory from being found orphaned.
_owner_locks: set[int] = set()


def _close_inherited_locks() -> None:
    for fd in _owner_locks:
        try:
            os.close(fd)
        except OSError:
            pass
    _owner_locks.clear()


os.register_at_fork(after_in_child=_close_inherited_locks)


def make_private_dir(parent: str) -> tuple[str, int]:
    """Create ``parent`` if needed and a fresh 0700 directory inside it for this module's swap,
    marked with its owner, whose lock the returned descriptor holds until closed; first remove
    the directories dead processes of this host left there (:func:`_remove_orphans`)."""
    try:
        os.makedirs(parent, exist_ok=True)
        _remove_orphans(parent)
        path = tempfile.mkdtemp(prefix="hetero-swap-", dir=parent)
        os.chmod(path, 0o700)
        fd = os.open(os.path.join(path, OWNER_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:  # (locked before the mark names a process: never a moment it reads as orphaned)
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as exc:  # a file system without locks: the process id alone tells
                log.debug("hetero: no lock on %s (%s)", path, exc)
            os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
        except BaseException:
            os.close(fd)
            raise
    except OSError as exc:
        raise HeteroConfigError(f"nvme_path={parent!r} cannot hold swap files ({exc}); expected a "
                                "writable directory on a local file system") from exc
    _owner_locks.add(fd)
    return path, fd


def _remove_orphans(parent: str) -> None:
    """Remove the ``hetero-swap-*`` directories under ``parent`` whose owner was a process of
    this host that no longer exists: a process killed by SIGKILL, or by SIGTERM (which by
    default ends Python without its exit handlers), could not remove its own. Directories of
    other hosts (a shared file system), of live processes and without an owner mark are left
    alone, and so is one whose owner file is still locked (a live owner in another PID
    namespace)."""
    host = socket.gethostname()
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if not name.startswith("hetero-swap-") or not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, OWNER_FILE)) as f:
                owner_host, pid = f.read().split()
            pid = int(pid)
        except (OSError, ValueError):
            continue
        if owner_host != host or pid == os.getpid() or _alive(pid) or _locked(os.path.join(path, OWNER_FILE)):
            continue
        log.info("hetero: removing %s, left by process %d, which no longer exists", path, pid)
        shutil.rmtree(path, ignore_errors=True)


def _locked(owner_file: str) -> bool:
    """Whether a process holds the lock on ``owner_file`` (see :data:`OWNER_FILE`)."""
    try:
        fd = os.open(owner_file, os.O_RDWR)  # (NFS emulates flock with write locks)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError as exc:  # held; else a file system without locks, where the process id alone tells
        return exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
    finally:
        os.close(fd)  # (and with it the lock it took)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@critical
def _release_once(finalizer: "list[weakref.finalize]", *args: Any) -> None:
    """:func:`_release`, and off atexit's list (whether it runs from close(), a garbage
    collection or the exit itself). Critical: a second Ctrl-C during the exit's clean-up (atexit
    runs outside hetero's calls) would leave the swap directory half removed."""
    atexit.unregister(finalizer[0])
    _release(*args)


def _release(io: "engine.SwapIO", files: "list[engine.SwapFile]", path: str, owner: int, lock: int) -> None:
    """Close the swap files and remove their directory, from the process that made them only:
    a child forked from it that exits must not take its parent's swap away (nor touch an engine
    whose threads it does not have). Closing matters as much as removing: a removed file's
    reserved space is only freed once its last descriptor is closed. Queued transfers finish
    first (none may reach a closed, reused descriptor). Needs no SwapSpace: it is the
    finalizer of one."""
    if os.getpid() != owner:
        return
    io.shutdown()
    for f in files:
        try:
            io.close(f)
        except OSError as exc:
            log.warning("hetero: closing swap file %s failed (%s)", f.path, exc)
    io.release()  # (its io_uring and eventfd)
    shutil.rmtree(path, ignore_errors=True)
    _owner_locks.discard(lock)
    os.close(lock)  # (the owner file's lock, see OWNER_FILE)


class SwapSpace:
    """Swap files for the NVMe tier: a few large files in a private directory.

    Files are created 0600 inside a 0700 directory made just for this module; the directory is
    removed by :meth:`close`, when the object is garbage collected and at interpreter exit, so
    swap never outlives the process that wrote it (an exception in a training step included).
    A process killed by a signal cannot remove it: the next swap directory made under the same
    parent removes those (:func:`_remove_orphans`).
    """

    MAX_FILES = 4

    @classmethod
    def layout(cls, capacity: int, slot_size: int, largest_block: int) -> list[int]:
        """Slots of each swap file for ``capacity`` bytes, whose whole slots the files never
        exceed (``nvme_budget`` caps the bytes on disk): up to MAX_FILES files, each but the
        last large enough for the largest block (a larger one is scattered over free slots).
        No file (an empty list) where not one slot fits. The simulator carves the same pools."""
        total = capacity // slot_size
        per_file = max(-(-total // cls.MAX_FILES), min(total, -(-largest_block // slot_size)), 1)
        return [min(per_file, total - start) for start in range(0, total, per_file)]

    def __init__(self, parent: str, capacity: int, slot_size: int, largest_block: int,
                 num_threads: int = 4) -> None:
        self.slots = self.layout(capacity, slot_size, largest_block)
        self.io = engine.SwapIO(num_threads=num_threads)
        try:
            self.dir, lock = make_private_dir(parent)
        except BaseException:
            self.io.shutdown()
            raise
        self.files: list[engine.SwapFile] = []
        # Close the files and remove the directory even if close() is never reached (the
        # module dropped, exceptions, interpreter exit).
        # (Also registered with atexit: it then runs before the handlers registered earlier,
        # where weakref's own exit hook is; unregistered once it ran, so that dropped models
        # leave nothing behind there.)
        mine: list[weakref.finalize] = []
        self._finalizer = weakref.finalize(self, _release_once, mine, self.io, self.files, self.dir,
                                           os.getpid(), lock)
        mine.append(self._finalizer)
        atexit.register(self._finalizer)
        try:
            # The probe writes no more than the files will hold: the budget caps disk use.
            self.io.tune(self.dir, max_bytes=sum(self.slots) * slot_size)
            for i, n in enumerate(self.slots):  # (a full disk fails here, reserving the space)
                self.files.append(self.io.open(os.path.join(self.dir, f"swap-{i}.bin"), n * slot_size))
        except HeteroIOError as exc:
            self.close()  # the files reserved so far: their space is free again at once
            if exc.errno != errno.ENOSPC:
                raise
            total = sum(self.slots) * slot_size
            raise HeteroIOError(
                errno.ENOSPC, f"nvme_budget: the NVMe tier reserves its swap files up front, "
                f"{total} bytes here (the budget, or less where the model's state needs less), and "
                f"the file system under {parent!r} has {shutil.disk_usage(parent).free} bytes free; "
                "expected a smaller nvme_budget (None: 90% of the free space) or more free space",
                exc.filename) from exc
        except BaseException:
            self.close()
            raise
        self.pools = [SlotPool(n, slot_size) for n in self.slots]
        log.info("NVMe tier: %d swap file(s) of %s slots of %d bytes in %s (direct I/O: %s)",
                 len(self.slots), "/".join(map(str, self.slots)), slot_size, self.dir,
                 all(f.direct for f in self.files))

    def alloc(self, nbytes: int, owner: object):
        """Where free slots for ``nbytes`` are (:func:`swap_alloc`), or None."""
        return swap_alloc(self.pools, nbytes, owner)

    def free(self, loc, nbytes: int) -> None:
        swap_free(self.pools, loc, nbytes)

    def write(self, loc, src: torch.Tensor):
        return self._transfer(self.io.write, loc, src)

    def read(self, loc, dst: torch.Tensor):
        return self._transfer(self.io.read, loc, dst)

    def _transfer(self, submit, loc, buf: torch.Tensor):
        """One request, or one per extent of a scattered copy (waited as one: :class:`Handles`)."""
        if not isinstance(loc, Scattered):
            return submit(self.files[loc[0]], loc[1], buf)
        handles, at = [], 0
        for i, off, n in loc:  # (the last extents can hold only room past the bytes)
            if at < buf.numel():
                handles.append(submit(self.files[i], off, buf[at:at + n]))
            at += n
        return Handles(handles)

    def close(self) -> None:
        """Close the swap files and remove the directory (:func:`_release`). Idempotent."""
        self._finalizer()


class TierStorage:
    """The real bytes behind the runtime's decisions: device buffers, host slots, swap files.

    Each block's device copy is a flat tensor whose storage is allocated and freed in place (so
    parameter views and the views autograd saved stay valid); its host copy is a run of arena
    slots; its NVMe copy a run of swap-file slots (or slots apart: :class:`Scattered`). The
    runtime's logical bookkeeping uses ``place`` / ``forget`` / ``adopt`` / ``loc`` / ``fits``
    (slots only); memory is touched by ``alloc`` /
    ``release`` (device storage), ``copy`` (asynchronous: host <-> device on the copy engine,
    host <-> NVMe on the swap engine) and ``fill``. The simulator uses a look-alike without memory.
    """

    def __init__(self, device: torch.device, arena: HostArena, swap: Optional[SwapSpace]) -> None:
        self.device = device
        self.arena = arena
        self.swap = swap
        self.copier = copies.CopyEngine()
        # Typed views of the arena by (offset, bytes, dtype): a placement's view is made once,
        # not at each of its copies and reads (three tensor ops, ~10 us, hundreds per step).
        self._views: dict[tuple, torch.Tensor] = {}

    # ------------------------------------------------------------------ slots (logical)

    def place(self, block, tier: str) -> bool:
        """Take slots for ``block`` on ``tier``; False when no run of slots is free."""
        if tier == HOST:
            block.host_offset = self.arena.pool.alloc(block.nbytes, block)
            return block.host_offset is not None
        if tier == NVME:
            block.nvme_loc = self.swap.alloc(block.nbytes, block)
            return block.nvme_loc is not None
        return True

    def loc(self, block, tier: str):
        """Where ``block``'s copy on ``tier`` is: None (device), arena offset, (file, offset)."""
        return {DEVICE: None, HOST: block.host_offset, NVME: block.nvme_loc}[tier]

    def forget(self, block, tier: str) -> None:
        """Give ``block``'s slots on ``tier`` back to the pool."""
        if tier != DEVICE:
            self.forget_at(tier, self.loc(block, tier), block.nbytes)
        if tier == HOST:
            block.host_offset = None
        elif tier == NVME:
            block.nvme_loc = None

    def forget_at(self, tier: str, loc, nbytes: int) -> None:
        """Give the slots at ``loc`` back (slots held for a shadow copy)."""
        if tier == HOST:
            self.arena.pool.free(loc, nbytes)
        elif tier == NVME:
            self.swap.free(loc, nbytes)

    def hold_nvme(self, nbytes: int, owner: object):
        """Take free NVMe slots for ``nbytes`` for ``owner``, not a block's copy (a shadow moved
        off the host); their location, or None when there are not enough."""
        return self.swap.alloc(nbytes, owner)

    def adopt(self, block, tier: str, loc, owner: object = None) -> None:
        """Take the free slots at ``loc`` again for ``block`` (its copy there is valid again) or,
        with ``owner``, hold them for it without making them its location."""
        if tier == DEVICE:
            return
        if tier == HOST:
            self.arena.pool.take(loc, block.nbytes, owner or block)
        else:
            swap_take(self.swap.pools, loc, block.nbytes, owner or block)
        if owner is None:
            if tier == HOST:
                block.host_offset = loc
            else:
                block.nvme_loc = loc

    def pools(self, tier: str) -> list[SlotPool]:
        return [self.arena.pool] if tier == HOST else list(self.swap.pools)

    def fits(self, tier: str, nbytes: int) -> bool:
        """Whether :meth:`place` would find room for ``nbytes`` on ``tier`` (host or NVMe) now."""
        return self.arena.pool.fits(nbytes) if tier == HOST else swap_fits(self.swap.pools, nbytes)

    # ------------------------------------------------------------------ memory (physical)

    def alloc(self, block, tier: str) -> None:
        """Back ``block``'s device buffer with memory (a no-op for slots, which always are)."""
        if tier == DEVICE:
            if block.device is None:  # kept for the run: a normal tensor, even if the first
                with torch.inference_mode(False):  # use is an inference-mode forward
                    block.device = torch.empty(block.numel, dtype=block.dtype, device=self.device)
            elif block.device.untyped_storage().nbytes() < block.nbytes:
                block.device.untyped_storage().resize_(block.nbytes)

    def release(self, block, tier: str) -> None:
        """Give ``block``'s device memory back (nothing reads or writes it any more)."""
        if tier == DEVICE and block.device is not None:
            block.device.untyped_storage().resize_(0)

    def data(self, block, tier: str) -> torch.Tensor:
        """The flat, typed tensor of ``block`` on ``tier`` (device or host)."""
        if tier == DEVICE:
            return block.device
        assert tier == HOST, "NVMe copies are not addressable; acquire the block on host first"
        return self._host(block.host_offset, block)

    def _host(self, offset: int, block) -> torch.Tensor:
        key = (offset, block.nbytes, block.dtype)
        view = self._views.get(key)
        if view is None:
            with torch.inference_mode(False):  # (a view made in inference mode could not be written after)
                view = self._views[key] = self.arena.view(offset, block.nbytes)[:block.nbytes].view(block.dtype)
        return view

    def copy(self, block, src: str, src_loc, dst: str, dst_loc, nth: int = 0):
        """Start copying ``block`` from ``src`` at ``src_loc`` to ``dst`` at ``dst_loc``; returns
        a handle with ``wait()`` (HeteroIOError for a failed swap transfer) and ``done()``.
        ``nth``, the copy's place among the block's copies, is for the simulator's storage (which
        fails the copies a run saw fail); real copies ignore it."""
        if NVME in (src, dst):
            if dst == NVME:
                return self.swap.write(dst_loc, self.arena.view(src_loc, block.nbytes))
            return self.swap.read(src_loc, self.arena.view(dst_loc, block.nbytes))
        src_t = block.device if src == DEVICE else self._host(src_loc, block)
        dst_t = block.device if dst == DEVICE else self._host(dst_loc, block)
        after = None
        cuda = src_t if src_t.is_cuda else dst_t if dst_t.is_cuda else None
        if cuda is not None:  # order after the compute stream's work on this memory
            after = torch.cuda.current_stream(cuda.device).cuda_stream
        return self.copier.copy(dst_t, src_t, after_stream=after)

    def fill(self, block, tier: str, loc, init: Optional[torch.Tensor]) -> None:
        """Write ``init`` (None: zeros) into ``block``'s copy on ``tier`` at ``loc`` (the location
        when the fill was issued: the block may have left it since)."""
        with torch.no_grad():
            dst = block.device if tier == DEVICE else self._host(loc, block)
            if init is None:
                dst.zero_()
            else:
                dst.copy_(init.reshape(-1))

    def on_device(self, block, resident: bool) -> None:
        """A param block's device copy is usable, or is about to go: repoint its parameters."""
        if block.kind == "param" and block.chunk.attached != resident:
            if resident:
                block.chunk.attach_params()
            else:
                block.chunk.detach_params()

    def written(self, block) -> None:
        """``block`` is about to be written (an optimizer step, a state-dict load). For a param
        block, its parameters' version counters advance as torch's in-place update would, so
        that a backward through a graph saved before (``loss.backward(retain_graph=True);
        opt.step(); loss.backward()``) raises as in eager instead of mixing old activations
        with new weights."""
        if block.kind == "param":
            block.chunk.advance_versions()

    def close(self, blocks: Iterable[Any] = ()) -> None:
        """Stop the engines, remove the swap and give back the host arena and the device memory
        of ``blocks`` (a closed model holds nothing, even while referenced)."""
        self.copier.shutdown()
        if self.swap is not None:
            self.swap.close()
        self.arena.buffer = self.arena.buffer.new_empty(0)
        self._views.clear()
        for block in blocks:
            block.device = None
