"""Belady with wrap-around: evict the block whose next use is furthest away.

Next uses come from the recorded step (:class:`~hetero.policies.base.Timeline`), counting into
the next step, which is where Gemini's warm-up trace stops. Among blocks with the same future the
one whose future the recording knows goes first (for blocks not needed again: certainly dead,
not merely unknown), then the clean one (a valid copy below means the eviction writes nothing).
Blocks the recording does not know, or whose recorded uses often do not come true lately (routed
experts), are predicted by ``fallback`` when there is one (``auto``; not in the second step, see
``Opt._predict``); plain ``opt`` trusts the recording and evicts unknown blocks first, least
recently used first. An optimizer state moved
up by :meth:`Opt.settle` is expected on the device at its next use anywhere, and so are the
blocks its chunk's update writes with it: that update runs where the state is, though the
recorded step updated the chunk below.

Chunks can be *resident*: given the device for good where the step's device working set leaves
room for all their blocks (see :meth:`Opt.home`). A resident chunk is updated on the device and
moves nothing, where any other chunk costs its parameters' fetch and its gradient's write-back
every step; so every block of a resident chunk is a victim only after every other block. Next
uses cannot see this: a resident state's next use is its update, the furthest of all, and Belady
would push it out first, moving the chunk's update below for good.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional, Sequence

from .base import DEVICE, GRAD, HOST, MASTER, OPTIMIZER_KINDS, TIER_ORDER, BlockInfo, Policy, Timeline
from .hotness import Hotness

#: kinds of block a step needs on the device only while their chunk is resident: the optimizer
#: states (any tier would do for them) and the gradient (it leaves at its chunk's update below)
_RESIDENT_ONLY = (*OPTIMIZER_KINDS, GRAD)


class Opt(Policy):
    name = "opt"

    def __init__(self, fallback: Optional[Hotness] = None) -> None:
        self.timeline = Timeline()
        self.fallback = fallback
        self._last: dict[str, int] = {}
        self.follow: list[tuple[int, int]] = []  # (matched, seen) accesses per completed step
        # predict() per (block, tier) since the last observe/end_step, the only calls that change
        # a prediction (settled drops the entries it changes): every eviction asks about all
        # candidates, often at the same position.
        self._predicted: dict[tuple[str, str], tuple[float, bool]] = {}
        # Distinct bytes the step uses on the device, gradients left out (see home): the largest
        # completed step's, and this step's so far, with the optimizer blocks homed there.
        self._ws_max = 0
        self._ws_extra = 0  # optimizer blocks homed on the device this step
        self._ws_grew = True  # the last complete step's working set exceeded every earlier one
        self._dev_now: set[str] = set()
        self._ws_now = 0
        # States moved up by settle whose device use no complete step has recorded yet: their
        # next update runs on the device, so their next use anywhere is their next device use.
        self._settled: set[str] = set()
        # Blocks whose victim key may have changed since changed_keys (None: any block's).
        self._stale: Optional[set[str]] = None
        self._guessed: set[str] = set()  # predicted by the fallback: their keys move every access
        self._resident: dict[str, None] = {}  # chunks given the device for good, in grant order (see home)
        self._grad_of: dict[str, str] = {}  # chunk -> its gradient block, once seen on the device
        self._master_of: dict[str, str] = {}  # chunk -> its fp32 master (mixed precision)
        self._updated_here: set[str] = set()  # chunks updated on the device this step
        self._device_capacity = math.inf  # as home and settle last saw it

    def observe(self, blocks: Sequence[str], tier: str, step: int, seq: int,
                write: bool = False) -> None:
        self._predicted.clear()
        generation = self.timeline.generation
        self.timeline.observe(blocks, tier, write)
        if self.timeline.generation != generation:  # a provisional recording: all new
            self._stale = None
        elif self._stale is not None:
            # Besides the blocks acquired, only those whose recorded use the step just passed
            # (matched or skipped; or went back before) have a new next use or a new record of
            # hits and misses.
            self._stale.update(blocks)
            lo, hi = self.timeline.span
            self._stale.update(b for b, _, _ in self.timeline.recorded[lo:hi])
        if self.fallback is not None:
            self.fallback.observe(blocks, tier, step, seq, write)
        for i, b in enumerate(blocks):
            self._last[b] = seq + i
        if tier == DEVICE:
            for b in blocks:
                self._use_device(b, self.sizes.get(b, 0))
        if write and any(self.kinds.get(b) in OPTIMIZER_KINDS for b in blocks):  # an update
            chunks = {self.chunks[b] for b in blocks if b in self.chunks}
            if tier == DEVICE:
                self._updated_here |= chunks
            elif chunks & self._resident.keys():  # pushed below after all: it moves like any other
                self._resident = {c: None for c in self._resident if c not in chunks}
                self._stale = None

    def _needs_device(self) -> int:
        """The distinct bytes this step used on the device that it needs there: all but the
        :data:`_RESIDENT_ONLY` blocks of chunks that are not resident."""
        return sum(self.sizes.get(b, 0) for b in self._dev_now
                   if self.kinds.get(b) not in _RESIDENT_ONLY or self.chunks.get(b) in self._resident)

    def _use_device(self, block_id: str, nbytes: int) -> None:
        """Count ``block_id`` into the distinct bytes this step uses on the device. Not a
        gradient, unless its chunk is resident: it lives there only from its backward to its
        chunk's update (zero_grad drops it), and where that update runs on the host it leaves
        at the update."""
        kind, chunk = self.kinds.get(block_id), self.chunks.get(block_id)
        if kind == GRAD and chunk is not None:
            self._grad_of[chunk] = block_id
        if block_id not in self._dev_now and (kind != GRAD or chunk in self._resident):
            self._dev_now.add(block_id)
            self._ws_now += nbytes

    def end_step(self, step: int) -> None:
        self._predicted.clear()
        # A chunk stays resident while it is updated on the device every step (an expert the
        # router skipped is not), and only while the step's device working set, resident
        # chunks included, fits on the device (routing may grow it past the room they took):
        # where it does not, the chunks granted last give their room back until it does.
        self._resident = {c: None for c in self._resident if c in self._updated_here}
        revoked = set()
        while self._resident and self._needs_device() > self._device_capacity:
            chunk = next(reversed(self._resident))
            del self._resident[chunk]
            revoked.add(chunk)
        if revoked:  # their states and gradients leave the device: later steps plan without them
            gone = {b for b in self._dev_now
                    if self.chunks.get(b) in revoked and self.kinds.get(b) in _RESIDENT_ONLY}
            self._dev_now -= gone
            self._ws_now -= sum(self.sizes.get(b, 0) for b in gone)
        self._updated_here = set()
        self.follow.append(self.timeline.end_step())
        self._ws_grew = self._ws_now > self._ws_max
        self._ws_max = max(self._ws_max, self._ws_now)
        self._settled -= self._dev_now
        self._dev_now, self._ws_now, self._ws_extra = set(), 0, 0
        self._stale = None

    def predict(self, block_id: str, tier: str) -> tuple[float, bool]:
        """(accesses until ``block_id`` is next needed on ``tier``, whether the recording says
        so). A copy the recording knows to be rewritten elsewhere first is certainly dead."""
        # A block on the host is needed there for any use (the device is fed through the host).
        key = (block_id, tier if tier == DEVICE else "*")
        found = self._predicted.get(key)
        if found is None:
            found = self._predicted[key] = self._predict(*key)
        if not found[1] and self.fallback is not None:
            self._guessed.add(block_id)
        return found

    def _predict(self, block_id: str, tier: str) -> tuple[float, bool]:
        """The recording's answer, else the fallback's, except in the second step (one step
        complete): there hotness knows each block from the same single step the recording holds,
        so a block the step has skipped so far (a routed expert) is better expected at its
        recorded use than at a reuse distance measured once. A block the recording never saw
        is then unknown, as under ``opt`` (evicted first), even one this step already used
        twice (a newly routed expert between its forward and backward), which hotness would
        keep: the price of the rule. (Routed model, 25% device budget, 24 seeds: NVMe bytes -17%
        and stall -16% against asking it there too; device bytes +1%.)"""
        d = self.timeline.next_use(block_id, "*" if block_id in self._settled else tier)
        if d is None and self.timeline.provisional and self.kinds.get(block_id) == GRAD:
            # The first step's guess (its forward mirrored) ends with the backward; a gradient
            # is read by its chunk's update, which comes right after it.
            return float(len(self.timeline.recorded) - self.timeline.pos), True
        if (self.fallback is not None and len(self.follow) != 1  # (the second step: see above)
                and (d is None or not self.timeline.reliable(block_id))):
            return self.fallback.predicted(block_id), False  # the recording cannot say: ask hotness
        return (math.inf, False) if d is None else (float(d), True)

    def next_use(self, block_id: str, tier: str) -> float:
        return self.predict(block_id, tier)[0]

    def victim_key(self, tier: str) -> Callable[[BlockInfo], Any]:
        """Blocks of resident chunks last (on the device); then furthest next use first; at
        equal distance the recording's prediction before a guess
        (so among blocks not needed again, those known to be rewritten elsewhere first before
        those nobody can predict: an expert not routed to yet may be next); then, among known
        futures, clean before dirty, then least recently used (among unknown ones recency comes
        before cleanness: else a dirty block nobody predicts stays for good while the clean ones
        around it thrash). The next use is keyed by its position in the
        recording rather than its distance, which shrinks for every block at every access: so
        an access changes the keys of only the blocks :meth:`changed_keys` names."""
        timeline = self.timeline

        def key(b: BlockInfo) -> Any:
            d, known = self.predict(b.id, tier)
            movable = tier != DEVICE or self.chunks.get(b.id) not in self._resident
            last = -self._last.get(b.id, -1)
            if known:
                return movable, d + timeline.pos, known, b.clean_below, last, b.id
            return movable, d + timeline.pos, known, last, b.clean_below, b.id
        return key

    def changed_keys(self) -> Optional[set[str]]:
        """The blocks acquired or passed in the recording since the last call, and every block
        the fallback predicts (a guess is a distance from now); None after a step's end or a
        new provisional recording."""
        stale = self._stale
        if stale is not None:
            stale |= self._guessed
        self._stale, self._guessed = set(), set()
        return stale

    def upcoming(self, groups: int) -> list[tuple[str, str]]:
        return self.timeline.upcoming(groups)

    def _fits_beside_working_set(self, nbytes: float, capacity: Mapping[str, int]) -> bool:
        """Whether ``nbytes`` more fit on the device beside its working set: the largest complete
        step's distinct device bytes plus the optimizer blocks homed there since, or the current
        step's so far if larger (the first step counts itself)."""
        ws = max(self._ws_max + self._ws_extra, self._ws_now)
        return bool(ws) and ws + nbytes <= capacity.get(DEVICE, 0)

    #: room a state settled on the device (one at a time, see settle) takes beside the working
    #: set, in its own bytes: itself and half its chunk's gradient (two states share one), which
    #: stays on the device until the chunk's update there
    RESIDENT_ROOM = 1.5

    def _home_on_device(self, block: BlockInfo, room: float = 1.0) -> None:
        self._ws_extra += room * block.nbytes
        self._use_device(block.id, block.nbytes)

    def settle(self, block: BlockInfo, capacity: Mapping[str, int]) -> Optional[str]:
        """An optimizer state below the device moves up where it fits beside the device working
        set of a complete step, as :meth:`home` would have placed it had that step been known,
        with its chunk's gradient (:attr:`RESIDENT_ROOM`), and only after a step that did not
        grow that working set. While it grows (routed experts picked for the first time), states
        moved up are pushed out again before their update.
        The states settled for a step count into its working set, so each round of settling is
        followed by a step that shows the working set it made before the next round is asked."""
        if block.kind not in OPTIMIZER_KINDS:
            return None
        self._device_capacity = capacity.get(DEVICE, 0)
        if not self._ws_max or self._ws_grew:
            return None
        if not self._fits_beside_working_set(self.RESIDENT_ROOM * block.nbytes, capacity):
            return None
        return DEVICE

    def settled(self, block: BlockInfo, tier: str) -> None:
        """The chunk of a settled state is updated on the device from now on: the state, and
        the blocks the recording writes with it (the chunk's parameters: the recording rewrites
        them on the host, so their device copies would look dead), are expected on the device
        at their next use anywhere."""
        self._home_on_device(block, self.RESIDENT_ROOM)
        moved = {block.id, *self.timeline.written_with(block.id)}
        self._settled |= moved
        for b in moved:
            self._predicted.pop((b, DEVICE), None)
        if self._stale is not None:
            self._stale |= moved

    def _make_resident(self, block: BlockInfo, chunk: Optional[str], capacity: Mapping[str, int]) -> bool:
        """At a chunk's first Adam state, once its gradient has been seen (after a backward, so
        with the step's working set known): make the chunk resident where there is room for
        both states (the same size) and for the gradient and the master (mixed precision)
        unless already counted, which stay on the device from then on."""
        grad = self._grad_of.get(chunk)
        if grad is None:
            return False
        also = [b for b in (grad, self._master_of.get(chunk)) if b is not None and b not in self._dev_now]
        extra = sum(self.sizes.get(b, 0) for b in also)
        if not self._fits_beside_working_set(2 * block.nbytes + extra, capacity):
            return False
        self._resident[chunk] = None
        self._stale = None
        self._home_on_device(block)
        self._ws_extra += extra
        for b in also:
            self._use_device(b, self.sizes.get(b, 0))
        return True

    def home(self, block: BlockInfo, free: Mapping[str, int], capacity: Mapping[str, int]) -> str:
        """Optimizer states are used once a step (long reuse distance): they take the device only
        where they cannot push out what every step needs there, so their chunk's update runs on
        the device and moves nothing. Where a chunk's two states fit beside the device working
        set (the distinct bytes a step uses there, the largest complete step seen, gradients
        left out) together with its gradient, the chunk becomes resident (decided at its first
        state, which takes the room of both): a chunk whose states are on the device trades its
        gradient's write-back and its parameters' fetch, every step, for their room. Where a
        state fits without that, or where the device stays at least half free after it, it
        starts on the device too, but as any other block. (With an NVMe tier, a chunk in its
        first step whose new states start on the device beside its parameters and gradient is
        updated there in place, after the step's commit, so it needs no pre-step copies in host
        memory.) Everything else takes the fastest room."""
        if block.kind in OPTIMIZER_KINDS:
            self._device_capacity = capacity.get(DEVICE, 0)
            chunk = self.chunks.get(block.id)
            if block.kind == MASTER:  # made at wrap, before any step: never resident by itself
                self._master_of[chunk] = block.id
            elif chunk in self._resident:  # the chunk's first Adam state took room for this one
                self._home_on_device(block)  # (the optimizer creates the two back to back)
                return DEVICE
            elif self._make_resident(block, chunk, capacity):
                return DEVICE
            if (self._fits_beside_working_set(block.nbytes, capacity)
                    or free.get(DEVICE, 0) - block.nbytes >= capacity.get(DEVICE, 0) / 2):
                self._home_on_device(block)
                return DEVICE
            tiers = [t for t in TIER_ORDER if t != DEVICE]
        else:
            tiers = list(TIER_ORDER)
        for t in tiers:
            if free.get(t, 0) >= block.nbytes:
                return t
        return HOST
