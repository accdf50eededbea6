"""What happened, in order: every access compute made to a block, every move between tiers, and
per-tier usage over time.

The access log is complete by construction: the runtime records an access inside ``acquire``,
which is the only way compute gets at a block. Moves and stalls carry wall-clock timestamps (seconds
since the tracker was created) for the Chrome trace and the usage plot.
"""

from __future__ import annotations

import dataclasses
import time


@dataclasses.dataclass(frozen=True)
class Access:
    step: int
    seq: int
    block: str
    bytes: int
    tier: str

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Move:
    block: str
    src: str
    dst: str
    bytes: int
    start: float
    end: float


DIRECTIONS = ("host->device", "device->host", "nvme->host", "host->nvme")


class Tracker:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.accesses: list[Access] = []
        self.moves: list[Move] = []
        self.usage: list[tuple[float, str, int]] = []  # (time, tier, bytes used after the change)
        self.stalls: list[tuple[float, float, str]] = []  # (start, end, block) waits for data
        self.traffic = {d: 0 for d in DIRECTIONS}
        self.step = 0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def access(self, block: str, nbytes: int, tier: str) -> int:
        seq = len(self.accesses)
        self.accesses.append(Access(self.step, seq, block, nbytes, tier))
        return seq

    def move(self, block: str, src: str, dst: str, nbytes: int, start: float, end: float) -> None:
        self.moves.append(Move(block, src, dst, nbytes, start, end))
        self.traffic[f"{src}->{dst}"] += nbytes

    def used(self, tier: str, used: int) -> None:
        self.usage.append((self.now(), tier, used))

    def stall(self, start: float, end: float, block: str) -> None:
        self.stalls.append((start, end, block))

    @property
    def stall_seconds(self) -> float:
        return sum(e - s for s, e, _ in self.stalls)
