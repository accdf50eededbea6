"""Random programs against the runtime over real swap files that hold stale bytes, transfers
running asynchronously under tight budgets with every policy: whatever is acquired (one or two
blocks, read or written, on the device or the host), read, discarded, created zero-filled on
NVMe (never written there: its first fetch is a fill), rolled back or committed, at whatever
step end or drain, and whatever transfer fails, every copy read holds the block's last written
value (zeros for one never written), the budgets and slots account exactly for the copies, and
the event log of a program that met no HeteroOOMError replays to the same traffic, failed
transfers and all. (Budgets are below what wrap() accepts, so a block spanning two slots may
find no contiguous run: HeteroOOMError, then unpin_all as the wrapper does.) Grew from a review's fuzzer of the zero-filled NVMe blocks."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from hetero import engine
from hetero.errors import HeteroIOError, HeteroOOMError
from hetero.simulator import replay
from hetero.tiers import DEVICE, HOST, NVME
from test_runtime_async import SLOT, TB, invariants, rig  # noqa: F401  (rig: a fixture)

PROGRAMS = int(os.environ.get("HETERO_FUZZ_PROGRAMS", "40"))


def _stale_swap_files(rt) -> None:
    """Fill every swap file with 777.0s: a slot read before it was written shows them."""
    swap = rt.storage.swap
    for i, n in enumerate(swap.slots):
        with open(os.path.join(swap.dir, f"swap-{i}.bin"), "r+b") as f:
            f.write(torch.full((n * SLOT // 4,), 777.0).numpy().tobytes())
            f.flush()
            os.fsync(f.fileno())


def _run(seed: int, rig, faults: bool) -> None:
    rng = random.Random(seed)
    sizes = [rng.choice([512, 1024, 1024, 2048]) for _ in range(rng.randint(4, 9))]
    slots = sum(-(-n * 4 // SLOT) for n in sizes)
    policy, prefetch = rng.choice(["lru", "auto", "opt", "hotness"]), rng.choice([0, 1, 2])
    rt = rig(rng.randint(4, 7), rng.randint(4, 8), rng.choice([slots + 4, 2 * slots + 4]), policy=policy,
             prefetch=prefetch, largest=2 * SLOT)
    _stale_swap_files(rt)
    blocks = [TB(f"b{i}", n) for i, n in enumerate(sizes)]
    if rng.random() < 0.5:  # chunks of two blocks: a rollback keeps a chunk whole where one is lost
        blocks = [TB(f"c{i // 2}.b{i}", n) for i, n in enumerate(sizes)]
        for b in blocks:
            b.chunk_id = b.id.split(".")[0]  # (as the simulator's blocks take it from the id)
    want: dict[str, float] = {}  # last value written per block (absent: zeros)
    before_txn: dict[str, float] = {}  # per block shadowed in the open transaction: its value then
    oomed = False  # (a replay stops at its first HeteroOOMError, where the program went on)

    def roll_back() -> None:
        txn = rt._txn
        shadows, created = set(txn.shadows), set(txn.created)
        kept = {b.chunk_id for b in txn.lost}
        try:
            rt.rollback()
        finally:
            for b in blocks:
                if b.chunk_id in kept:
                    continue
                if b in shadows:
                    if b.id in before_txn:
                        want[b.id] = before_txn[b.id]
                    else:
                        want.pop(b.id, None)
                elif b in created:
                    want.pop(b.id, None)

    for _ in range(250):
        for b in rt._zero:
            assert NVME in b.tiers, f"{b} is marked never written but has no NVMe copy"
        r = rng.random()
        try:
            if faults and rng.random() < 0.03:
                engine.inject_fault(rng.choice(["eio", "short"]), rng.randint(0, 3))
            if r < 0.45:  # acquire one or two blocks, check them, maybe write them
                chosen = rng.sample(blocks, rng.randint(1, 2))
                tier, write = rng.choice([DEVICE, HOST]), rng.random() < 0.5
                txn = rt._txn
                if txn is not None and tier == DEVICE and any(txn.shadows.get(b, ("",))[0] == DEVICE for b in chosen):
                    continue  # (the runtime never fetches a block onto its own device shadow)
                if txn is not None and write:
                    for b in chosen:
                        try:
                            rt.ensure_shadow(b, tier)
                        except HeteroOOMError:
                            oomed = True
                shadowed = set(txn.shadows) if txn is not None else set()
                values = dict(want)
                try:
                    rt.acquire(chosen, tier, write=write)
                except HeteroOOMError:
                    rt.unpin_all()
                    oomed = True
                    continue
                if txn is not None:
                    for b in set(txn.shadows) - shadowed:
                        if b.id in values:
                            before_txn[b.id] = values[b.id]
                        else:
                            before_txn.pop(b.id, None)
                for b in chosen:
                    got = rt.data(b, tier)
                    assert torch.all(got == want.get(b.id, 0.0)), f"{b.id} on {tier}: {got[:3]}, want {want.get(b.id, 0.0)}"
                    if write:
                        want[b.id] = float(rng.randint(1, 999))
                        got.fill_(want[b.id])
                rt.release(chosen, tier)
            elif r < 0.55:  # discard a block, mostly making it anew on NVMe
                b = rng.choice(blocks)
                if not any(b.pins.values()):
                    rt.discard(b)
                    want.pop(b.id, None)
                    if rng.random() < 0.7:
                        rt.create(b, tier=NVME)
            elif r < 0.6:
                rt.end_step()
            elif r < 0.65:
                rt.drain()
            elif r < 0.72:
                if rt._txn is None:
                    rt.begin()
                    before_txn.clear()
                elif rng.random() < 0.5:
                    rt.commit()
                else:
                    roll_back()
            else:
                b = rng.choice(blocks)
                if b.tiers:
                    try:
                        value = rt.read(b)
                    except HeteroOOMError:
                        rt.unpin_all()
                        oomed = True
                        continue
                    assert torch.all(value == want.get(b.id, 0.0)), f"read {b.id}: {value[:3]}, want {want.get(b.id, 0.0)}"
        except HeteroIOError:
            rt.unpin_all()
            if rt._txn is not None:
                try:
                    roll_back()
                except HeteroIOError:
                    pass
    engine.inject_fault("none")
    if rt._txn is not None:
        rt.commit()
    try:
        rt.drain()
    except HeteroIOError:
        rt.drain()
    invariants(rt)
    for b in blocks:
        if b.tiers:
            assert torch.all(rt.read(b) == want.get(b.id, 0.0)), b.id
    if not oomed:  # the event log, as saved and loaded (JSON), replays to the same traffic (failed
        # transfers included: the replay fails them where the program found them failed)
        events = [tuple(tuple(x) if isinstance(x, list) else x for x in json.loads(json.dumps(e)))
                  for e in rt.tracker.events]
        sim = replay(events, {b.id: (b.kind, b.nbytes) for b in blocks}, policy,
                     {n: t.capacity for n, t in rt.tiers.items()}, SLOT, prefetch=prefetch)
        assert sim.oom is None and sim.traffic == dict(rt.tracker.traffic)


@pytest.mark.parametrize("faults", [False, True], ids=["clean", "faults"])
@pytest.mark.parametrize("seed", range(PROGRAMS))
def test_random_programs_read_what_was_written(seed: int, faults: bool, rig) -> None:
    _run(seed, rig, faults)
