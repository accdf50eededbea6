"""Review tests of the asynchronous runtime (hetero/runtime.py): ordering of transfers, the undo
of failed transfers (``_recover``), transactions and the optimizer step built on them, and the
simulator's agreement with a real run.

Each is a property that holds and should keep holding; several began as reproductions of bugs
found in review.

Runtime-level tests drive a :class:`Runtime` directly over real storage (host arena, swap files)
with small tensor-backed blocks, so every sequence is exact. Model-level tests use the GPT of
``tests/models.py``. Faults are deterministic: :func:`faults` makes the k-th transfer to or from
NVMe *issued* from a given point fail (issue order is logical, hence the same in every run), or
``engine.inject_fault`` where the next swap request is known.
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
import time
from typing import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hetero
import hetero.runtime as R
from hetero import copies, engine
from hetero.errors import HeteroIOError, HeteroOOMError
from hetero.policies import Policy, make_policy
from hetero.simulator import SimBlock, SimStorage
from hetero.tiers import DEVICE, HOST, NVME, HostArena, Scattered, SwapSpace, TierStorage
from helpers import default_step
from models import GPT, batches, state_bytes
from test_faults import assert_same_state, snapshot

SLOT = 4096


# ---------------------------------------------------------------------------------------- harness


class TB:
    """A tensor-backed block of ``numel`` float32 (not a param block: no parameter views)."""

    def __init__(self, name: str, numel: int, kind: str = "exp_avg") -> None:
        self.id, self.kind, self.dtype, self.numel = name, kind, torch.float32, numel
        self.chunk_id = name  # a chunk of its own
        self.nbytes = numel * 4
        self.device = None
        self.host_offset = None
        self.nvme_loc = None
        self.tiers: set[str] = set()
        self.pins: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"TB({self.id}, tiers={sorted(self.tiers)}, pins={self.pins})"


class Scripted(Policy):
    """A policy whose victims, next uses and upcoming acquires the test dictates."""

    name = "scripted"

    def __init__(self) -> None:
        self.up: list[tuple[str, str]] = []
        self.uses: dict[str, float] = {}
        self.prefer: list[str] = []

    def victim(self, tier, candidates):
        for want in self.prefer:
            for c in candidates:
                if c.id == want:
                    return c
        return candidates[0]

    def upcoming(self, groups):
        return self.up[:groups]

    def next_use(self, block_id, tier):
        return self.uses.get(block_id, math.inf)


class _Failing:
    """A transfer handle that never finishes and fails when waited for."""

    def done(self) -> bool:
        return False

    def wait(self) -> None:
        raise HeteroIOError("injected: the transfer failed")


def failing_sim_storage(block_id: str, src: str, dst: str) -> type:
    """SimStorage whose transfer of ``block_id`` from ``src`` to ``dst`` fails when waited for."""

    class Storage(SimStorage):
        def copy(self, block, src_, src_loc, dst_, dst_loc, nth=0):
            if block.id == block_id and (src_, dst_) == (src, dst):
                return _Failing()
            return super().copy(block, src_, src_loc, dst_, dst_loc, nth)

    return Storage


def bounded_drain(rt: R.Runtime, stall: bool = False) -> None:
    """``Runtime.drain`` that raises instead of spinning forever on an op left behind in a
    terminal state (what a crash inside ``_recover`` leaves)."""
    rt._pump()  # (as drain: a failure a release found raises here)
    while rt._ops:
        op = rt._ops.first()
        if op.state not in ("queued", "running"):
            raise RuntimeError(f"drain would spin forever: {op} is still listed as in flight")
        rt._wait_for([op], stall)


def guard(rt: R.Runtime) -> R.Runtime:
    rt._drain = lambda stall=False: bounded_drain(rt, stall)  # drain's, _rollback's and close's
    return rt


def safe_close(rt: R.Runtime) -> None:
    try:
        bounded_drain(rt)
    except BaseException:
        pass
    finally:
        rt.storage.close()


def invariants(rt: R.Runtime) -> None:
    """After a drain: nothing in flight, budgets match the blocks' copies, every slot is owned by
    a block listing that tier (and every such block owns its slots), device memory is allocated
    exactly for the blocks on the device."""
    assert not rt._ops, rt._ops
    assert rt._txn is None
    assert all(NVME in b.tiers for b in rt._zero), "a block marked never written has no NVMe copy"
    for name, t in rt.tiers.items():
        expect = sum(rt._size_on(name, b) for b in rt.blocks() if name in b.tiers)
        assert t.used == expect, f"{name}: used {t.used} != {expect} (sum of its copies)"
        assert t.used <= t.capacity
    for tier in (HOST, NVME):
        if tier not in rt.tiers:
            continue
        owners = set()
        for p, pool in enumerate(rt.storage.pools(tier)):
            for off, o in pool.blocks():
                assert tier in o.tiers, f"{tier} offset {off} owned by {o!r}, which has no copy there"
                loc = rt.storage.loc(o, tier)
                if isinstance(loc, Scattered):  # extents apart; the pool names each part
                    assert (p, off) in {e[:2] for e in loc}, f"{o} is at {loc}, one of its parts at {(p, off)}"
                else:
                    assert loc == (off if tier == HOST else (p, off)), f"{o} is at {loc}, its slots at {off}"
                owners.add(id(o))
        for b in rt.blocks():
            if tier in b.tiers:
                assert rt.storage.loc(b, tier) is not None and id(b) in owners, f"{b} owns no {tier} slots"
    for b in rt.blocks():
        dev = getattr(b, "device", None)
        if isinstance(dev, torch.Tensor):
            allocated = dev.untyped_storage().nbytes() > 0
            assert allocated == (DEVICE in b.tiers), f"{b}: device memory allocated={allocated}"


@pytest.fixture
def rig():
    """make(device, host, nvme, policy=..., prefetch=..., largest=..., sim=False) -> Runtime with
    capacities in slots; real storage (swap files in a temp dir) unless ``sim``."""
    made: list[R.Runtime] = []
    dirs: list[str] = []

    def make(device: int, host: int, nvme: int = 0, policy="lru", prefetch: int = 0,
             largest: int = SLOT, sim: bool = False) -> R.Runtime:
        caps = {DEVICE: device * SLOT, HOST: host * SLOT}
        if nvme:
            caps[NVME] = nvme * SLOT
        pol = make_policy(policy) if isinstance(policy, str) else policy
        if sim:
            return R.Runtime(caps, SLOT, pol, SimStorage(caps, SLOT), prefetch)
        swap = None
        if nvme:
            dirs.append(tempfile.mkdtemp(prefix="hetero-review-"))
            swap = SwapSpace(dirs[-1], nvme * SLOT, SLOT, largest)
        rt = guard(R.Runtime(caps, SLOT, pol, TierStorage(torch.device("cpu"), HostArena(host, SLOT, pin=False), swap),
                             prefetch))
        made.append(rt)
        return rt

    yield make
    engine.inject_fault("none")
    for rt in made:
        safe_close(rt)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def swapdir():
    d = tempfile.mkdtemp(prefix="hetero-review-")
    yield d
    engine.inject_fault("none")
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def faults(monkeypatch):
    """``arm(k, kind)``: the k-th transfer to or from NVMe issued from now on fails (once).
    ``count()``: NVMe transfers issued since the last ``arm``/``count`` reset."""
    st_ = {"k": None, "n": 0, "kind": "eio"}

    class ArmedOp(R.Op):
        __slots__ = ("fail",)

        def __init__(self, seq, block, src, dst, *rest, **kw):
            super().__init__(seq, block, src, dst, *rest, **kw)
            self.fail = None
            if src is not None and dst is not None and NVME in (src, dst):
                if st_["k"] is not None and st_["n"] == st_["k"]:
                    self.fail, st_["k"] = st_["kind"], None
                st_["n"] += 1

    real_start = R.Runtime._start

    def start(self, op):
        if getattr(op, "fail", None):
            engine.inject_fault(op.fail, 0)  # consumed by this op's submission, right below
        real_start(self, op)

    monkeypatch.setattr(R, "Op", ArmedOp)
    monkeypatch.setattr(R.Runtime, "_start", start)

    class Faults:
        @staticmethod
        def arm(k: int, kind: str = "eio") -> None:
            st_.update(k=k, n=0, kind=kind)

        @staticmethod
        def reset() -> None:
            st_.update(k=None, n=0)

        @staticmethod
        def count() -> int:
            return st_["n"]

    yield Faults
    engine.inject_fault("none")


def make_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(n_layer=2)


TOTAL = state_bytes(make_gpt())


def wrap_gpt(path: str, device: float, host: float, policy: str = "auto", **kw) -> hetero.HeteroModule:
    model = hetero.wrap(make_gpt(), device="cpu", device_budget=int(TOTAL * device),
                        host_budget=int(TOTAL * host), nvme_path=path, nvme_budget=int(TOTAL * 4),
                        chunk_size="8KiB", policy=policy, **kw)
    guard(model._hetero_state.runtime)
    return model


def close_model(model: hetero.HeteroModule) -> None:
    safe_close(model._hetero_state.runtime)


def ready_for_step(path: str, device: float, host: float, policy: str):
    """Two training steps, then the third's backward: gradients are waiting for opt.step()."""
    model = wrap_gpt(path, device, host, policy)
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    data = batches(3, seed=1)
    for b in data[:2]:
        default_step(model, opt, b)
    x, y = data[2]
    model(x, y).backward()
    rt = model._hetero_state.runtime
    rt.drain()
    return model, opt, rt


