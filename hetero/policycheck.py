"""What a custom policy's hooks answer, checked before the runtime acts on it.

A policy passed as an instance (``policy=MyPolicy()``) can answer nonsense: a tier that does not
exist, None where a number is due, something other than the (block, tier) pairs of a prefetch
order. Acted on, such an answer would fail deep inside a backward with an error that names
neither the policy nor the hook (a TypeError from a comparison, an AttributeError). So the
runtime asks a policy whose class is not one of hetero's own (a subclass of one included: it
may override any hook) through :class:`Checked`, which raises a HeteroStateError naming the
policy, the hook and what was expected, before anything acts on the answer; nothing has moved
then, so the run can go on once the policy is fixed. hetero's own classes are asked directly:
these calls are on the hot path of every acquire and eviction (``benchmarks/bench_runtime.py``).
The victim a policy names is checked for every policy, in :mod:`hetero.victims`, where the
check costs no more than finding the block did.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, Optional, Sequence

from .errors import HeteroStateError
from .policies import POLICIES, BlockInfo, Policy
from .policies.base import TIER_ORDER

BUILTIN = frozenset(POLICIES.values())


def trusted(policy: Policy) -> bool:
    """Whether ``policy`` is an instance of one of hetero's own classes (not a subclass)."""
    return type(policy) in BUILTIN


def policy_error(policy: Policy, hook: str, what: str) -> HeteroStateError:
    """The error for a policy's hook that misbehaved: ``policy Cls.hook() <what>``."""
    return HeteroStateError(f"policy {type(policy).__name__}.{hook}() {what}")


def bad_answer(policy: Policy, hook: str, answer: Any, expected: str) -> HeteroStateError:
    return policy_error(policy, hook, f"returned {answer!r}; expected {expected}")


_TIERS = f"a tier name ({', '.join(repr(t) for t in TIER_ORDER)})"


class Checked:
    """``policy``'s hooks whose answers the runtime acts on, each answer checked (see the
    module). The other hooks are reached through ``policy`` itself."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    def home(self, block: BlockInfo, free: Mapping[str, int], capacity: Mapping[str, int]) -> str:
        tier = self.policy.home(block, free, capacity)
        if tier not in TIER_ORDER:
            raise bad_answer(self.policy, "home", tier, f"{_TIERS} for new block {block.id!r}")
        return tier

    def settle(self, block: BlockInfo, capacity: Mapping[str, int]) -> Optional[str]:
        tier = self.policy.settle(block, capacity)
        if tier is not None and tier not in TIER_ORDER:
            raise bad_answer(self.policy, "settle", tier, f"None or {_TIERS} for {block.id!r}")
        return tier

    def next_use(self, block_id: str, tier: str) -> float:
        n = self.policy.next_use(block_id, tier)
        if not isinstance(n, numbers.Real) or isinstance(n, bool) or math.isnan(n):
            raise bad_answer(self.policy, "next_use", n, f"a number of accesses (math.inf: not "
                             f"expected) for {block_id!r} on {tier!r}")
        return n

    def upcoming(self, groups: int) -> Sequence[tuple[str, str]]:
        ahead = self.policy.upcoming(groups)
        expected = "a list of (block id, tier name) pairs, [] if unknown"
        if not isinstance(ahead, (list, tuple)):
            raise bad_answer(self.policy, "upcoming", ahead, expected)
        for entry in ahead:
            if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], str)
                    and entry[1] in TIER_ORDER):
                raise policy_error(self.policy, "upcoming", f"returned a list holding {entry!r}; "
                                   f"expected {expected}")
        return ahead


def hooks(policy: Policy) -> "Policy | Checked":
    """What the runtime asks for home, settle, next_use and upcoming: the policy itself where
    it is trusted, else its answers checked."""
    return policy if trusted(policy) else Checked(policy)
