"""The placement engine: the only code that allocates, moves, evicts and accounts model state.

Hooks and the optimizer ask for blocks with :meth:`Runtime.acquire` (which pins them on a tier
until :meth:`Runtime.release`); everything else happens here. Invariants kept at every instant:

* each tier's ``used`` never exceeds its budget (``Tier.reserve`` asserts it);
* every copy listed in ``block.tiers`` is valid; a write drops all other copies first;
* a pinned copy, or one being copied, is never evicted.

Decisions (what to evict, where a block starts, what to prefetch) come from a pure
:class:`~hetero.policies.Policy`; bytes are moved by a storage object (:class:`TierStorage` for
real, :class:`~hetero.simulator.SimStorage` in the simulator), so a policy measured in simulation
is the policy that runs. Every call is recorded in the tracker's event log, which the simulator
replays. Copies are synchronous for now.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Optional, Sequence

import torch

from .chunks import EXP_AVG, Block, Chunk
from .config import Config, format_size
from .errors import HeteroOOMError
from .policies import BlockInfo, Policy
from .tiers import (DEVICE, HOST, NVME, TIER_ORDER, HostArena, SwapSpace, Tier, TierStorage,
                    slot_size_for, slots_for)
from .tracker import Tracker

log = logging.getLogger(__name__)


def expected_block_bytes(chunks: Sequence[Chunk]) -> list[int]:
    """Bytes of every block the chunks have or will have (Adam's two states per trainable chunk)."""
    sizes = []
    for c in chunks:
        sizes += [b.nbytes for b in c.blocks.values()]
        if c.requires_grad and EXP_AVG not in c.blocks:
            sizes += [c.full_precision.nbytes] * 2
    return sizes


class Runtime:
    def __init__(self, capacities: dict[str, int], slot_size: int, policy: Policy, storage: Any,
                 prefetch: int = 0) -> None:
        self.tiers = {name: Tier(name, cap) for name, cap in capacities.items()}
        self.slot_size = slot_size
        self.policy = policy
        self.storage = storage
        self.prefetch_depth = prefetch
        self.tracker = Tracker()
        self._blocks: dict[str, Block] = {}
        self._on: dict[str, dict[Block, None]] = {name: {} for name in capacities}  # copies per tier
        self._in_flight: set[Block] = set()  # blocks whose copy is being made: never victims

    @classmethod
    def for_chunks(cls, cfg: Config, chunks: Sequence[Chunk], policy: Policy) -> "Runtime":
        """The runtime of a wrapped model: real device buffers, a host arena, swap files."""
        sizes = expected_block_bytes(chunks)
        slot = slot_size_for(cfg.chunk_size, sizes)
        needed = sum(slots_for(n, slot) for n in sizes)  # the arena never exceeds the whole state
        arena = HostArena(min(cfg.host_budget // slot, needed), slot, pin=cfg.device.type == "cuda")
        capacities = {DEVICE: cfg.device_budget, HOST: cfg.host_budget}
        swap = None
        if cfg.nvme_path is not None:
            capacities[NVME] = cfg.nvme_budget
            swap = SwapSpace(cfg.nvme_path, cfg.nvme_budget, slot, max(sizes, default=0))
        return cls(capacities, slot, policy, TierStorage(cfg.device, arena, swap), cfg.prefetch)

    # ------------------------------------------------------------------ queries

    def blocks(self) -> Iterable[Block]:
        return self._blocks.values()

    def top(self, block: Block) -> str:
        """The fastest tier holding a valid copy of ``block``."""
        return min(block.tiers, key=TIER_ORDER.index)

    def working_tier(self, block: Block) -> str:
        """Where compute that reads ``block`` in place should run: its fastest copy, or host for a
        block that is only on NVMe."""
        top = self.top(block)
        return HOST if top == NVME else top

    def data(self, block: Block, tier: str) -> torch.Tensor:
        """The flat, typed tensor of ``block`` on ``tier`` (which must hold a copy)."""
        assert tier in block.tiers, f"{block} has no copy on {tier}"
        return self.storage.data(block, tier)

    def free_bytes(self) -> dict[str, int]:
        return {name: t.free for name, t in self.tiers.items()}

    # ------------------------------------------------------------------ public operations

    def create(self, block: Block, init: Optional[torch.Tensor] = None, tier: Optional[str] = None) -> None:
        """Give a new block its first home and fill it from ``init`` (a flat tensor of the
        block's dtype on any device; ``None`` zero-fills). The home is ``tier`` if given, else
        the policy's choice."""
        assert not block.tiers, f"{block} already exists"
        self._blocks[block.id] = block
        self.tracker.event("create", block.id, block.kind, block.nbytes, tier)
        if tier is None:
            tier = self.policy.home(self._info(block), self.free_bytes(),
                                    {n: t.capacity for n, t in self.tiers.items()})
        first = HOST if tier == NVME else tier  # NVMe is written from a host slot
        self._in_flight.add(block)
        try:
            self._alloc(block, first, set())
        finally:
            self._in_flight.discard(block)
        self._add_copy(block, first)
        self.storage.fill(block, first, init)
        self.storage.on_device(block, first == DEVICE)
        if tier == NVME:
            self._evict(block, HOST)

    def acquire(self, blocks: Sequence[Block], tier: str = DEVICE, write: bool = False,
                record: bool = True) -> None:
        """Pin valid copies of ``blocks`` on ``tier``, creating (zero-filled), fetching and
        evicting as needed, then prefetch what the policy expects next.

        Records one access per block (``record=False`` for reads that are not compute, such as
        ``state_dict``). With ``write`` every other copy is dropped, because the caller is about
        to change the data. Raises HeteroOOMError when the tier cannot hold them.
        """
        for block in blocks:
            if not block.tiers:  # first use (or first since a discard): start where it is needed
                self.create(block, tier=tier)
        self.tracker.event("acquire", tuple(b.id for b in blocks), tier, write, record)
        protect = set(blocks)
        group = self.tracker.groups
        self.tracker.groups += 1
        for block in blocks:
            if record and tier not in block.tiers:
                self.tracker.misses += 1
            self._fetch(block, tier, protect)
            block.pins[tier] = block.pins.get(tier, 0) + 1
            if write:
                for other in list(block.tiers - {tier}):
                    assert not block.pins.get(other), f"{block} is written on {tier} while pinned on {other}"
                    self._free(block, other)
        if record:
            seq = len(self.tracker.accesses)
            for block in blocks:
                self.tracker.access(block.id, block.nbytes, tier, group, write)
            self.policy.observe([b.id for b in blocks], tier, self.tracker.step, seq, write)
            self._prefetch()

    def release(self, blocks: Sequence[Block], tier: str = DEVICE) -> None:
        self.tracker.event("release", tuple(b.id for b in blocks), tier)
        for block in blocks:
            n = block.pins.get(tier, 0)
            assert n > 0, f"{block} released on {tier} without being acquired"
            block.pins[tier] = n - 1

    def read(self, block: Block) -> torch.Tensor:
        """A CPU copy of ``block``'s data, wherever it lives (not recorded as a compute access)."""
        tier = self.working_tier(block)
        self.acquire([block], tier, record=False)
        try:
            return self.data(block, tier).to("cpu", copy=True)
        finally:
            self.release([block], tier)

    def write(self, block: Block, value: torch.Tensor) -> None:
        """Overwrite ``block``'s data with the flat ``value`` (creating the block if needed)."""
        if not block.tiers:
            self.create(block, value)
            return
        tier = self.working_tier(block)
        self.acquire([block], tier, write=True, record=False)
        try:
            with torch.no_grad():
                self.data(block, tier).copy_(value.reshape(-1))
        finally:
            self.release([block], tier)

    def discard(self, block: Block) -> None:
        """Drop every copy of ``block``: its contents are dead (gradients after zero_grad). The
        next acquire creates it afresh where it is needed, moving nothing."""
        if not block.tiers:
            return
        assert not any(block.pins.values()), f"{block} is discarded while in use"
        self.tracker.event("discard", block.id)
        for tier in list(block.tiers):
            self._free(block, tier)

    def unpin_all(self) -> None:
        """Forget every pin (after an exception abandoned a forward or backward half-way)."""
        self.tracker.event("unpin_all")
        for block in self.blocks():
            block.pins.clear()

    def end_step(self) -> None:
        self.tracker.event("end_step")
        self.policy.end_step(self.tracker.step)
        self.tracker.step += 1

    def close(self) -> None:
        self.storage.close()

    # ------------------------------------------------------------------ prefetch

    def _prefetch(self) -> None:
        """Bring what the policy expects next towards the device, in next-use order: the next
        ``prefetch`` acquires onto the device, the ones after them from NVMe into host memory.
        A prefetch only evicts blocks the policy expects later than the block it brings."""
        if self.prefetch_depth <= 0:
            return
        ahead = self.policy.upcoming(2 * self.prefetch_depth)
        near = self.policy.upcoming(self.prefetch_depth)
        for i, (block_id, tier) in enumerate(ahead):
            block = self._blocks.get(block_id)
            if (block is None or not block.tiers or tier != DEVICE or DEVICE in block.tiers
                    or any(block.pins.values())):
                continue  # absent or discarded, not for the device, already there, or in use
            target = DEVICE if i < len(near) else HOST
            if target == HOST and HOST in block.tiers:
                continue
            horizon = self.policy.next_use(block_id, DEVICE)
            if not self._prefetch_one(block, target, horizon):
                break

    def _prefetch_one(self, block: Block, target: str, horizon: float) -> bool:
        steps = ([HOST] if HOST not in block.tiers else []) + ([DEVICE] if target == DEVICE else [])
        for tier in steps:
            self._in_flight.add(block)  # its staged host copy must survive making device room
            try:
                if not self._make_room(block, tier, horizon):
                    return False
            finally:
                self._in_flight.discard(block)
            src = HOST if tier == DEVICE else (DEVICE if DEVICE in block.tiers else NVME)
            start = self.tracker.now()
            self._replicate(block, src, tier, set(), prefetch=True)
            if tier == DEVICE:
                self.storage.on_device(block, True)
                self.tracker.prefetched.add(block.id)
            # Copies are synchronous for now, so compute waits for a prefetch too.
            self.tracker.stall(start, self.tracker.now(), block.id)
        self.tracker.prefetch_issued += 1
        return True

    def _make_room(self, block: Block, tier: str, horizon: float) -> bool:
        """Free room for ``block`` on ``tier`` by evicting only blocks needed after ``horizon``
        and after every block pinned there now."""
        t = self.tiers[tier]
        need = self._size_on(tier, block)
        if t.free >= need:
            return True
        # Blocks pinned now are released before ``block`` is used: a demand fetch at that moment
        # would evict them before anything needed sooner, so a prefetch must not evict what is
        # needed before them either (it would only move the miss, and cost a fetch).
        horizon = max([horizon] + [self.policy.next_use(b.id, tier) for b in self._on[tier]
                                   if b.pins.get(tier) and b is not block])
        while t.free < need:
            victims = [self._info(b) for b in self._on[tier] if self._evictable(b, tier, {block})
                       and self.policy.next_use(b.id, tier) > horizon]
            if not victims:
                return False
            self._evict(self._blocks[self.policy.victim(tier, victims).id], tier)
        return True

    # ------------------------------------------------------------------ internals

    def _info(self, block: Block) -> BlockInfo:
        return BlockInfo(block.id, block.kind, block.nbytes, clean_below=len(block.tiers) > 1)

    def _size_on(self, tier: str, block: Block) -> int:
        """Bytes ``block`` takes from ``tier``'s budget: whole slots below the device."""
        return block.nbytes if tier == DEVICE else slots_for(block.nbytes, self.slot_size) * self.slot_size

    def _fetch(self, block: Block, tier: str, protect: set[Block]) -> None:
        """Make a valid copy of ``block`` on ``tier`` (host or device). ``protect`` are the other
        blocks of the same acquire: they are not evicted from ``tier`` to make room."""
        if tier in block.tiers:
            return
        assert tier != NVME, "blocks reach NVMe only by eviction"
        if tier == DEVICE and HOST not in block.tiers:  # NVMe -> device goes through host
            self._fetch(block, HOST, set())
        src = HOST if tier == DEVICE else (DEVICE if DEVICE in block.tiers else NVME)
        start = self.tracker.now()
        self._replicate(block, src, tier, protect)
        if tier == DEVICE:
            self.storage.on_device(block, True)
        self.tracker.stall(start, self.tracker.now(), block.id)

    def _evictable(self, b: Block, tier: str, protect: set[Block]) -> bool:
        if tier not in b.tiers or b.pins.get(tier) or b in protect or b in self._in_flight:
            return False
        below = TIER_ORDER[TIER_ORDER.index(tier) + 1:]
        return len(b.tiers) > 1 or any(t in self.tiers for t in below)

    def _alloc(self, block: Block, tier: str, protect: set[Block]) -> None:
        """Reserve space for ``block`` on ``tier``, evicting as needed: policy-chosen victims while
        bytes are short, then (for a block spanning several slots) the cheapest contiguous run."""
        t = self.tiers.get(tier)
        if t is None:
            raise HeteroOOMError(self._oom_message(block, tier, "that tier is not enabled"))
        need = self._size_on(tier, block)
        if need > t.capacity:
            raise HeteroOOMError(self._oom_message(block, tier, "the block is larger than the budget"))
        while True:
            if t.free >= need and self.storage.place(block, tier):
                t.reserve(need)
                self.tracker.used(tier, t.used)
                return
            if t.free < need:
                victims = [self._info(b) for b in self._on[tier] if self._evictable(b, tier, protect)]
                if not victims:
                    raise HeteroOOMError(self._oom_message(block, tier, "every block there is in use"))
                self._evict(self._blocks[self.policy.victim(tier, victims).id], tier)
                continue
            windows = [w for w in (p.window(block.nbytes, lambda b: self._evictable(b, tier, protect))
                                   for p in self.storage.pools(tier)) if w is not None]
            if not windows:
                raise HeteroOOMError(self._oom_message(
                    block, tier, f"no run of {need} contiguous bytes can be freed around blocks in use"))
            for victim in min(windows, key=len):
                self._evict(victim, tier)

    def _evict(self, block: Block, tier: str) -> None:
        """Remove ``block``'s copy from ``tier``, first writing it one tier down if it is the
        only copy (making room there recursively)."""
        if block.tiers == {tier}:
            self._replicate(block, tier, TIER_ORDER[TIER_ORDER.index(tier) + 1], set())
        self._free(block, tier)

    def _replicate(self, block: Block, src: str, dst: str, protect: set[Block],
                   prefetch: bool = False) -> None:
        """Give ``block`` a copy on ``dst`` made from ``src``; on failure nothing has changed."""
        self._in_flight.add(block)
        try:
            self._alloc(block, dst, protect)
            start = self.tracker.now()
            try:
                self.storage.copy(block, src, dst)
            except BaseException:
                self._free(block, dst, present=False)
                raise
            self.tracker.move(block.id, src, dst, block.nbytes, start, self.tracker.now(), prefetch)
        finally:
            self._in_flight.discard(block)
        self._add_copy(block, dst)

    def _add_copy(self, block: Block, tier: str) -> None:
        block.tiers.add(tier)
        self._on[tier][block] = None

    def _free(self, block: Block, tier: str, present: bool = True) -> None:
        if tier == DEVICE and present:
            self.storage.on_device(block, False)
        self.storage.free(block, tier)
        block.tiers.discard(tier)
        self._on[tier].pop(block, None)
        t = self.tiers[tier]
        t.release(self._size_on(tier, block))
        self.tracker.used(tier, t.used)

    def _oom_message(self, block: Block, tier: str, why: str) -> str:
        tiers = ", ".join(f"{n}: {format_size(t.used)} used of {format_size(t.capacity)} "
                          f"({format_size(sum(self._size_on(n, b) for b in self.blocks() if b.pins.get(n)))} pinned)"
                          for n, t in self.tiers.items())
        return (f"cannot place block {block.id} ({format_size(block.nbytes)}) on the {tier} tier: {why}. "
                f"Tiers: {tiers}. Raise device_budget/host_budget, or set nvme_path to add an NVMe tier.")