# ------------------------------------------------------------------- bugs: undo of failed transfers


def test_failure_while_a_started_hold_op_is_in_flight_is_undone(rig) -> None:
    rt = rig(4, 2, 8)
    a, c = TB("a", 1024), TB("c", 1024)
    rt.create(c, torch.ones(1024), tier=NVME)
    rt.drain()
    rt.create(a, torch.ones(1024), tier=NVME)  # a's write to NVMe is in flight ...
    rt.discard(a)  # ... so freeing its NVMe copy is a hold op queued behind it
    write_back = rt._ops.first()
    write_back.handle.wait()  # the write is done; the next _pump retires it and starts the hold
    engine.inject_fault("eio", 0)  # c's read, issued by the same acquire, fails
    with pytest.raises(HeteroIOError):
        rt.acquire([c], HOST)
    assert not c.pins.get(HOST)
    bounded_drain(rt)
    assert c.tiers == {NVME} and not a.tiers
    invariants(rt)


def test_undo_of_a_cancelled_nvme_hold_stays_within_the_budget(rig) -> None:
    pol = Scripted()
    # NVMe budget 3 slots; the 2-slot block makes it 2 files x 2 slots = 4 physical slots.
    rt = rig(4, 2, 3, policy=pol, prefetch=1, largest=2 * SLOT)
    s, v, big, w, t, q = (TB("s", 1024), TB("v", 1024), TB("big", 2048), TB("w", 1024),
                          TB("t", 1024), TB("q", 1024))
    value = torch.arange(1024, dtype=torch.float32)
    rt.create(s, tier=NVME)
    rt.create(v, value, tier=NVME)
    rt.drain()
    rt.discard(s)  # a free slot below v's ...
    rt.create(big, tier=NVME)  # ... that the 2-slot block cannot use: NVMe budget now full
    rt.create(w, tier=HOST)
    rt.create(t, tier=DEVICE)
    rt.create(q, tier=DEVICE)
    rt.drain()
    assert rt.tiers[NVME].free == 0 and v.nvme_loc[1] > 0
    # One acquire's prefetch: read v into host (this read will fail), then make host room for q
    # by writing w to NVMe, which takes the budget of v's NVMe copy (dropped: v is on host too).
    pol.up, pol.uses, pol.prefer = [("v", HOST), ("q", HOST)], {"v": 1, "q": 2}, ["w"]
    engine.inject_fault("eio", 0)
    rt.acquire([t], DEVICE)
    pol.up = []
    rt.release([t], DEVICE)
    with pytest.raises(HeteroIOError):
        rt.drain()
    assert NVME in v.tiers
    assert torch.equal(rt.read(v), value)
    bounded_drain(rt)
    invariants(rt)


def _zero_block_over_stale_bytes(rig) -> tuple[R.Runtime, TB]:
    """A zero-filled block ``z`` created on NVMe in the slots an earlier block filled with 7s."""
    rt = rig(4, 2, 8, policy=Scripted())
    old, z = TB("old", 1024), TB("z", 1024)
    rt.create(old, torch.full((1024,), 7.0), tier=NVME)
    rt.drain()
    loc = old.nvme_loc
    rt.discard(old)
    rt.create(z, tier=NVME)
    assert z.tiers == {NVME} and z.nvme_loc == loc, "the test needs z in the slots old wrote"
    return rt, z


def _read(rt: R.Runtime, block: TB) -> torch.Tensor:
    rt.acquire([block], HOST)
    try:
        return rt.data(block, HOST).clone()
    finally:
        rt.release([block], HOST)


def test_a_zero_filled_block_homed_on_nvme_is_neither_written_nor_read_until_it_changes(rig) -> None:
    """A new zero-filled block homed on NVMe (an Adam state in its first step) takes its NVMe
    slots and nothing else: no write, and its first fetch fills the host copy with zeros instead
    of reading the slots (which hold an older block's bytes here). Once written it goes down and
    comes back as any block does."""
    rt, z = _zero_block_over_stale_bytes(rig)
    assert rt.tiers[NVME].used == rt._size_on(NVME, z)  # its room is taken all the same
    assert rt.tracker.traffic["host->nvme"] == 4096  # old's write only
    assert torch.equal(_read(rt, z), torch.zeros(1024))
    assert rt.tracker.traffic["nvme->host"] == 0 and z.tiers == {HOST, NVME}
    rt.acquire([z], HOST, write=True)
    rt.data(z, HOST).fill_(3.0)
    rt.release([z], HOST)
    rt.policy.prefer = ["z"]
    a, b = TB("a", 1024), TB("b", 1024)
    rt.create(a, tier=HOST)
    rt.create(b, tier=HOST)  # the host is full: z goes down, written this time
    rt.drain()
    assert z.tiers == {NVME} and rt.tracker.traffic["host->nvme"] == 2 * 4096
    assert torch.equal(_read(rt, z), torch.full((1024,), 3.0))
    assert rt.tracker.traffic["nvme->host"] == 4096
    bounded_drain(rt)
    invariants(rt)


@pytest.mark.parametrize("end", ["rollback", "commit"])
def test_a_never_written_nvme_copy_kept_as_a_shadow_reads_as_zeros_after_a_rollback(rig, end: str) -> None:
    """Writing such a block inside a transaction keeps its NVMe copy as the shadow; a rollback
    gives it back, still reading as zeros (not the slots' stale bytes), a commit keeps the write."""
    rt, z = _zero_block_over_stale_bytes(rig)
    rt.begin()
    rt.acquire([z], HOST, write=True)
    assert rt._txn.shadows[z][0] == NVME
    rt.data(z, HOST).fill_(3.0)
    rt.release([z], HOST)
    getattr(rt, end)()
    expect = torch.zeros(1024) if end == "rollback" else torch.full((1024,), 3.0)
    assert z.tiers == ({NVME} if end == "rollback" else {HOST})
    assert torch.equal(_read(rt, z), expect)
    assert rt.tracker.traffic["nvme->host"] == 0
    bounded_drain(rt)
    invariants(rt)


def _fill_behind_a_failing_write() -> tuple[R.Runtime, TB]:
    """Sim storage where x's write-out to NVMe fails; z, never written, is fetched into the host
    slot x leaves, so z's fill queues behind that write. NVMe (2 slots) and host are full."""
    caps = {DEVICE: 4 * SLOT, HOST: 2 * SLOT, NVME: 2 * SLOT}
    pol = Scripted()
    rt = guard(R.Runtime(caps, SLOT, pol, failing_sim_storage("x", HOST, NVME)(caps, SLOT), prefetch=1))
    z, x, y = (TB(n, 1024) for n in "zxy")
    rt.create(z, tier=NVME)
    rt.create(x, tier=HOST)
    rt.create(y, tier=HOST)
    pol.prefer = ["x", "y", "z"]
    rt.hint([([z], HOST)])
    return rt, z


def test_a_cancelled_fill_of_a_never_written_block_gives_its_nvme_copy_back() -> None:
    """z's first fetch (a fill: z was never written) waits for x's write-out from the same host
    slot; meanwhile NVMe takes z's slots back (z looks clean on the host); then x's write fails
    and the fill is cancelled. z gets its NVMe copy back, still reading as zeros, as a block
    whose read was cancelled gets its NVMe copy back (it had none left: found by review)."""
    rt, z = _fill_behind_a_failing_write()
    v = TB("v", 1024)
    drops = []
    real_drop = rt._drop
    rt._drop = lambda block, tier: (drops.append((block.id, tier)), real_drop(block, tier))
    with pytest.raises(HeteroIOError):  # (v's own fill waits for x's write too)
        rt.acquire([v], HOST)  # the host is full: y goes down, for which NVMe drops z's copy
    assert ("z", NVME) in drops
    assert z.tiers == {NVME} and z in rt._zero
    bounded_drain(rt)
    invariants(rt)


