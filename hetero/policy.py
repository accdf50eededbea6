"""Placement policies: pure functions of block metadata and access history.

A policy never touches tensors or does I/O. The runtime tells it about every access
(:meth:`Policy.record`) and asks it two questions: which resident block to evict from a full tier
(:meth:`Policy.victim`) and on which tier a newly created block should start (:meth:`Policy.home`).
Because it sees only metadata, a policy can be unit-tested and replayed on a recorded access log
without a model.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from .tiers import HOST, TIER_ORDER


@dataclasses.dataclass(frozen=True)
class BlockInfo:
    """What a policy may know about a block."""

    id: str
    kind: str
    nbytes: int
    clean_below: bool  # a valid copy exists on a slower tier: evicting it writes nothing


class Policy:
    """Base class of placement policies (subclass it to pass an instance as ``policy=``)."""

    name = "base"

    def record(self, block_id: str, step: int, seq: int) -> None:
        """Compute touched ``block_id``; ``seq`` increases with every access of the run."""

    def victim(self, tier: str, candidates: Sequence[BlockInfo]) -> BlockInfo:
        """The block to evict from ``tier``; ``candidates`` is non-empty and all are unpinned."""
        raise NotImplementedError

    def home(self, block: BlockInfo, free: Mapping[str, int]) -> str:
        """Tier on which a new block starts, given each tier's free bytes (fastest first).

        The default takes the fastest tier with room, else the host tier (making room there).
        """
        for tier in TIER_ORDER:
            if free.get(tier, 0) >= block.nbytes:
                return tier
        return HOST


class LRU(Policy):
    """Evict the least recently used block (never-used blocks first, then by id for determinism)."""

    name = "lru"

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def record(self, block_id: str, step: int, seq: int) -> None:
        self._last[block_id] = seq

    def victim(self, tier: str, candidates: Sequence[BlockInfo]) -> BlockInfo:
        return min(candidates, key=lambda b: (self._last.get(b.id, -1), b.id))


def make_policy(policy: "str | Policy") -> Policy:
    """The policy object for a ``policy=`` argument.

    Only LRU exists so far; the names ``auto``, ``opt``, ``hotness`` and ``static`` are accepted
    (the API promises them) and are served by LRU until their own implementations land.
    """
    if isinstance(policy, Policy):
        return policy
    return LRU()
