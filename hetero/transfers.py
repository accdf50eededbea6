"""Physical transfers in flight, and the conflict rules that order them.

The runtime (:mod:`hetero.runtime`) decides placements logically and at once; each decision that
moves bytes becomes an :class:`Op` here. An op may start only when every earlier op it conflicts
with has finished: ops of the same block; ops reading memory it overwrites, or writing memory it
reads or writes; and, for an op writing a tier, evictions still giving that tier's memory back,
as many as the tier would be over budget by if they all failed and were undone.
:class:`InFlight` keeps the unfinished ops in issue order and indexes them by block and by the
memory they touch, so finding an op's conflicts costs what its neighbours cost, not a scan of
everything in flight (a step at small chunk sizes keeps hundreds of ops in flight: the optimizer's
deferred chunk updates, write-backs, prefetches).
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Protocol

import torch

from .tiers import DEVICE, HOST, NVME, Scattered, is_small, slots_for, unit_for

#: host and NVMe copies occupy whole pages (slots and units are page multiples)
PAGE = 4096


def regions(block: Any, tier: str, loc: Any, slot_size: int) -> tuple:
    """A block copy's memory as (space, file, start, end) ranges: device memory is per block;
    a host copy is a byte range of the arena, an NVMe copy one of a swap file (or, scattered,
    one extent of a swap file per range). A range covers what the copy holds of its pool, whole
    slots (whole units of a slot shared by small blocks), not only its bytes: the room past
    them is the copy's too, and a placement there must wait for the copy's transfer out (if that
    fails, undoing it takes the room back)."""
    if tier == DEVICE:
        return ((DEVICE, id(block), 0, 1),)
    grain = unit_for(slot_size) if is_small(block.nbytes, slot_size) else slot_size
    n = slots_for(block.nbytes, grain) * grain
    if tier == HOST:
        return ((HOST, 0, loc, loc + n),)
    if isinstance(loc, Scattered):
        return tuple((NVME, f, off, off + n) for f, off, n in loc)
    return ((NVME, loc[0], loc[1], loc[1] + n),)


def overlap(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and a[1] == b[1] and a[2] < b[3] and b[2] < a[3]


class Op:
    """One physical transfer of a block between tiers; or (``src`` None) filling a new block's
    first copy (on NVMe: claiming the slots of a never-written one, which writes nothing); or
    (``dst`` None) the hold a freed copy keeps on its memory until the block's earlier transfers
    are done; or (``compute``) host work on the block's copy (see
    :meth:`Runtime.defer <hetero.runtime.Runtime.defer>`), which reads ``src`` and writes ``dst``.

    ``src_loc`` / ``dst_loc`` are the locations at issue time (the block's logical location may
    change before the op runs). ``freed_src``: the source copy was dropped logically when the op
    was issued (an eviction), so undoing the op gives it back. ``shadow``: the op writes the
    pre-write copy a transaction keeps (not the block's own copy) one tier down. ``zero``: its
    ``src`` copy is a never-written NVMe copy that reads as zeros (a transfer out of it is a
    fill; the hold of a freed one gives the mark back if undone). ``freed``: the bytes of
    ``src``'s budget a ``freed_src`` op gave back (set by the runtime before the op is added).
    """

    __slots__ = ("seq", "block", "src", "dst", "src_loc", "dst_loc", "freed_src", "prefetch",
                 "init", "deps", "handle", "state", "start", "restorable", "compute", "reads", "writes",
                 "shadow", "zero", "freed", "nth")

    def __init__(self, seq: int, block: Any, src: Optional[str], dst: Optional[str], src_loc: Any,
                 dst_loc: Any, freed_src: bool, prefetch: bool, init: Optional[torch.Tensor],
                 issued: float, slot_size: int, compute: bool = False) -> None:
        self.seq, self.block, self.src, self.dst, self.init = seq, block, src, dst, init
        self.src_loc, self.dst_loc, self.freed_src, self.prefetch = src_loc, dst_loc, freed_src, prefetch
        self.deps: list[Op] = []
        self.handle: Any = None
        self.state = "queued"  # queued -> running -> finished | failed | cancelled
        self.start = issued
        self.restorable = True
        self.compute = compute
        self.shadow: Any = None  # the transaction whose shadow it moves
        self.zero = False
        self.freed = 0
        self.nth = 0  # a copy's place among its block's copies issued (see Runtime._found_failure)
        # the memory it reads and writes, fixed at issue (conflicts are judged on these)
        self.reads = () if src is None else regions(block, src, src_loc, slot_size)
        self.writes = () if dst is None else regions(block, dst, dst_loc, slot_size)

    @property
    def pending(self) -> bool:
        return self.state in ("queued", "running")

    def __repr__(self) -> str:
        what = (f"compute on {self.src}" if self.compute else f"hold {self.src}" if self.dst is None
                else f"fill {self.dst}" if self.src is None else f"{self.src}->{self.dst}")
        return f"<Op #{self.seq} {self.block.id} {what} {self.state}>"


class Job(Protocol):
    """The handle of host work started off the caller's thread (:meth:`Runtime.defer
    <hetero.runtime.Runtime.defer>`): ``done()`` never blocks; ``wait()`` blocks until the work
    ran and raises what it raised."""

    def done(self) -> bool: ...

    def wait(self) -> None: ...


class Deferred:
    """The handle of deferred host work (a :class:`Job`), shared by its blocks' ops: what the
    work raised is raised by the first wait only."""

    __slots__ = ("_job", "_reported")

    def __init__(self, job: Job) -> None:
        self._job = job
        self._reported = False

    def done(self) -> bool:
        return self._job.done()

    def wait(self) -> None:
        if self._reported:
            return
        try:
            self._job.wait()
        except BaseException:
            self._reported = True
            raise


class InFlight:
    """Issued, unfinished ops in issue order, indexed by block, by the memory they read and
    write (in units of ``unit`` bytes: the slot size), and (evictions) by the tier they free,
    with the bytes of its budget they gave back (:meth:`freeing`)."""

    def __init__(self, unit: int) -> None:
        self.unit = max(unit, PAGE)
        self._ops: dict[Op, None] = {}
        self._by_block: dict[Any, list[Op]] = {}
        self._freeing: dict[str, dict[Op, None]] = {}
        self._freeing_bytes: dict[str, int] = {}
        self._readers: dict[tuple, dict[Op, None]] = {}
        self._writers: dict[tuple, dict[Op, None]] = {}

    def __len__(self) -> int:
        return len(self._ops)

    def __iter__(self) -> Iterator[Op]:
        """The ops in issue order (a snapshot: callers may finish ops while iterating)."""
        return iter(list(self._ops))

    def first(self) -> Op:
        return next(iter(self._ops))

    def of(self, block: Any) -> list[Op]:
        """``block``'s unfinished ops, in issue order (do not modify)."""
        return self._by_block.get(block, [])

    def touch(self, block: Any, where: tuple) -> bool:
        """Whether an unfinished op of ``block`` reads or writes the memory ``where`` (its
        :func:`regions`)."""
        return any(overlap(w, r) for op in self._by_block.get(block, ()) for r in op.reads + op.writes
                   for w in where)

    def _keys(self, r: tuple) -> range:
        return range(r[2] // self.unit, (r[3] - 1) // self.unit + 1)

    def _index_keys(self, regions: tuple) -> "dict[tuple, None]":
        """The index keys of ``regions`` (those off the device), each once: a scattered copy's
        extents can share a slot."""
        return {(r[0], r[1], k): None for r in regions if r[0] != DEVICE for k in self._keys(r)}

    def freeing(self, tier: str) -> int:
        """Bytes of ``tier``'s budget that unfinished ``freed_src`` ops gave back: undone, they
        would take them again."""
        return self._freeing_bytes.get(tier, 0)

    def conflicts(self, op: Op, over: int = 0) -> list[Op]:
        """Unfinished ops that must finish before ``op`` starts, in issue order: those of the same
        block, those using memory it writes or writing memory it reads, and (for an op writing a
        tier that would be ``over`` budget by that many bytes with its unfinished evictions all
        undone: see :meth:`Runtime._issue <hetero.runtime.Runtime._issue>`) evictions giving
        back at least that many of the tier's bytes: those already among the others, then the
        oldest."""
        deps: dict[Op, None] = dict.fromkeys(self._by_block.get(op.block, ()))
        # Device copies are per block: they only ever conflict with ops of the same block.
        for w in op.writes:
            if w[0] == DEVICE:
                continue
            for k in self._keys(w):
                for index, attr in ((self._readers, "reads"), (self._writers, "writes")):
                    for p in index.get((w[0], w[1], k), ()):
                        if p not in deps and any(overlap(w, r) for r in getattr(p, attr)):
                            deps[p] = None
        for r in op.reads:
            if r[0] == DEVICE:
                continue
            for k in self._keys(r):
                for p in self._writers.get((r[0], r[1], k), ()):
                    if p not in deps and any(overlap(r, w) for w in p.writes):
                        deps[p] = None
        deps.pop(op, None)
        freeing = self._freeing.get(op.dst, {}) if op.dst is not None else {}
        if over > 0 and freeing:
            over -= sum(p.freed for p in deps if p in freeing)
            for p in freeing:
                if over <= 0:
                    break
                if p not in deps:
                    deps[p] = None
                    over -= p.freed
        return sorted(deps, key=lambda p: p.seq)

    def add(self, op: Op) -> None:
        self._ops[op] = None
        self._by_block.setdefault(op.block, []).append(op)
        if op.freed_src:
            self._freeing.setdefault(op.src, {})[op] = None
            self._freeing_bytes[op.src] = self._freeing_bytes.get(op.src, 0) + op.freed
        for index, regions in ((self._readers, op.reads), (self._writers, op.writes)):
            for key in self._index_keys(regions):
                index.setdefault(key, {})[op] = None

    def remove(self, op: Op) -> None:
        del self._ops[op]
        ops = self._by_block[op.block]
        ops.remove(op)
        if not ops:
            del self._by_block[op.block]
        if op.freed_src:
            freeing = self._freeing[op.src]
            del freeing[op]
            self._freeing_bytes[op.src] -= op.freed
            if not freeing:
                del self._freeing[op.src]
                del self._freeing_bytes[op.src]
        for index, regions in ((self._readers, op.reads), (self._writers, op.writes)):
            for key in self._index_keys(regions):
                ops_at = index[key]
                del ops_at[op]
                if not ops_at:
                    del index[key]