def test_a_never_written_block_waits_for_the_nvme_slots_it_takes_to_be_given_back() -> None:
    """w, new and zero-filled, takes the NVMe slots z's copy just gave up while an op still
    reads them (z's fill, queued behind x's write-out). x's write fails: undoing gives z its
    slots back, so w's claim on them is undone first and w is left with no copy, as a block
    whose creation failed (it is made again, zero-filled, at its first use). Before, w held the
    slots with no op and undoing z's hold found them taken (found by review)."""
    rt, z = _fill_behind_a_failing_write()
    w = TB("w", 1024)
    slots = z.nvme_loc
    rt.create(w, tier=NVME)  # NVMe is full: z's clean copy goes, and w takes its slots
    assert w.nvme_loc == slots and NVME not in z.tiers
    with pytest.raises(HeteroIOError):
        rt.drain()
    assert z.tiers == {NVME} and z.nvme_loc == slots and z in rt._zero and not w.tiers
    bounded_drain(rt)
    invariants(rt)


def test_a_discarded_block_stays_discarded_when_an_earlier_transfer_fails(rig) -> None:
    rt = rig(4, 2, 8)
    a = TB("a", 1024)
    engine.inject_fault("eio", 0)  # a's write to NVMe fails
    rt.create(a, torch.full((1024,), 5.0), tier=NVME)
    rt.discard(a)
    with pytest.raises(HeteroIOError):
        rt.drain()
    assert not a.tiers, f"discarded block came back: {a}"
    invariants(rt)


def test_end_step_ends_the_step_even_when_an_earlier_transfer_failed(rig) -> None:
    rt = rig(4, 2, 8)
    a = TB("a", 1024)
    engine.inject_fault("eio", 0)
    rt.create(a, torch.ones(1024), tier=NVME)  # its write to NVMe fails in the background
    while not rt._ops.first().handle.done():
        pass
    step = rt.tracker.step
    with pytest.raises(HeteroIOError):
        rt.end_step()
    assert rt.tracker.step == step + 1, "the event log says the step ended, the run says it did not"


# ------------------------------------------------------------- bugs: exception safety of acquire


def test_acquire_that_runs_out_of_room_leaves_no_pins(rig) -> None:
    rt = rig(1, 4, sim=True)
    a, b = SimBlock("a", "exp_avg", SLOT), SimBlock("b", "exp_avg", SLOT)
    rt.create(a, tier=HOST)
    rt.create(b, tier=HOST)
    with pytest.raises(HeteroOOMError):
        rt.acquire([a, b], DEVICE)
    assert not a.pins.get(DEVICE) and not b.pins.get(DEVICE), (a.pins, b.pins)


def _fragmented_host(rig, in_txn: bool):
    """Host of 3 slots: [free, q, free]; p (2 slots) on NVMe is the next expected acquire."""
    pol = Scripted()
    rt = rig(8, 3, 16, policy=pol, prefetch=1, sim=True)
    f, q, p = (SimBlock("f", "exp_avg", SLOT), SimBlock("q", "exp_avg", SLOT),
               SimBlock("p", "exp_avg", 2 * SLOT))
    rt.create(p, tier=NVME)  # zero-filled: it takes NVMe slots only
    rt.create(f, tier=HOST)
    rt.create(q, tier=HOST)
    assert (f.host_offset, q.host_offset, p.tiers) == (0, SLOT, {NVME})
    if in_txn:  # q also on the device, so that writing it there keeps its host copy as shadow
        rt.acquire([q], DEVICE, record=False)
        rt.release([q], DEVICE)
    rt.discard(f)
    pol.up, pol.uses = [("p", HOST)], {"p": 1}
    return rt, q, p


def test_a_prefetch_that_finds_no_room_does_not_fail_the_acquire(rig) -> None:
    rt, q, p = _fragmented_host(rig, in_txn=False)
    rt.acquire([q], HOST)
    assert q.pins[HOST] == 1
    rt.release([q], HOST)


def test_a_prefetch_never_gives_up_a_transaction_shadow(rig) -> None:
    rt, q, p = _fragmented_host(rig, in_txn=True)
    rt.begin()
    rt.acquire([q], DEVICE, write=True)  # q's host copy becomes its shadow; prefetch p follows
    rt.release([q], DEVICE)
    assert q in rt._txn.shadows and rt._txn.complete, "a shadow was given up for a prefetch"
    rt.rollback()


# ------------------------------------------------------------------------ bugs: transactions


def test_rollback_restores_a_block_whose_older_copy_was_evicted_before_the_write(rig) -> None:
    rt = rig(4, 2)
    a, b, h = TB("a", 1024), TB("b", 1024), TB("h", 1024)
    rt.create(a, torch.full((1024,), 1.0), tier=DEVICE)
    rt.create(b, torch.full((1024,), 2.0), tier=DEVICE)
    rt.create(h, tier=HOST)
    rt.acquire([h], HOST)  # host: h (pinned) + one free slot
    with pytest.raises(RuntimeError, match="step failed"):
        with rt.transaction() as txn:
            rt.protect([a, b])  # as Adam.step does: older copies survive fetching the rest
            rt.ensure_shadow(a, DEVICE)  # a -> host: the host is full
            rt.ensure_shadow(b, DEVICE)  # no room left for b's (a's host copy is protected)
            rt.acquire([a, b], DEVICE, write=True)
            rt.protect([a, b], on=False)
            rt.data(a, DEVICE).fill_(9.0)
            rt.data(b, DEVICE).fill_(9.0)
            rt.release([a, b], DEVICE)
            covered = a in txn.shadows and (b in txn.shadows or not txn.complete)
            complete = txn.complete
            raise RuntimeError("step failed")
    rt.release([h], HOST)
    assert covered, "a block was written without a shadow and the transaction still claims to be complete"
    assert torch.equal(rt.read(a), torch.full((1024,), 1.0))
    assert not complete or torch.equal(rt.read(b), torch.full((1024,), 2.0))


def test_a_block_whose_shadow_was_given_up_gets_no_new_shadow_at_its_next_write(rig) -> None:
    """Found in review: NVMe needed the room of a's shadow, so a was marked lost; a's second write
    in the same transaction then kept its mid-transaction copy as a new shadow, and the rollback
    restored that (2.0): neither the value before the transaction (0.0) nor the latest (3.0). A
    lost block keeps its latest value, as the optimizer expects of a lost chunk."""
    rt = rig(1, 2, 3, policy="lru")
    a, b, c, e = (TB(n, 1024) for n in "abce")

    def write(block: TB, value: float) -> None:
        rt.acquire([block], HOST, write=True)
        rt.data(block, HOST).fill_(value)
        rt.release([block], HOST)

    def touch(block: TB) -> None:
        rt.acquire([block], HOST)
        rt.release([block], HOST)

    rt.create(a, tier=NVME)  # zeros
    rt.begin()
    write(a, 2.0)  # a's shadow: its NVMe copy
    write(b, 5.0)
    touch(b)
    write(c, 6.0)  # the host is full: a goes to NVMe beside its shadow
    write(e, 7.0)  # b goes to NVMe: NVMe is full
    touch(c)
    touch(a)  # a comes back; the block it displaces needs NVMe room: a's shadow is given up
    assert a in rt._txn.lost and a not in rt._txn.shadows
    write(a, 3.0)
    assert a not in rt._txn.shadows
    rt.rollback()
    assert torch.equal(rt.read(a), torch.full((1024,), 3.0))
    invariants(rt)


