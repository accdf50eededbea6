"""Replay a run's placement without tensors: the same runtime and policy code over simulated
storage, so "what would policy X do under budgets Y" is answered by the code that would run.

* :func:`replay` re-issues a run's event log (every create / acquire / release / discard /
  end_step the runtime saw) and returns bytes moved per direction, misses and peaks;
* :func:`replay_access_log` does the same from a public access log alone (each access is an
  acquire, blocks appear at first use) — an approximation for logs recorded elsewhere;
* :func:`belady_bound` is the clairvoyant minimum of device fetches for the same accesses:
  evict the block whose next use is furthest, knowing the whole future (over pages: a lower
  bound); :func:`coresident_bound` is the same with the constraints every placement obeys
  (an acquire's blocks are on the device together until released; data appears on the device
  for free only where it is created), tighter and still a lower bound.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import heapq
import logging
import math
import threading
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

from .config import file_path, parse_prefetch, parse_size
from .errors import HeteroConfigError, HeteroIOError, HeteroOOMError
from .policies import Policy, make_policy
from .runtime import Runtime
from .tiers import (DEVICE, HOST, NVME, SlotPool, align_up, swap_alloc, swap_fits, swap_free, swap_take,
                    unit_for, whole_units)


class SimBlock:
    """A block with no data: what the runtime needs to place and account it."""

    def __init__(self, block_id: str, kind: str, nbytes: int) -> None:
        self.id, self.kind, self.nbytes = block_id, kind, nbytes
        self.chunk_id = block_id.rpartition(".")[0] or block_id  # ids are "<chunk>.<kind>"
        self.tiers: set[str] = set()
        self.pins: dict[str, int] = {}
        self.host_offset: Optional[int] = None
        self.nvme_loc: Optional[tuple] = None  # (file, offset), or Scattered

    def __repr__(self) -> str:
        return f"SimBlock({self.id}, {self.nbytes} B, tiers={sorted(self.tiers)})"


_WRITTEN = object()  # stands for the data a run gave a block at its creation (SimStorage holds none)


class _Done:
    """The handle of a simulated transfer: finished the moment it is issued."""

    @staticmethod
    def wait() -> None:
        pass

    @staticmethod
    def done() -> bool:
        return True


class _Failed:
    """The handle of a transfer the run saw fail (its ``failed`` event): it fails where the run
    found the failure, the place :meth:`Runtime._found_failure <hetero.runtime.Runtime._found_failure>`
    recorded. At a pump: it shows done from that pump on (the events the runtime has recorded,
    then the pumps since the last of them); else never done, and it fails when waited for."""

    def __init__(self, runtime: Runtime, site: str, events: int, pumps: int) -> None:
        self.runtime, self.site, self.at = runtime, site, (events, pumps)

    def done(self) -> bool:
        return self.site == "pump" and self.runtime._pumped_at >= self.at

    def wait(self) -> None:
        raise HeteroIOError(errno.EIO, "a swap transfer that failed in the run being replayed")


class SimStorage:
    """Storage that carves slots exactly as :class:`~hetero.tiers.TierStorage` but holds no bytes;
    its transfers finish at once, so the runtime's decisions (which never depend on timing) are
    those of the run it replays. The transfers the run saw fail (``failures``: (block id, the
    copy's place among the block's copies issued) -> a :class:`_Failed` handle) fail."""

    def __init__(self, capacities: Mapping[str, int], slot_size: int, host_slots: Optional[int] = None,
                 nvme_files: Optional[Sequence[int]] = None) -> None:
        self.failures: dict[tuple[str, int], _Failed] = {}
        slots = capacities[HOST] // slot_size
        self.host = SlotPool(max(1, slots if host_slots is None else min(slots, host_slots)), slot_size)
        if nvme_files is None:  # one file of the budget's whole slots (none under one slot)
            whole = capacities.get(NVME, 0) // slot_size
            nvme_files = [whole] if whole else []
        files = list(nvme_files)
        self.nvme = [SlotPool(n, slot_size) for n in files]  # one per swap file, searched in order

    def place(self, block: SimBlock, tier: str) -> bool:
        if tier == DEVICE:
            return True
        if tier == HOST:
            block.host_offset = self.host.alloc(block.nbytes, block)
            return block.host_offset is not None
        block.nvme_loc = self.hold_nvme(block.nbytes, block)
        return block.nvme_loc is not None

    def loc(self, block: SimBlock, tier: str) -> Any:
        return {DEVICE: None, HOST: block.host_offset, NVME: block.nvme_loc}[tier]

    def forget(self, block: SimBlock, tier: str) -> None:
        if tier != DEVICE:
            self.forget_at(tier, self.loc(block, tier), block.nbytes)
        if tier == HOST:
            block.host_offset = None
        elif tier == NVME:
            block.nvme_loc = None

    def forget_at(self, tier: str, loc: Any, nbytes: int) -> None:
        if tier == HOST:
            self.host.free(loc, nbytes)
        elif tier == NVME:
            swap_free(self.nvme, loc, nbytes)

    def hold_nvme(self, nbytes: int, owner: object) -> Any:
        return swap_alloc(self.nvme, nbytes, owner)

    def adopt(self, block: SimBlock, tier: str, loc: Any, owner: object = None) -> None:
        if tier == HOST:
            self.host.take(loc, block.nbytes, owner or block)
            if owner is None:
                block.host_offset = loc
        elif tier == NVME:
            swap_take(self.nvme, loc, block.nbytes, owner or block)
            if owner is None:
                block.nvme_loc = loc

    def pools(self, tier: str) -> list[SlotPool]:
        return [self.host] if tier == HOST else list(self.nvme)

    def fits(self, tier: str, nbytes: int) -> bool:
        return self.host.fits(nbytes) if tier == HOST else swap_fits(self.nvme, nbytes)

    def alloc(self, block: SimBlock, tier: str) -> None:
        pass

    def release(self, block: SimBlock, tier: str) -> None:
        pass

    def data(self, block: SimBlock, tier: str) -> Any:
        raise RuntimeError("a simulated block has no data")

    def copy(self, block: SimBlock, src: str, src_loc: Any, dst: str, dst_loc: Any, nth: int = 0) -> "_Done | _Failed":
        return self.failures.get((block.id, nth)) or _Done()

    def fill(self, block: SimBlock, tier: str, loc: Any, init: Any) -> None:
        pass

    def on_device(self, block: SimBlock, resident: bool) -> None:
        pass

    def written(self, block: SimBlock) -> None:
        pass

    def close(self) -> None:
        pass


@dataclasses.dataclass
class SimResult:
    traffic: dict[str, int]
    misses: int  # acquires whose block was not already on the requested tier
    peak: dict[str, int]
    prefetch_issued: int
    prefetch_hits: int
    accesses: int
    oom: Optional[str] = None  # the HeteroOOMError message if the budgets could not serve the run
    step_traffic: list[dict[str, int]] = dataclasses.field(default_factory=list)
    # Why the replay ended before the log did (see :func:`replay`): at the run's first swap
    # failure, for a replay that is not the run's own; where a replay of a faulted run parted
    # from it. Else None.
    stopped: Optional[str] = None

    @property
    def device_fetch_bytes(self) -> int:
        return self.traffic["host->device"]


def _nothing() -> None:
    pass


def replay(events: Iterable[Sequence[Any]], catalog: Mapping[str, tuple[str, int]],
           policy: "str | Policy", capacities: Mapping[str, int], slot_size: int,
           prefetch: int = 2, host_slots: Optional[int] = None,
           nvme_files: Optional[Sequence[int]] = None, failures: bool = True) -> SimResult:
    """Re-issue ``events`` (a run's ``Report.events``) against a runtime with ``policy`` and
    ``capacities`` ({"device": bytes, "host": bytes, "nvme": bytes}); ``catalog`` maps block
    ids to ``(kind, nbytes)``; ``host_slots`` caps the host arena's slots as the run's model
    state did (``Report.host_slots``), and ``nvme_files`` carves the NVMe tier into the run's
    swap files (``Report.nvme_files``; None: one pool of the NVMe budget). ``policy`` is a
    built-in's name or an instance, used as given (state and all: pass a fresh one; not the
    live policy of an open wrapped model, which the replay would take over: HeteroConfigError,
    as for a name that is not a built-in's, such as a custom policy's in an event log's
    header). With the run's own policy and budgets the result is the run's, swap transfers that
    failed in the run included (``failures``: they fail again where the run found them failed).
    Under another policy or other budgets the transfers are others: with ``failures=False`` the
    replay ends where the run's first failure was found (``SimResult.stopped`` says so): after
    it the log holds the run's recovery (a call the failure cut short and made again), which
    a placement whose transfers all succeeded cannot follow."""
    if not whole_units(slot_size):  # (a log saved before slots were rounded to whole units)
        raise HeteroConfigError(
            f"slot_size={slot_size} is not whole units (slots shared by small blocks are whole units of "
            "a sixteenth of one, in 4 KiB pages, as hetero makes them since its 23rd session); expected "
            f"a slot_size of a report or log saved since, or one such as {align_up(slot_size, unit_for(slot_size))}")
    files = list(nvme_files) if nvme_files is not None else None
    events = list(events)
    failed = [i for i, e in enumerate(events) if e[0] == "failed"]
    stopped = None
    if failed and not failures:
        stopped = (f"the run's swap transfer of block {events[failed[0]][1]} failed at event {failed[0]} "
                   f"of {len(events)}; this replay (another policy or other budgets) ends there")
        events, failed = events[:failed[0]], []
    storage = SimStorage(capacities, slot_size, host_slots, files)
    rt = Runtime(dict(capacities), slot_size, make_policy(policy), storage, prefetch, host_slots, files)
    for i in failed:
        block_id, nth, site, at_events, at_pumps = events[i][1:]
        storage.failures[(block_id, nth)] = _Failed(rt, site, at_events, at_pumps)
    blocks: dict[str, SimBlock] = {}

    def get(block_id: str) -> SimBlock:
        if block_id not in blocks:
            kind, nbytes = catalog[block_id]
            blocks[block_id] = SimBlock(block_id, kind, nbytes)
        return blocks[block_id]

    # A log with failures replayed as the run: where a failure's undo depended on timing (see
    # README, Architecture) the replay may part from the run; it ends there, saying so, rather
    # than going on from another state (it would raise on the run's recovery, or count wrong).
    watch = bool(failed)
    oom = None
    try:
        with _runtime_logs_off():
            for i, (op, *args) in enumerate(events):
                try:
                    _replay_one(rt, get, op, args)
                except HeteroIOError:
                    pass  # a failure the run saw, found where the run found it (the run went on)
                except AssertionError:
                    if not watch:
                        raise
                    stopped = _parted(i, len(events))
                    break
                if watch and not _follows(rt.tracker.events, events, i):
                    stopped = _parted(i, len(events))
                    break
    except HeteroOOMError as exc:
        oom = str(exc)
    tr = rt.tracker
    return SimResult(dict(tr.traffic), tr.misses, {n: t.peak for n, t in rt.tiers.items()},
                     tr.prefetch_issued, tr.prefetch_hits, len(tr.accesses), oom, tr.step_traffic, stopped)


def _parted(i: int, n: int) -> str:
    return (f"the replay parted from the run at event {i} of {n}: a transfer the run undid with a failed "
            "one (waiting on it for budget room only, which depends on timing) ran in the replay")


def _follows(replayed: Sequence[Sequence[Any]], log: Sequence[Sequence[Any]], i: int) -> bool:
    """Whether the events the replay recorded match the log's through event ``i`` (a failure the
    replay found itself is recorded at the log's place, before the log's event for it)."""
    if len(replayed) <= i:
        return False  # (the log's failure, found at a wait the replay did not make)
    return all(_plain(replayed[j]) == _plain(log[j]) for j in range(max(0, i - 2), min(len(replayed), len(log))))


def _plain(event: Sequence[Any]) -> Any:
    """An event as JSON gives it back (lists for tuples); of a failure, what names the transfer
    and how it was found (where a wait found it, the pumps before are no one's business)."""
    event = event[:4] if event[0] == "failed" else event
    return _listed(event)


def _listed(x: Any) -> Any:
    return [_listed(y) for y in x] if isinstance(x, (list, tuple)) else x


@contextlib.contextmanager
def _runtime_logs_off() -> Iterator[None]:
    """Leave out what the runtime logs in this thread meanwhile: the warnings a replay repeats
    (a failed transfer undone, an update that can no longer be undone) were the run's."""
    logger, me = logging.getLogger(Runtime.__module__), threading.get_ident()

    def other_threads(record: logging.LogRecord) -> bool:
        return record.thread != me

    logger.addFilter(other_threads)
    try:
        yield
    finally:
        logger.removeFilter(other_threads)


def _replay_one(rt: Runtime, get: Callable[[str], SimBlock], op: str, args: list) -> None:
    """Make the runtime call of one event (see :func:`replay`)."""
    if op == "create":  # (a zero-filled block homed on NVMe is made without a write)
        rt.create(get(args[0]), tier=args[3], init=None if args[4:] == [True] else _WRITTEN)
    elif op == "acquire":
        ids, tier, write, record = args
        rt.acquire([get(i) for i in ids], tier, write, record)
    elif op == "release":
        ids, tier = args
        rt.release([get(i) for i in ids], tier)
    elif op == "discard":
        rt.discard(get(args[0]))
    elif op == "end_step":
        rt.end_step()
    elif op == "unpin_all":
        rt.unpin_all()
    elif op in ("begin", "commit", "rollback"):
        getattr(rt, op)()
    elif op == "ensure_shadow":
        rt.ensure_shadow(get(args[0]), args[1])
    elif op == "prefetching":
        rt.set_prefetching(args[0])
    elif op == "hint":
        rt.hint([([get(i) for i in ids], tier) for ids, tier in args[0]])
    elif op == "settle":
        rt.settle([get(i) for i in args[0]])
    elif op == "protect":
        rt.protect([get(i) for i in args[0]], args[1])
    elif op == "postpone":  # nothing to run: the work's own events follow its catch_up
        rt.postpone(args[0], _nothing, lambda: ([], DEVICE), args[1])
    elif op == "catch_up":
        rt.catch_up(set(args[0]))
    elif op == "drain":
        rt.drain()
    elif op == "failed":  # found by a call whose own event the run never recorded (it
        if any(o.nth == args[1] for o in rt._ops.of(get(args[0]))):  # raised first)
            rt._pump()
    elif op == "raised":  # likewise: the failure a release found, raised by the next call
        if rt._failure is not None:
            rt._pump()
    else:
        raise ValueError(f"unknown event {op!r} in the event log")


def access_log_events(lines: Iterable[Mapping[str, Any]]) -> tuple[list[tuple], dict[str, tuple[str, int]]]:
    """Events and catalog reconstructed from public access-log lines: consecutive lines of one
    ``group`` (when present, else each line) form one acquire, released right after."""
    events: list[tuple] = []
    catalog: dict[str, tuple[str, int]] = {}
    step, group = 0, None
    pending: list[Mapping[str, Any]] = []

    def flush() -> None:
        if pending:
            ids = tuple(l["block"] for l in pending)
            tier, write = pending[0]["tier"], any(l.get("write", False) for l in pending)
            events.append(("acquire", ids, tier, write, True))
            events.append(("release", ids, tier))
            pending.clear()

    for line in lines:
        catalog.setdefault(line["block"], (line["block"].split(".")[-1], int(line["bytes"])))
        while line["step"] > step:
            flush()
            events.append(("end_step",))
            step += 1
        g = line.get("group", line["seq"])
        if g != group:
            flush()
            group = g
        pending.append(line)
    flush()
    events.append(("end_step",))
    return events, catalog


def replay_access_log(lines: Iterable[Mapping[str, Any]], policy: "str | Policy",
                      capacities: Mapping[str, "int | str"], slot_size: "int | str",
                      prefetch: int = 2) -> SimResult:
    """:func:`replay` of a public access log (:func:`access_log_events`). ``capacities`` maps
    "device" and "host" (and "nvme", for an NVMe tier) to sizes as ``hetero.wrap`` takes them
    (``4096``, ``"512MiB"``); arguments are checked as ``wrap`` checks its own
    (HeteroConfigError naming the argument)."""
    if not isinstance(capacities, Mapping) or not {DEVICE, HOST} <= set(capacities) or not set(capacities) <= {
            DEVICE, HOST, NVME}:
        raise HeteroConfigError(f"capacities={capacities!r} is not accepted; expected a dict of the tiers' "
                                "sizes with 'device' and 'host' (and 'nvme' for an NVMe tier), such as "
                                "{'device': '1MiB', 'host': '4MiB'}")
    caps = {t: parse_size(v, f"capacities[{t!r}]", allow_none=False) for t, v in capacities.items()}
    slot = parse_size(slot_size, "slot_size", allow_none=False)
    if any(v <= 0 for v in caps.values()) or slot <= 0:
        raise HeteroConfigError(f"capacities={capacities!r}, slot_size={slot_size!r}: expected sizes > 0")
    events, catalog = access_log_events(list(lines))
    return replay(events, catalog, policy, caps, slot, parse_prefetch(prefetch))


def belady_bound(events: Iterable[Sequence[Any]], catalog: Mapping[str, tuple[str, int]],
                 capacity: int, max_pages: int = 4_000_000) -> int:
    """A lower bound on the bytes any placement must fetch onto a device of ``capacity`` bytes
    for the run's device accesses: Belady's MIN (evict the furthest next use, knowing the whole
    future) over equal-size pages of the blocks.

    Splitting blocks into pages relaxes the problem (a policy may keep part of a block), and for
    equal sizes MIN is optimal, so no whole-block policy can fetch less: with blocks of unequal
    sizes, block-level MIN is not a bound. Pages are the gcd of the block sizes (coarser if the
    log would need more than ``max_pages`` page accesses; then each block counts only its whole
    pages, which relaxes further). A block's first use after its creation (or a discard, which
    also frees its memory) is free, as in the runtime, which creates blocks where they are first
    needed; a write elsewhere (the optimizer updating a block in host memory) kills the device
    copy. See :func:`coresident_bound` for a tighter bound that is still valid.
    """
    return _page_min(_device_ops(events, coresident=False), catalog, capacity, max_pages)


def coresident_bound(events: Iterable[Sequence[Any]], catalog: Mapping[str, tuple[str, int]],
                     capacity: int, max_pages: int = 4_000_000) -> int:
    """:func:`belady_bound` with two constraints every placement obeys: still a lower bound on the
    bytes any placement must fetch onto the device, and never below ``belady_bound``.

    1. *Co-residency.* Every block of an acquire stays on the device from the acquire to its
       release (the runtime pins them; compute needs them together). MIN never evicts a page of a
       pinned block; ``belady_bound`` may evict the first pages of an acquire to load its last.
    2. *Creation.* A block's data appears on the device without a fetch only when it is created
       there (``create`` events: parameters at wrap time, optimizer states, gradients created by
       their first acquire). That is a free, optional load *at creation*; the block then holds
       device memory until its first use. ``belady_bound`` instead makes the first use free
       whenever it comes, as if the block could be created on the device at that moment.

    Validity. Relax whole blocks to independent pages of equal size (as ``belady_bound``). The
    requests are then: at each acquire, its pages must be loaded and stay resident until the
    release; a creation offers one free load; a discard or a write on another tier kills a
    copy. Any runtime schedule is feasible for this relaxed problem at no more cost (its budget
    is a hard cap, its pins are these pins, its only free loads are creations, it drops the
    same copies), so the relaxed optimum is a lower bound. MIN (on a fault or an offered free
    load, evict the unpinned page used furthest in the future, and decline a free load whose
    own next use is the furthest) is optimal for it, by Belady's exchange argument: if an
    optimal schedule evicts ``q`` where MIN evicts ``p`` (so ``p`` is needed no sooner than
    ``q``), swapping the two costs nothing before ``q``'s next request, because a page is
    pinned only from a request of it on, so ``p`` is not pinned in between; from there the
    swapped schedule saves the fetch of ``q`` and pays at most one fetch of ``p``. Pages
    the device cannot hold beside pinned ones are fetched and not kept (where the runtime would
    raise HeteroOOMError), which only lowers the bound.

    The property test in ``tests/test_policies.py`` checks ``belady_bound <= coresident_bound <=``
    the traffic of every policy, and ``coresident_bound <=`` an exhaustive whole-block optimum,
    on random logs.
    """
    return _page_min(_device_ops(events, coresident=True), catalog, capacity, max_pages)


def _device_ops(events: Iterable[Sequence[Any]], coresident: bool) -> list[tuple]:
    """The device's requests in a run's events, in order: ``("use", block, free)`` (``free``: the
    first use after creation, in ``belady_bound``), ``("load", block)`` (an optional free load at
    creation), ``("kill", block)``, ``("pin", blocks)`` and ``("unpin", blocks)`` (co-residency),
    ``("step",)``."""
    ops: list[tuple] = []
    fresh: set[str] = set()
    seen: set[str] = set()
    # Device acquires that are not compute (record=False: state_dict, summon) pin nothing here;
    # their releases must not unpin what compute pinned.
    unrecorded: dict[str, int] = {}
    for op, *args in events:
        if op == "create":
            if coresident:
                ops.append(("kill", args[0]))  # no copy can outlive a creation (nothing to keep)
                if args[3] in (None, DEVICE):  # the policy's home, or the device: it may start there
                    ops.append(("load", args[0]))
                seen.add(args[0])
            else:
                fresh.add(args[0])
        elif op == "discard":  # its memory is freed everywhere at once
            ops.append(("kill", args[0]))
            if not coresident:
                fresh.add(args[0])
        elif op == "acquire" and args[1] == DEVICE and not args[3]:
            for b in args[0]:
                unrecorded[b] = unrecorded.get(b, 0) + 1
        elif op == "acquire" and args[1] == DEVICE and args[3]:
            if coresident:
                ops.append(("pin", tuple(args[0])))
            for b in args[0]:
                ops.append(("use", b, b in fresh or b not in seen))
                fresh.discard(b)
                seen.add(b)
        elif op == "acquire" and args[1] != DEVICE and args[2]:  # written off the device
            ops += [("kill", b) for b in args[0]]
        elif op == "release" and args[1] == DEVICE:
            compute = []
            for b in args[0]:
                if unrecorded.get(b):
                    unrecorded[b] -= 1
                else:
                    compute.append(b)
            if coresident and compute:
                ops.append(("unpin", tuple(compute)))
        elif op == "end_step":
            ops.append(("step",))
    return ops


def _page_min(ops: list[tuple], catalog: Mapping[str, tuple[str, int]], capacity: int,
              max_pages: int) -> int:
    """Bytes MIN fetches for ``ops`` (see :func:`_device_ops`) over equal pages of the blocks."""
    used_sizes = {catalog[o[1]][1] for o in ops if o[0] == "use"}  # (both bounds: same pages)
    if not used_sizes:
        return 0
    page = functools.reduce(math.gcd, used_sizes)
    total = sum(catalog[o[1]][1] for o in ops if o[0] == "use")
    page *= max(1, -(-total // (page * max_pages)))
    npages = {b: catalog[b][1] // page for b in catalog}  # exact unless coarsened: then fewer

    # Expand to page requests: (kind, page, free); pins stay per block.
    seq: list[tuple] = []
    for o in ops:
        if o[0] == "use":
            seq += [("use", (o[1], k), o[2]) for k in range(npages[o[1]])]
        elif o[0] in ("load", "kill"):
            seq += [(o[0], (o[1], k), False) for k in range(npages[o[1]])]
        elif o[0] in ("pin", "unpin"):
            seq.append(o)
    never = len(seq) + 1
    nxt = [never] * len(seq)  # index of the page's next use while its copy lives
    last: dict[tuple[str, int], int] = {}
    for i in range(len(seq) - 1, -1, -1):
        kind, pg = seq[i][0], seq[i][1]
        if kind in ("use", "load"):
            nxt[i] = last.get(pg, never)
            if kind == "use":
                last[pg] = i
        elif kind == "kill":
            last.pop(pg, None)  # the copy dies here: no later use can be served by it

    slots = capacity // page
    cache: dict[tuple[str, int], int] = {}  # page -> index of its next use
    heap: list[tuple[int, tuple[str, int]]] = []  # (-next use, page) of unpinned pages; stale skipped
    pins: dict[str, int] = {}
    fetched = 0

    def evict_one(keep_before: int) -> bool:
        """Evict the unpinned page used furthest, if after ``keep_before``."""
        while heap:
            neg, victim = heap[0]
            if cache.get(victim) != -neg or pins.get(victim[0]):
                heapq.heappop(heap)  # stale, or pinned (pushed back when unpinned)
                continue
            if -neg <= keep_before:
                return False
            heapq.heappop(heap)
            del cache[victim]
            return True
        return False

    for i, (kind, *rest) in enumerate(seq):
        if kind == "pin":
            for b in rest[0]:
                pins[b] = pins.get(b, 0) + 1
            continue
        if kind == "unpin":
            for b in rest[0]:
                pins[b] -= 1
                if not pins[b]:
                    for k in range(npages[b]):
                        if (b, k) in cache:
                            heapq.heappush(heap, (-cache[(b, k)], (b, k)))
            continue
        pg, free = rest
        if kind == "kill":
            cache.pop(pg, None)
            continue
        if kind == "load":  # optional and free: only if it displaces a page needed later
            if nxt[i] == never or (len(cache) >= slots and not evict_one(nxt[i])):
                continue
        elif pg not in cache:
            if not free:
                fetched += page
            if len(cache) >= slots and not evict_one(-1):
                continue  # no room beside pinned pages: streamed, never cached
        cache[pg] = nxt[i]
        if not pins.get(pg[0]):
            heapq.heappush(heap, (-nxt[i], pg))
    return fetched


def load_event_log(path: str) -> tuple[list[tuple], dict[str, tuple[str, int]], dict[str, Any]]:
    """Events, catalog and header (slot_size, capacities, prefetch, policy, host_slots, nvme_files) of a file written by
    ``Report.save_event_log``."""
    import json

    def bad(line: int, why: str) -> HeteroConfigError:
        return HeteroConfigError(f"load_event_log: {path!r} line {line}: {why}; expected a file written "
                                 "by Report.save_event_log, whole")

    header, events = None, []
    with open(file_path("load_event_log", path)) as f:
        for n, line in enumerate(f, 1):
            try:
                item = json.loads(line)
            except ValueError as exc:
                raise bad(n, f"not JSON ({exc})") from None
            if n == 1:
                if not (isinstance(item, dict) and isinstance(item.get("catalog"), dict)):
                    raise bad(n, "no header with a catalog")
                header = item
            elif not (isinstance(item, list) and item and isinstance(item[0], str)):
                raise bad(n, f"not an event: {line.strip()[:80]}")
            else:
                events.append(tuple(tuple(x) if isinstance(x, list) else x for x in item))
    if header is None:
        raise bad(1, "the file is empty")
    try:
        catalog = {k: (str(v[0]), int(v[1])) for k, v in header.pop("catalog").items()}
    except (TypeError, ValueError, IndexError) as exc:
        raise bad(1, f"a catalog entry is not (kind, bytes): {exc}") from None
    count = header.pop("events", None)  # (logs saved before it was written carry none)
    if count is not None and count != len(events):
        raise bad(len(events) + 1, f"{len(events)} events where the header says {count}: the file is cut short")
    return events, catalog, header
