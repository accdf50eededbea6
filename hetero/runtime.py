"""The placement engine: the only code that allocates, moves, evicts and accounts model state.

Hooks and the optimizer ask for blocks with :meth:`Runtime.acquire` (which pins them on a tier
until :meth:`Runtime.release`); everything else happens here.

Two views of every block are kept apart:

* the **logical** state — which tiers hold a valid copy (``block.tiers``), where (slots), what each
  tier's budget has reserved. It changes at once, as if every copy were instantaneous, so every
  decision (victims, prefetch, homes) is the same as in a synchronous run and the simulator, which
  replays the same code over tensor-free storage, reproduces a run's traffic exactly.
* the **physical** transfers — an :class:`~hetero.transfers.Op` per copy, run by the copy engine
  (host <-> device) or the swap engine (host <-> NVMe) while compute goes on. An op starts only
  when every earlier op it conflicts with has finished (the same block; a slot it overwrites that
  an earlier op still reads or writes; evictions still giving back memory of its tier, as many as
  the tier would be over budget by if all were undone; see :class:`~hetero.transfers.InFlight`),
  so a slot is reused only after the transfer out of it completed and device memory in use never
  exceeds the device budget, even when failed evictions are undone.
  Compute waits only in :meth:`acquire`, for the blocks it asked for; that wait is the stall time.
  Host-side work on blocks can be an op too (:meth:`defer`: the optimizer's CPU step of a chunk,
  on :class:`hetero.optim.queue.AdamQueue`), so it runs off the training thread while the next
  forward goes on, and whatever touches those blocks next waits for it through the same conflict
  rules.

Invariants kept at every instant:

* each tier's ``used`` never exceeds its budget (``Tier.reserve`` asserts it);
* every copy listed in ``block.tiers`` is valid once the block's ops have finished; a write drops
  all other copies first;
* a pinned copy is never evicted.

A failed transfer (``HeteroIOError``) is undone before the error propagates: ops that depended on
it are cancelled, and the logical changes of the failed and cancelled ops are reverted newest
first, so every block again has valid copies where the runtime says (see :meth:`_recover`). With
:meth:`transaction`, writes also keep the block's previous copy as a *shadow* until commit (a
shadow in host memory moves to NVMe when the host needs the room), so a whole optimizer step can
be rolled back (see :mod:`hetero.optim.adam`).

Decisions come from a pure :class:`~hetero.policies.Policy` (a custom one's answers checked before
they are acted on: :mod:`hetero.policycheck`); bytes are moved by a storage object
(:class:`TierStorage` for real, :class:`~hetero.simulator.SimStorage` in the simulator). Every call
is recorded in the tracker's event log, which the simulator replays, and so is every transfer that
failed, with where the run found it failed (:meth:`Runtime._found_failure`): the only outcome of a
transfer that changes later decisions.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import math
import os
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch

from .chunks import EXP_AVG, Block, Chunk
from .config import Config, exact_size, raise_budget_advice
from .errors import HeteroIOError, HeteroOOMError, HeteroStateError
from .interrupts import critical
from .policies import BlockInfo, Policy
from .policycheck import hooks, policy_error
from .tiers import (DEVICE, HOST, NVME, TIER_ORDER, HostArena, SlotPool, SwapSpace, Tier, TierStorage,
                    is_small, slot_cost, slot_size_for, slots_for, whole_units)
from .tracker import Tracker
from .transfers import Deferred, InFlight, Job, Op, regions
from .victims import Victims

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
                 prefetch: int = 0, host_slots: Optional[int] = None,
                 nvme_files: Optional[list[int]] = None) -> None:
        assert whole_units(slot_size), f"slot size {slot_size} is not whole units (see slot_size_for)"
        # (NVMe's room: the whole slots its swap files hold)
        self.tiers = {name: Tier(name, cap, sum(len(p.owner) for p in storage.pools(NVME)) * slot_size
                                 if name == NVME else None) for name, cap in capacities.items()}
        self.slot_size = slot_size
        # The host arena's size limit from the model state (None: the host budget alone): the
        # arena has min(host budget / slot, host_slots) slots, which the simulator must know;
        # likewise the slots of each swap file (None: one pool of the NVMe budget).
        self.host_slots = host_slots
        self.nvme_files = nvme_files
        self.policy = policy
        self._ask = hooks(policy)  # the hooks whose answers it acts on (a custom policy's checked)
        self._victims = Victims(policy)
        self._sizes: dict[str, int] = {}
        self._kinds: dict[str, str] = {}
        self._chunks: dict[str, str] = {}
        policy.sizes, policy.kinds, policy.chunks = self._sizes, self._kinds, self._chunks
        self.storage = storage
        self.prefetch_depth = prefetch
        self.tracker = Tracker()
        self._blocks: dict[str, Block] = {}
        self._on: dict[str, dict[Block, None]] = {name: {} for name in capacities}  # copies per tier
        self._pinned: dict[str, dict[Block, None]] = {name: {} for name in capacities}  # pins > 0 there
        self._placing: set[Block] = set()  # blocks being placed right now: never victims
        # Tiers below each tier that this runtime has, and the two BlockInfo each block can show
        # a policy (clean below or not): every eviction describes every candidate.
        self._below = {t: tuple(u for u in TIER_ORDER[TIER_ORDER.index(t) + 1:] if u in self.tiers)
                       for t in TIER_ORDER}
        self._infos: dict[tuple[str, bool], BlockInfo] = {}
        self._ops = InFlight(slot_size)  # issued and not yet finished
        self._seq = itertools.count()
        self._txn: Optional[_Transaction] = None
        self.prefetching = True
        self._prefetching_now = False
        self._protected: set[Block] = set()
        # Blocks whose NVMe copy was never written and reads as zeros (new optimizer states homed
        # there): a fetch fills the host copy instead of reading the disk.
        self._zero: set[Block] = set()
        # Host copies a prefetch or hint brought up from NVMe that nothing has used since (this
        # step): the host headroom leaves them, since writing one out would undo the fetch.
        self._staged: set[Block] = set()
        self._evicting_from_device = 0  # device evictions in progress (each may place a block on the host)
        # Work postponed per chunk (the optimizer's updates that must move data), run before
        # anything touches one of the chunk's blocks: see postpone().
        # chunk id -> (run, needs, when it was postponed: the order in which the forward needs it)
        self._postponed: dict[str, tuple[Callable[[], None], Callable[[], tuple[list[Block], str]], int]] = {}
        self._catching_up = False
        self._postpone_seq = itertools.count()
        self._last_at = -1  # when the postponed work that ran (runs) last was postponed
        self._failure: Optional[BaseException] = None  # found by a release, raised by the next pump
        # Where a failed transfer was found, so that a replay fails it at the same point (see
        # _found_failure): copies issued per block, and the pumps since the last event.
        self._copies_of: dict[str, int] = {}
        self._pumped_at = (0, 0)  # (events recorded, pumps since the last of them)
        self.closed = False  # (close(): nothing may move any more)
        self._pid = os.getpid()  # a forked child has none of this process's I/O threads

    @classmethod
    def for_chunks(cls, cfg: Config, chunks: Sequence[Chunk], policy: Policy) -> "Runtime":
        """The runtime of a wrapped model: real device buffers, a host arena, swap files."""
        sizes = expected_block_bytes(chunks)
        slot = slot_size_for(cfg.chunk_size, sizes)
        slots = [slots_for(n, slot) for n in sizes]
        needed = sum(slots)
        # The arena never exceeds what the state can use: every block once, plus a run for the
        # largest, so that with the whole state on the host a block spanning several slots still
        # finds room without evicting. (A transaction's shadows can need more; where the arena is
        # full they are given up, as where the budget is.)
        limit = needed + max(slots, default=0)
        arena = HostArena(min(cfg.host_budget // slot, limit), slot, pin=cfg.device.type == "cuda" and cfg.device)
        capacities = {DEVICE: cfg.device_budget, HOST: cfg.host_budget}
        swap = None
        if cfg.nvme_path is not None:
            capacities[NVME] = cfg.nvme_budget
            # Swap files are sized (and their space reserved) for what they can ever hold: the
            # whole state plus its shadows during an optimizer step — not the rest of the budget,
            # which defaults to most of the disk.
            swap = SwapSpace(cfg.nvme_path, min(cfg.nvme_budget, 2 * needed * slot), slot, max(sizes, default=0))
        return cls(capacities, slot, policy, TierStorage(cfg.device, arena, swap), cfg.prefetch, limit,
                   None if swap is None else swap.slots)

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
        """The flat, typed tensor of ``block`` on ``tier`` (which must hold a copy; valid while
        the block is acquired there)."""
        assert tier in block.tiers, f"{block} has no copy on {tier}"
        return self.storage.data(block, tier)

    def free_bytes(self) -> dict[str, int]:
        return {name: t.free for name, t in self.tiers.items()}

    def pinned_bytes(self, tier: str, besides: Sequence[Block] = ()) -> int:
        """Bytes of the blocks held on ``tier`` now, other than ``besides``."""
        on = self._on[tier]
        return sum(b.nbytes for b in self._pinned[tier] if b in on and b not in besides)

    @property
    def holds_pins(self) -> bool:
        """Whether any block is pinned anywhere."""
        return any(self._pinned.values())

    def _pin(self, block: Block, tier: str, delta: int) -> None:
        """Add ``delta`` to ``block``'s pins on ``tier``, keeping the index of pinned blocks."""
        n = block.pins.get(tier, 0) + delta
        assert n >= 0, f"{block} released on {tier} without being acquired"
        block.pins[tier] = n
        if n:
            self._pinned[tier][block] = None
        else:
            self._pinned[tier].pop(block, None)

    @property
    def in_flight(self) -> int:
        """Transfers issued and not finished yet."""
        return len(self._ops)

    # ------------------------------------------------------------------ public operations

    def create(self, block: Block, init: Optional[torch.Tensor] = None, tier: Optional[str] = None) -> None:
        """Give a new block its first home and fill it from ``init`` (a flat tensor of the
        block's dtype on any device; ``None`` zero-fills). The home is ``tier`` if given, else
        the policy's choice. A block homed on NVMe is made on the host and written there, or,
        zero-filled, only takes its NVMe slots (nothing is written, and its first fetch fills
        the host copy instead of reading); it stays on the host if NVMe has no room for it."""
        self.check_open()
        assert not block.tiers, f"{block} already exists"
        self._blocks[block.id] = block
        self._sizes[block.id] = block.nbytes
        self._kinds[block.id] = block.kind
        self._chunks[block.id] = block.chunk_id
        self.tracker.event("create", block.id, block.kind, block.nbytes, tier, init is None)
        if tier is None:
            tier = self._ask.home(self._info(block), self.free_bytes(),
                                  {n: t.capacity for n, t in self.tiers.items()})
            self._victims.invalidate()  # a home may change keys (opt: a chunk made resident)
        if tier == NVME and NVME not in self.tiers:
            tier = HOST  # no NVMe tier: as where NVMe has no room (see Policy.home)
        if tier == NVME and init is None and self._create_zero_on_nvme(block):
            return
        first = HOST if tier == NVME else tier  # NVMe is written from a host slot
        self._placing.add(block)
        try:
            try:
                self._alloc(block, first, set())
            except HeteroOOMError:
                # The policy chose by free bytes; a tier of fixed slots may still have no run for
                # the block. Another tier with room will do rather than failing the step.
                first = next((t for t in (DEVICE, HOST) if t != first and t in self.tiers
                              and self.tiers[t].free >= self._size_on(t, block)), None)
                if first is None:
                    raise
                tier = first
                self._alloc(block, first, set())
        finally:
            self._placing.discard(block)
        self._add_copy(block, first)
        if self._txn is not None:
            self._txn.created[block] = None
        # The memory may still be in use by transfers out of the blocks that had it before: the
        # fill is an op that starts after them (and is undone with them if one fails).
        fill = self._issue(block, None, first, None, self.storage.loc(block, first), False, False, init)
        self._wait_for([fill], stall=True)
        if tier == NVME:
            try:
                self._evict(block, HOST)
            except HeteroOOMError:  # NVMe has no room after all: the block stays where it was made
                log.debug("hetero: %s stays on the host: no room for it on NVMe", block.id)

    def _create_zero_on_nvme(self, block: Block) -> bool:
        """Give a new zero-filled block NVMe slots and nothing else (see :meth:`create`); False
        where NVMe has no room for it. The slots are claimed by an op that writes nothing but,
        as a write there would, waits for the ops still giving back the NVMe memory it takes
        (those reading its slots, and as many evictions as the budget needs): if one of those
        is undone, the claim is too, and the block is left with no copy, as a block whose
        creation failed (a zero-filled block is made again at its first use)."""
        try:
            self._alloc(block, NVME, set())
        except HeteroOOMError:
            return False
        self._add_copy(block, NVME)
        self._zero.add(block)
        if self._txn is not None:
            self._txn.created[block] = None
        self._issue(block, None, NVME, None, self.storage.loc(block, NVME), freed_src=False, prefetch=False)
        return True

    @critical
    def acquire(self, blocks: Sequence[Block], tier: str = DEVICE, write: bool = False,
                record: bool = True, changed: bool = False) -> None:
        """Pin valid copies of ``blocks`` on ``tier``, creating (zero-filled), fetching and
        evicting as needed, then prefetch what the policy expects next. Returns when the copies
        are there (the wait is recorded as stall time).

        Records one access per block (``record=False`` for reads that are not compute, such as
        ``state_dict``). With ``write`` every other copy is dropped (kept as the shadow inside a
        :meth:`transaction`), because the caller is about to change the data (``changed``: the
        caller, holding them pinned there, already changed them in place). Raises
        HeteroOOMError when the tier cannot hold them, HeteroIOError when a transfer failed.
        """
        self.check_open()
        self._pump()
        if self._postponed:
            self.catch_up({b.chunk_id for b in blocks})
            if self._failure is not None:  # found by the work's releases: raised before this acquire
                self._pump()  # does anything (as in a replay, where the work's calls are its own)
        for block in blocks:
            if not block.tiers:  # first use (or first since a discard): start where it is needed
                self.create(block, tier=tier)
        self.tracker.event("acquire", tuple(b.id for b in blocks), tier, write, record)
        self._staged.difference_update(blocks)
        protect = set(blocks)
        group = self.tracker.groups
        self.tracker.groups += 1
        pinned: list[Block] = []
        try:
            for block in blocks:
                if record and tier not in block.tiers:
                    self.tracker.misses += 1
                self._fetch(block, tier, protect)
                self._pin(block, tier, 1)
                pinned.append(block)
            for block in blocks:
                self._wait_block(block, stall=True)
            self._pump()  # start what the ops just finished were holding back
        except BaseException:
            for block in pinned:
                self._pin(block, tier, -1)
            raise
        for block in blocks:
            if tier == DEVICE:
                self.storage.on_device(block, True)
            if write:
                if not changed:  # (else the in-place change advanced the versions already)
                    self.storage.written(block)
                others = sorted(block.tiers - {tier}, key=TIER_ORDER.index)
                keep = self._txn.shadow_tier(block, others) if self._txn is not None else None
                if (self._txn is not None and keep is None and block not in self._txn.shadows
                        and block not in self._txn.created and block not in self._txn.lost):
                    self._txn.lose(block)
                    log.warning("hetero: %s is written with no older copy to keep; this update (an "
                                "optimizer step, a state-dict load) can no longer be undone if a "
                                "transfer fails", block.id)
                for other in others:
                    assert not block.pins.get(other), f"{block} is written on {tier} while pinned on {other}"
                    if other == keep:
                        self._shadow(block, other)
                    else:
                        self._free(block, other)
        if record:
            seq = self.tracker.access_count
            for block in blocks:
                self.tracker.access(block.id, block.nbytes, tier, group, write)
            self.policy.observe([b.id for b in blocks], tier, self.tracker.step, seq, write)
            self._victims.invalidate()
            if self.prefetching:
                self._prefetch()

    @critical
    def release(self, blocks: Sequence[Block], tier: str = DEVICE) -> None:
        self.tracker.event("release", tuple(b.id for b in blocks), tier)
        for block in blocks:
            self._pin(block, tier, -1)
        self._pump(raising=False)  # start the next stage of a multi-stage prefetch now

    @critical
    def read(self, block: Block) -> torch.Tensor:
        """A CPU copy of ``block``'s data, wherever it lives (not recorded as a compute access)."""
        tier = self.working_tier(block)
        self.acquire([block], tier, record=False)
        try:
            return self.data(block, tier).to("cpu", copy=True)
        finally:
            self.release([block], tier)

    @critical
    def write_all(self, groups: Iterable[Sequence[tuple[Block, torch.Tensor]]],
                  kept: Optional[set[str]] = None) -> None:
        """Overwrite blocks with new values, all or nothing: inside a :meth:`transaction`, each
        block's previous version is kept until every write, and every transfer the writes
        caused, has landed; a failure rolls them all back and raises. Each group (a chunk's
        blocks: its two moments, its master and parameter) is written as one: its blocks are
        acquired together, then all copied. Near capacity a previous version may find no room
        and be given up (logged, :meth:`ensure_shadow`); a failure then leaves the chunks that
        lost one as the writes made them or found them, each chunk consistent, and adds the ids
        of those written to ``kept``. ``groups`` may be a generator, read inside the transaction,
        so that only a group's values need exist at a time. Without an NVMe tier no write can
        fail half-way (only swap I/O fails), and none keeps a previous version."""
        if NVME not in self.tiers:
            for group in groups:
                self._write_group(group)
            return
        written: set[str] = set()
        txn = None
        try:
            with self.transaction() as txn:
                for group in groups:
                    blocks = [b for b, _ in group]
                    self.protect(blocks)  # a shadow copied for one must not make room for the next
                    try:
                        for block in blocks:
                            if block.tiers:
                                self.ensure_shadow(block, self.working_tier(block))
                        self._write_group(group)
                    finally:
                        self.protect(blocks, on=False)
                    written.update(b.chunk_id for b, _ in group)
                self.drain()
        except BaseException:
            if kept is not None and txn is not None:
                kept.update({b.chunk_id for b in txn.lost} & written)
            raise

    def _write_group(self, group: Sequence[tuple[Block, torch.Tensor]]) -> None:
        """Overwrite each block's data with its flat value (not recorded as a compute access):
        a block that does not exist yet is created with it; the others are acquired together on
        their working tiers, then copied into, so that a failed fetch among them leaves every
        block of the group as it was."""
        by_tier: dict[str, list[tuple[Block, torch.Tensor]]] = {}
        for block, value in group:
            if not block.tiers:
                self.create(block, value)
            else:
                by_tier.setdefault(self.working_tier(block), []).append((block, value))
        pinned: list[tuple[list[Block], str]] = []
        try:
            for tier, items in by_tier.items():
                blocks = [b for b, _ in items]
                self.acquire(blocks, tier, write=True, record=False)
                pinned.append((blocks, tier))
            with torch.no_grad():
                for tier, items in by_tier.items():
                    for block, value in items:
                        self.data(block, tier).copy_(value.reshape(-1))
        finally:
            for blocks, tier in pinned:
                self.release(blocks, tier)

    def discard(self, block: Block) -> None:
        """Drop every copy of ``block``: its contents are dead (gradients after zero_grad). The
        next acquire creates it afresh where it is needed, moving nothing."""
        if not block.tiers:
            return
        assert not any(block.pins.values()), f"{block} is discarded while in use"
        self.tracker.event("discard", block.id)
        for op in self._ops.of(block):
            op.restorable = False  # the data is dead: undoing a transfer never brings it back
        for tier in list(block.tiers):
            self._free(block, tier, restorable=False)

    def unpin_all(self) -> None:
        """Forget every pin (after an exception abandoned a forward or backward half-way)."""
        self.tracker.event("unpin_all")
        for block in self.blocks():
            block.pins.clear()
        for pinned in self._pinned.values():
            pinned.clear()

    def end_step(self) -> None:
        """A training step is complete: the runtime's own bookkeeping first, then the policy
        hears of it (:meth:`Policy.end_step`). Where the policy raises, the step still counts,
        and the error (:meth:`_after_step`) says so."""
        self.tracker.event("end_step")
        step = self.tracker.step
        self._staged.clear()
        self.tracker.next_step()
        self._after_step("end_step", self.policy.end_step, step)
        self._victims.invalidate()
        self._pump()

    def _after_step(self, hook: str, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)``: policy hook ``hook``, asked after an optimizer step was applied in
        full. Where it raises, the error says so (a HeteroStateError chained from the policy's),
        since running that step again would apply it twice."""
        try:
            return call(*args)
        except Exception as exc:
            self._victims.reset()  # the policy may have changed keys half-way
            what = str(exc) if isinstance(exc, HeteroStateError) else str(
                policy_error(self.policy, hook, f"raised {type(exc).__name__}: {exc}"))
            raise HeteroStateError(
                f"{what}. The optimizer step had been applied in full before the policy was asked "
                "(every parameter, optimizer state and step count is updated, and the step is "
                "counted): do not run that step again; fix the policy to go on training") from exc

    @critical
    def drain(self, stall: bool = False) -> None:
        """Wait for every transfer issued so far (HeteroIOError if one failed, after undoing it;
        one a release already undid raises first, with what was issued since maybe still in
        flight: drain again to wait for it); ``stall``: the wait is inside a training step (the
        optimizer's), recorded as stall time where something was still in flight."""
        self.tracker.event("drain")
        self._drain(stall)

    def _drain(self, stall: bool = False) -> None:
        """:meth:`drain`, not recorded: inside a runtime call that is an event of its own."""
        self._pump()  # (a failure a release found raises here)
        while self._ops:
            op = self._ops.first()
            assert op.pending, f"runtime bug: {op} left in flight"
            self._wait_for([op], stall)

    def check_open(self) -> None:
        if self.closed:
            raise HeteroStateError("this model was closed (HeteroModule.close()): its state can no "
                                   "longer be read, moved or trained; expected no use of the model "
                                   "or its optimizer after close() (its parameters stay hetero's "
                                   "placeholders: to train on, load a state_dict saved before close() "
                                   "into a new module and wrap that)")
        if os.getpid() != self._pid:
            raise HeteroStateError(
                f"this model was wrapped in process {self._pid}, and this is a child forked from it "
                "(os.fork, a fork-started worker): the threads that move its state exist only in "
                "the parent; expected the model used in the process that wrapped it (wrap one in "
                "the child, or start workers with the 'spawn' method)")

    @critical
    def close(self) -> None:
        """Drain, drop what is still postponed and remove the swap files; every later use of
        the model's state raises HeteroStateError. Idempotent. In a forked child it only
        marks the model closed: the swap files and the threads are the parent's."""
        self.closed = True
        if os.getpid() != self._pid:
            return
        if self._postponed:  # nothing can read the model once its swap files are gone
            log.debug("hetero: closing with %d postponed update(s) not run", len(self._postponed))
            self._postponed.clear()
        try:
            self._drain()
        except HeteroIOError as exc:
            log.warning("hetero: a transfer failed while closing: %s", exc)
        finally:
            for op in list(self._ops):  # deferred work left by a failure: let it end first
                if op.compute:
                    try:
                        op.handle.wait()
                    except Exception:  # noqa: BLE001 - reported by the wait that failed
                        pass
            self.storage.close(self.blocks())

    def defer(self, tier: str, reads: Sequence[Block], writes: Sequence[Block],
              start: Callable[[], Job]) -> None:
        """Start work that reads ``reads`` and writes ``writes`` on ``tier`` (host) off this
        thread (``start()`` submits it and returns its :class:`~hetero.transfers.Job`), and
        return at once. The caller holds all of them acquired on ``tier`` (so they are there,
        with no transfer pending) and may release them right away: each gets a compute op that
        every later transfer, acquire, eviction or slot reuse of the block waits for, like any
        op. Not recorded in the event log: it changes no placement, only when the bytes are
        ready. An exception of the work surfaces from the runtime call that waits for it."""
        assert tier == HOST, "deferred work runs on host copies"
        blocks = list(reads) + [b for b in writes if b not in reads]
        for b in blocks:
            assert b.pins.get(tier) and not self._ops.of(b), f"runtime bug: defer on {b}"
        handle = Deferred(start())
        for b in blocks:
            loc = self.storage.loc(b, tier)
            op = Op(next(self._seq), b, tier, tier if b in writes else None, loc, loc, False, False,
                    None, self.tracker.now(), self.slot_size, compute=True)
            op.handle, op.state = handle, "running"
            self._ops.add(op)

    def postpone(self, chunk_id: str, run: Callable[[], None],
                 needs: Callable[[], tuple[list[Block], str]], first: bool = False,
                 at: Optional[int] = None) -> None:
        """Run ``run`` (work on chunk ``chunk_id``'s blocks: the optimizer's update of a chunk
        whose state must move) later: before the first acquire, read or write of one of the
        chunk's blocks, or at :meth:`catch_up`; oldest first (``first``: before the others).
        The optimizer step returns at once, and the transfers of its updates overlap the next
        forward, which runs each one as it reaches the chunk while the blocks of the next are
        fetched (:meth:`hint_postponed`, from what it ``needs``: blocks and the tier). Until it
        runs, the policy's prefetch brings none of the chunk's blocks onto the device (the work
        rewrites them first; the hints and :meth:`settle` still move them), and its parameters
        read as NaN, as off the device: their device copy is stale. ``run`` must leave the chunk
        as before when it raises (HeteroIOError, HeteroOOMError): it stays postponed and runs
        again at the next touch (a failure rolls forward, not back), keeping its place ``at``
        in the order. :meth:`close` drops what is still postponed. Recorded in the event log,
        as is each run (a replay runs nothing: the work's own acquires are in the log)."""
        self.check_open()
        assert chunk_id not in self._postponed, f"runtime bug: {chunk_id} postponed twice"
        self.tracker.event("postpone", chunk_id, first)
        entry = (run, needs, next(self._postpone_seq) if at is None else at)
        if first:
            self._postponed = {chunk_id: entry, **self._postponed}
        else:
            self._postponed[chunk_id] = entry
        for block in needs()[0]:  # parameters it will rewrite must not read as current meanwhile
            self.storage.on_device(block, False)

    def postponed(self, chunk_id: str) -> bool:
        return chunk_id in self._postponed

    @critical
    def catch_up(self, chunk_ids: Optional[set[str]] = None) -> None:
        """Run the postponed work of ``chunk_ids`` (None: all of it), oldest first. One that
        raises stays postponed, and the error propagates."""
        if self._catching_up:
            return  # (the work running touches only its own chunk's blocks)
        for cid in [c for c in self._postponed if chunk_ids is None or c in chunk_ids]:
            run, needs, self._last_at = self._postponed.pop(cid)
            self.tracker.event("catch_up", (cid,))
            self._catching_up = True
            try:
                run()
            except BaseException:
                self.postpone(cid, run, needs, first=True, at=self._last_at)
                raise
            finally:
                self._catching_up = False

    def _up_next(self) -> list[str]:
        """The postponed work the forward is expected to reach next: at most ``2 * prefetch``
        pieces (a unit's chunks run back to back, so one ahead would be no lead), in the order
        it was postponed (the optimizer's: the forward's), after the work that ran last. Work
        older than that was passed by (a routed expert the forward skipped): it runs at the next
        step's catch-up, or at its chunk's next touch."""
        later = (c for c, (_, _, at) in self._postponed.items() if at > self._last_at)
        return heapq.nsmallest(max(1, 2 * self.prefetch_depth), later, key=self._order)

    def hint_postponed(self) -> None:
        """Start fetching what the work up next needs (:meth:`_up_next`), else what the oldest
        work needs."""
        if self._postponed:
            nxt = self._up_next() or [min(self._postponed, key=self._order)]
            self.hint([self._postponed[cid][1]() for cid in nxt])

    def _order(self, chunk_id: str) -> int:
        """When the work postponed for ``chunk_id`` was postponed."""
        return self._postponed[chunk_id][2]

    # ------------------------------------------------------------------ transactions

    @contextlib.contextmanager
    def transaction(self) -> Iterator["_Transaction"]:
        """All-or-nothing updates: inside, a write keeps the block's previous copy (on the tier
        below, where one exists) as a shadow instead of dropping it, and blocks created are noted.
        An exception rolls every written block back to its shadow and discards the created ones;
        leaving normally drops the shadows. A write to a block with no other copy is not covered:
        callers that need it must see to an older copy first (:meth:`ensure_shadow`)."""
        self.begin()
        try:
            yield self._txn
        except BaseException:
            self.rollback()
            raise
        self.commit()

    def begin(self) -> None:
        """Start a transaction (see :meth:`transaction`, which is how callers should use it)."""
        assert self._txn is None, "transactions do not nest"
        self.tracker.event("begin")
        self._txn = _Transaction()

    def commit(self) -> None:
        self.tracker.event("commit")
        txn, self._txn = self._txn, None
        for block, (tier, loc) in txn.shadows.items():
            self._release_shadow(block, tier, loc)
        txn.shadows.clear()  # (a shadow write still in flight that fails has nothing to restore)

    def rollback(self) -> None:
        self.tracker.event("rollback")
        txn, self._txn = self._txn, None
        self._rollback(txn)

    def hint(self, groups: Sequence[tuple[Sequence[Block], str]]) -> None:
        """Start bringing each group's blocks to its tier, in order, because the caller knows
        they are needed there next (the optimizer's next chunks), whatever the policy predicts:
        a recorded step the current one does not follow (the chunks that must move differ from
        step to step, routed experts) predicts nothing. Transfers are issued, not waited for;
        room is made only by evicting blocks the policy expects later than the hinted blocks up
        to and including the group's (in accesses), never one of the hinted blocks. Does nothing
        while prefetch is off; recorded in the event log."""
        self.tracker.event("hint", tuple((tuple(b.id for b in blocks), tier) for blocks, tier in groups))
        if not self.prefetching or self.prefetch_depth <= 0:
            return
        wanted = {b for blocks, _ in groups for b in blocks} - self._protected
        self._protected |= wanted
        try:
            ahead = 0
            for blocks, tier in groups:
                ahead += len(blocks)
                for block in blocks:
                    if not self._fetchable(block, tier):
                        continue
                    if not self._prefetch_one(block, tier, ahead):
                        return
        finally:
            self._protected -= wanted

    def settle(self, blocks: Sequence[Block]) -> None:
        """Ask the policy whether ``blocks`` should now live elsewhere (:meth:`Policy.settle`;
        the optimizer asks for the states it keeps below the device after each step, once the
        step's working set is known) and start bringing those it moves up. Speculative, like a
        prefetch: it uses free room only (host room to stage a block from NVMe, device room;
        only free host slots that are not contiguous make a placement clear a window), and a
        failed read surfaces from the next runtime call like a failed prefetch, with the step
        that asked complete. Recorded in the event log."""
        self.tracker.event("settle", tuple(b.id for b in blocks))
        if not self.prefetching or self.prefetch_depth <= 0:
            return
        capacity = {n: t.capacity for n, t in self.tiers.items()}
        for block in blocks:
            if not self._fetchable(block, DEVICE):  # (also: not discarded, not on the device yet)
                continue
            info = self._info(block)
            if self._after_step("settle", self._ask.settle, info, capacity) != DEVICE:
                continue
            if not self._prefetch_one(block, DEVICE, math.inf):
                return  # no free room: the blocks after it would not find any either
            self._after_step("settled", self.policy.settled, info, DEVICE)
            self._victims.invalidate()  # predicted uses on the device may have changed

    def set_prefetching(self, on: bool) -> None:
        """Turn prefetch off (on) for the acquires that follow."""
        self.tracker.event("prefetching", on)
        self.prefetching = on

    def ensure_shadow(self, block: Block, tier: str) -> bool:
        """Inside a transaction, make sure a write of ``block`` on ``tier`` will keep an older copy:
        if its only copy is on ``tier``, copy it one tier down first (HeteroOOMError if there is
        no room). False when there is no tier below to hold one. A block the transaction created
        needs none (a rollback discards it), nor one already lost (it keeps its latest value)."""
        assert self._txn is not None
        self.tracker.event("ensure_shadow", block.id, tier)
        if (block in self._txn.shadows or block in self._txn.created or block in self._txn.lost
                or block.tiers - {tier} or not block.tiers):
            return True
        below = [t for t in TIER_ORDER[TIER_ORDER.index(tier) + 1:] if t in self.tiers]
        if not below:
            return False
        try:
            self._replicate(block, tier, below[0], {block})
        except HeteroOOMError:
            self._txn.lose(block)
            log.warning("hetero: no room for the previous version of %s; this update (an optimizer "
                        "step, a state-dict load) can no longer be undone if a transfer fails", block.id)
            return False
        return True

    def _shadow(self, block: Block, tier: str) -> None:
        """Stop counting ``block``'s copy on ``tier`` as valid but keep its memory and budget (host
        and NVMe slots under a placeholder owner; a device buffer, which the block does not get
        back on the device until the transaction ends): the pre-write version for a rollback."""
        loc = self.storage.loc(block, tier)
        self._txn.shadows[block] = (tier, loc)
        if tier == NVME and block in self._zero:  # the shadow reads as zeros too
            self._zero.discard(block)
            self._txn.zero.add(block)
        self._remove_copy(block, tier)
        if tier == DEVICE:
            self.storage.on_device(block, False)
        else:
            self.storage.forget(block, tier)
            self.storage.adopt(block, tier, loc, owner=_Shadow(block))

    def _drop_shadow(self, tier: str) -> bool:
        """Make room on ``tier`` by moving a shadow there one tier down (host to NVMe, where it
        fits) or, failing that, by giving it up: the transaction goes on, but can no longer undo
        that block (logged once per transaction)."""
        txn = self._txn
        if txn is None or self._prefetching_now:  # never give up a shadow for a prefetch
            return False
        found = next(((b, loc) for b, (t, loc) in txn.shadows.items() if t == tier), None)
        if found is None:
            return False
        block, loc = found
        if tier == HOST and self._demote_shadow(txn, block, loc):
            return True
        self._give_up_shadow(block)
        return True

    def _give_up_shadow(self, block: Block) -> None:
        """Drop ``block``'s shadow: the transaction goes on, but can no longer undo that block
        (logged once per transaction)."""
        txn = self._txn
        tier, loc = txn.shadows.pop(block)
        txn.zero.discard(block)
        self._release_shadow(block, tier, loc)
        if txn.complete:
            log.warning("hetero: no room on the %s tier for the previous versions of the blocks an "
                        "optimizer step writes; this step can no longer be undone if a transfer fails "
                        "(give the %s tier more room to keep steps all-or-nothing)", tier, tier)
        txn.lose(block)

    def _demote_shadow(self, txn: "_Transaction", block: Block, loc: Any) -> bool:
        """Write ``block``'s host shadow at ``loc`` to free NVMe slots and give the host slots
        up (they are free for the next placement at once; a transfer into them waits for the
        write). False when NVMe has no room. If the write fails, :meth:`_recover` puts the shadow
        back on the host (:meth:`_undo_demotion`), so the transaction can still roll back."""
        nvme = self.tiers.get(NVME)
        need = self._size_on(NVME, block)
        if nvme is None or nvme.free < need:
            return False
        dst = self.storage.hold_nvme(block.nbytes, _Shadow(block))
        if dst is None:
            return False
        self._reserve(block, NVME)
        txn.shadows[block] = (NVME, dst)
        self._release_shadow(block, HOST, loc)
        self.tracker.count(block.id, HOST, NVME, block.nbytes, False)
        op = self._issue(block, HOST, NVME, loc, dst, freed_src=True, prefetch=False)
        op.shadow = txn
        log.debug("hetero: moved the previous version of %s to NVMe to make room on the host", block.id)
        return True

    def _undo_demotion(self, op: Op) -> None:
        """Revert a failed :meth:`_demote_shadow`: the host slots it read were never overwritten
        (every transfer into them depended on it and was undone first). Nothing to put back if
        the transaction gave that shadow up since (NVMe needed its room) or has ended."""
        block, txn = op.block, op.shadow
        if txn.shadows.get(block) != (NVME, op.dst_loc):
            return
        self._release_shadow(block, NVME, op.dst_loc)
        self.storage.adopt(block, HOST, op.src_loc, owner=_Shadow(block))
        self._reserve(block, HOST)
        txn.shadows[block] = (HOST, op.src_loc)

    def _release_shadow(self, block: Block, tier: str, loc: Any) -> None:
        if tier == DEVICE:
            self.storage.release(block, DEVICE)
        else:
            self.storage.forget_at(tier, loc, block.nbytes)
        self._unreserve(block, tier)

    def _rollback(self, txn: "_Transaction") -> None:
        """Put every block written in ``txn`` back to its shadow; discard blocks it created. A
        chunk with a block that cannot be undone (``lost``) keeps the transaction's writes in all
        its blocks instead, so that they stay consistent with each other (new parameters with
        new moments, not old ones)."""
        try:
            self._drain()
        except HeteroIOError:
            self._drain()  # _recover undid the failure; wait for the rest
        kept = {b.chunk_id for b in txn.lost}
        for block in txn.created:
            if block.chunk_id not in kept:
                for tier in list(block.tiers):
                    self._free(block, tier)
        for block, (tier, loc) in txn.shadows.items():
            if block.chunk_id in kept:
                self._release_shadow(block, tier, loc)
                continue
            for other in list(block.tiers):
                self._free(block, other)
            if tier != DEVICE:
                self.storage.forget_at(tier, loc, block.nbytes)
                self.storage.adopt(block, tier, loc)
            self._add_copy(block, tier)
            if block in txn.zero:
                self._zero.add(block)
        self._drain()
        log.info("hetero: transaction rolled back (%d blocks restored, %d created blocks dropped)",
                 len(txn.shadows), len(txn.created))

    # ------------------------------------------------------------------ prefetch

    def _prefetch(self) -> None:
        """Bring what the policy expects next towards where it is needed, in next-use order: the
        next ``prefetch`` acquires onto their tier, the ones after them from NVMe into host
        memory. A prefetch only evicts blocks the policy expects later than the block it brings.
        A block the next acquires create on the device gets its room made the same way (and kept
        from the fetches after it), so its creation waits for no write-back. Transfers are
        issued and not waited for. Then host memory above NVMe gets its headroom back
        (:meth:`_keep_host_headroom`). Nothing to do while every copy is on the device (a model
        within its device budget): the tiers below hold nothing then."""
        if self.prefetch_depth <= 0 or not any(self.tiers[t].used for t in self._below[DEVICE]):
            return
        ahead = self._ask.upcoming(2 * self.prefetch_depth)
        near = None  # how many of them the next ``prefetch`` acquires make up (asked when needed)
        made = 0  # device bytes freed for blocks the next acquires create: later fetches leave them
        for i, (block_id, tier) in enumerate(ahead):
            block = self._blocks.get(block_id)
            if block is None or tier == NVME:
                continue
            creating = not block.tiers  # made anew where it is used (a gradient zero_grad freed)
            if creating and tier != DEVICE:
                continue
            if not creating and not self._fetchable(block, tier):
                continue
            if near is None:
                near = len(self._ask.upcoming(self.prefetch_depth))
            if creating:
                if i < near:
                    if not self._make_room_ahead(block, self._ask.next_use(block_id, tier), made):
                        break
                    made += block.nbytes
                continue
            target = tier if i < near else HOST
            if target == HOST and HOST in block.tiers:
                continue
            if target == DEVICE and block.chunk_id in self._postponed:
                continue  # the chunk's postponed work runs first, and rewrites it elsewhere
            horizon = self._ask.next_use(block_id, tier)
            if not self._prefetch_one(block, target, horizon, keep=made):
                break
        self._keep_host_headroom(len(ahead))

    def _fetchable(self, block: Block, tier: str) -> bool:
        """Whether a speculative fetch of ``block`` to ``tier`` has work to do and may do it: not
        for a discarded block, one already there, one in use, or one holding a shadow."""
        return bool(block.tiers) and tier not in block.tiers and not any(block.pins.values()) and not (
            self._txn is not None and block in self._txn.shadows)

    def _speculate(self, work: Callable[[], bool]) -> bool:
        """Run ``work``, moves nobody waits for yet (a prefetch, room made ahead): it never gives
        up a transaction's shadow, even in the write-backs its evictions cause, and where room
        cannot be made (no room below for a victim, no contiguous run free) it is False instead
        of a HeteroOOMError."""
        self._prefetching_now = True
        try:
            return work()
        except HeteroOOMError:
            return False
        finally:
            self._prefetching_now = False

    def _prefetch_one(self, block: Block, target: str, horizon: float, keep: int = 0) -> bool:
        """Issue the transfers that bring ``block`` to ``target``, leaving ``keep`` device bytes
        free; False (and nothing more issued) where room cannot be made. Speculative
        (:meth:`_speculate`)."""

        def bring() -> bool:
            for tier in ([HOST] if HOST not in block.tiers else []) + ([DEVICE] if target == DEVICE else []):
                self._placing.add(block)  # its staged host copy must survive making device room
                try:
                    if not self._make_room(block, tier, horizon, keep if tier == DEVICE else 0):
                        return False
                finally:
                    self._placing.discard(block)
                src = HOST if tier == DEVICE else (DEVICE if DEVICE in block.tiers else NVME)
                self._replicate(block, src, tier, set(), prefetch=True)
                if tier == DEVICE:
                    self.tracker.prefetched.add(block.id)
                elif src == NVME:
                    self._staged.add(block)
            return True

        if not self._speculate(bring):
            return False
        self.tracker.prefetch_issued += 1
        return True

    def _make_room_ahead(self, block: Block, horizon: float, keep: int) -> bool:
        """Evict now what the device must give up for ``block``, which the next acquires create
        there (a gradient made anew by the backward), beside ``keep`` bytes kept free for others:
        the write-backs then run while the current unit computes instead of holding up the
        creation. Like a prefetch, only blocks the policy expects later than ``horizon`` go, and
        it is False where that is not enough."""
        return self._speculate(lambda: self._make_room(block, DEVICE, horizon, keep))

    #: Host memory kept free above NVMe, in slots per unit of ``prefetch`` (and at most
    #: 1 / HEADROOM_SHARE of the host budget), and how far down the policy's ranking of host
    #: blocks a victim for it is looked for: see _keep_host_headroom.
    HEADROOM_SLOTS = 2
    HEADROOM_SHARE = 16
    HEADROOM_SCAN = 32

    def _keep_host_headroom(self, horizon: float) -> None:
        """Keep a little host memory free while NVMe is below it, by writing out now the blocks
        the policy expects last (only those needed after ``horizon`` accesses, the prefetch's
        window). Why: a block the device evicts is written back to the host. On a full host
        that write-back must first wait for an NVMe write to free a slot, and an acquire waiting
        for device room waits for both; with headroom the write-back lands at once. It matters
        where the device's evictions are not foreseen (a routed step's new gradients) and costs
        at most the headroom's bytes of host capacity. Never written out: a host copy a device
        copy falls back on (it would come back as a write-back) and one a prefetch or hint
        staged for a use still to come (``_staged``; policies without a future, ``lru`` and
        ``static``, would pick those first). Only the policy's first ``HEADROOM_SCAN`` choices
        are looked at: where those may not go, the blocks after them are ones it would rather
        keep, and every acquire would otherwise search the whole host tier in vain (a host full
        of device-backed copies). Speculative (:meth:`_speculate`)."""
        host = self.tiers.get(HOST)
        if host is None or NVME not in self.tiers:
            return
        need = min(self.HEADROOM_SLOTS * self.prefetch_depth * self.slot_size,
                   host.capacity // self.HEADROOM_SHARE)
        if host.free >= need:
            return
        later = lambda b: (DEVICE not in b.tiers and b not in self._staged  # noqa: E731
                           and self._evictable(b, HOST, set()) and self._ask.next_use(b.id, HOST) > horizon)
        self._speculate(lambda: self._evict_until(HOST, need, later, self.HEADROOM_SCAN))

    def _make_room(self, block: Block, tier: str, horizon: float, keep: int = 0) -> bool:
        """Free room for ``block`` on ``tier`` (beside ``keep`` more bytes, on the device) by
        evicting only blocks needed after ``horizon``: bytes of its budget, then (below the
        device) a free run of slots or units in which the placement cannot fail, so that the
        placement itself evicts nothing."""
        later = lambda b: self._evictable(b, tier, {block}) and self._ask.next_use(b.id, tier) > horizon  # noqa: E731
        if not self._evict_until(tier, self._size_on(tier, block) + keep, later):
            return False
        return tier == DEVICE or self._make_run(block, tier, later)

    def _evict_until(self, tier: str, need: int, eligible: Callable[[Block], bool],
                     within: Optional[int] = None) -> bool:
        """Evict the policy's victims among ``eligible`` blocks (among its first ``within``
        choices, see :meth:`Victims.choose <hetero.victims.Victims.choose>`) until ``tier`` has
        ``need`` bytes of its budget free; False where they run out first."""
        t = self.tiers[tier]
        while t.free < need:
            victim = self._victims.choose(tier, self._on[tier], self._info, eligible, within)
            if victim is None:
                return False
            self._evict(victim, tier)
        return True

    # ------------------------------------------------------------------ logical placement

    def _info(self, block: Block) -> BlockInfo:
        key = (block.id, len(block.tiers) > 1)
        info = self._infos.get(key)
        if info is None:  # a block's id, kind and size never change
            info = self._infos[key] = BlockInfo(block.id, block.kind, block.nbytes, clean_below=key[1])
        return info

    def _reserve(self, block: Block, tier: str) -> None:
        """Take ``block``'s bytes on ``tier`` (whole slots below the device) from its budget."""
        t = self.tiers[tier]
        t.reserve(self._size_on(tier, block))
        self.tracker.used(tier, t.used)

    def _unreserve(self, block: Block, tier: str) -> None:
        t = self.tiers[tier]
        t.release(self._size_on(tier, block))
        self.tracker.used(tier, t.used)

    def slot_bytes(self, nbytes: int) -> int:
        """Bytes a block of ``nbytes`` takes from the host or NVMe budget: whole slots, or units
        of a shared slot for a small block (:func:`~hetero.tiers.slot_cost`)."""
        return slot_cost(nbytes, self.slot_size)

    def _size_on(self, tier: str, block: Block) -> int:
        """Bytes ``block`` takes from ``tier``'s budget (:meth:`slot_bytes` below the device)."""
        return block.nbytes if tier == DEVICE else self.slot_bytes(block.nbytes)

    def _fetch(self, block: Block, tier: str, protect: set[Block]) -> None:
        """Give ``block`` a copy on ``tier`` (host or device), issuing the transfers.
        ``protect`` are the other blocks of the same acquire: they are not evicted from ``tier``."""
        if tier in block.tiers:
            return
        assert tier != NVME, "blocks reach NVMe only by eviction"
        assert not (tier == DEVICE and self._txn is not None and self._txn.shadows.get(block, ("",))[0] == DEVICE), (
            f"runtime bug: {block} is fetched to the device, which holds its shadow copy")
        if tier == DEVICE and HOST not in block.tiers:  # NVMe -> device goes through host
            self._fetch(block, HOST, set())
        src = HOST if tier == DEVICE else (DEVICE if DEVICE in block.tiers else NVME)
        self._replicate(block, src, tier, protect)

    def protect(self, blocks: Sequence[Block], on: bool = True) -> None:
        """Keep every copy of ``blocks`` from eviction (``on=False``: no longer), e.g. the older
        copies a transaction's writes will keep as shadows, while their chunk is being fetched."""
        self.tracker.event("protect", tuple(b.id for b in blocks), on)
        if on:
            self._protected.update(blocks)
        else:
            self._protected.difference_update(blocks)

    def _held(self, b: Block, tier: str, protect: set[Block]) -> bool:
        """Whether ``b``'s copy on ``tier`` must stay where it is: absent, pinned, protected, or
        being placed."""
        return bool(tier not in b.tiers or b.pins.get(tier) or b in protect or b in self._placing
                    or b in self._protected)

    def _evictable(self, b: Block, tier: str, protect: set[Block], up: bool = False) -> bool:
        """Whether ``b``'s copy on ``tier`` may go: it is not held and has another copy or a
        tier below to go to (``up``: or it may move up from a bottom host, :meth:`_promotable`)."""
        if self._held(b, tier, protect):
            return False
        return len(b.tiers) > 1 or bool(self._below[tier]) or (up and self._promotable(b, tier))

    def _may_lift(self, tier: str) -> bool:
        """``tier`` is the host and its blocks may move up now: not while the device is evicting
        (the two tiers would trade blocks back and forth)."""
        return tier == HOST and not self._evicting_from_device

    def _bottom_host(self, tier: str) -> bool:
        """``tier`` is a host tier with no NVMe below it whose blocks may move up now."""
        return self._may_lift(tier) and not self._below[HOST]

    def _promotable(self, b: Block, tier: str) -> bool:
        """Whether ``b``, whose only copy is on ``tier``, may leave it upwards: a full host whose
        blocks cannot go down makes room by moving a block into free device room, never by
        evicting on the device; and never a block that has a transaction's shadow (which may be
        its own device memory)."""
        return (self._may_lift(tier) and self.tiers[DEVICE].free >= b.nbytes
                and not (self._txn is not None and b in self._txn.shadows))

    def _lift(self, tier: str, protect: set[Block]) -> bool:
        """Where the host's victims cannot go down (NVMe is full of blocks that have no other
        copy), make host room as a host with no NVMe does: move a block up into free device room,
        dropping clean device copies for that room if they make enough. Inside a transaction,
        shadows on the device are given up only where that moves a block (their blocks' writes
        can no longer be undone): first a block whose own shadow is the device memory it moves
        into (one shadow for one block), else the largest shadows until a block fits. False
        where none of this can be done (or ``tier`` is not the host); then nothing was dropped."""
        if not self._may_lift(tier):
            return False
        device, txn = self.tiers[DEVICE], self._txn
        shadows = txn.shadows if txn is not None and not self._prefetching_now else {}
        candidates = [b for b in self._on[tier] if b.tiers == {tier} and not self._held(b, tier, protect)]
        free = [b for b in candidates if txn is None or b not in txn.shadows]
        smallest = min((b.nbytes for b in free), default=None)
        clean = sum(b.nbytes for b in self._on[DEVICE] if len(b.tiers) > 1 and self._evictable(b, DEVICE, set()))
        own = [b for b in candidates if shadows.get(b, ("",))[0] == DEVICE]
        given = sorted((b for b, (t, _) in shadows.items() if t == DEVICE), key=lambda b: -b.nbytes)
        if smallest is not None and device.free + clean >= smallest:
            while device.free < smallest and self._room_to_promote(tier):
                pass
        elif own:
            victim = self._victims.choose(tier, self._on[tier], self._info, lambda b: b in own)
            self._give_up_shadow(victim)
            self._replicate(victim, tier, DEVICE, set(), evict=True)
            return True
        elif smallest is not None and device.free + clean + sum(b.nbytes for b in given) >= smallest:
            while device.free < smallest and self._room_to_promote(tier):
                pass
            for b in given:
                if device.free >= smallest:
                    break
                self._give_up_shadow(b)
        else:
            return False
        victim = self._victims.choose(tier, self._on[tier], self._info,
                                      lambda b: b in free and self._promotable(b, tier))
        self._replicate(victim, tier, DEVICE, set(), evict=True)
        return True

    def _no_room_below(self, tier: str, protect: set[Block]) -> bool:
        """The policy's victim on ``tier`` found no room on the tiers below (full of blocks that
        cannot leave them): make room on ``tier`` another way, cheapest first. Drop a copy there
        that has another one (no write); from the host, move a block up (:meth:`_lift`); give
        up a transaction's shadow on ``tier``. (The failed attempt below may already have given
        up shadows there.) False where none can be done."""
        clean = self._victims.choose(tier, self._on[tier], self._info,
                                     lambda b: len(b.tiers) > 1 and not self._held(b, tier, protect))
        if clean is not None:
            self._free(clean, tier)
            return True
        return self._lift(tier, protect) or self._drop_shadow(tier)

    def _victim(self, tier: str, protect: set[Block]) -> Optional[Block]:
        """The policy's victim on ``tier``; a block that would move up (:meth:`_promotable`) only
        when no other can go."""
        for up in (False, True):
            victim = self._victims.choose(tier, self._on[tier], self._info,
                                          lambda b: self._evictable(b, tier, protect, up))
            if victim is not None or not self._bottom_host(tier):
                return victim
        return None

    def _make_run(self, block: Block, tier: str, eligible: Callable[[Block], bool]) -> bool:
        """With ``block``'s bytes free in ``tier``'s budget but no room to place it (its slots
        or units are not contiguous), evict ``eligible`` blocks until there is: for a small
        block, the fewest in a slab; for one needing a single slot, the policy's victim among
        blocks holding whole slots; else the cheapest run of slots. False where none will do."""
        pools = self.storage.pools(tier)
        single = slots_for(block.nbytes, self.slot_size) == 1
        while not self.storage.fits(tier, block.nbytes):
            units = [w for w in (p.unit_window(block.nbytes, eligible) for p in pools) if w is not None]
            if units:
                self._evict_all(min(units, key=len), tier, eligible)
                continue
            if single:
                victim = self._victims.choose(
                    tier, self._on[tier], self._info,
                    lambda b: not is_small(b.nbytes, self.slot_size) and eligible(b))
                if victim is not None:
                    self._evict(victim, tier)
                    continue
            windows = [w for w in (p.window(block.nbytes, eligible) for p in pools) if w is not None]
            if not windows:
                return False
            self._evict_all(min(windows, key=len), tier, eligible)
        return True

    def _evict_all(self, blocks: list[Block], tier: str, eligible: Callable[[Block], bool]) -> None:
        for victim in blocks:
            if eligible(victim):  # (a block moving up may have taken the device room the next needed)
                self._evict(victim, tier)

    def _room_to_promote(self, tier: str) -> bool:
        """Where a full host whose blocks cannot go down has no block to move up, make device
        room for one by dropping a device copy that has another copy (no write; not of a block
        in use or being placed): the policy's choice among them. False when there is none (or
        ``tier`` is not the host)."""
        if not self._may_lift(tier):
            return False
        victim = self._victims.choose(DEVICE, self._on[DEVICE], self._info,
                                      lambda b: len(b.tiers) > 1 and self._evictable(b, DEVICE, set()))
        if victim is None:
            return False
        self._free(victim, DEVICE)
        return True

    def _compact(self, block: Block, tier: str, protect: set[Block]) -> bool:
        """Where the host has the bytes for ``block`` but no contiguous run, and no block can
        leave it (no tier below, or NVMe full): open a run by moving the blocks in it elsewhere
        in the host (a copy each; blocks with another copy just leave), trying the runs cheapest first (a run
        whose block fills a slot finds no room while the others are shared slots; the blocks of
        a shared one may fit into another's free units). False where no run holds only blocks
        that may move and all find room outside it."""
        if tier != HOST:
            return False
        pool = self.storage.pools(HOST)[0]

        def movable(b: object) -> bool:
            return self._blocks.get(getattr(b, "id", None)) is b and not self._held(b, HOST, protect)

        tried: set[int] = set()
        while (found := pool.window_at(block.nbytes, movable, tried)) is not None:
            run, blocks = found
            for b in blocks:
                if len(b.tiers) > 1:  # another copy: it just leaves
                    self._free(b, HOST)
                elif not self._relocate(b, pool, run):
                    break
            else:
                return True
            tried.add(run.start)  # (the blocks that moved out of it stay moved: no harm)
        return False

    def _relocate(self, block: Block, pool: SlotPool, avoid: range) -> bool:
        """Move ``block``'s host copy to free slots outside ``avoid`` (an asynchronous copy that
        later users of either place wait for, like any transfer); False where there are none."""
        new = pool.alloc(block.nbytes, block, avoid)
        if new is None:
            return False
        pool.free(new, block.nbytes)  # (taken again below, as the block's location)
        old = self.storage.loc(block, HOST)
        self.storage.forget(block, HOST)
        self.storage.adopt(block, HOST, new)
        self._issue(block, HOST, HOST, old, new, freed_src=True, prefetch=False)
        log.debug("hetero: moved %s within the host to make a contiguous run", block.id)
        return True

    def _alloc(self, block: Block, tier: str, protect: set[Block]) -> None:
        """Reserve space for ``block`` on ``tier``, evicting as needed: policy-chosen victims while
        bytes are short, then (for a block spanning several slots) the cheapest contiguous run.
        Where a victim finds no room below, :meth:`_no_room_below` makes room another way."""
        t = self.tiers.get(tier)
        if t is None:
            raise HeteroOOMError(self._oom_message(block, tier, "that tier is not enabled"))
        need = self._size_on(tier, block)
        if need > t.room:
            raise HeteroOOMError(self._oom_message(block, tier, "the block is larger than the budget"))
        stuck: set[Block] = set()  # victims that found no room below, while others may
        stuck_error: Optional[HeteroOOMError] = None  # (why the last of them found none)
        while True:
            if t.free >= need and self.storage.place(block, tier):
                self._reserve(block, tier)
                return
            if t.free < need:
                victim = self._victim(tier, protect | stuck if stuck else protect)
                if victim is None and (self._drop_shadow(tier) or (
                        self._bottom_host(tier) and self._room_to_promote(tier))):
                    continue
                if victim is None:
                    raise stuck_error or HeteroOOMError(self._oom_message(block, tier, "every block there is in use"))
                try:
                    self._evict(victim, tier)
                except HeteroOOMError as exc:  # no room below for it: another way, or a victim that fits there
                    if not self._no_room_below(tier, protect):
                        stuck.add(victim)
                        stuck_error = exc
                continue
            try:
                if (self._make_run(block, tier, lambda b: self._evictable(b, tier, protect))
                        or (self._bottom_host(tier) and self._make_run(
                            block, tier, lambda b: self._evictable(b, tier, protect, up=True)))
                        or self._drop_shadow(tier) or self._compact(block, tier, protect)
                        or (self._bottom_host(tier) and self._room_to_promote(tier))):
                    continue
            except HeteroOOMError:  # the run's blocks found no room below
                if not (self._no_room_below(tier, protect) or self._compact(block, tier, protect)):
                    raise
                continue
            raise HeteroOOMError(self._oom_message(
                block, tier, f"no run of {need} contiguous bytes can be freed around blocks in use"))

    def _evict(self, block: Block, tier: str) -> None:
        """Remove ``block``'s copy from ``tier``, first writing it one tier down if it is the
        only copy (making room there recursively), or, from a bottom host tier, up into free
        device room."""
        if block.tiers == {tier}:  # down one tier, or up into free device room (_promotable)
            below = self._below[tier]
            self._evicting_from_device += tier == DEVICE
            try:
                self._replicate(block, tier, below[0] if below else DEVICE, set(), evict=True)
            finally:
                self._evicting_from_device -= tier == DEVICE
        else:
            self._free(block, tier)

    def _replicate(self, block: Block, src: str, dst: str, protect: set[Block],
                   prefetch: bool = False, evict: bool = False) -> None:
        """Give ``block`` a copy on ``dst`` made from ``src`` (dropping the ``src`` copy when
        ``evict``); the transfer is issued, not waited for."""
        self._placing.add(block)
        try:
            self._alloc(block, dst, protect)
        finally:
            self._placing.discard(block)
        src_loc, dst_loc = self.storage.loc(block, src), self.storage.loc(block, dst)
        zero = src == NVME and block in self._zero  # never written: the copy is a fill, not a read
        if not zero:
            self.tracker.count(block.id, src, dst, block.nbytes, prefetch)
        self._add_copy(block, dst)
        if evict:
            self._drop(block, src)
        self._issue(block, src, dst, src_loc, dst_loc, freed_src=evict, prefetch=prefetch, zero=zero)

    def _add_copy(self, block: Block, tier: str) -> None:
        block.tiers.add(tier)
        self._on[tier][block] = None
        self._victims.changed(block)

    def _remove_copy(self, block: Block, tier: str) -> None:
        block.tiers.discard(tier)
        self._on[tier].pop(block, None)
        self._victims.changed(block)  # its other copies are no longer clean below

    def _drop(self, block: Block, tier: str) -> None:
        """Logically drop ``block``'s copy on ``tier``: its slots and budget are free for the next
        placement at once (a transfer into them waits for those still using them); the caller
        gives device memory back (``storage.release``) when nothing reads it any more."""
        if tier == DEVICE:
            self.storage.on_device(block, False)
        elif tier == NVME:
            self._zero.discard(block)
        self.storage.forget(block, tier)
        self._remove_copy(block, tier)
        self._unreserve(block, tier)

    def _free(self, block: Block, tier: str, restorable: bool = True) -> None:
        """Drop ``block``'s copy on ``tier`` and give its memory back — at once, or (when
        unfinished ops of the block read or write that copy) through a hold op that ends after
        them. A copy no op touches goes at once: the device copy of a gradient discarded while
        the deferred update of its chunk still reads the host copy must not hold device memory,
        which every later transfer onto the device would wait for."""
        loc = self.storage.loc(block, tier)
        zero = tier == NVME and block in self._zero
        self._drop(block, tier)
        self._give_back(block, tier, loc, restorable, zero)

    def _give_back(self, block: Block, tier: str, loc: Any, restorable: bool = True, zero: bool = False) -> None:
        """Give back the memory at ``loc`` of ``block``'s dropped copy on ``tier``: at once, or
        through a hold op after the unfinished ops that still read or write it. ``restorable``
        False: the copy is dead (a discarded block's), undoing the hold never brings it back."""
        if self._ops.touch(block, regions(block, tier, loc, self.slot_size)):
            op = self._issue(block, tier, None, loc, None, freed_src=True, prefetch=False, zero=zero)
            op.restorable = restorable
        else:
            self.storage.release(block, tier)

    # ------------------------------------------------------------------ physical transfers

    def _issue(self, block: Block, src: Optional[str], dst: Optional[str], src_loc: Any, dst_loc: Any,
               freed_src: bool, prefetch: bool, init: Optional[torch.Tensor] = None, zero: bool = False) -> Op:
        op = Op(next(self._seq), block, src, dst, src_loc, dst_loc, freed_src, prefetch, init,
                self.tracker.now(), self.slot_size)
        op.zero = zero
        if src is not None and dst is not None and not zero:  # a copy: numbered (see _found_failure)
            op.nth = self._copies_of[block.id] = self._copies_of.get(block.id, 0) + 1
        if freed_src:
            op.freed = self._size_on(src, block)
        # Memory an unfinished eviction gave back is only free once it finished: if it fails,
        # undoing it takes the bytes back. So a placement waits for as many of its tier's
        # unfinished evictions (oldest first) as the tier would be over budget with them all
        # undone: with those done, undoing any of the others keeps the tier within its budget.
        # (Slots an eviction still reads are conflicts of their own.)
        t = self.tiers.get(dst) if dst is not None else None
        op.deps = self._ops.conflicts(op, 0 if t is None else t.used + self._ops.freeing(dst) - t.capacity)
        self._ops.add(op)
        if not op.deps:
            self._start(op)
        return op

    def _start(self, op: Op) -> None:
        op.state = "running"
        op.start = self.tracker.now()
        if op.dst is not None:
            self.storage.alloc(op.block, op.dst)
            if op.dst == NVME and op.src is None:
                pass  # the claim of a never-written copy's slots: nothing to write
            elif op.src is None or op.zero:
                self.storage.fill(op.block, op.dst, op.dst_loc, op.init)
                op.init = None
            else:
                op.handle = self.storage.copy(op.block, op.src, op.src_loc, op.dst, op.dst_loc, op.nth)

    def _finish(self, op: Op, polled: bool = False) -> None:
        """Wait for a running op and retire it; on failure undo it (and what depended on it).
        ``polled``: a pump found it done (else a wait for it)."""
        if op.handle is not None:
            try:
                op.handle.wait()
            except HeteroIOError as exc:
                op.state = "failed"
                self._found_failure(op, "pump" if polled else "wait")
                self._recover(op)
                raise exc
            except BaseException:
                if op.compute:  # deferred work raised: nothing to undo, the error is the caller's
                    op.state = "failed"
                    self._ops.remove(op)
                raise
            if not op.compute:
                self.tracker.move(op.block.id, op.src, op.dst, op.block.nbytes, op.start,
                                  self.tracker.now(), op.prefetch)
        op.state = "finished"
        self._ops.remove(op)
        if op.freed_src:
            self.storage.release(op.block, op.src)

    def _wait_op(self, op: Op) -> None:
        for d in op.deps:
            if d.pending:
                self._wait_op(d)
        if op.state == "queued":
            self._start(op)
        if op.state == "running":
            self._finish(op)

    def _wait_for(self, ops: Iterable[Op], stall: bool, block: Optional[Block] = None) -> None:
        """Finish ``ops``; the time counts as stall (``stall``) only where one of them waits for
        work still to be done (:meth:`_moving`): retiring work that is already done, and
        starting an op that moves nothing once what it waited for is done, is bookkeeping."""
        ops = [o for o in ops if o.pending]
        if not ops:
            return
        stall = stall and self._moving(ops)
        start = self.tracker.now()
        try:
            for o in ops:
                self._wait_op(o)
        finally:
            if stall:
                self.tracker.stall(start, self.tracker.now(), (block or ops[0].block).id,
                                   optimizer=any(o.compute for o in ops))

    @staticmethod
    def _moving(ops: list[Op]) -> bool:
        """Whether finishing ``ops`` waits for work not yet done: a transfer or deferred work in
        flight, a transfer still queued, or an op queued behind one of those. An op that moves
        no bytes (a zero fill, a never-written NVMe copy's claim or fill, the hold of a freed
        copy) queued behind ops that are all done only waits for the runtime to start it: a new
        Adam state made on the device right after the write-back its room needed."""
        seen: set[int] = set()
        todo = list(ops)
        while todo:
            op = todo.pop()
            if id(op) in seen or not op.pending:
                continue
            seen.add(id(op))
            if op.state == "running":
                if op.handle is not None and not op.handle.done():
                    return True
            elif op.init is not None or (op.src is not None and op.dst is not None and not op.zero):
                return True  # a transfer (or a fill from a tensor) still to run
            else:
                todo.extend(op.deps)
        return False

    def _wait_block(self, block: Block, stall: bool) -> None:
        self._wait_for(list(self._ops.of(block)), stall, block)

    def _pump(self, raising: bool = True) -> None:
        """Retire finished transfers and start those whose conflicts are gone (the next stage of
        a multi-stage prefetch, a copy waiting for a deferred update); never blocks. A failure
        found here is undone at once (:meth:`_finish`) and raised: here, or where ``raising`` is
        False (``release``, which autograd hooks and ``finally`` blocks call) by the next pump
        or drain, the call at which it surfaced before the pipeline moved on at releases (an
        assertion, a runtime bug, raises at once)."""
        events = self.tracker.event_count
        self._pumped_at = (events, self._pumped_at[1] + 1 if self._pumped_at[0] == events else 1)
        if self._failure is not None:
            if not raising:  # one failure at a time: nothing moves on until it has surfaced
                return
            failure, self._failure = self._failure, None
            self.tracker.event("raised")  # (a replay raises it here too: see _found_failure)
            raise failure
        deferred_busy = False  # deferred work mostly runs in order: once one is busy, skip the rest
        for op in self._ops:
            if op.state == "running":
                if op.compute and deferred_busy:
                    continue
                if op.handle is None or op.handle.done():
                    try:
                        self._finish(op, polled=True)
                    except AssertionError:  # a runtime bug, not a failure of the work
                        raise
                    except Exception as exc:  # undone if it can be
                        if raising:
                            raise
                        self._failure = exc  # raised by the next pump
                        return
                elif op.compute:
                    deferred_busy = True
            elif op.state == "queued" and all(d.state == "finished" for d in op.deps):
                self._start(op)

    def _recover(self, failed: Op) -> None:
        """Undo a failed transfer: cancel the ops that depend on it, let the running ones end,
        then revert the logical changes of every failed or cancelled op, newest first. Sources
        of those ops were never overwritten (whatever would overwrite them depended on them), so
        afterwards every block's copies are valid again."""
        bad = {failed}
        while True:
            for op in self._ops:
                if op.state == "queued" and any(d in bad for d in op.deps):
                    op.state = "cancelled"
                    bad.add(op)
            running = [op for op in self._ops if op.state == "running" and op not in bad]
            if not running:
                break
            for op in running:
                try:
                    if op.handle is not None:
                        op.handle.wait()
                except HeteroIOError:
                    op.state = "failed"
                    self._found_failure(op, "recover")
                    bad.add(op)
                else:
                    self._finish(op)
        gone: dict[Block, None] = {}  # blocks whose device memory no copy holds any more
        for op in sorted(bad, key=lambda o: o.seq, reverse=True):
            assert not op.compute, f"runtime bug: {op} undone (deferred work has no dependencies)"
            self._ops.remove(op)
            if op.shadow is not None:  # it moved a shadow, not the block's own copy
                self._undo_demotion(op)
                continue
            block = op.block
            if op.dst is not None and op.dst in block.tiers:
                self._drop(block, op.dst)
                if op.dst == DEVICE:
                    gone[block] = None
            if op.freed_src and op.restorable:
                self.storage.adopt(block, op.src, op.src_loc)
                self._reserve(block, op.src)
                self._add_copy(block, op.src)
                if op.zero:
                    self._zero.add(block)
            elif op.freed_src and op.src == DEVICE:  # a dead copy (a discarded block's)
                gone[block] = None
        # Device memory no copy holds any more goes back after the ops that survived the undo
        # and still use it (an earlier write-back out of it, a copy into it), never under them;
        # not at all where the undo restored a device copy.
        for block in gone:
            if DEVICE not in block.tiers:
                self._give_back(block, DEVICE, None, restorable=False)
        log.warning("hetero: a transfer failed; undid %d transfer(s): %s", len(bad),
                    ", ".join(map(repr, sorted(bad, key=lambda o: o.seq))))

    def _found_failure(self, op: Op, site: str) -> None:
        """Record in the event log where the failure of transfer ``op`` was found, so that a
        replay (:func:`hetero.simulator.replay`, whose transfers otherwise all succeed) fails the
        same transfer there and undoes what the run undid. Where is a matter of timing in the
        run: ``site`` "pump" (a pump found it done; the pump's place is the events recorded and
        the pumps since the last of them), "wait" (the first wait for it) or "recover" (waited
        for while another failure was undone). The transfer is named by its block and its place
        among the block's copies issued: placement decisions, which timing does not change."""
        if op.nth:
            self.tracker.event("failed", op.block.id, op.nth, site, *self._pumped_at)

    def _oom_message(self, block: Block, tier: str, why: str) -> str:
        tiers = ", ".join(f"{n}: {exact_size(t.used)} used of {exact_size(t.capacity)} "
                          + (f"(the swap files' whole slots hold {exact_size(t.room)}) " if t.room < t.capacity else "")
                          + f"({exact_size(sum(self._size_on(n, b) for b in self.blocks() if b.pins.get(n)))} pinned)"
                          for n, t in self.tiers.items())
        advice = raise_budget_advice(NVME in self.tiers)
        pinned = sum(self._size_on(tier, b) for b in self._on.get(tier, ()) if b.pins.get(tier))
        if tier == DEVICE and pinned + self._size_on(tier, block) > self.tiers[DEVICE].capacity:
            # (no other tier can help: these blocks are in use on the device at once)
            advice = ("raise device_budget: the device must hold, at once, the blocks of every unit "
                      "whose forward or backward is running, with activation checkpointing the units "
                      "a recompute re-runs too (wrap's minimum counts one unit and its parents)")
        return (f"cannot place block {block.id} ({exact_size(block.nbytes)}) on the {tier} tier: {why}. "
                f"Tiers: {tiers}. To fix: {advice}.")


class _Transaction:
    """Shadows (block -> (tier, location) of its pre-write copy) and blocks created."""

    def __init__(self) -> None:
        self.shadows: dict[Block, tuple[str, Any]] = {}
        self.created: dict[Block, None] = {}  # in creation order (a set that keeps it)
        self.zero: set[Block] = set()  # shadows that are never-written NVMe copies (read as zeros)
        self.lost: set[Block] = set()  # written, and no older copy kept: a rollback cannot undo them

    @property
    def complete(self) -> bool:
        """Whether a rollback would undo every write."""
        return not self.lost

    def lose(self, block: Block) -> None:
        self.lost.add(block)

    def shadow_tier(self, block: Block, others: list[str]) -> Optional[str]:
        """Which of a written block's other copies (fastest first) to keep as its shadow: the
        slowest (a device copy only when there is no other: it keeps device memory, and the block
        cannot come back to the device before the end), unless the block already has a shadow or
        did not exist before the transaction, or has lost its shadow (a new one would keep a
        copy written in this transaction: a rollback would restore neither the old value nor the
        new)."""
        if block in self.shadows or block in self.created or block in self.lost or not others:
            return None
        kept = [t for t in others if t != DEVICE]
        return kept[-1] if kept else others[-1]


class _Shadow:
    """Owner of the slots a shadow keeps: never a victim (it holds no valid copy anywhere)."""

    __slots__ = ("block", "tiers", "pins")

    def __init__(self, block: Block) -> None:
        self.block, self.tiers, self.pins = block, frozenset(), {}