def test_a_rollback_keeps_the_whole_chunk_of_a_block_it_cannot_undo(rig) -> None:
    """Found in review: a chunk's first moment was written with no older copy to keep (lost) and
    its second kept a shadow; the rollback restored the second alone, leaving the chunk's new
    parameters beside an old moment while the optimizer kept the chunk's new step count. Now a
    chunk with a lost block keeps the transaction's writes in all its blocks, a block created
    in it included."""
    rt = rig(2, 4, 2, policy="lru")
    m, v, new, other = TB("c.exp_avg", 1024), TB("c.exp_avg_sq", 1024), TB("c.master", 1024), TB("d", 1024)
    m.chunk_id = v.chunk_id = new.chunk_id = "c"
    rt.create(v, tier=NVME)  # zeros, then a host copy beside the NVMe one
    rt.acquire([v], HOST)
    rt.release([v], HOST)
    rt.create(m, tier=HOST)  # its only copy
    rt.create(other, tier=NVME)
    rt.begin()
    for block, value in ((v, 1.0), (m, 2.0), (new, 3.0), (other, 4.0)):
        rt.acquire([block], HOST, write=True)
        rt.data(block, HOST).fill_(value)
        rt.release([block], HOST)
    assert v in rt._txn.shadows and m in rt._txn.lost and new in rt._txn.created
    assert other in rt._txn.shadows
    assert rt.ensure_shadow(m, HOST)  # lost: nothing to keep, nothing copied down (no shadow given up)
    assert m.tiers == {HOST} and v in rt._txn.shadows and rt.tiers[NVME].used == 2 * 4096
    rt.rollback()
    assert [rt.read(b)[0].item() for b in (v, m, new)] == [1.0, 2.0, 3.0]
    assert torch.equal(rt.read(other), torch.zeros(1024))  # another chunk: undone
    invariants(rt)


def test_failed_optimizer_step_under_host_pressure_changes_nothing(swapdir, faults, monkeypatch) -> None:
    monkeypatch.setenv("HETERO_DEFER_STEP", "0")  # the all-or-nothing step and its shadows
    model, opt, rt = ready_for_step(swapdir + "/count", 0.2, 0.21, "auto")
    snapshot(model, opt)
    rt.drain()
    faults.reset()
    opt.step()
    rt.drain()
    n = faults.count()
    close_model(model)
    model, opt, rt = ready_for_step(swapdir + "/run", 0.2, 0.21, "auto")
    before = snapshot(model, opt)
    rt.drain()
    faults.arm(n - 5)  # late in the step: after the shadow has been given up
    try:
        with pytest.raises(HeteroIOError):
            opt.step()
            rt.drain()
        assert_same_state(snapshot(model, opt), before)
    finally:
        close_model(model)


# ------------------------------------------------------------------- simulator agreement


class Residual(torch.nn.Module):
    """A residual MLP block: the unit of the fault-replay models below."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(h, 2 * h), torch.nn.Linear(2 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


def faulted_steps(model: hetero.HeteroModule, opt: torch.optim.Optimizer, r, after: int,
                  step: Callable[[torch.Tensor], None]) -> hetero.Report:
    """Six training steps (``step(loss)`` after the forward), each with a swap fault armed
    within its first ``after`` requests (``r`` a random.Random); a step that raises
    HeteroIOError is dropped, as a training loop would. The report, faults cleared."""
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        engine.inject_fault(r.choice(["eio", "short"]), r.randint(0, after))
        try:
            step(model(torch.randn(4, 8, generator=g)).pow(2).mean())
        except HeteroIOError:
            pass
        opt.zero_grad()
    engine.inject_fault("none")
    return model.placement_report()


def residual_net(h: int) -> torch.nn.Module:
    """Four Residual blocks of width ``h`` between 8 inputs and 4 outputs (seed 0)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, h), *[Residual(h) for _ in range(4)], torch.nn.Linear(h, 4))


@pytest.mark.parametrize("defer", ["0", "1"], ids=["synchronous", "postponed"])
@pytest.mark.parametrize("at", [1, 3, 8, 20])
def test_replay_reproduces_a_run_that_survived_a_failed_transfer(swapdir, faults, monkeypatch, caplog,
                                                                 defer, at) -> None:
    """The run undid a failed transfer and transferred again later; the replay fails the same
    transfer where the run found it failed (the event log records it), so it moves the same
    bytes, and says nothing of it (the warning was the run's). Before the failure was recorded
    the replay's transfers all succeeded and it drifted from the fault on."""
    monkeypatch.setenv("HETERO_DEFER_STEP", defer)
    model = wrap_gpt(swapdir, 0.2, 0.3, "lru")
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)
    rt = model._hetero_state.runtime
    try:
        data = batches(4, seed=1)
        default_step(model, opt, data[0])
        rt.drain()
        faults.arm(at)  # during the next forward, or (later requests) its backward and step
        with pytest.raises(HeteroIOError):
            default_step(model, opt, data[1])
            rt.drain()
        opt.zero_grad()
        for batch in data[2:]:
            default_step(model, opt, batch)
        rt.drain()
        rep = model.placement_report()
        assert any(e[0] == "failed" for e in rep.events)
        caplog.clear()
        sim = rep.simulate()
        assert sim.oom is None
        assert sim.traffic == rep.as_dict()["traffic"]
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        close_model(model)


