"""Least recently used: the baseline every other policy must beat."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from .base import BlockInfo, Policy


class LRU(Policy):
    """Evict the least recently used block (never-used blocks first, the largest id first)."""

    name = "lru"

    def __init__(self) -> None:
        self._last: dict[str, int] = {}
        self._seen: set[str] = set()  # observed since changed_keys: only their keys changed

    def observe(self, blocks: Sequence[str], tier: str, step: int, seq: int,
                write: bool = False) -> None:
        for i, b in enumerate(blocks):
            self._last[b] = seq + i
        self._seen.update(blocks)

    def victim_key(self, tier: str) -> Callable[[BlockInfo], Any]:
        return lambda b: (-self._last.get(b.id, -1), b.id)

    def changed_keys(self) -> set[str]:
        seen, self._seen = self._seen, set()
        return seen
