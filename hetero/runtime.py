"""The placement engine: the only code that allocates, moves, evicts and accounts model state.

Hooks and the optimizer ask for blocks with :meth:`Runtime.acquire` (which pins them on a tier
until :meth:`Runtime.release`); everything else happens here. Invariants kept at every instant:

* each tier's ``used`` never exceeds its budget (``Tier.reserve`` asserts it);
* every copy listed in ``block.tiers`` is valid; a write drops all other copies first;
* a pinned copy is never evicted.

Copies between tiers are synchronous for now; the accesses, moves and stalls are recorded in a
:class:`~hetero.tracker.Tracker` for the report.
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional, Sequence

import torch

from .chunks import EXP_AVG, PARAM, Block, Chunk
from .config import Config, format_size
from .errors import HeteroOOMError
from .policy import BlockInfo, Policy
from .tiers import (DEVICE, HOST, NVME, TIER_ORDER, HostArena, SwapSpace, Tier, slot_size_for,
                    slots_for)
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
    def __init__(self, cfg: Config, chunks: Sequence[Chunk], policy: Policy) -> None:
        self.device = cfg.device
        self.chunks = list(chunks)
        self.policy = policy
        self.tracker = Tracker()
        self.tiers: dict[str, Tier] = {DEVICE: Tier(DEVICE, cfg.device_budget),
                                       HOST: Tier(HOST, cfg.host_budget)}
        sizes = expected_block_bytes(chunks)
        self.slot_size = slot_size_for(cfg.chunk_size, sizes)
        # The arena holds what the host budget allows, and no more than the whole state.
        needed = sum(slots_for(n, self.slot_size) for n in sizes)
        self.arena = HostArena(min(cfg.host_budget // self.slot_size, needed), self.slot_size,
                               pin=cfg.device.type == "cuda")
        self.swap: Optional[SwapSpace] = None
        self._in_flight: set[Block] = set()  # blocks whose copy is being made: never victims
        if cfg.nvme_path is not None:
            self.tiers[NVME] = Tier(NVME, cfg.nvme_budget)
            self.swap = SwapSpace(cfg.nvme_path, cfg.nvme_budget, self.slot_size, max(sizes, default=0))

    # ------------------------------------------------------------------ queries

    def blocks(self) -> Iterable[Block]:
        for c in self.chunks:
            yield from c.blocks.values()

    def top(self, block: Block) -> str:
        """The fastest tier holding a valid copy of ``block``."""
        return min(block.tiers, key=TIER_ORDER.index)

    def data(self, block: Block, tier: str) -> torch.Tensor:
        """The flat, typed tensor of ``block`` on ``tier`` (which must hold a copy)."""
        assert tier in block.tiers, f"{block} has no copy on {tier}"
        if tier == DEVICE:
            return block.device
        assert tier == HOST, "NVMe copies are not addressable; acquire the block on host first"
        return self.arena.view(block.host_offset, block.nbytes)[:block.nbytes].view(block.dtype)

    def free_bytes(self) -> dict[str, int]:
        return {name: t.free for name, t in self.tiers.items()}

    # ------------------------------------------------------------------ public operations

    def create(self, block: Block, init: Optional[torch.Tensor] = None) -> None:
        """Give a new block its first home (chosen by the policy) and fill it from ``init``.

        ``init`` is a flat tensor of the block's dtype on any device; ``None`` zero-fills.
        """
        assert not block.tiers, f"{block} already exists"
        tier = self.policy.home(self._info(block), self.free_bytes())
        first = HOST if tier == NVME else tier  # NVMe is written from a host slot
        self._alloc(block, first, protect={block})
        block.tiers.add(first)
        with torch.no_grad():
            dst = self.data(block, first)
            if init is None:
                dst.zero_()
            else:
                dst.copy_(init.reshape(-1))
        if block.kind == PARAM:
            if first == DEVICE:
                block.chunk.attach_params()
            else:
                block.chunk.detach_params()
        if tier == NVME:
            self._evict(block, HOST)

    def acquire(self, blocks: Sequence[Block], tier: str = DEVICE, write: bool = False,
                record: bool = True) -> None:
        """Pin valid copies of ``blocks`` on ``tier``, fetching and evicting as needed.

        Records one access per block (``record=False`` for reads that are not compute, such as
        ``state_dict``). With ``write`` every other copy is dropped, because the
        caller is about to change the data. Raises HeteroOOMError when the tier cannot hold them.
        """
        protect = set(blocks)
        for block in blocks:
            self._fetch(block, tier, protect)
            block.pins[tier] = block.pins.get(tier, 0) + 1
            if record:
                seq = self.tracker.access(block.id, block.nbytes, tier)
                self.policy.record(block.id, self.tracker.step, seq)
            if write:
                for other in list(block.tiers - {tier}):
                    assert not block.pins.get(other), f"{block} is written on {tier} while pinned on {other}"
                    self._free(block, other)

    def release(self, blocks: Sequence[Block], tier: str = DEVICE) -> None:
        for block in blocks:
            n = block.pins.get(tier, 0)
            assert n > 0, f"{block} released on {tier} without being acquired"
            block.pins[tier] = n - 1

    def prefetch(self, blocks: Sequence[Block]) -> int:
        """Bring ``blocks`` to the device where that needs no eviction; returns bytes fetched.

        A prefetch never evicts, so it can never push out something needed sooner.
        """
        fetched = 0
        for block in blocks:
            if DEVICE in block.tiers or HOST not in block.tiers:
                continue  # already there, or on NVMe only (staging it would need host room)
            if self.tiers[DEVICE].free < block.nbytes:
                break
            self._fetch(block, DEVICE, protect={block}, stall=False)
            fetched += block.nbytes
        return fetched

    def working_tier(self, block: Block) -> str:
        """Where compute that reads ``block`` in place should run: its fastest copy, or host for a
        block that is only on NVMe."""
        top = self.top(block)
        return HOST if top == NVME else top

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

    def unpin_all(self) -> None:
        """Forget every pin (after an exception abandoned a forward or backward half-way)."""
        for block in self.blocks():
            block.pins.clear()

    def end_step(self) -> None:
        self.tracker.step += 1

    def close(self) -> None:
        if self.swap is not None:
            self.swap.close()

    # ------------------------------------------------------------------ internals

    def _info(self, block: Block) -> BlockInfo:
        return BlockInfo(block.id, block.kind, block.nbytes, clean_below=len(block.tiers) > 1)

    def _size_on(self, tier: str, block: Block) -> int:
        """Bytes ``block`` takes from ``tier``'s budget: whole slots below the device."""
        return block.nbytes if tier == DEVICE else slots_for(block.nbytes, self.slot_size) * self.slot_size

    def _fetch(self, block: Block, tier: str, protect: set[Block], stall: bool = True) -> None:
        """Make a valid copy of ``block`` on ``tier`` (host or device). ``protect`` are the other
        blocks of the same acquire: they are not evicted from ``tier`` to make room."""
        if tier in block.tiers:
            return
        assert block.tiers, f"{block} was never created"
        assert tier != NVME, "blocks reach NVMe only by eviction"
        if tier == DEVICE and HOST not in block.tiers:  # NVMe -> device goes through host
            self._fetch(block, HOST, set(), stall)
        src = HOST if tier == DEVICE else (DEVICE if DEVICE in block.tiers else NVME)
        start = self.tracker.now()
        self._replicate(block, src, tier, protect)
        if tier == DEVICE and block.kind == PARAM:
            block.chunk.attach_params()
        if stall:
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
            if t.free >= need and self._place(block, tier):
                t.reserve(need)
                self.tracker.used(tier, t.used)
                return
            if t.free < need:
                victims = [self._info(b) for b in self.blocks() if self._evictable(b, tier, protect)]
                if not victims:
                    raise HeteroOOMError(self._oom_message(block, tier, "every block there is in use"))
                self._evict(self._by_id(self.policy.victim(tier, victims).id), tier)
                continue
            window = self._window(block, tier, protect)
            if window is None:
                raise HeteroOOMError(self._oom_message(
                    block, tier, f"no run of {need} contiguous bytes can be freed around blocks in use"))
            for victim in window:
                self._evict(victim, tier)

    def _window(self, block: Block, tier: str, protect: set[Block]) -> Optional[list[Block]]:
        pools = [self.arena.pool] if tier == HOST else self.swap.pools
        windows = [w for w in (p.window(block.nbytes, lambda b: self._evictable(b, tier, protect))
                               for p in pools) if w is not None]
        return min(windows, key=len, default=None)

    def _place(self, block: Block, tier: str) -> bool:
        """Carve storage for ``block`` on ``tier``; False when no contiguous run of slots is free."""
        if tier == DEVICE:
            if block.device is None:
                block.device = torch.empty(block.numel, dtype=block.dtype, device=self.device)
            else:
                block.device.untyped_storage().resize_(block.nbytes)
            return True
        if tier == HOST:
            block.host_offset = self.arena.pool.alloc(block.nbytes, block)
            return block.host_offset is not None
        block.nvme_loc = self.swap.alloc(block.nbytes, block)
        return block.nvme_loc is not None

    def _evict(self, block: Block, tier: str) -> None:
        """Remove ``block``'s copy from ``tier``, first writing it one tier down if it is the
        only copy (making room there recursively)."""
        if block.tiers == {tier}:
            self._replicate(block, tier, TIER_ORDER[TIER_ORDER.index(tier) + 1], set())
        self._free(block, tier)

    def _replicate(self, block: Block, src: str, dst: str, protect: set[Block]) -> None:
        """Give ``block`` a copy on ``dst`` made from ``src``; on failure nothing has changed."""
        self._in_flight.add(block)
        try:
            self._alloc(block, dst, protect)
            try:
                self._copy(block, src, dst)
            except BaseException:
                self._free(block, dst, present=False)
                raise
        finally:
            self._in_flight.discard(block)
        block.tiers.add(dst)

    def _free(self, block: Block, tier: str, present: bool = True) -> None:
        if tier == DEVICE:
            if block.kind == PARAM and present:
                block.chunk.detach_params()
            block.device.untyped_storage().resize_(0)
        elif tier == HOST:
            self.arena.pool.free(block.host_offset, block.nbytes)
            block.host_offset = None
        else:
            self.swap.free(block.nvme_loc, block.nbytes)
            block.nvme_loc = None
        block.tiers.discard(tier)
        t = self.tiers[tier]
        t.release(self._size_on(tier, block))
        self.tracker.used(tier, t.used)

    def _copy(self, block: Block, src: str, dst: str) -> None:
        start = self.tracker.now()
        with torch.no_grad():
            if NVME in (src, dst):
                slot = self.arena.view(block.host_offset, block.nbytes)
                if dst == NVME:
                    self.swap.write(block.nvme_loc, slot).wait()
                else:
                    self.swap.read(block.nvme_loc, slot).wait()
            else:
                self._tensor(block, dst).copy_(self._tensor(block, src))
        self.tracker.move(block.id, src, dst, block.nbytes, start, self.tracker.now())

    def _tensor(self, block: Block, tier: str) -> torch.Tensor:
        if tier == DEVICE:
            return block.device
        return self.arena.view(block.host_offset, block.nbytes)[:block.nbytes].view(block.dtype)

    def _by_id(self, block_id: str) -> Block:
        chunk_index, kind = block_id[1:].split(".", 1)
        return self.chunks[int(chunk_index)].blocks[kind]

    def _oom_message(self, block: Block, tier: str, why: str) -> str:
        tiers = ", ".join(f"{n}: {format_size(t.used)} used of {format_size(t.capacity)} "
                          f"({format_size(sum(self._size_on(n, b) for b in self.blocks() if b.pins.get(n)))} pinned)"
                          for n, t in self.tiers.items())
        return (f"cannot place block {block.id} ({format_size(block.nbytes)}) on the {tier} tier: {why}. "
                f"Tiers: {tiers}. Raise device_budget/host_budget, or set nvme_path to add an NVMe tier.")