def test_replay_reproduces_runs_with_a_fault_in_every_step(swapdir) -> None:
    """Random faults in every step of runs under several policies (postponed updates: a failure
    is often found by a release inside the postponed update the next forward's acquire runs,
    which then raises before doing anything, as the replay's own calls do): the replay matches
    the run, and replays under another policy, prefetch or budget (whose transfers are others:
    the run's failures are not replayed there) end at the run's first failure, saying so, instead
    of raising on the run's recovery from it."""
    import random

    for trial in range(25):
        r = random.Random(trial)
        net = residual_net(64)
        total = state_bytes(net)
        model = hetero.wrap(net, device="cpu", device_budget=int(total * 0.2), host_budget=int(total * 0.3),
                            nvme_path=f"{swapdir}/{trial}", chunk_size="32KiB", auto_wrap_policy={Residual},
                            policy=r.choice(["opt", "lru", "hotness"]), prefetch=1)
        opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)

        def step(loss: torch.Tensor) -> None:
            loss.backward()
            opt.step()

        try:
            rep = faulted_steps(model, opt, r, 12, step)
            d, sim = rep.as_dict(), rep.simulate()
            assert sim.oom is None and (sim.traffic, sim.misses) == (d["traffic"], d["misses"]), trial
            failed = any(e[0] == "failed" for e in rep.events)
            policy = "auto" if d["policy"] != "auto" else "lru"
            for other in [dict(policy=policy), dict(prefetch=0), dict(device=total // 3)]:
                replayed = rep.simulate(**other)  # (up to the run's first failure)
                assert (replayed.stopped is not None) == failed, (trial, other)
        finally:
            engine.inject_fault("none")
            model.close()


def test_replays_of_faulted_runs_with_every_operation_never_raise(swapdir) -> None:
    """Faults in every step of runs that also clip, scale, read and load state dicts and drain,
    under every policy, host budget and prefetch: the run's own replay never raises (it raised
    AssertionErrors on the run's recovery after parting from it). Where a failed transfer took a
    transfer queued behind it only for budget room with it (timing: README, Architecture) the
    replay ends at the first event it does not reproduce, saying so, or (logs that stay the same)
    moves a block or two more or less; most match exactly."""
    import random

    exact = 0
    for trial in range(20):
        r = random.Random(100 + trial)
        net = residual_net(64)
        total = state_bytes(net)
        model = hetero.wrap(net, device="cpu", device_budget=int(total * r.choice([0.2, 0.3])),
                            host_budget=int(total * r.choice([0.3, 0.5])), nvme_path=f"{swapdir}/{trial}",
                            chunk_size="32KiB", auto_wrap_policy={Residual}, prefetch=r.choice([0, 1, 2]),
                            policy=r.choice(["auto", "opt", "lru", "hotness", "static"]))
        opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = hetero.optim.GradScaler("cpu")

        def step(loss: torch.Tensor) -> None:
            what = r.choice(["plain", "clip", "scaler", "state_dict", "optimizer_state", "drain"])
            if what == "scaler":
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                if what == "clip":
                    model.clip_grad_norm_(1.0)
                opt.step()
            if what == "state_dict":
                model.load_state_dict(model.state_dict())
            elif what == "optimizer_state":
                opt.load_state_dict(opt.state_dict())
            elif what == "drain":
                model._hetero_state.runtime.drain()

        try:
            rep = faulted_steps(model, opt, r, 15, step)
            d, sim = rep.as_dict(), rep.simulate()
            assert sim.oom is None, trial
            if (sim.traffic, sim.misses) == (d["traffic"], d["misses"]):
                exact += 1
            else:  # (timing: how often depends on the machine's load; 18-20 of 20 exact on a quiet one)
                assert sim.stopped is None or "parted from the run" in sim.stopped
        finally:
            engine.inject_fault("none")
            model.close()
    assert exact >= 12, exact


def test_replay_reproduces_a_run_whose_host_budget_exceeds_the_state(swapdir) -> None:
    """The host arena is sized to the model state, below this host budget: the simulator must
    carve the same arena (``Report.host_slots``), or where shadows fill it the run evicts and
    the replay does not."""
    model = wrap_gpt(swapdir, 0.3, 3.0, "auto")
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        for b in batches(3, seed=1):
            default_step(model, opt, b)
        model._hetero_state.runtime.drain()
        rep = model.placement_report()
        assert rep.simulate().traffic == rep.as_dict()["traffic"]
    finally:
        close_model(model)


# ----------------------------------------------------------------------- properties that hold


@settings(max_examples=5, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(device=st.sampled_from([0.2, 0.35, 0.6, 1.0]), host=st.sampled_from([0.25, 0.4, 0.6]),
       policy=st.sampled_from(["auto", "lru", "opt", "hotness", "static"]),
       prefetch=st.integers(0, 2))
def test_after_training_budgets_slots_and_device_memory_match_the_blocks(device, host, policy, prefetch,
                                                                          swapdir) -> None:
    """Without faults: after a drain every tier's ``used`` is the sum of its copies, no slot is
    owned by a block without a copy there, device memory is allocated exactly for the blocks on
    the device, peaks stay within budgets, and the simulator reproduces the run's traffic."""
    model = wrap_gpt(f"{swapdir}/{device}-{host}-{policy}-{prefetch}", device, host, policy, prefetch=prefetch)
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        for b in batches(2, seed=2):
            default_step(model, opt, b)
        rt = model._hetero_state.runtime
        rt.drain()
        invariants(rt)
        rep = model.placement_report()
        d = rep.as_dict()
        assert all(t["peak"] <= t["capacity"] for t in d["tiers"].values())
        sim = rep.simulate()
        assert sim.oom is None and sim.traffic == d["traffic"] and sim.misses == d["misses"]
    finally:
        close_model(model)


class _Settled:
    """A transfer handle that finished when it was issued (deterministic timing)."""

    def __init__(self, handle) -> None:
        self.error = None
        try:
            handle.wait()
        except HeteroIOError as exc:
            self.error = exc

    def wait(self) -> None:
        if self.error is not None:
            raise self.error

    def done(self) -> bool:
        return True


def settle_transfers(rt: R.Runtime) -> None:
    real = rt.storage.copy
    rt.storage.copy = lambda *args: _Settled(real(*args))


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=st.sampled_from([(0.3, 0.25, "lru"), (1.0, 0.21, "static"), (0.2, 0.6, "hotness"),
                               (0.3, 1.5, "auto")]),
       k=st.integers(0, 40), kind=st.sampled_from(["eio", "enospc", "short"]))
def test_failed_optimizer_step_changes_nothing_and_the_retry_goes_through(config, k, kind, swapdir,
                                                                          faults) -> None:
    """A swap transfer failing anywhere in ``opt.step()`` (budgets with room for every shadow):
    parameters, optimizer states and step counts are as before, the runtime's accounting is
    consistent after a drain, and the retried step succeeds. Transfers complete as they are
    issued, so each example is deterministic."""
    device, host, policy = config
    model, opt, rt = ready_for_step(f"{swapdir}/{k}-{kind}", device, host, policy)
    try:
        settle_transfers(rt)
        before = snapshot(model, opt)
        rt.drain()
        faults.arm(k, kind)
        try:
            opt.step()
            rt.drain()
            failed = False
        except HeteroIOError:
            failed = True
        faults.reset()
        if failed:
            assert_same_state(snapshot(model, opt), before)
            rt.drain()
            invariants(rt)
            opt.step()
            rt.drain()
        after = snapshot(model, opt)
        assert any(not torch.equal(after[0][n], before[0][n]) for n in before[0])
        rt.drain()
        invariants(rt)
    finally:
        close_model(model)


def test_a_block_created_in_a_transaction_needs_no_shadow(rig) -> None:
    """A rollback discards the blocks a transaction created (an optimizer's new states), so
    writing them keeps no older copy: nothing is copied below for them (found in review: every
    first optimizer step wrote its zero-filled states to NVMe for nothing)."""
    rt = rig(2, 2, 4)
    s = TB("s", 1024)
    rt.begin()
    rt.create(s, tier=HOST)
    assert rt.ensure_shadow(s, HOST)
    assert s.tiers == {HOST} and rt.tracker.traffic["host->nvme"] == 0
    rt.acquire([s], HOST, write=True)
    rt.data(s, HOST).fill_(3.0)
    rt.release([s], HOST)
    assert rt._txn.complete
    rt.rollback()
    assert not s.tiers  # discarded, as every block the transaction created


def test_a_hint_never_gives_up_a_transaction_shadow(rig) -> None:
    """Making room for a speculative fetch must not cost the transaction a shadow (found in review:
    the eviction's write-back below made room by dropping one)."""
    rt = rig(1, 3, 8, policy=Scripted(), prefetch=1)
    a, h, x = TB("a", 1024), TB("h", 1024), TB("x", 1024)
    rt.create(a, torch.full((1024,), 1.0), tier=HOST)
    rt.acquire([a], DEVICE)
    rt.release([a], DEVICE)  # a on host + device
    rt.create(h, tier=HOST)
    rt.create(x, tier=HOST)
    rt.drain()
    rt.acquire([h], HOST)  # pinned: the host holds a, h, x
    rt.begin()
    rt.acquire([a], DEVICE, write=True)  # a's host copy becomes its shadow
    rt.data(a, DEVICE).fill_(2.0)
    rt.release([a], DEVICE)
    assert a in rt._txn.shadows and rt._txn.complete
    rt.hint([([x], DEVICE)])
    complete = rt._txn.complete
    rt.rollback()
    rt.release([h], HOST)
    assert complete, "a hint gave up a transaction shadow"
    assert torch.equal(rt.read(a), torch.full((1024,), 1.0))


def test_a_hint_that_finds_no_room_is_dropped(rig) -> None:
    """A speculative fetch never fails its caller: here the only victim on the device would need
    a host slot, and the host's only other block is pinned."""
    rt = rig(1, 2, 0, policy=Scripted(), prefetch=1)
    d, h, x = TB("d", 1024), TB("h", 1024), TB("x", 1024)
    rt.create(d, tier=DEVICE)
    rt.create(h, tier=HOST)
    rt.create(x, tier=HOST)
    rt.acquire([h], HOST)
    rt.hint([([x], DEVICE)])
    assert x.tiers == {HOST} and d.tiers == {DEVICE}
    rt.release([h], HOST)



def test_a_full_host_without_nvme_moves_a_block_up_into_free_device_room(rig) -> None:
    """With no NVMe tier the host is the bottom: a full host makes room by moving a block whose
    only copy it holds up into free device room, data intact (found by random near-capacity
    budgets: optimizer steps failed with room left on the device)."""
    rt = rig(2, 2)
    a, b, c = TB("a", 1024), TB("b", 1024), TB("c", 1024)
    rt.create(a, torch.full((1024,), 1.0), tier=HOST)
    rt.create(b, torch.full((1024,), 2.0), tier=HOST)
    rt.acquire([c], HOST, write=True)  # created on the host, which a and b fill
    rt.data(c, HOST).fill_(3.0)
    rt.release([c], HOST)
    rt.drain()
    invariants(rt)
    moved = [x for x in (a, b) if x.tiers == {DEVICE}]
    assert len(moved) == 1 and c.tiers == {HOST}, (a, b, c)
    assert rt.tracker.traffic["host->device"] == 1024 * 4
    for x, v in ((a, 1.0), (b, 2.0), (c, 3.0)):
        assert torch.equal(rt.read(x), torch.full((1024,), v)), x



def test_a_host_whose_nvme_is_full_moves_a_block_up_into_free_device_room(rig) -> None:
    """NVMe full of blocks that have no other copy cannot take the host's victim; the host then
    makes room as a host without NVMe does, by moving a block up into free device room, data
    intact (found by random near-capacity budgets with NVMe: 18 of 60 configurations failed in
    an optimizer step so)."""
    pol = Scripted()
    rt = rig(2, 2, 1, policy=pol)
    n, a, b, c = TB("n", 1024), TB("a", 1024), TB("b", 1024), TB("c", 1024)
    rt.create(n, torch.full((1024,), 9.0), tier=NVME)  # NVMe's one slot: its only copy
    rt.create(a, torch.full((1024,), 1.0), tier=HOST)
    rt.create(b, torch.full((1024,), 2.0), tier=HOST)
    pol.prefer = ["a"]
    rt.create(c, torch.full((1024,), 3.0), tier=HOST)  # a cannot go down: it goes up
    rt.drain()
    invariants(rt)
    assert (n.tiers, a.tiers, b.tiers, c.tiers) == ({NVME}, {DEVICE}, {HOST}, {HOST})
    assert rt.tracker.traffic["host->device"] == 1024 * 4 and rt.tracker.traffic["host->nvme"] == 1024 * 4
    for x, v in ((n, 9.0), (a, 1.0), (b, 2.0), (c, 3.0)):
        assert torch.equal(rt.read(x), torch.full((1024,), v)), x


def test_a_host_whose_nvme_is_full_drops_a_clean_copy_before_moving_a_block_up(rig) -> None:
    """Where the host's victim finds NVMe full, a host copy that has another copy goes first
    (no transfer at all), before a block moves up (which would also have worked here, by
    dropping the device copy instead)."""
    pol = Scripted()
    rt = rig(1, 2, 1, policy=pol)
    n, a, b, c = TB("n", 1024), TB("a", 1024), TB("b", 1024), TB("c", 1024)
    rt.create(n, torch.full((1024,), 9.0), tier=NVME)
    rt.create(a, torch.full((1024,), 1.0), tier=HOST)
    rt.create(b, torch.full((1024,), 2.0), tier=DEVICE)
    rt.acquire([b], HOST)  # b: device and host copies; the device and host are full
    rt.release([b], HOST)
    rt.drain()
    moved = dict(rt.tracker.traffic)
    pol.prefer = ["a"]
    rt.create(c, torch.full((1024,), 3.0), tier=HOST)
    rt.drain()
    invariants(rt)
    assert (n.tiers, a.tiers, b.tiers, c.tiers) == ({NVME}, {HOST}, {DEVICE}, {HOST})
    assert rt.tracker.traffic == moved  # nothing crossed a tier
    for x, v in ((a, 1.0), (b, 2.0), (c, 3.0)):
        assert torch.equal(rt.read(x), torch.full((1024,), v)), x
    rt.discard(c)  # (every tier is full: reading n needs a free slot)
    assert torch.equal(rt.read(n), torch.full((1024,), 9.0))


def test_a_host_whose_nvme_is_full_gives_up_no_shadow_that_moves_nothing_up(rig) -> None:
    """Inside a transaction, the host's way around a full NVMe (moving a block up) may give up
    a shadow on the device only where that lets a block move; where no block can (here the only
    candidate is larger than the device), the shadow stays and the failure rolls back cleanly
    (found in review: every device shadow was given up first, and the rollback then could not
    restore them)."""
    pol = Scripted()
    rt = rig(2, 4, 2, policy=pol, largest=3 * SLOT)
    n1, n2, big, s, y = TB("n1", 1024), TB("n2", 1024), TB("big", 3 * 1024), TB("s", 1024), TB("y", 1024)
    rt.create(n1, torch.full((1024,), 9.0), tier=NVME)  # NVMe full of blocks with no other copy
    rt.create(n2, torch.full((1024,), 8.0), tier=NVME)
    rt.create(big, torch.full((3 * 1024,), 1.0), tier=HOST)  # three slots: more than the device holds
    rt.create(s, torch.full((1024,), 2.0), tier=DEVICE)
    rt.create(y, torch.full((1024,), 3.0), tier=DEVICE)  # the device is full
    rt.drain()
    pol.prefer = ["big"]
    rt.begin()
    rt.acquire([s], HOST, write=True)  # s's device copy is its shadow; the host is full
    rt.data(s, HOST).fill_(-1.0)
    with pytest.raises(HeteroOOMError):
        rt.acquire([y], HOST)
    assert not rt._txn.lost and rt._txn.shadows[s][0] == DEVICE
    rt.release([s], HOST)
    rt.rollback()
    rt.drain()
    invariants(rt)
    assert torch.equal(rt.read(s), torch.full((1024,), 2.0))


@pytest.mark.parametrize("fault", [None, "eio", "short", "corrupt"])
def test_a_block_larger_than_a_slot_scatters_over_nvme_slots_that_are_apart(rig, faults, fault) -> None:
    """NVMe whose free slots are all apart takes a two-slot block in two of them (found by random
    near-capacity budgets with NVMe: 5 of 200 configurations failed in a step for want of a
    contiguous run, with half the swap space free). It goes and comes back byte-exact. A fault
    in the first part of its write fails the whole eviction, which is undone (the block stays
    on the host), and the next try succeeds; a fault in its read (a corrupted one included,
    which the checksums catch) is undone the same way."""
    rt = rig(2, 2, 6, largest=2 * SLOT)  # three swap files of two slots
    blocks = {n: TB(n, 1024) for n in "axbwv"}
    for i, (n, b) in enumerate(blocks.items()):
        rt.create(b, torch.full((1024,), float(i)), tier=NVME)
    rt.discard(blocks["x"])
    rt.discard(blocks["w"])  # free: the second slot of each file
    z, c = TB("z", 2048), TB("c", 1024)
    data = torch.arange(2048, dtype=torch.float32)
    rt.create(z, data, tier=HOST)  # the host's two slots
    if fault in ("eio", "short"):  # (a corrupted write is only seen when read: checksums)
        faults.arm(0, fault)  # z's write: the first of its two requests
        with pytest.raises(HeteroIOError):
            rt.acquire([c], HOST, write=True)
        rt.drain()
        invariants(rt)
        assert z.tiers == {HOST} and not c.pins.get(HOST)
    rt.acquire([c], HOST, write=True)
    rt.data(c, HOST).fill_(7.0)
    rt.release([c], HOST)
    rt.drain()
    invariants(rt)
    assert z.tiers == {NVME} and isinstance(z.nvme_loc, Scattered)
    assert [off for _, off, _ in z.nvme_loc] == [SLOT, SLOT]
    if fault is not None:
        faults.arm(1, fault)  # z's read (after c's write, which makes the room for it)
        with pytest.raises(HeteroIOError):
            rt.read(z)
        rt.drain()
        invariants(rt)
        assert z.tiers == {NVME}
    assert torch.equal(rt.read(z), data)
    assert torch.equal(rt.read(c), torch.full((1024,), 7.0))
    rt.drain()
    invariants(rt)


def test_a_full_host_without_nvme_moves_blocks_within_itself_for_a_contiguous_run(rig) -> None:
    """With no NVMe tier and a full device, a block spanning two slots finds its run on a host
    whose free slots are apart by moving a block into another free slot (a copy), data intact
    (found by random near-capacity budgets: a gradient larger than a slot had nowhere to go)."""
    rt = rig(1, 4)
    d = TB("d", 1024)
    rt.create(d, torch.full((1024,), 4.0), tier=DEVICE)  # the device is full, and d has no other copy
    a, x, b = TB("a", 1024), TB("x", 1024), TB("b", 1024)
    for blk, v in ((a, 1.0), (x, 0.0), (b, 2.0)):
        rt.create(blk, torch.full((1024,), v), tier=HOST)
    rt.discard(x)  # host slots: a, free, b, free
    z = TB("z", 2048)
    rt.create(z, torch.full((2048,), 3.0), tier=HOST)
    rt.drain()
    invariants(rt)
    assert (a.tiers, b.tiers, d.tiers, z.tiers) == ({HOST}, {HOST}, {DEVICE}, {HOST})
    assert (z.host_offset, a.host_offset, b.host_offset) == (0, 3 * SLOT, 2 * SLOT)  # a moved out of z's run
    assert rt.tracker.traffic == {k: 0 for k in rt.tracker.traffic}  # no tier was crossed
    for blk, v, n in ((a, 1.0, 1024), (b, 2.0, 1024), (d, 4.0, 1024), (z, 3.0, 2048)):
        assert torch.equal(rt.read(blk), torch.full((n,), v)), blk


@pytest.mark.parametrize("end", ["commit", "rollback"])
def test_a_block_whose_shadow_is_on_the_device_never_moves_up(rig, end) -> None:
    """Inside a transaction a block written on the host keeps its device copy as the shadow; a
    full host must not move that block up into the same device memory (found in review: the move
    overwrote the shadow, and the commit then freed the block's only copy)."""
    rt = rig(2, 2, policy="lru")
    a, h, c = TB("a", 1024), TB("h", 1024), TB("c", 1024)
    rt.create(a, torch.full((1024,), 1.0), tier=DEVICE)
    rt.create(h, torch.full((1024,), 2.0), tier=HOST)
    rt.begin()
    rt.acquire([a], HOST, write=True)  # its device copy becomes the shadow
    rt.data(a, HOST).fill_(5.0)
    rt.release([a], HOST)
    rt.acquire([h], HOST)
    rt.release([h], HOST)  # h used later than a: a is LRU's victim on the host
    rt.create(c, torch.full((1024,), 3.0), tier=HOST)  # the host is full
    assert a.tiers == {HOST}, a
    getattr(rt, end)()
    rt.drain()
    invariants(rt)
    assert torch.equal(rt.read(a), torch.full((1024,), 5.0 if end == "commit" else 1.0))

def test_a_host_making_room_for_a_device_eviction_moves_nothing_up(rig, monkeypatch) -> None:
    """While the device evicts a block down to a full host, the host must not make room by moving
    a block up into the device room being freed: the two tiers would trade blocks for ever. The
    placement fails instead, with nothing pinned."""
    rt = rig(2, 1)
    d, h, z = TB("d", 1024), TB("h", 1024), TB("z", 2048)
    rt.create(d, tier=DEVICE)
    rt.create(h, tier=HOST)
    evictions = 0
    evict = rt._evict

    def counted(block, tier):
        nonlocal evictions
        evictions += 1
        assert evictions < 20, "the device and host trade blocks back and forth"
        evict(block, tier)

    monkeypatch.setattr(rt, "_evict", counted)
    with pytest.raises(HeteroOOMError):
        rt.acquire([z], DEVICE)  # 2 slots: d must go down, and the host holds h only
    assert d.tiers == {DEVICE} and h.tiers == {HOST} and not z.pins.get(DEVICE)

def _first_step_ready(path: str, policy: str, device: float = 0.8, host: float = 0.3, **kw):
    model = wrap_gpt(path, device, host, policy, **kw)
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = batches(1, seed=1)[0]
    model(x, y).backward()
    rt = model._hetero_state.runtime
    rt.drain()
    return model, opt, rt


@pytest.mark.parametrize("policy,device,host,bf16,async_copies", [
    ("auto", 0.5, 0.21, False, False), ("opt", 0.8, 0.21, False, False), ("lru", 0.3, 0.21, False, False),
    ("hotness", 0.3, 0.21, False, False), ("lru", 0.3, 0.3, True, False), ("auto", 0.5, 0.21, False, True)])
def test_a_host_tier_too_small_for_the_shadows_moves_them_to_nvme(
        policy, device, host, bf16, async_copies, swapdir, faults, caplog, monkeypatch) -> None:
    """The first step writes every chunk, and each written block keeps its previous copy (its
    shadow) until the commit. With these host budgets the shadows did not all fit: the step gave
    some up, logged that it could no longer be undone, and a fault after that left chunks
    updated (found in review; 8 of 144 small configurations). A shadow that needs the host's room
    now moves to NVMe. Every NVMe transfer of the step fails in turn (shadow writes included,
    whose failure puts the shadow back on the host); each time the step raises and changes
    nothing, and no step gives up its guarantee. ``async_copies``: every host copy runs on the
    copy engine's workers, so faults find host <-> device copies in flight, as on a GPU."""
    kw = {"mixed_precision": hetero.MixedPrecision(param_dtype=torch.bfloat16)} if bf16 else {}
    if async_copies:
        monkeypatch.setattr(copies, "INLINE_BYTES", 0)

    def ready(path: str):
        model, opt, _ = _first_step_ready(path, policy, device, host, **kw)
        return model, opt, snapshot(model, opt)  # (reading the state moves blocks: before counting)

    model, opt, _ = ready(swapdir + "/count")
    faults.reset()
    with caplog.at_level(logging.WARNING, logger="hetero"):
        opt.step()
        model._hetero_state.runtime.drain()
    n = faults.count()
    close_model(model)
    assert not [r for r in caplog.records if "undone" in r.getMessage()]
    for k in range(n):
        model, opt, before = ready(f"{swapdir}/{k}")
        faults.arm(k)
        with pytest.raises(HeteroIOError):
            opt.step()
            model._hetero_state.runtime.drain()
        faults.reset()
        assert_same_state(snapshot(model, opt), before)
        assert not opt.state_dict()["state"]
        close_model(model)


@pytest.mark.parametrize("then", ["given up", "committed"])
def test_a_shadow_write_that_fails_after_the_shadow_is_gone_restores_nothing(then) -> None:
    """A host shadow moved to NVMe may be given up while its write is in flight (NVMe needed the
    room), or its transaction may commit first; if that write then fails, there is no shadow to
    put back. Putting it back freed its NVMe slots a second time (found in review). Sim storage
    whose one shadow write fails late."""
    caps = {DEVICE: 8 * SLOT, HOST: 2 * SLOT, NVME: 2 * SLOT}
    rt = R.Runtime(caps, SLOT, Scripted(), failing_sim_storage("a", HOST, NVME)(caps, SLOT), 0)
    n1, a, b, c = (TB(x, SLOT // 4) for x in ("n1", "a", "b", "c"))
    rt.create(n1, tier=NVME)
    rt.create(a, tier=DEVICE)
    rt.acquire([a], HOST)  # a on the device and the host
    rt.release([a], HOST)
    rt.create(c, tier=HOST)
    rt.create(b, tier=DEVICE)
    rt.begin()
    rt.acquire([a], DEVICE, write=True)  # a's host copy is its shadow; the host is full
    rt.release([a], DEVICE)
    rt.protect([c])
    assert rt.ensure_shadow(b, DEVICE)  # needs the host: a's shadow moves to NVMe (pending)
    assert rt._txn.shadows[a][0] == NVME
    if then == "given up":
        rt.ensure_shadow(c, HOST)  # NVMe is full: a's shadow is given up
        assert a not in rt._txn.shadows
        with pytest.raises(HeteroIOError):
            rt.drain()
        rt.rollback()
    else:
        rt.commit()
        with pytest.raises(HeteroIOError):
            rt.drain()
    for name, t in rt.tiers.items():
        assert t.used == sum(rt._size_on(name, x) for x in (n1, a, b, c) if name in x.tiers), name
    assert a.tiers == {DEVICE} and b.tiers == {DEVICE} and c.tiers == {HOST}


@pytest.mark.parametrize("policy", ["auto", "lru", "hotness"])
def test_a_failure_late_in_the_first_step(policy, swapdir, faults) -> None:
    """The first step creates every optimizer state inside its transaction. A swap fault in its
    last transfers must surface as HeteroIOError (found in review: a KeyError on the states of
    chunks the step had not reached hid it) and change nothing. ``lru`` and ``hotness`` home
    states on the device wherever there is room: each such chunk's parameters were copied to
    the host before their update, and the host ran out of room for those copies (the step gave
    up its guarantee, and some chunks kept it). Such a chunk is now updated after the commit,
    in place, needing no copy."""
    model, opt, rt = _first_step_ready(swapdir + "/count", policy)
    faults.reset()
    opt.step()
    rt.drain()
    n = faults.count()
    close_model(model)
    for k in range(max(0, n - 3), n):
        model, opt, rt = _first_step_ready(f"{swapdir}/{k}", policy)
        before = snapshot(model, opt)
        faults.arm(k)
        with pytest.raises(HeteroIOError):
            opt.step()
            rt.drain()
        faults.reset()
        after = snapshot(model, opt)  # reads every state through state_dict
        assert_same_state(after, before)
        assert not opt.state_dict()["state"]  # no chunk kept the step
        close_model(model)


def _slow_copies(rt: R.Runtime, seconds: float) -> None:
    """Every copy ``rt`` starts from now on ends ``seconds`` from now, at the earliest."""
    real, until = rt.storage.copy, time.perf_counter() + seconds

    class Slow:
        def __init__(self, handle) -> None:
            self.handle = handle

        def done(self) -> bool:
            return time.perf_counter() >= until and self.handle.done()

        def wait(self) -> None:
            time.sleep(max(0.0, until - time.perf_counter()))
            self.handle.wait()

    rt.storage.copy = lambda *args: Slow(real(*args))


def test_retiring_work_already_done_is_not_stall(rig) -> None:
    """Stall time is time compute waited for a transfer still queued or in flight: creating
    blocks in free memory (a fill done at once) records none, while a read from NVMe that an
    acquire has to wait for does."""
    rt = rig(4, 2, 8)
    for name in "abc":
        rt.create(TB(name, 1024), tier=DEVICE)
    assert rt.tracker.stalls == []
    n = TB("n", 1024)
    rt.create(n, torch.ones(1024), tier=NVME)
    rt.drain()
    _slow_copies(rt, 0.05)
    _read(rt, n)
    assert [b for _, _, b in rt.tracker.stalls] == ["n"] and rt.tracker.stall_seconds >= 0.04
    bounded_drain(rt)
    invariants(rt)


@pytest.mark.parametrize("in_step", [True, False])
def test_a_drain_inside_a_step_is_stall(rig, in_step: bool) -> None:
    """The optimizer's step waits for every transfer in flight before it updates anything
    (``drain(stall=True)``): compute waiting, recorded as stall like any wait for a block. A
    drain outside a step (closing, a state_dict) is not."""
    rt = rig(4, 2, 8, prefetch=1)
    n = TB("n", 1024)
    rt.create(n, torch.ones(1024), tier=NVME)
    rt.drain()
    _slow_copies(rt, 0.05)
    rt.hint([([n], HOST)])  # the read starts and is left in flight
    assert len(rt._ops) == 1 and rt.tracker.stalls == []
    R.Runtime.drain(rt, stall=in_step)  # (the real one: rig's runtimes drain through a guard)
    assert not rt._ops
    if in_step:
        assert [b for _, _, b in rt.tracker.stalls] == ["n"] and rt.tracker.stall_seconds >= 0.04
    else:
        assert rt.tracker.stalls == []
    invariants(rt)


def _prefetch_from_nvme(rig, fail: bool):
    """A runtime in which acquiring ``a`` on the device prefetches ``n`` there from NVMe: a read
    into the host, then a copy to the device queued behind it (``fail``: the read fails).
    Returns (runtime, a, n, the read) once the read has ended, ``a`` still acquired."""
    pol = Scripted()
    rt = rig(4, 2, 8, policy=pol, prefetch=1)
    a, n = TB("a", 1024), TB("n", 1024)
    rt.create(n, torch.full((1024,), 3.0), tier=NVME)
    rt.create(a, tier=DEVICE)
    rt.drain()
    pol.up, pol.uses = [("n", DEVICE)], {"n": 1}
    if fail:
        engine.inject_fault("eio", 0)
    rt.acquire([a], DEVICE)
    pol.up = []
    read, copy = rt._ops.of(n)
    assert (read.src, read.dst, copy.src, copy.dst) == (NVME, HOST, HOST, DEVICE) and copy.state == "queued"
    while not read.handle.done():
        time.sleep(0.001)
    return rt, a, n, read


def test_a_release_starts_the_next_stage_of_a_prefetch(rig) -> None:
    """Once the NVMe read of a two-stage prefetch has landed, the next runtime call, here the
    release of the block in use, starts the host-to-device copy: it does not wait for the next
    acquire, up to a unit's compute later."""
    rt, a, n, _ = _prefetch_from_nvme(rig, fail=False)
    rt.release([a], DEVICE)
    assert all(op.state != "queued" for op in rt._ops.of(n))
    bounded_drain(rt)
    assert n.tiers >= {DEVICE, HOST}
    assert torch.equal(rt.read(n), torch.full((1024,), 3.0))
    invariants(rt)


def test_a_failure_a_release_finds_is_undone_there_and_raised_by_the_next_call(rig) -> None:
    """A release must not raise (autograd hooks and ``finally`` blocks call it): a failed
    transfer it retires is undone at once (the prefetched block is where it was) and raises
    from the next acquire, as before; the acquire after that goes through."""
    rt, a, n, read = _prefetch_from_nvme(rig, fail=True)
    engine.inject_fault("none")
    rt.release([a], DEVICE)
    assert read.state == "failed" and n.tiers == {NVME} and not rt._ops.of(n)
    with pytest.raises(HeteroIOError):
        rt.acquire([a], DEVICE)
    assert not a.pins.get(DEVICE)
    rt.acquire([n], DEVICE)
    assert torch.equal(rt.data(n, DEVICE), torch.full((1024,), 3.0))
    rt.release([n], DEVICE)
    bounded_drain(rt)
    invariants(rt)


class _FailedJob:
    """Deferred work that has ended and raised."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        raise RuntimeError("injected kernel failure")


def test_a_failed_deferred_update_a_release_finds_raises_from_the_next_acquire(rig) -> None:
    """Deferred work that raised is retired by the release after it, which keeps the error (a
    release never raises) for the next acquire, which raises it once; the block is usable after
    that."""
    rt = rig(4, 2)
    b = TB("b", 1024)
    rt.create(b, torch.ones(1024), tier=HOST)
    rt.acquire([b], HOST)
    rt.defer(HOST, [b], [b], _FailedJob)
    rt.release([b], HOST)
    assert not rt._ops.of(b)
    with pytest.raises(RuntimeError, match="injected kernel failure"):
        rt.acquire([b], HOST)
    rt.acquire([b], HOST)
    rt.release([b], HOST)
    bounded_drain(rt)
    invariants(rt)


def test_a_runtime_bug_a_release_finds_raises_at_once(rig) -> None:
    """A failure of the work (an I/O error, deferred work's error, a copy engine's) waits for
    the next call; an assertion while retiring a transfer is a runtime bug and raises from the
    release."""
    rt, a, n, read = _prefetch_from_nvme(rig, fail=False)

    def buggy(op, polled=False):
        raise AssertionError("runtime bug")

    rt._finish = buggy
    with pytest.raises(AssertionError, match="runtime bug"):
        rt.release([a], DEVICE)
    del rt._finish
    assert rt._failure is None


def test_replay_reproduces_a_run_with_no_swap_file(tmp_path) -> None:
    """An NVMe budget under one slot makes no swap file: the replay must carve none either (one
    slot there would take small blocks the run kept on the host)."""
    from torch import nn

    from hetero.wrap import minimum_budgets

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(32, 32)] + [nn.Linear(2, 2) for _ in range(12)])
            self.head = nn.Linear(32, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.head(self.layers[0](x))
            for layer in self.layers[1:]:
                y = y + layer(y)
            return y.pow(2).mean()

    def make() -> nn.Module:
        torch.manual_seed(0)
        return Net()

    probe = hetero.wrap(make(), device="cpu", chunk_size=4224)
    slot = probe._hetero_state.runtime.slot_size
    device_min, _ = minimum_budgets(probe, True)
    probe.close()
    x = torch.randn(8, 32)
    for host in (253952, 258048):  # (the optimizer's least, in whole slots and not)
        model = hetero.wrap(make(), device="cpu", device_budget=device_min, host_budget=host,
                            nvme_path=str(tmp_path), nvme_budget=slot // 2, chunk_size=4224, policy="lru")
        opt = hetero.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(3):
            model(x).backward()
            opt.step()
            opt.zero_grad()
        rep = model.placement_report()
        assert rep.nvme_files == []
        sim = rep.simulate()
        assert sim.oom is None and sim.traffic == rep.as_dict()["traffic"], host
        model.close()


def test_undoing_an_eviction_takes_back_room_a_larger_block_took_past_its_bytes(swapdir, monkeypatch) -> None:
    """A small block's host copy shares a slot with others; evicted, it leaves the slot empty, and a
    block of more than a slot took that slot as the tail of its run, past its last byte. The
    eviction's write failed: undoing it must take the small block's room back, so the placement
    in that slot must wait for the eviction (and be undone with it). It did not (transfers
    conflicted on bytes, not on the slots they hold), and the undo crashed with 'runtime bug:
    slot in use' out of opt.step() instead of HeteroIOError, leaving a block with no copy (found
    by a review's fuzzing: bf16, ``static``, synchronous step)."""
    monkeypatch.setenv("HETERO_DEFER_STEP", "0")
    net = residual_net(48)
    initial = {k: v.clone() for k, v in net.state_dict().items()}
    model = hetero.wrap(net, device="cpu", device_budget=72687, host_budget=245604, nvme_path=swapdir,
                        chunk_size="16KiB", policy="static", prefetch=0, auto_wrap_policy={Residual},
                        mixed_precision=hetero.MixedPrecision(param_dtype=torch.bfloat16))
    guard(model._hetero_state.runtime)
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
        engine.inject_fault("short", 9)  # the write-back of a small block to NVMe in the step
        with pytest.raises(HeteroIOError):
            loss.backward()
            opt.step()
        engine.inject_fault("none")
        sd, state = snapshot(model, opt)  # the first step failed: nothing moved on
        assert sd.keys() == initial.keys() and all(torch.equal(sd[k], initial[k]) for k in sd)
        assert not state
        opt.zero_grad()
        model(torch.randn(4, 8)).float().pow(2).mean().backward()
        opt.step()
        model._hetero_state.runtime.drain()
        invariants(model._hetero_state.runtime)
    finally:
        engine.inject_fault("none")
        close_model(model)
