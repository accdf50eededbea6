"""Which block leaves a full tier: the policy's choice, from a ranking kept across evictions.

Every eviction asks the policy for the best victim among the evictable blocks on a tier. Asking
:meth:`Policy.victim <hetero.policies.base.Policy.victim>` weighs every block there each time,
and a step evicts hundreds of times. A policy that ranks blocks by a key
(:meth:`Policy.victim_key <hetero.policies.base.Policy.victim_key>`) lets the runtime keep each
tier sorted and evict from the top. The sorted order is kept until a key may have changed: a
copy added or dropped (which moves the block onto or off the tier, or flips its "clean below"
flag), or an observation or step end of the policy. After those, only the blocks the policy
names (:meth:`Policy.changed_keys <hetero.policies.base.Policy.changed_keys>`) are weighed again
and moved to their new place; a policy that cannot name them has the tier re-sorted. So the
answer is always the same as asking ``victim`` over the same candidates; only the cost differs.
"""

from __future__ import annotations

import bisect
import functools
import numbers
from typing import Any, Callable, Collection, Iterable, Optional

from .chunks import Block
from .policies.base import BlockInfo, Policy
from .policycheck import bad_answer, policy_error, trusted


def _nan(key: Any) -> bool:
    """Whether ``key`` is or holds a NaN (a float, numpy's or a 0-d tensor; tuples of them)."""
    if isinstance(key, tuple):
        return any(_nan(k) for k in key)
    if isinstance(key, (numbers.Integral, str, bytes)):
        return False
    try:
        return bool(key != key)
    except (TypeError, ValueError, RuntimeError):  # (not one value: its comparison raises elsewhere)
        return False


def _checked_rank(policy: Policy, tier: str, rank: Callable[[Block], tuple], block: Block) -> tuple:
    """A custom policy's rank of ``block``, refused where its key holds a NaN."""
    r = rank(block)
    if _nan(r[0]):
        raise policy_error(policy, "victim_key", f"ranked block {block.id} of the {tier} tier with "
                           f"the key {r[0]!r}; NaN compares false with everything, so no order can be "
                           "kept; expected keys of one type that compare with each other for every "
                           "block (numbers, or tuples of them), without NaN")
    return r


def _owner(cls: type, name: str) -> type:
    return next(c for c in cls.__mro__ if name in c.__dict__)


class _Ranked:
    """One tier's blocks sorted by (key, id), best victim last; and those to weigh again."""

    __slots__ = ("ranks", "entries", "stale")

    def __init__(self, order: list[tuple[Any, Block]]) -> None:
        order.sort(key=lambda e: e[0])
        self.ranks: list[Any] = [k for k, _ in order]
        self.entries: dict[str, tuple[Any, Block]] = {b.id: (k, b) for k, b in order}
        self.stale: set[Block] = set()

    def remove(self, block: Block) -> None:
        entry = self.entries.pop(block.id, None)
        if entry is not None:
            del self.ranks[bisect.bisect_left(self.ranks, entry[0])]

    def insert(self, rank: Any, block: Block) -> None:
        bisect.insort(self.ranks, rank)
        self.entries[block.id] = (rank, block)


