"""The policy interface, and the recorded-step timeline that trace-driven policies share.

A policy is pure: it sees block metadata and the stream of acquires, never tensors or I/O. The
runtime (and the simulator, which is the same runtime over simulated storage) calls:

* :meth:`Policy.observe` for every recorded acquire, and :meth:`Policy.end_step` after each step;
* :meth:`Policy.victim` (or the ranking of :meth:`Policy.victim_key`) to choose which unpinned
  block leaves a full tier;
* :meth:`Policy.home` for the tier a new block starts on, and :meth:`Policy.settle` whether an
  optimizer state below the device should move up after a step (:meth:`Policy.settled` once it
  does);
* :meth:`Policy.next_use` and :meth:`Policy.upcoming` to prefetch in next-use order;

and keeps :attr:`Policy.sizes`, :attr:`Policy.kinds` and :attr:`Policy.chunks` current (the
bytes, kind and chunk of every block it has created, by id).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import types
from typing import Any, Callable, Collection, Mapping, Optional, Sequence

DEVICE, HOST, NVME = "device", "host", "nvme"
GRAD, MASTER = "grad", "master"
TIER_ORDER = (DEVICE, HOST, NVME)
OPTIMIZER_KINDS = (MASTER, "exp_avg", "exp_avg_sq")


@dataclasses.dataclass(frozen=True)
class BlockInfo:
    """What a policy may know about a block."""

    id: str
    kind: str
    nbytes: int
    clean_below: bool  # a valid copy exists on another tier: evicting it writes nothing


class Policy:
    """Base class of placement policies (subclass it to pass an instance as ``policy=``).

    A subclass must override :meth:`victim` or :meth:`victim_key` (``wrap`` refuses one that
    overrides neither). An instance passed to ``wrap`` is that model's live policy, used as
    given, not copied (so the caller can watch what it learns): ``wrap`` refuses an instance
    that another open model runs (until that model's ``close()``), since each runtime points the
    policy's tables at its own blocks. ``Report.simulate`` replays a copy of an instance.

    The answers of a class other than hetero's own (a subclass of a built-in included) are
    checked before the runtime acts on them (:mod:`hetero.policycheck`): an answer outside
    what each hook documents raises :class:`~hetero.errors.HeteroStateError` naming the policy,
    the hook and what was expected. A hook that raises after an optimizer step was applied
    (:meth:`end_step`, :meth:`settle`, :meth:`settled`) makes ``step()`` raise a
    HeteroStateError, chained from it, that says the step was applied and must not be run
    again.

    Reports and event logs name the policy by :attr:`name` where a class sets its own; a class
    that does not, or sets a built-in's name, is reported by its class name, and a replay by
    a name that is not a built-in's asks for an instance.
    """

    #: the policy's name in reports (a built-in's, or one a custom class gives itself)
    name = "base"

    #: bytes of every block the runtime has created, by id (the runtime sets and updates it)
    sizes: Mapping[str, int] = types.MappingProxyType({})
    #: kind of every block the runtime has created, by id ("param", "grad", "exp_avg", ...)
    kinds: Mapping[str, str] = types.MappingProxyType({})
    #: chunk of every block the runtime has created, by id: the blocks of one chunk (its
    #: parameters, gradient and optimizer states) are updated together by the optimizer
    chunks: Mapping[str, str] = types.MappingProxyType({})

    def observe(self, blocks: Sequence[str], tier: str, step: int, seq: int,
                write: bool = False) -> None:
        """Compute acquired ``blocks`` on ``tier`` (to change them, if ``write``); ``seq`` is the
        access number of the first."""

    def end_step(self, step: int) -> None:
        """Training step ``step`` is complete."""

    def victim(self, tier: str, candidates: Sequence[BlockInfo]) -> BlockInfo:
        """The block to evict from ``tier``: one of ``candidates`` (non-empty, all unpinned;
        any other answer raises HeteroStateError, since a block not offered may be in use).
        Default: the candidate with the largest :meth:`victim_key` (then the largest id)."""
        key = self.victim_key(tier)
        if key is None:
            raise NotImplementedError(f"{type(self).__name__} defines neither victim nor victim_key")
        return max(candidates, key=lambda b: (key(b), b.id))

    def victim_key(self, tier: str) -> Optional[Callable[[BlockInfo], Any]]:
        """A ranking of blocks on ``tier`` as victims (largest first; ties go to the largest id),
        or None. Keys of all blocks must compare with each other (numbers, or tuples of them).
        Keys may change only in :meth:`observe`, :meth:`end_step`, :meth:`settled` and
        :meth:`home`: in between, the runtime keeps each tier sorted and evicts down the list
        (:mod:`hetero.victims`) instead of weighing every block for every eviction. Used only
        where :meth:`victim` is this default."""
        return None

    def changed_keys(self) -> Optional[Collection[str]]:
        """Ids of the blocks whose :meth:`victim_key` may differ from what it was at the last
        call (the runtime calls this after every :meth:`observe`, :meth:`end_step`,
        :meth:`settled` and :meth:`home`), or None if any block's may (the default). A policy
        that can name them spares the runtime a re-sort of every tier per acquire: it re-weighs
        only those.
        Trusted only from the class that defines :meth:`victim_key` (a subclass changing the
        key must override both)."""
        return None

    def home(self, block: BlockInfo, free: Mapping[str, int], capacity: Mapping[str, int]) -> str:
        """Tier on which a new block starts: ``"device"``, ``"host"`` or ``"nvme"`` (anything
        else raises HeteroStateError). A tier without room gets it the usual way (evictions), or
        the block starts on another tier with room; ``"nvme"`` in a run without an NVMe tier
        (``nvme_path=None``) is treated as NVMe without room: the block starts on the host.
        Default: the fastest tier with room, else host."""
        for tier in TIER_ORDER:
            if free.get(tier, 0) >= block.nbytes:
                return tier
        return HOST

    def settle(self, block: BlockInfo, capacity: Mapping[str, int]) -> Optional[str]:
        """The tier an existing block below the device should move up to now, or None (the
        default) to leave it (only ``"device"`` moves it; another tier name leaves it too, and
        anything else raises): asked after each step for optimizer states, whose best home may
        be known only once a step has shown what else the device must hold. Called in turn for
        each block offered, each answer followed by :meth:`settled` if the move could be made."""
        return None

    def settled(self, block: BlockInfo, tier: str) -> None:
        """The runtime started moving ``block`` up to ``tier`` as :meth:`settle` asked. Not
        called where it could not (settling uses free room only), so a policy counting the
        room its answers take counts only the moves made."""

    def next_use(self, block_id: str, tier: str) -> float:
        """Predicted accesses until ``block_id`` is next needed on ``tier`` (inf: not expected): a
        real number, not NaN."""
        return math.inf

    def upcoming(self, groups: int) -> list[tuple[str, str]]:
        """``(block, tier)`` of the next ``groups`` expected acquires, in order ([] if unknown):
        a list of pairs of a block id and a tier name. Ids of blocks not created (yet) are
        skipped."""
        return []


class Timeline:
    """The access sequence of the last complete step, and where the current step stands in it.

    Training steps repeat, so the previous step tells each block's next use exactly (with
    wrap-around into the next step). When the current step departs from it (routing, branches)
    the position resynchronizes on the nearest recorded use of the access: at once where that
    is at most ``NEAR`` recorded accesses away, ahead or behind (the step may have done a few
    accesses out of the recorded order), else, up to ``window`` ahead, only once the access
    after it follows there too. (A single access found far ahead is mostly one that moved: an
    optimizer update the step runs on another tier than the recording did, whose next match is
    in the backward pass; jumping there on its word would skip the rest of the forward and leave
    every later access of the step behind the position, unmatched.) Blocks the recorded step
    never touched have an unknown future. At the end of each step the step just
    seen becomes the recording, so a changed sequence is learned after one step, never dropped.

    Before any step is complete the first step is predicted from its own forward pass: when the
    first write arrives (the backward pass storing gradients) the accesses so far, followed by
    the same acquires in reverse order, become a *provisional* recording, because a backward pass
    visits the units of the forward in reverse (the order FSDP prefetches its first backward in).
    A forward block then has a known next use instead of none, and blocks the backward has
    already revisited are due only in the next step. The first complete step replaces the guess.

    Per block, the recording's predictions that came true (hits) and that the step skipped
    (misses) are counted with a decay of ``DECAY`` per step, so a block that was skipped while
    the routing settled is trusted again once the recording predicts it right for a few steps.
    """

    #: weight of last step's hit and miss counts against this step's (per step)
    DECAY = 0.5

    def __init__(self, window: int = 256) -> None:
        self.window = window
        self.recorded: list[tuple[str, str, int]] = []  # (block, tier, acquire index in step)
        self._writes: set[int] = set()  # positions in ``recorded`` that were writes
        self._index: dict[tuple[str, str], list[int]] = {}  # (block, tier or "*") -> positions
        self._current: list[tuple[str, str, int]] = []
        self._current_writes: set[int] = set()
        self._groups = 0
        self.pos = 0
        self.matched = 0  # accesses this step that were the recording's next one (in order)
        self.seen = 0
        self.streak = 0  # accesses in a row that matched the recording exactly
        self._far: Optional[int] = None  # where the step would be if the last access's far match is right
        self._high = 0  # the furthest position this step reached (it may go back a little)
        self._missed: set[int] = set()  # recorded accesses this step counted as skipped
        self.span = (0, 0)  # the lowest and highest position of the last observe() (see Opt)
        self._hits: dict[str, float] = {}  # recorded uses that came true, per block (decayed)
        self._misses: dict[str, float] = {}  # recorded uses skipped (the step went another way)
        self.provisional = False  # ``recorded`` is the current step's forward mirrored, a guess
        self.generation = 0  # recordings adopted so far: every prediction changes with one
        # next_use per (block, tier) as (valid while pos <= this, answer), both as positions in
        # the recording unrolled from ``pos`` (a position before ``pos`` counts from the next
        # step): an answer only changes once the current step has passed the block's next use.
        self._next: dict[tuple[str, str], tuple[float, Optional[float]]] = {}

    def _adopt(self, recorded: list[tuple[str, str, int]], writes: set[int]) -> None:
        self.recorded, self._writes = recorded, writes
        self.generation += 1
        self._next = {}
        self._index = {}
        for i, (b, t, _) in enumerate(self.recorded):
            self._index.setdefault((b, t), []).append(i)
            self._index.setdefault((b, "*"), []).append(i)

    def _mirror(self) -> None:
        """Adopt the accesses of the current step so far, then the same acquires in reverse
        order, as a provisional recording, positioned where the reversed part begins."""
        forward = list(self._current)
        by_group: dict[int, list[tuple[str, str, int]]] = {}
        for b, t, g in forward:
            by_group.setdefault(g, []).append((b, t, g))
        last = self._groups
        mirrored = [(b, t, last + k) for k, g in enumerate(sorted(by_group, reverse=True))
                    for b, t, _ in by_group[g]]
        self._adopt(forward + mirrored, set(self._current_writes))
        self.pos = self._high = len(forward)
        self.provisional = True

    def observe(self, blocks: Sequence[str], tier: str, write: bool = False) -> None:
        if write and not self.recorded and self._current:
            self._mirror()
        lo = hi = self.pos
        for b in blocks:
            if write:
                self._current_writes.add(len(self._current))
            self._current.append((b, tier, self._groups))
            self.seen += 1
            if not self.recorded:
                continue
            far, self._far = self._far, None
            if self._is(self.pos, b, tier):
                self._pass(self.pos)
                self.streak += 1
                self.matched += 1
            else:
                self.streak = 0
                if far is not None and self._is(far, b, tier):
                    self._resync(far - 1)  # the access before was right: the step is there
                    self._resync(far)
                else:
                    positions = self._index.get((b, tier), [])
                    i = bisect.bisect_left(positions, self.pos)
                    ahead = positions[i] - self.pos if i < len(positions) else math.inf
                    behind = self.pos - positions[i - 1] if i > 0 else math.inf
                    if min(ahead, behind) <= self.NEAR:
                        self._resync(positions[i] if ahead <= behind else positions[i - 1])
                    elif ahead <= self.window:
                        self._far = positions[i] + 1
            lo, hi = min(lo, self.pos), max(hi, self.pos)
        self.span = (lo, hi)
        self._groups += 1

    #: recorded accesses a resynchronization may skip on one access's word (see the class)
    NEAR = 16

    def _is(self, p: int, block: str, tier: str) -> bool:
        """Whether recorded access ``p`` is ``block`` on ``tier``."""
        return p < len(self.recorded) and self.recorded[p][:2] == (block, tier)

    def _resync(self, p: int) -> None:
        """Move the position past recorded access ``p``, which the current access matched; the
        recorded accesses skipped on the way, and not reached before, are uses this step did not
        make. (Moving back, the next uses of the blocks between are nearer again: the memoized
        answers go.)"""
        for q in range(max(self.pos, self._high), p):
            skipped = self.recorded[q][0]
            self._misses[skipped] = self._misses.get(skipped, 0) + 1
            self._missed.add(q)
        if p < self.pos:
            self._next = {}
        self._pass(p)

    def _pass(self, p: int) -> None:
        """The current access made recorded access ``p``: a hit, unless this step made it
        already (the position came back over it); one counted as skipped is not any more."""
        b = self.recorded[p][0]
        if p in self._missed:
            self._missed.discard(p)
            self._misses[b] -= 1
            if self._misses[b] < 0.01:
                del self._misses[b]
            self._hits[b] = self._hits.get(b, 0) + 1
        elif p >= self._high:
            self._hits[b] = self._hits.get(b, 0) + 1
        self.pos = p + 1
        self._high = max(self._high, self.pos)

    def end_step(self) -> tuple[int, int]:
        """Adopt the step just seen as the recording; returns (matched, seen) of that step: its
        accesses that came in the recorded order (a resynchronization, near or far, is not one),
        and all of them."""
        result = (self.matched, self.seen)
        for counts in (self._hits, self._misses):
            for b in list(counts):
                counts[b] *= self.DECAY
                if counts[b] < 0.01:
                    del counts[b]
        if self._current:
            self._adopt(self._current, self._current_writes)
            self.provisional = False
        self._current, self._current_writes = [], set()
        self._groups, self.pos, self.matched, self.seen = 0, 0, 0, 0
        self._far, self._high, self._missed = None, 0, set()
        self._next = {}
        return result

    def reliable(self, block: str) -> bool:
        """Whether the recording's predictions for ``block`` have mostly come true (a routed
        expert that is skipped as often as used is not)."""
        hits, misses = self._hits.get(block, 0), self._misses.get(block, 0)
        return misses == 0 or hits >= 3 * misses

    def confirmed(self, block: str) -> bool:
        """Reliable, and some recorded use of ``block`` came true lately: worth a prefetch. A
        block seen for the first time last step (an expert the router just picked) is not yet."""
        return self._hits.get(block, 0) > 0 and self.reliable(block)

    def next_use(self, block: str, tier: str) -> Optional[float]:
        """Accesses until ``block`` is next used on ``tier`` ("*": anywhere), wrapping into the
        next step; None when the recorded step never uses it there. A copy on ``tier`` that a
        write on another tier will replace first is never used again: infinity."""
        known = self._next.get((block, tier))
        if known is None or self.pos > known[0]:
            known = self._next[(block, tier)] = self._scan(block, tier)
        answer = known[1]
        return answer if answer is None else answer - self.pos

    def _scan(self, block: str, tier: str) -> tuple[float, Optional[float]]:
        """(the block's first use from ``pos`` on any tier, the answer of :meth:`next_use`), as
        unrolled positions (see ``_next``)."""
        positions = self._index.get((block, "*"))
        if not positions:
            return math.inf, None
        n = len(self.recorded)
        i = bisect.bisect_left(positions, self.pos)
        first = None
        for k in range(len(positions)):
            p = positions[(i + k) % len(positions)]
            unrolled = p if p >= self.pos else p + n
            if first is None:
                first = unrolled
            t = self.recorded[p][1]
            if tier == "*" or t == tier:
                return first, unrolled
            if p in self._writes:
                return first, math.inf  # rewritten elsewhere before this copy is used again
        return first, None

    def written_with(self, block: str) -> list[str]:
        """The blocks the recording writes in the same acquire as ``block``, itself included (an
        optimizer update writes its chunk's parameters and states together); [] if none."""
        for p in self._index.get((block, "*"), []):
            if p in self._writes:
                group = self.recorded[p][2]
                lo = hi = p
                while lo > 0 and self.recorded[lo - 1][2] == group:
                    lo -= 1
                while hi + 1 < len(self.recorded) and self.recorded[hi + 1][2] == group:
                    hi += 1
                return [b for b, _, _ in self.recorded[lo:hi + 1]]
        return []

    #: exact matches in a row needed before prefetching from the recording again
    LOCK = 8

    def upcoming(self, groups: int) -> list[tuple[str, str]]:
        """Accesses of the next ``groups`` recorded acquires from the current position, leaving
        out blocks whose recorded uses have not come true lately (:meth:`confirmed`). Empty
        while the step is not following the recording (prefetching on a wrong guess evicts what
        is needed): it resumes after ``LOCK`` accesses in a row match again."""
        out: list[tuple[str, str]] = []
        if not self.recorded or groups <= 0 or self.streak < self.LOCK:
            return out
        n = len(self.recorded)
        last_group = None
        seen_groups = 0
        for k in range(n):
            b, t, g = self.recorded[(self.pos + k) % n]
            if g != last_group:
                seen_groups += 1
                if seen_groups > groups:
                    break
                last_group = g
            if self.confirmed(b):
                out.append((b, t))
        return out
