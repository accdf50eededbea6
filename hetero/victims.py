"""Which block leaves a full tier: the policy's choice, ranked once between observations.

Every eviction asks the policy for the best victim among the evictable blocks on a tier. Asking
:meth:`Policy.victim <hetero.policies.base.Policy.victim>` weighs every block there each time,
and a step evicts hundreds of times. A policy that ranks blocks by a key
(:meth:`Policy.victim_key <hetero.policies.base.Policy.victim_key>`) lets the runtime sort a
tier once and evict down the list until the policy's keys may change, at its next ``observe`` or
``end_step``. Blocks whose key inputs changed in between (a copy added or dropped anywhere, which
moves the block onto or off the tier or flips its "clean below" flag) are weighed afresh. So the
answer is always the same as asking ``victim`` over the same candidates; only the cost differs.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

from .chunks import Block
from .policies.base import BlockInfo, Policy


class _Ranked:
    __slots__ = ("epoch", "order", "changed")

    def __init__(self, epoch: int, order: list[tuple[Any, Block]]) -> None:
        self.epoch = epoch
        self.order = order  # (key, block), best victim first
        self.changed: set[Block] = set()  # key inputs changed since ranked: weighed afresh


class Victims:
    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        # The key is only used where it decides alone: a policy that overrides victim() itself
        # (a subclass of a built-in) is asked every time.
        self._keyed = type(policy).victim is Policy.victim
        self._epoch = 0
        self._ranked: dict[str, _Ranked] = {}

    def invalidate(self) -> None:
        """The policy's keys may have changed (it observed an acquire, or a step ended)."""
        self._epoch += 1

    def changed(self, block: Block) -> None:
        """``block`` gained or lost a copy: re-weigh it on every tier it is on."""
        for tier in block.tiers:
            r = self._ranked.get(tier)
            if r is not None and r.epoch == self._epoch:
                r.changed.add(block)

    def choose(self, tier: str, blocks: Iterable[Block], info: Callable[[Block], BlockInfo],
               eligible: Callable[[Block], bool]) -> Optional[Block]:
        """The policy's victim among ``blocks`` (every block on ``tier``) that are ``eligible``;
        None if none is."""
        key = self.policy.victim_key(tier) if self._keyed else None
        if key is None:
            candidates = [info(b) for b in blocks if eligible(b)]
            if not candidates:
                return None
            chosen = self.policy.victim(tier, candidates).id
            return next(b for b in blocks if b.id == chosen)
        # Ties go to the largest id, as in Policy.victim: the answer never depends on the order
        # blocks are listed or stored in.
        rank = lambda b: (key(info(b)), b.id)  # noqa: E731
        r = self._ranked.get(tier)
        if r is None or r.epoch != self._epoch:
            order = [(rank(b), b) for b in blocks]
            order.sort(key=lambda e: e[0], reverse=True)
            r = self._ranked[tier] = _Ranked(self._epoch, order)
        best: Optional[tuple[Any, Block]] = None
        for k, b in r.order:
            if b not in r.changed and tier in b.tiers and eligible(b):
                best = (k, b)
                break
        for b in r.changed:
            if tier in b.tiers and eligible(b):
                k = rank(b)
                if best is None or k > best[0]:
                    best = (k, b)
        return None if best is None else best[1]
