"""ZeRO-Infinity-like fixed homes: parameters and gradients live in host memory and stream to the
device for every use; optimizer states live in host memory, or on NVMe when host is short."""

from __future__ import annotations

from typing import Mapping

from .base import HOST, NVME, BlockInfo
from .lru import LRU


class Static(LRU):
    """Fixed homes by kind (never the device); LRU decides what leaves a full tier."""

    name = "static"

    def home(self, block: BlockInfo, free: Mapping[str, int], capacity: Mapping[str, int]) -> str:
        if free.get(HOST, 0) >= block.nbytes or NVME not in free:
            return HOST
        return NVME
