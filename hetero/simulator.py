"""Replay a run's placement without tensors: the same runtime and policy code over simulated
storage, so "what would policy X do under budgets Y" is answered by the code that would run.

* :func:`replay` re-issues a run's event log (every create / acquire / release / discard /
  end_step the runtime saw) and returns bytes moved per direction, misses and peaks;
* :func:`replay_access_log` does the same from a public access log alone (each access is an
  acquire, blocks appear at first use) — an approximation for logs recorded elsewhere;
* :func:`belady_bound` is the clairvoyant minimum of device fetches for the same accesses:
  evict the block whose next use is furthest, knowing the whole future.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from typing import Any, Iterable, Mapping, Optional, Sequence

from .errors import HeteroOOMError
from .policies import Policy, make_policy
from .runtime import Runtime
from .tiers import DEVICE, HOST, NVME, SlotPool


class SimBlock:
    """A block with no data: what the runtime needs to place and account it."""

    def __init__(self, block_id: str, kind: str, nbytes: int) -> None:
        self.id, self.kind, self.nbytes = block_id, kind, nbytes
        self.tiers: set[str] = set()
        self.pins: dict[str, int] = {}
        self.host_offset: Optional[int] = None
        self.nvme_loc: Optional[tuple[int, int]] = None

    def __repr__(self) -> str:
        return f"SimBlock({self.id}, {self.nbytes} B, tiers={sorted(self.tiers)})"


class _Done:
    """The handle of a simulated transfer: finished the moment it is issued."""

    @staticmethod
    def wait() -> None:
        pass

    @staticmethod
    def done() -> bool:
        return True


class SimStorage:
    """Storage that carves slots exactly as :class:`~hetero.tiers.TierStorage` but holds no bytes;
    its transfers finish at once, so the runtime's decisions (which never depend on timing) are
    those of the run it replays."""

    def __init__(self, capacities: Mapping[str, int], slot_size: int) -> None:
        self.host = SlotPool(max(1, capacities[HOST] // slot_size), slot_size)
        self.nvme = SlotPool(max(1, capacities.get(NVME, 0) // slot_size), slot_size)

    def place(self, block: SimBlock, tier: str) -> bool:
        if tier == DEVICE:
            return True
        if tier == HOST:
            block.host_offset = self.host.alloc(block.nbytes, block)
            return block.host_offset is not None
        off = self.nvme.alloc(block.nbytes, block)
        block.nvme_loc = None if off is None else (0, off)
        return off is not None

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
            self.nvme.free(loc[1], nbytes)

    def adopt(self, block: SimBlock, tier: str, loc: Any, owner: object = None) -> None:
        if tier == HOST:
            self.host.take(loc, block.nbytes, owner or block)
            if owner is None:
                block.host_offset = loc
        elif tier == NVME:
            self.nvme.take(loc[1], block.nbytes, owner or block)
            if owner is None:
                block.nvme_loc = loc

    def pools(self, tier: str) -> list[SlotPool]:
        return [self.host] if tier == HOST else [self.nvme]

    def alloc(self, block: SimBlock, tier: str) -> None:
        pass

    def release(self, block: SimBlock, tier: str) -> None:
        pass

    def data(self, block: SimBlock, tier: str) -> Any:
        raise RuntimeError("a simulated block has no data")

    def copy(self, block: SimBlock, src: str, src_loc: Any, dst: str, dst_loc: Any) -> _Done:
        return _Done()

    def fill(self, block: SimBlock, tier: str, init: Any) -> None:
        pass

    def on_device(self, block: SimBlock, resident: bool) -> None:
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

    @property
    def device_fetch_bytes(self) -> int:
        return self.traffic["host->device"]


def replay(events: Iterable[Sequence[Any]], catalog: Mapping[str, tuple[str, int]],
           policy: "str | Policy", capacities: Mapping[str, int], slot_size: int,
           prefetch: int = 2) -> SimResult:
    """Re-issue ``events`` (a run's ``Report.events``) against a runtime with ``policy`` and
    ``capacities`` ({"device": bytes, "host": bytes, "nvme": bytes}); ``catalog`` maps block
    ids to ``(kind, nbytes)``. With the run's own policy and budgets the result is the run's."""
    rt = Runtime(dict(capacities), slot_size, make_policy(policy) if isinstance(policy, str) else policy,
                 SimStorage(capacities, slot_size), prefetch)
    blocks: dict[str, SimBlock] = {}

    def get(block_id: str) -> SimBlock:
        if block_id not in blocks:
            kind, nbytes = catalog[block_id]
            blocks[block_id] = SimBlock(block_id, kind, nbytes)
        return blocks[block_id]

    oom = None
    try:
        for op, *args in events:
            if op == "create":
                rt.create(get(args[0]), tier=args[3])
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
            else:
                raise ValueError(f"unknown event {op!r} in the event log")
    except HeteroOOMError as exc:
        oom = str(exc)
    tr = rt.tracker
    return SimResult(dict(tr.traffic), tr.misses, {n: t.peak for n, t in rt.tiers.items()},
                     tr.prefetch_issued, tr.prefetch_hits, len(tr.accesses), oom, tr.step_traffic)


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
                      capacities: Mapping[str, int], slot_size: int, prefetch: int = 2) -> SimResult:
    events, catalog = access_log_events(list(lines))
    return replay(events, catalog, policy, capacities, slot_size, prefetch)


def belady_bound(events: Iterable[Sequence[Any]], catalog: Mapping[str, tuple[str, int]],
                 capacity: int, max_pages: int = 4_000_000) -> int:
    """A lower bound on the bytes any placement must fetch onto a device of ``capacity`` bytes
    for the run's device accesses: Belady's MIN (evict the furthest next use, knowing the whole
    future) over equal-size pages of the blocks.

    Splitting blocks into pages relaxes the problem (a policy may keep part of a block), and for
    equal sizes MIN is optimal, so no whole-block policy can fetch less: with blocks of unequal
    sizes, block-level MIN is not a bound. Pages are the gcd of the block sizes (coarser if the
    log would need more than ``max_pages`` page accesses). A block's first use after its creation
    (or a discard, which also frees its memory) is free, as in the runtime, which creates blocks
    where they are first needed; a write elsewhere (the optimizer updating a block in host
    memory) kills the device copy.
    """
    ops: list[tuple[bool, str, bool]] = []  # (use?, block, fresh: first use since creation)
    fresh: set[str] = set()
    seen: set[str] = set()
    for op, *args in events:
        if op in ("create", "discard"):
            fresh.add(args[0])
            if op == "discard":  # its memory is freed everywhere at once
                ops.append((False, args[0], False))
        elif op == "acquire" and args[1] == DEVICE and args[3]:
            for b in args[0]:
                ops.append((True, b, b in fresh or b not in seen))
                fresh.discard(b)
                seen.add(b)
        elif op == "acquire" and args[1] != DEVICE and args[2]:  # written off the device
            ops += [(False, b, False) for b in args[0]]
    used_sizes = {catalog[b][1] for _, b, _ in ops}
    if not used_sizes:
        return 0
    page = functools.reduce(math.gcd, used_sizes)
    total = sum(catalog[b][1] for use, b, _ in ops if use)
    page *= max(1, -(-total // (page * max_pages)))
    pages: list[tuple[bool, tuple[str, int], bool, int]] = []
    for use, b, is_fresh in ops:
        size = catalog[b][1]
        for k in range(-(-size // page)):
            pages.append((use, (b, k), is_fresh, min(page, size - k * page)))
    never = len(pages) + 1
    nxt = [never] * len(pages)
    last: dict[tuple[str, int], int] = {}
    for i in range(len(pages) - 1, -1, -1):
        use, pg, _, _ = pages[i]
        if use:
            nxt[i] = last.get(pg, never)
            last[pg] = i
        else:
            last.pop(pg, None)  # the copy dies here: no later use can be served by it
    cache: dict[tuple[str, int], int] = {}  # page -> index of its next use
    heap: list[tuple[int, tuple[str, int]]] = []  # (-next use, page), stale entries skipped
    used = fetched = 0
    for i, (use, pg, is_fresh, cost) in enumerate(pages):
        if not use:
            if pg in cache:
                del cache[pg]
                used -= cost
            continue
        if pg not in cache:
            if not is_fresh:
                fetched += cost
            while used + cost > capacity and heap:
                neg, victim = heapq.heappop(heap)
                if cache.get(victim) == -neg:
                    del cache[victim]
                    used -= min(page, catalog[victim[0]][1] - victim[1] * page)
            if used + cost > capacity:
                continue  # larger than the device: streamed, never cached
            used += cost
        cache[pg] = nxt[i]
        heapq.heappush(heap, (-nxt[i], pg))
    return fetched


def load_event_log(path: str) -> tuple[list[tuple], dict[str, tuple[str, int]], dict[str, Any]]:
    """Events, catalog and header (slot_size, capacities, prefetch, policy) of a file written by
    ``Report.save_event_log``."""
    import json

    with open(path) as f:
        header = json.loads(f.readline())
        events = [tuple(tuple(x) if isinstance(x, list) else x for x in json.loads(line)) for line in f]
    catalog = {k: (v[0], int(v[1])) for k, v in header.pop("catalog").items()}
    return events, catalog, header
