"""What happened, in order: every runtime call (the event log a simulator replays), every access
compute made to a block, every move between tiers, stalls, and per-tier usage over time.

The access log is complete by construction: the runtime records an access inside ``acquire``,
which is the only way compute gets at a block. Moves, stalls and compute spans carry wall-clock
timestamps (seconds since the tracker was created) for the Chrome trace and the usage plot.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional


@dataclasses.dataclass(frozen=True)
class Access:
    """One block touched by compute: the public access-log line, plus the acquire it belonged to
    (``group``) and whether it was written."""

    step: int
    seq: int
    block: str
    bytes: int
    tier: str
    group: int = 0
    write: bool = False

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
    prefetch: bool = False


DIRECTIONS = ("host->device", "device->host", "nvme->host", "host->nvme")


@dataclasses.dataclass
class BlockStats:
    """Per-block statistics the hotness policy and the report use (positions are access seqs)."""

    accesses: int = 0
    in_logs: int = 0  # of them, those the access log still holds (all, unless it is bounded)
    last: int = -1
    reuse_ewma: Optional[float] = None  # smoothed distance between consecutive accesses
    per_step: dict[int, int] = dataclasses.field(default_factory=dict)

    def touch(self, seq: int, step: int) -> None:
        if self.last >= 0:
            d = seq - self.last
            self.reuse_ewma = d if self.reuse_ewma is None else 0.5 * self.reuse_ewma + 0.5 * d
        self.accesses += 1
        self.in_logs += 1
        self.last = seq
        self.per_step[step] = self.per_step.get(step, 0) + 1


class Tracker:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.events: list[tuple[Any, ...]] = []  # runtime calls in order, see Runtime for the ops
        self.accesses: list[Access] = []
        self.moves: list[Move] = []
        self.usage: list[tuple[float, str, int]] = []  # (time, tier, bytes used after the change)
        self.stalls: list[tuple[float, float, str]] = []  # (start, end, block) waits for data
        # (what, phase, start, end): a unit's forward / backward / recompute, the optimizer's step
        self.computes: list[tuple[str, str, float, float]] = []
        self.stall_seconds = 0.0  # all of them, since the start (the list may be a window)
        self.optimizer_stall_seconds = 0.0  # the part of them spent on deferred optimizer updates
        self.step_stall: list[float] = []  # stall seconds per step (the first steps record and warm up)
        self.traffic = {d: 0 for d in DIRECTIONS}
        self.step_traffic: list[dict[str, int]] = []  # the same, per step
        self.stats: dict[str, BlockStats] = {}
        self.step = 0
        self.groups = 0
        self.prefetched: set[str] = set()  # on the device thanks to a prefetch, not used yet
        self.misses = 0  # recorded acquires whose block was not on the requested tier
        self.prefetch_issued = 0
        self.prefetch_hits = 0
        self.access_count = 0  # accesses recorded so far (the next one's seq)
        # The window (wrap's log_steps): the logs hold steps from first_step on (all: 0).
        self.keep_steps: Optional[int] = None
        self.first_step = 0
        self._dropped_events = 0
        self._step_starts: dict[int, tuple[float, int]] = {0: (0.0, 0)}  # step -> (time, event index)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def event(self, *ev: Any) -> None:
        self.events.append(ev)

    @property
    def event_count(self) -> int:
        """Events recorded so far, those dropped by ``keep_steps`` included."""
        return self._dropped_events + len(self.events)

    def access(self, block: str, nbytes: int, tier: str, group: int, write: bool) -> Access:
        a = Access(self.step, self.access_count, block, nbytes, tier, group, write)
        self.access_count += 1
        self.accesses.append(a)
        stats = self.stats.get(block)
        if stats is None:
            stats = self.stats[block] = BlockStats()
        stats.touch(a.seq, a.step)
        if block in self.prefetched:
            self.prefetched.discard(block)
            self.prefetch_hits += 1
        return a

    def count(self, block: str, src: str, dst: str, nbytes: int, prefetch: bool = False) -> None:
        """A transfer was issued: the traffic counters (a run's and its replay's agree on these)."""
        self.traffic[f"{src}->{dst}"] += nbytes
        while len(self.step_traffic) <= self.step:
            self.step_traffic.append({d: 0 for d in DIRECTIONS})
        self.step_traffic[self.step][f"{src}->{dst}"] += nbytes

    def move(self, block: str, src: str, dst: str, nbytes: int, start: float, end: float,
             prefetch: bool = False) -> None:
        """A transfer finished: when it ran (for the trace and the plot)."""
        self.moves.append(Move(block, src, dst, nbytes, start, end, prefetch))

    def used(self, tier: str, used: int) -> None:
        self.usage.append((self.now(), tier, used))

    def stall(self, start: float, end: float, block: str, optimizer: bool = False) -> None:
        """Compute waited for ``block`` from ``start`` to ``end``; ``optimizer``: for a deferred
        optimizer update of it to finish (not for a transfer)."""
        self.stalls.append((start, end, block))
        self.stall_seconds += end - start
        while len(self.step_stall) <= self.step:
            self.step_stall.append(0.0)
        self.step_stall[self.step] += end - start
        if optimizer:
            self.optimizer_stall_seconds += end - start

    def next_step(self) -> None:
        """A step ended. With ``keep_steps``, drop what the logs hold of steps before the last
        ``keep_steps`` (done once they hold twice that, so each entry is looked at twice). The
        logs are only ever appended to, and replaced to drop entries, never changed in place: a
        report's snapshot is a list and its length (:meth:`Report.from_state`)."""
        self.step += 1
        if self.keep_steps is None:
            return
        self._step_starts[self.step] = (self.now(), self._dropped_events + len(self.events))
        first = self.step - self.keep_steps
        if first - self.first_step < self.keep_steps:
            return
        t_cut, e_cut = self._step_starts[first]
        self.accesses = [a for a in self.accesses if a.step >= first]
        self.moves = [m for m in self.moves if m.start >= t_cut]
        self.usage = [u for u in self.usage if u[0] >= t_cut]
        self.stalls = [s for s in self.stalls if s[0] >= t_cut]
        self.computes = [c for c in self.computes if c[2] >= t_cut]
        self.events = self.events[e_cut - self._dropped_events:]
        self._dropped_events = e_cut
        self._step_starts = {s: v for s, v in self._step_starts.items() if s >= first}
        for stats in self.stats.values():
            stats.in_logs -= sum(n for s, n in stats.per_step.items() if s < first)
            stats.per_step = {s: n for s, n in stats.per_step.items() if s >= first}
        self.first_step = first

    def compute(self, what: str, phase: str, start: float) -> None:
        """Compute ran from ``start`` until now: ``phase`` (forward, backward, recompute, step)
        of ``what`` (a wrapped unit, the optimizer), for the trace and the plot."""
        self.computes.append((what, phase, start, self.now()))

