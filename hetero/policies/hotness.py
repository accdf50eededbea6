"""Hotness: predict each block's next use from how often and how recently it was used.

Usable with no recorded step at all. A block's reuse distance (accesses between consecutive
uses) is smoothed; its predicted next use is its last use plus that distance (an overdue block
is predicted as far ahead as it is overdue). Blocks used once (or not yet) are predicted far
away, larger ones first, so the cold and the big leave first.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from .base import BlockInfo, Policy


class Hotness(Policy):
    name = "hotness"

    def __init__(self) -> None:
        self._last: dict[str, int] = {}
        self._reuse: dict[str, float] = {}
        self.now = 0

    def observe(self, blocks: Sequence[str], tier: str, step: int, seq: int,
                write: bool = False) -> None:
        for i, b in enumerate(blocks):
            s = seq + i
            if b in self._last:
                d = s - self._last[b]
                r = self._reuse.get(b)
                self._reuse[b] = d if r is None else 0.5 * r + 0.5 * d
            self._last[b] = s
        self.now = seq + len(blocks)

    def predicted(self, block_id: str) -> float:
        """Predicted accesses from now until ``block_id`` is used again (inf: no estimate).

        A block past its due time without having been used (an expert the router stopped
        picking, a gradient whose backward is over) is predicted as far again as it is overdue,
        not "now": the longer it is overdue, the less it is expected back."""
        r = self._reuse.get(block_id)
        if r is None:
            return math.inf
        return abs(self._last[block_id] + r - self.now)

    def victim_key(self, tier: str) -> Callable[[BlockInfo], Any]:
        """Furthest predicted use first, then clean, larger, least recently used."""
        return lambda b: (self.predicted(b.id), b.clean_below, b.nbytes, -self._last.get(b.id, -1), b.id)

    def next_use(self, block_id: str, tier: str) -> float:
        return self.predicted(block_id)