class Victims:
    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        cls = type(policy)
        # The key is only used where it decides alone: a policy that overrides victim() itself
        # (a subclass of a built-in) is asked every time.
        self._keyed = cls.victim is Policy.victim
        # The policy's list of changed keys is trusted only from the class that defines the key.
        self._named = _owner(cls, "changed_keys") is _owner(cls, "victim_key")
        self._trusted = trusted(policy)  # (see hetero.policycheck)
        self._ranked: dict[str, _Ranked] = {}

    def invalidate(self) -> None:
        """The policy's keys may have changed (it observed an acquire, a step ended, a state
        settled, or it chose a new block's home)."""
        ids = self.policy.changed_keys() if self._named else None
        if ids is None:
            self._ranked.clear()
            return
        if not self._trusted and (isinstance(ids, str) or not isinstance(ids, Collection)):
            self._ranked.clear()
            raise bad_answer(self.policy, "changed_keys", ids, "a collection of block ids, or None")
        for r in self._ranked.values():
            for i in ids:
                entry = r.entries.get(i)
                if entry is not None:
                    r.stale.add(entry[1])

    def reset(self) -> None:
        """Forget every ranking: a policy hook failed half-way, so keys may have changed that
        the policy cannot name."""
        self._ranked.clear()

    def changed(self, block: Block) -> None:
        """``block`` gained or lost a copy: weigh it again on every tier (or leave it out)."""
        for r in self._ranked.values():
            r.stale.add(block)

    def choose(self, tier: str, blocks: Iterable[Block], info: Callable[[Block], BlockInfo],
               eligible: Callable[[Block], bool], within: Optional[int] = None) -> Optional[Block]:
        """The policy's victim among ``blocks`` (every block on ``tier``) that are ``eligible``;
        None if none is. ``within``: only if it is among the policy's first ``within`` choices
        (eligible or not; a policy without a ranking key has every candidate weighed anyway)."""
        key = self.policy.victim_key(tier) if self._keyed else None
        if key is None:
            return self._asked(tier, blocks, info, eligible)
        if not self._trusted and not callable(key):
            raise bad_answer(self.policy, "victim_key", key, "a callable(BlockInfo) -> key, or None")
        r = self._ranking(tier, key, blocks, info)
        entries = r.entries
        last = -1 if within is None else max(-1, len(r.ranks) - 1 - within)
        for i in range(len(r.ranks) - 1, last, -1):
            b = entries[r.ranks[i][-1]][1]
            if eligible(b):
                return b
        return None

    def _asked(self, tier: str, blocks: Iterable[Block], info: Callable[[Block], BlockInfo],
               eligible: Callable[[Block], bool]) -> Optional[Block]:
        """The victim the policy's victim() names among the eligible blocks. Only those are
        offered, and only one of them may go: a block named otherwise may be in use (pinned),
        and evicting it would free memory that compute still reads."""
        offered = [b for b in blocks if eligible(b)]
        if not offered:
            return None
        candidates = [info(b) for b in offered]
        chosen = self.policy.victim(tier, candidates)
        chosen_id = chosen.id if isinstance(chosen, BlockInfo) else None
        for b in offered:
            if b.id == chosen_id:
                return b
        raise bad_answer(self.policy, "victim", chosen,
                         f"one of the {len(candidates)} candidates it was offered to leave the {tier} "
                         "tier (a BlockInfo from candidates: only they are not in use)")

    def _ranking(self, tier: str, key: Callable[[BlockInfo], Any], blocks: Iterable[Block],
                 info: Callable[[Block], BlockInfo]) -> _Ranked:
        """The tier's blocks sorted by the policy's key, re-weighing those whose key may have
        changed. Where that fails (the policy's key raised, or gave keys that do not compare),
        the tier's ranking is dropped, half re-sorted as it may be: it is sorted afresh next time."""
        # Ties go to the largest id, as in Policy.victim: the answer never depends on the order
        # blocks are listed or stored in.
        rank = lambda b: (key(info(b)), b.id)  # noqa: E731
        if not self._trusted:  # a NaN key compares false both ways: the sorted ranking breaks
            rank = functools.partial(_checked_rank, self.policy, tier, rank)
        try:
            r = self._ranked.get(tier)
            if r is not None and 2 * len(r.stale) > len(r.entries):  # cheaper to sort afresh
                r = None
            if r is None:
                r = self._ranked[tier] = _Ranked([(rank(b), b) for b in blocks])
            for b in r.stale:
                r.remove(b)
                if tier in b.tiers:
                    r.insert(rank(b), b)
            r.stale.clear()
            return r
        except TypeError as exc:  # keys that do not compare: None among numbers
            self._ranked.pop(tier, None)
            raise policy_error(self.policy, "victim_key", f"ranked the {tier} tier with keys that could "
                               f"not be computed or compared (TypeError: {exc}); expected keys of one "
                               "type that compare with each other for every block (numbers, or tuples "
                               "of them)") from exc
        except BaseException:
            self._ranked.pop(tier, None)
            raise
