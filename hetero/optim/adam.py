"""Adam and AdamW over chunks, stepping each chunk on the tier that holds its optimizer state.

For every chunk the step acquires four blocks on one tier — param, grad, exp_avg, exp_avg_sq — and
updates contiguous runs of parameters with ``hetero.optim.kernel.adam_step_`` (the fused C++ SIMD
kernel on CPU tiers, torch ops on a GPU). The tier is the device when the chunk's exp_avg is there
and the four blocks fit the device budget, else the host (a block on NVMe is staged through a host
slot). The math is torch's single-tensor Adam, op for op, so results match ``torch.optim.Adam`` /
``AdamW`` to float32 rounding; ``state_dict()`` is torch's format and loads into either.

Without an NVMe tier, a chunk stepped on the host is *deferred* (:meth:`Runtime.defer`):
``step()`` returns once every chunk's update is queued (:class:`~hetero.optim.queue.AdamQueue`: a
C++ thread, free of the GIL), and the next forward waits only for the chunks it is about to use.
Chunks are queued in the order the forward uses them, so on a GPU the CPU updates the later chunks
while the GPU runs the first layers. The results are the same bits as a synchronous step. With
NVMe, a chunk whose state must move is *postponed* (:meth:`Runtime.postpone`): its update, NVMe
reads and writes included, runs when the next forward reaches the chunk, so the disk works while
the forward computes; a failure there rolls the update forward, not back (:meth:`Adam.step`).
``HETERO_DEFER_STEP=0`` turns both off: the step is then synchronous, and with NVMe all or nothing.
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
import functools
import itertools
import logging
import numbers
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Optional

import torch

from ..chunks import EXP_AVG, EXP_AVG_SQ, GRAD, MASTER, PARAM, Block, Chunk, ParamSlot
from ..config import exact_size, format_size, raise_budget_advice
from ..distributed import gather_states, noted
from ..engine import env_flag
from ..errors import HeteroConfigError, HeteroIOError, HeteroOOMError, HeteroStateError
from ..interrupts import critical
from ..tiers import DEVICE, HOST, NVME, packed_bytes
from .kernel import adam_step_, adam_update_  # noqa: F401  (adam_update_: the torch-ops reference)
from .queue import AdamQueue

if TYPE_CHECKING:  # pragma: no cover
    from ..wrap import HeteroState

log = logging.getLogger(__name__)

_UNSUPPORTED = ("amsgrad", "maximize", "capturable", "differentiable")


def _check_supported(group: dict[str, Any], where: str) -> None:
    """Refuse the options hetero's Adam does not implement, wherever they come from (the
    constructor, a parameter group changed in place, a loaded state dict): ignored, they would
    make the results differ from torch's in silence."""
    for name in _UNSUPPORTED:
        if group.get(name):
            raise HeteroConfigError(f"{where}{name}={group[name]!r} is not supported by hetero.optim; "
                                    f"expected {name}=False")


class Adam(torch.optim.Optimizer):
    """``torch.optim.Adam`` (L2 weight decay) for parameters of a :class:`hetero.HeteroModule`."""

    _hetero = True
    _decoupled_only = False

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, *, maximize: bool = False, foreach: Optional[bool] = None,
                 capturable: bool = False, differentiable: bool = False, fused: Optional[bool] = None,
                 decoupled_weight_decay: bool = False) -> None:
        def number(x: Any) -> bool:  # as torch: a real number (numpy's too) or a one-element tensor
            if isinstance(x, torch.Tensor):
                return x.numel() == 1 and not x.is_complex() and bool(x >= 0)
            return isinstance(x, numbers.Real) and not isinstance(x, bool) and x >= 0

        lr_ok = number(lr)
        betas_ok = isinstance(betas, (tuple, list)) and len(betas) == 2 and all(
            number(b) and b < 1 for b in betas)
        for name, value, ok in (("lr", lr, lr_ok), ("eps", eps, number(eps)),
                                ("weight_decay", weight_decay, number(weight_decay)), ("betas", betas, betas_ok)):
            if not ok:
                raise HeteroConfigError(f"{name}={value!r} is not accepted; expected a non-negative float"
                                        + (" pair, each in [0, 1)" if name == "betas" else
                                           " (or a one-element tensor)" if name == "lr" else ""))
        _check_supported(dict(amsgrad=amsgrad, maximize=maximize, capturable=capturable,
                              differentiable=differentiable), "")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=False, foreach=foreach, capturable=False, differentiable=False,
                        fused=fused, decoupled_weight_decay=bool(decoupled_weight_decay))
        self._state = None
        self._frozen: list[tuple[torch.Tensor, str]] = []  # parameters of chunks packed frozen
        self._queue = AdamQueue()  # runs deferred host updates, in order, off the GIL
        self._host_fits: dict[tuple[int, int], bool] = {}  # see _host_holds
        # Several ranks: this rank's update of the step is done, the step not yet complete on
        # every rank (see _ranks_step), as of HeteroState.forwards = _done_mark.
        self._done, self._done_mark = False, 0
        super().__init__(params, defaults)

    @property
    def state(self) -> "_StateView":  # type: ignore[override]
        """``optimizer.state`` as torch's code reads it (``opt.state[p]["step"]``, ``if
        opt.state``); read-only (see :class:`_StateView`)."""
        return _StateView(self)

    @state.setter
    def state(self, value: Any) -> None:
        pass  # torch's constructor sets a dict: the state lives in the model's chunks

    # ------------------------------------------------------------------ parameter bookkeeping

    @critical
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, checked first (a group refused is not added). A parameter whose state an
        earlier optimizer left (its steps and moments live in the model's chunks, one state per
        parameter) starts afresh, as in a new torch optimizer; the earlier optimizer then
        refuses to step it (:meth:`_check_owner`)."""
        from ..wrap import state_of

        super().add_param_group(param_group)
        old_state, n_frozen = self._state, len(self._frozen)
        try:
            _check_supported(self.param_groups[-1], f"param_groups[{len(self.param_groups) - 1}]: ")
            seen: set[int] = set()
            for p in self.param_groups[-1]["params"]:
                st = state_of(p)
                if st is None:
                    raise HeteroConfigError(
                        f"params contains a tensor of shape {tuple(p.shape)} that no HeteroModule manages; "
                        "expected the parameters of hetero.wrap(model) (model.parameters())")
                if self._state is None:
                    self._state = st
                elif st is not self._state:
                    raise HeteroConfigError("params come from two HeteroModules; expected one per optimizer")
                chunk, slot = st.slot_of[id(p)]
                if id(p) in seen:  # (torch steps it once per listing, hetero once per parameter)
                    raise HeteroConfigError(
                        f"params lists the parameter {slot.names[0]!r} twice in one group; torch warns "
                        "that this is deprecated (it updates the parameter twice per step() and will "
                        "refuse it); expected each parameter once")
                seen.add(id(p))
                if not chunk.requires_grad:
                    self._frozen.append((p, slot.names[0]))
            self._check_frozen()
            if self._state is None:
                return  # (groups without parameters so far, as torch takes them: nothing to check)
            rep = self._state.replicas
            if rep is None:
                self._check_capacity()
                self._take_over(self.param_groups[-1]["params"])
            else:  # every rank refuses where one must (its peers would die at their next collective)
                rep.together(self._check_capacity, lambda: HeteroOOMError(
                    "another rank of the process group cannot hold its optimizer states in its budgets "
                    "(its error says what they need); expected budgets that hold them on every rank"))
                rep.together(lambda: self._take_over(self.param_groups[-1]["params"]), lambda: HeteroIOError(
                    "another rank of the process group could not take its parameters' optimizer state "
                    "over (running the updates an earlier step postponed: its error says why); "
                    "expected the optimizer made again on every rank"))
        except BaseException:
            self.param_groups.pop()
            self._state = old_state
            del self._frozen[n_frozen:]
            raise

    def _take_over(self, params: list[torch.Tensor]) -> None:
        """Make this optimizer the owner of ``params``' state, restarting what another left."""
        me = weakref.ref(self)
        slots = [self._state.slot_of[id(p)] for p in params]
        # An earlier step's postponed updates count their steps when they run: run them first.
        self._state.runtime.catch_up({c.blocks[PARAM].chunk_id for c, _ in slots})
        replaced = {id(o): o for _, s in slots if s.owner is not None and (o := s.owner()) not in (None, self)}
        stale = [(c, s) for c, s in slots if s.step and (s.owner is None or s.owner() is not self)]
        if stale:
            log.info("hetero: %d parameter(s) had the state of an earlier optimizer; it restarts",
                     len(stale))
            self._write_states({id(s): (c, s, None) for c, s in stale})
        for _, s in slots:
            s.owner = me
        for earlier in replaced.values():  # (its thread starts again if it still steps others)
            earlier.stop_updates()

    def stop_updates(self) -> None:
        """Let the deferred host updates queued so far run, then stop their thread (a later
        step starts it again): ``HeteroModule.close()`` calls it, and a newer optimizer over the
        same parameters, so that an optimizer kept referenced holds no thread."""
        self._queue.shutdown()

    def _check_owner(self) -> None:
        """Refuse to use a state that a newer optimizer over the same parameters took over."""
        for g in self.param_groups:
            for p in g["params"]:
                _, slot = self._state.slot_of[id(p)]
                if slot.owner is None or slot.owner() is not self:
                    raise HeteroStateError(
                        f"parameter {slot.names[0]!r} is now optimized by another hetero optimizer, "
                        "built over it after this one: hetero keeps one optimizer state per "
                        "parameter (in the model's chunks), and the newer optimizer restarted it; "
                        "expected one optimizer per parameter (use the newer one)")

    def _check_frozen(self) -> None:
        """A parameter frozen when the model was wrapped was packed into a chunk without
        gradients: unfrozen later, its gradient would go nowhere and the step would skip it."""
        for p, name in self._frozen:
            if p.requires_grad:
                raise HeteroConfigError(
                    f"parameter {name!r} was frozen (requires_grad=False) when hetero.wrap packed "
                    "it into a chunk without gradients, and requires a gradient now; expected "
                    "requires_grad set as it will be trained before hetero.wrap")

    def _group_index(self) -> dict[int, int]:
        return {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}

    def _chunks(self, owned: bool = True) -> list[Chunk]:
        """The trainable chunks holding this optimizer's parameters (``owned``: those this rank
        updates, all but with sharded data parallelism: :mod:`hetero.distributed`)."""
        groups = self._group_index()
        rep = self._state.replicas
        return [c for c in self._state.chunks
                if c.requires_grad and any(id(s.param) in groups for s in c.slots)
                and (not owned or rep is None or rep.owns(c))]

    def _check_capacity(self) -> None:
        """Refuse up front when parameters, gradients and these optimizer states cannot all fit,
        counting each block as the room it would take on the host or NVMe tier (whole slots, or
        units of shared slots for small blocks, packed: :func:`~hetero.tiers.packed_bytes`),
        those tiers as the whole slots their budgets hold, and the room of two more blocks of
        the largest size: with every tier full, a block coming to the device and one leaving it
        need a free place to pass each other (without one, two full tiers cannot trade blocks),
        and the device holds whole blocks, so up to one block's bytes of its budget can stay
        unused (a randomized review found budgets accepted with one block of room that failed
        mid-run, 70 of 101 such cases train with two); a state the device alone holds is always
        accepted. Then, since one chunk's update holds all of the chunk's blocks at once (on the
        device, or on the host in slots), refuse where neither tier can hold the largest one
        (:meth:`_tier_for`)."""
        rt = self._state.runtime
        sizes = [b.nbytes for c in self._state.chunks for b in c.blocks.values()]
        sizes += [c.full_precision.nbytes for c in self._chunks() if EXP_AVG not in c.blocks] * 2
        if sum(sizes) <= rt.tiers[DEVICE].capacity:
            return  # the device alone holds the whole state
        need = packed_bytes(sizes, rt.slot_size) + 2 * rt.slot_bytes(max(sizes, default=0))
        held = {n: t.capacity if n == DEVICE else t.capacity // rt.slot_size * rt.slot_size
                for n, t in rt.tiers.items()}
        if need > sum(held.values()):
            raise HeteroOOMError(
                f"parameters, gradients and optimizer states need {exact_size(need)} (in host and "
                f"NVMe {format_size(rt.slot_size)} slots, with room for two of the largest blocks) but "
                f"the tiers hold {exact_size(sum(held.values()))} "
                f"({', '.join(f'{n} {exact_size(b)}' for n, b in held.items())}); "
                f"{raise_budget_advice(NVME in rt.tiers)}")
        # One chunk's update holds its parameters, gradient and states together on one tier.
        update = max(([b.nbytes for b in c.blocks.values()]
                      + [c.full_precision.nbytes] * 2 * (EXP_AVG not in c.blocks) for c in self._chunks()),
                     key=sum, default=[])
        if sum(update) > rt.tiers[DEVICE].capacity and packed_bytes(update, rt.slot_size) > rt.tiers[HOST].capacity:
            raise HeteroOOMError(
                f"one chunk's update holds its parameters, gradient and optimizer states together "
                f"on the device or the host: {exact_size(sum(update))} on the device, "
                f"{exact_size(packed_bytes(update, rt.slot_size))} in host slots, but the device budget "
                f"is {exact_size(rt.tiers[DEVICE].capacity)} and the host budget "
                f"{exact_size(rt.tiers[HOST].capacity)}; raise device_budget or host_budget, or "
                "use a smaller chunk_size")

    # ------------------------------------------------------------------ stepping

    def _runs(self, chunk: Chunk, groups: dict[int, int]) -> list[tuple[int, int, int, int]]:
        """``(start, end, group, step)`` element ranges of consecutive parameters to update with
        one set of hyper-parameters."""
        runs: list[tuple[int, int, int, int]] = []
        for s in chunk.slots:
            g = groups.get(id(s.param))
            if g is None or not s.has_grad:
                continue
            if runs and runs[-1][1] == s.offset and runs[-1][2] == g and runs[-1][3] == s.step:
                runs[-1] = (runs[-1][0], s.offset + s.numel, g, s.step)
            else:
                runs.append((s.offset, s.offset + s.numel, g, s.step))
        return runs

    def _tier_for(self, chunk: Chunk) -> str:
        """The device where the chunk's exp_avg is there, or where the host budget can never
        hold the update's blocks together (a policy homing states on a small host), and they
        fit beside what others hold pinned there (a postponed update runs inside a forward,
        whose enclosing units are pinned); else the host."""
        rt = self._state.runtime
        blocks = list(chunk.blocks.values())
        if DEVICE not in chunk.blocks[EXP_AVG].tiers and self._host_holds(chunk):
            return HOST
        room = rt.tiers[DEVICE].capacity - rt.pinned_bytes(DEVICE, besides=blocks)
        return DEVICE if sum(b.nbytes for b in blocks) <= room else HOST

    def _host_holds(self, chunk: Chunk) -> bool:
        """Whether the host budget, empty, holds ``chunk``'s blocks (one update's) together;
        asked for every update, known once per chunk and set of blocks."""
        key = (chunk.index, len(chunk.blocks))
        fits = self._host_fits.get(key)
        if fits is None:
            rt = self._state.runtime
            fits = self._host_fits[key] = (packed_bytes([b.nbytes for b in chunk.blocks.values()], rt.slot_size)
                                           <= rt.tiers[HOST].capacity)
        return fits

    @staticmethod
    def _written(chunk: Chunk) -> list[Block]:
        """Blocks a step changes: master (or param), exp_avg, exp_avg_sq, and the low-precision
        param copy under mixed precision."""
        blocks = [chunk.full_precision, chunk.blocks[EXP_AVG], chunk.blocks[EXP_AVG_SQ]]
        return blocks + ([chunk.blocks[PARAM]] if MASTER in chunk.blocks else [])

    def _in_place(self, chunk: Chunk) -> bool:
        """Whether the chunk's step needs no transfer: its states exist and every block it reads
        or writes already has a copy on the tier it would be updated on."""
        if not _has_states(chunk):
            return False
        tier = self._tier_for(chunk)
        return all(tier in b.tiers for b in self._written(chunk) + [chunk.blocks[GRAD]])

    @critical
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One update of every parameter with a gradient.

        With an NVMe tier, the updates of chunks whose state must move (or is new, except where
        it starts on the device beside the rest of its chunk) are *postponed*
        (:meth:`Runtime.postpone`): ``step()`` returns once the chunks already in place are
        updated (on the host deferred, as without NVMe), and each postponed update runs when
        something next touches its chunk: the next forward as it reaches the chunk, so that its
        NVMe reads and writes overlap that forward's compute. The step's values are fixed when
        ``step()`` is called (hyper-parameters, gradient, clip scale). An update is atomic per
        chunk (nothing is written until all its blocks are fetched), and a failure under it
        (HeteroIOError, or HeteroOOMError) raises from the call that ran it with the chunk
        unchanged and still postponed: the step rolls forward when the fault is gone, it is never
        lost while the model is open (``close()`` drops what is still postponed). Until then the
        chunk's parameters read as NaN outside forward and backward, as off the device.
        Anything that reads state (``state_dict``, the next ``step()``) runs postponed updates
        first.

        With ``HETERO_DEFER_STEP=0`` the step is synchronous and all or nothing instead: moving
        chunks are updated inside a runtime transaction (each written block keeps its previous
        copy as a shadow), every transfer is waited for, and a failure (HeteroIOError, or
        HeteroOOMError for want of room for shadows) restores every parameter, state and step
        count and propagates from ``step()``. Only once the transaction has committed are the
        chunks already in place updated, with no transfer that could fail.
        """
        if self._state is not None:
            self._state.runtime.check_open()  # (even with no gradient to apply)
        # Read per step (tests switch it); a bad value is refused here, before anything moves.
        defer = env_flag("HETERO_DEFER_STEP") is not False
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        st = self._state
        if st is None:
            return loss
        t0 = st.runtime.tracker.now()
        try:
            if st.replicas is not None:
                self._ranks_step(st, defer)
            else:
                self._update(st, defer)
        finally:
            st.runtime.tracker.compute("optimizer", "step", t0)
        return loss

    def _ranks_step(self, st: "HeteroState", defer: bool) -> None:
        """The step with several ranks: each rank updates its chunks (all of them under NO_SHARD,
        its own when sharded), the ranks agree that all did, then, sharded, each chunk's owner
        broadcasts its parameters (HeteroState.share_updates). A failure anywhere raises on every
        rank, and step() called again on every rank completes the step: a rank whose update
        was done (``_done``) does not update again. (A forward since ends the step, sharing
        what was left: the next step() is a new one.)"""
        rep = st.replicas
        chunks = self._chunks(owned=False)
        if self._done and self._done_mark != st.forwards:
            self._done = False

        def update() -> None:
            if not self._done:
                self._update(st, defer)
                self._done, self._done_mark = True, st.forwards

        rep.together(update, lambda: HeteroIOError(
            "another rank of the process group could not update its chunks (its error says why); "
            "this rank's are updated; call step() again on every rank to complete the step (this "
            "rank does not update twice)"),
            own=lambda exc: noted(exc, "nothing was updated on this rank; call step() again on every "
                                       "rank to complete the step"))
        if rep.sharded:
            st.share_updates(chunks)
        self._done = False

    def _update(self, st: "HeteroState", defer: bool) -> None:
        """The step proper (see :meth:`step`), timed there for the profiler's trace; ``defer``:
        HETERO_DEFER_STEP as ``step()`` read it."""
        if torch._C._current_graph_task_id() != -1:
            raise HeteroStateError(
                "optimizer.step() was called inside a backward pass (torch's 'optimizer step in "
                "backward' recipe, from a gradient hook): hetero's units and gradient blocks are "
                "held by the backward until it ends; expected step() after backward() returns")
        for i, group in enumerate(self.param_groups):
            _check_supported(group, f"param_groups[{i}]: ")
        self._check_frozen()
        self._check_owner()
        st.drop_stale_pins()
        rt = st.runtime
        if st._unshared:  # (sharded: a failed step's broadcast first)
            st.share_updates([])
        try:
            # (A postponed update of the last step reads its gradients: one whose grad block
            # this touches runs first.)
            st.adopt_grads(p for g in self.param_groups for p in g["params"])
            rt.catch_up()  # the rest of the last step's postponed updates, before this step's
        except (HeteroIOError, HeteroOOMError):
            if st.replicas is None:
                raise
            # The other ranks are about to average gradients, or already are (a gradient reader
            # on one rank alone, clip_grad_norm_, averages there): this rank joins them, then
            # fails its update (the ranks agree on that after it, in _ranks_step).
            st.reduce_gradients()
            raise
        st.reduce_gradients()
        groups = self._group_index()
        work = [self._plan(c, runs, groups)
                for c in self._chunks() if (runs := self._runs(c, groups))]
        updated = [u.chunk for u in work]
        if NVME not in rt.tiers:  # nothing can fail half-way
            for update, then in self._hinting_next(work):
                self._step_chunk(update, shadow=False, defer=defer, then=then)
            st.end_step()
            self._settle(updated)
            return
        if defer:
            for update in work:
                self._create_states(update.chunk)
            # The updates made now must all run once begun: a transfer failing among them (any
            # still in flight, a write-back of the backward) would stop them half-way. So every
            # transfer lands first, and a failure raises here with nothing updated.
            rt.drain(stall=True)
            later = [u for u in work if not self._in_place(u.chunk)]
            self._update_in_place([u for u in work if u not in later])
            for update in later:
                update.freeze()
                rt.postpone(update.chunk.blocks[PARAM].chunk_id, functools.partial(self._run_postponed, update),
                            functools.partial(self._needs, update.chunk))
            st.end_step()
            self._settle(updated)  # (a postponed update runs on the tier its states are on then)
            return
        steps = [(u.chunk, s, s.step) for u in work for s in u.chunk.slots]
        txn = None
        try:
            with rt.transaction() as txn:
                while True:
                    moving = [u for u in work if not self._in_place(u.chunk)]
                    if not moving:
                        break
                    stepped = set()
                    for update, then in self._hinting_next(moving):
                        # A chunk in its first step whose new states start on the device beside
                        # its parameters and gradient is in place: updated after the commit, it
                        # needs no copies of its parameters in host memory, for which a small
                        # host tier has no room when every chunk is new. (On the host such a
                        # chunk is updated at once: waiting, its blocks get pushed out by the
                        # chunks fetched meanwhile, and come back from NVMe.)
                        chunk = update.chunk
                        self._create_states(chunk)
                        if self._tier_for(chunk) == DEVICE and self._in_place(chunk):
                            continue
                        self._step_chunk(update, shadow=True, then=then)
                        stepped.add(id(update))
                    work = [u for u in work if id(u) not in stepped]
                # Every transfer still in flight, this step's or earlier ones (write-backs and
                # prefetches of the backward), must have landed before the commit: the updates
                # after it cannot be undone, so no failure may surface among them.
                rt.drain(stall=True)
        except BaseException:
            # Chunks whose writes could not all be undone (no room was left for their older
            # copies: logged) keep this step, step counts included: the rollback keeps every
            # block of such a chunk as written, states made in this step included, so each chunk
            # stays consistent. (Chunks the step did not reach may have no states yet: look at
            # the blocks they have.)
            kept = {id(c) for c, _, _ in steps if txn is not None and any(b in txn.lost for b in c.blocks.values())}
            for chunk, slot, n in steps:
                if id(chunk) not in kept or not _has_states(chunk):
                    slot.step = n
            if kept:
                log.error("hetero: the failed optimizer step could not be undone for %d chunk(s) "
                          "(no room for their previous versions); they keep this step", len(kept))
            raise
        # Every transfer the step needed is done and committed. The chunks left are in place:
        # their updates move nothing, so nothing can fail half-way and none needs a shadow.
        self._update_in_place(work, defer=False)
        st.end_step()
        self._settle(updated)

    def _update_in_place(self, work: list["_Update"], defer: bool = True) -> None:
        """Run the updates of chunks whose blocks are all where they are updated: nothing moves,
        so nothing can fail (on the host deferred to the optimizer's queue when ``defer``)."""
        rt = self._state.runtime
        rt.set_prefetching(False)  # in place: nothing to fetch ahead
        try:
            for update in work:
                self._step_chunk(update, shadow=False, defer=defer)
        finally:
            rt.set_prefetching(True)

    def _run_postponed(self, update: "_Update") -> None:
        """A postponed update (see :meth:`step`); meanwhile the next chunk's blocks are fetched.
        A ``zero_grad`` since the step left the gradient for it: it is dead now."""
        rt = self._state.runtime
        self._step_chunk(update, shadow=False, defer=True, then=rt.hint_postponed)
        if not any(s.has_grad for s in update.chunk.slots):
            rt.discard(update.chunk.blocks[GRAD])

    def _settle(self, updated: list[Chunk]) -> None:
        """Now that a whole step has shown what the device must hold, let the states that fit
        there beside it move up (:meth:`Runtime.settle`): their chunks' next steps run on the
        device and move nothing. Only the states of chunks this step ``updated``: a chunk left
        out (an expert the router did not pick) may stay out, and its states would take device
        room for nothing."""
        self._state.runtime.settle([b for c in updated if _has_states(c)
                                    for b in (c.blocks[EXP_AVG], c.blocks[EXP_AVG_SQ])
                                    if DEVICE not in b.tiers])

    def _create_states(self, chunk: Chunk) -> None:
        """Give ``chunk`` its Adam states (zero-filled, where the policy homes them) if it has
        none yet: in its first step, or again after a rolled-back first step discarded them."""
        for kind in (EXP_AVG, EXP_AVG_SQ):
            block = chunk.add_block(kind, chunk.state_dtype)
            if not block.tiers:
                self._state.runtime.create(block)

    def _needs(self, chunk: Chunk) -> tuple[list[Block], str]:
        """What ``chunk``'s step reads and writes, and the tier it will be updated on."""
        return [b for b in [chunk.blocks[GRAD]] + self._written(chunk) if b.tiers], self._tier_for(chunk)

    def _hint(self, chunk: Chunk) -> None:
        """Start fetching what ``chunk``'s step needs to the tier it will be updated on, while
        the current chunk computes: the optimizer knows its next chunk even where the recorded
        step does not (which chunks must move changes from step to step)."""
        if not _has_states(chunk):
            return  # its first step: the states are created where they start, not fetched
        self._state.runtime.hint([self._needs(chunk)])

    def _hinting_next(self, work: list["_Update"]) -> Iterator[tuple["_Update", Optional[Callable[[], None]]]]:
        """Each update with what starts fetching for the one after it (None for the last)."""
        for i, update in enumerate(work):
            yield update, functools.partial(self._hint, work[i + 1].chunk) if i + 1 < len(work) else None

    def _plan(self, chunk: Chunk, runs: list[tuple[int, int, int, int]], groups: dict[int, int]) -> "_Update":
        """The update of ``chunk``: the kernel's arguments per run, with the hyper-parameters of
        now."""
        calls = []
        for start, end, g, step in runs:
            group = self.param_groups[g]
            beta1, beta2 = group["betas"]
            # Square roots as torch's default Adam takes them (bit-identical), or with fused=True
            # as torch's fused AdamW does (IEEE sqrt: one pass, faster).
            kwargs = dict(step=step + 1, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                          weight_decay=group["weight_decay"], decoupled=group["decoupled_weight_decay"],
                          grad_scale=chunk.grad_scale, sqrt="ieee" if group.get("fused") else "torch")
            calls.append((start, end, kwargs))
        slots = [s for s in chunk.slots if id(s.param) in groups and s.has_grad]
        return _Update(chunk, calls, slots)

    def _step_chunk(self, update: "_Update", shadow: bool, defer: bool = False,
                    then: Optional[Callable[[], None]] = None) -> None:
        """Run ``update`` on the tier holding its chunk's optimizer states; once its blocks are
        there, ``then`` runs (it starts fetching for the chunk updated next). Until the blocks
        are acquired nothing is written, so a failure there leaves the chunk as it was."""
        rt = self._state.runtime
        chunk = update.chunk
        self._create_states(chunk)
        tier = self._tier_for(chunk)
        master, grad, m, v = (chunk.full_precision, chunk.blocks[GRAD], chunk.blocks[EXP_AVG],
                              chunk.blocks[EXP_AVG_SQ])
        param = chunk.blocks[PARAM] if MASTER in chunk.blocks else None  # low-precision copy
        writes = self._written(chunk)
        if shadow:  # the older copies of what is written must survive fetching the rest
            rt.protect(writes)
        try:
            if shadow:
                for block in writes:
                    rt.ensure_shadow(block, tier)
            rt.acquire([grad], tier)
            try:
                rt.acquire(writes, tier, write=True)
            except BaseException:
                rt.release([grad], tier)
                raise
        finally:
            if shadow:
                rt.protect(writes, on=False)
        try:
            if then is not None:
                then()
            w_flat, g_flat, m_flat, v_flat = (rt.data(b, tier) for b in (master, grad, m, v))
            p_flat = rt.data(param, tier) if param is not None else None
            deferring = defer and tier == HOST
            if deferring:
                update.freeze()  # it runs on the optimizer's queue after this returns
            # On the CPU one fused pass of the C++ kernel: low-precision grad in with the clip/loss
            # scale folded in, fp32 master/m/v updated, low-precision param out. Elsewhere the same
            # math as torch ops (hetero.optim.kernel.adam_step_).
            # Complex parameters update their real and imaginary parts as two reals (torch's Adam
            # views them as real, so exp_avg_sq stays a pair of non-negative numbers).
            k = 2 if w_flat.is_complex() else 1
            w_flat, g_flat, m_flat, v_flat = (torch.view_as_real(t).view(-1) if t.is_complex() else t
                                              for t in (w_flat, g_flat, m_flat, v_flat))
            calls = [((w_flat[k * a:k * b], g_flat[k * a:k * b], m_flat[k * a:k * b], v_flat[k * a:k * b]),
                      dict(kw, param_out=None if p_flat is None else p_flat[a:b]))
                     for a, b, kw in update.calls]

            if deferring:
                rt.defer(tier, [grad], writes, functools.partial(self._queue.submit, calls))
            else:
                with torch.no_grad():
                    for args, kwargs in calls:
                        adam_step_(*args, **kwargs)
            for s in update.slots:
                s.step += 1
        finally:
            rt.release([grad] + writes, tier)

    @critical
    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._state is not None:
            self._state.zero_grad(set(self._group_index()), set_to_none)

    # ------------------------------------------------------------------ state dict (torch's format)

    def _slots_in_order(self) -> list[tuple[int, Chunk, ParamSlot]]:
        st = self._state
        params = [p for g in self.param_groups for p in g["params"]]
        return [(i, *st.slot_of[id(p)]) for i, p in enumerate(params)]

    @critical
    def state_dict(self) -> dict[str, Any]:
        """torch's format (see the module docstring), with torch's state_dict hooks."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        if self._state is not None:
            self._state.runtime.check_open()  # (its states are gone: an empty state would be silent)
            self._check_owner()
        groups = []
        index = itertools.count()
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = [next(index) for _ in g["params"]]
            groups.append(packed)
        state: dict[int, dict[str, torch.Tensor]] = {}
        if self._state is not None:
            rt = self._state.runtime
            rt.catch_up()  # step counts and states as of the last step()
            flats: dict[tuple[int, str], torch.Tensor] = {}
            rep = self._state.replicas
            steps: dict[int, int] = {}  # id(slot) -> step count, from the owners where sharded
            if rep is not None and rep.sharded:
                for index, (counts, got) in gather_states(rep, rt, self._chunks(owned=False),
                                                          (EXP_AVG, EXP_AVG_SQ)).items():
                    chunk = self._state.chunks[index]
                    steps.update((id(s), n) for s, n in zip(chunk.slots, counts))
                    flats.update(((index, k), f) for k, f in got.items())
            for i, chunk, slot in self._slots_in_order():
                step = steps.get(id(slot), slot.step)
                if step == 0:
                    continue
                entry = {"step": torch.tensor(float(step), dtype=torch.float32)}
                for kind in (EXP_AVG, EXP_AVG_SQ):
                    key = (chunk.index, kind)
                    if key not in flats:
                        flats[key] = rt.read(chunk.blocks[kind])
                    entry[kind] = slot.slice(flats[key]).clone()
                state[i] = entry
        result = {"state": state, "param_groups": groups}
        for hook in self._optimizer_state_dict_post_hooks.values():
            out = hook(self, result)
            if out is not None:
                result = out
        return result

    @critical
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``Optimizer.load_state_dict``: every key of the saved groups (a scheduler's
        ``initial_lr`` too), and per parameter its step count and moments; a parameter the
        saved state has none for starts afresh (step 0, zero moments), as in torch. All or
        nothing: a failed swap transfer raises with every state, step count and group as
        they were (:meth:`Runtime.write_all`). torch's load_state_dict hooks run around it."""
        state_dict = state_dict.copy()
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        saved_groups = copy.deepcopy(state_dict["param_groups"])  # (a tensor lr is not shared)
        if len(saved_groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(saved_groups, self.param_groups)):
            raise HeteroConfigError("state_dict has parameter groups of different sizes than this "
                                    "optimizer's; expected a state dict of an optimizer over the same parameters")
        for i, saved in enumerate(saved_groups):
            _check_supported(saved, f"state_dict's param_groups[{i}]: ")
        saved_state = state_dict["state"]
        # The saved groups name each parameter's state key, in this optimizer's order: indices
        # in torch's own format, names (FQNs) in torch.distributed.checkpoint's.
        keys = [k for g in saved_groups for k in g["params"]]
        if self._state is not None:
            self._check_owner()
            entries = {}
            for i, chunk, slot in self._slots_in_order():
                entry = saved_state.get(keys[i])
                if isinstance(entry, Mapping) and not entry:
                    entry = None  # ({}: torch's "no state yet")
                _check_entry(keys[i], slot, entry)
                rep = self._state.replicas
                if rep is None or rep.owns(chunk):  # (sharded: each rank keeps its own chunks')
                    entries[id(slot)] = (chunk, slot, entry)
            self._write_states(entries)
        for saved, group in zip(saved_groups, self.param_groups):
            for k, v in saved.items():
                if k != "params":
                    group[k] = tuple(v) if k == "betas" else v
            if self._decoupled_only:
                group["decoupled_weight_decay"] = True  # as torch's AdamW, whatever was saved
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _write_states(self, entries: dict[int, tuple[Chunk, ParamSlot, Optional[dict[str, Any]]]]) -> None:
        """Set each slot's step count and moments to its entry (torch's per-parameter state), or
        with ``None`` restart it (step 0, zero moments). All or nothing: a failed swap transfer
        raises with every state and step count as they were (:meth:`Runtime.write_all`)."""
        rt = self._state.runtime
        rt.catch_up()  # else they would run on top of the new states
        steps: dict[int, int] = {}  # id(slot) -> its new step count
        by_chunk: dict[int, list[tuple[ParamSlot, Optional[dict]]]] = {}
        chunks = {}
        for chunk, slot, entry in entries.values():
            if entry is None:
                steps[id(slot)] = 0
                if not slot.step or not _has_states(chunk):
                    continue  # (its moments are zero, or not made yet)
            else:
                steps[id(slot)] = int(entry["step"].item() if isinstance(entry["step"], torch.Tensor)
                                      else entry["step"])
            by_chunk.setdefault(chunk.index, []).append((slot, entry))
            chunks[chunk.index] = chunk

        def moments() -> Iterator[list[tuple[Block, torch.Tensor]]]:
            for index, items in by_chunk.items():
                chunk = chunks[index]
                group = []
                for kind in (EXP_AVG, EXP_AVG_SQ):
                    block = chunk.add_block(kind, chunk.state_dtype)
                    flat = rt.read(block) if block.tiers else torch.zeros(chunk.numel, dtype=block.dtype)
                    for slot, entry in items:
                        if entry is None:
                            slot.slice(flat).zero_()
                        else:
                            slot.slice(flat).copy_(entry[kind])
                    group.append((block, flat))
                yield group

        kept: set[str] = set()
        try:
            rt.write_all(moments(), kept)  # all or nothing, as is what follows (no I/O)
        except BaseException:  # near capacity, chunks it could not undo keep the new moments
            for chunk, slot, _ in entries.values():
                if chunk.blocks[PARAM].chunk_id in kept:
                    slot.step = steps[id(slot)]
            raise
        for _, slot, _ in entries.values():
            slot.step = steps[id(slot)]


class AdamW(Adam):
    """``torch.optim.AdamW`` (decoupled weight decay) for parameters of a HeteroModule."""

    _decoupled_only = True  # as torch's AdamW: loading an Adam state keeps decoupled decay

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 amsgrad: bool = False, *, maximize: bool = False, foreach: Optional[bool] = None,
                 capturable: bool = False, differentiable: bool = False, fused: Optional[bool] = None) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad=amsgrad, maximize=maximize,
                         foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True)


class _StateView(collections.abc.Mapping):
    """A hetero optimizer's per-parameter state in torch's form: for each parameter that has
    taken a step, ``{"step": tensor, "exp_avg": tensor, "exp_avg_sq": tensor}`` as
    ``state_dict()`` gives them. Read from the chunks at each lookup (postponed updates run
    first), and copies: changing them changes nothing (``load_state_dict`` does)."""

    def __init__(self, opt: Adam) -> None:
        self._opt = opt
        st = opt._state
        self._slots = {} if st is None else {
            id(p): (p, *st.slot_of[id(p)]) for g in opt.param_groups for p in g["params"]}

    def _has(self, found: Iterable[tuple[torch.Tensor, Chunk, ParamSlot]]) -> list[torch.Tensor]:
        """Those of ``found``'s parameters that have a state of this optimizer. Their chunks'
        postponed updates run first: a step counts when its update runs (Runtime.postpone)."""
        found = list(found)
        if not found:
            return []
        rt = self._opt._state.runtime
        rt.check_open()  # (a closed model's state is gone)
        rt.catch_up({chunk.blocks[PARAM].chunk_id for _, chunk, _ in found})
        return [p for p, _, slot in found
                if slot.step and slot.owner is not None and slot.owner() is self._opt]

    def __getitem__(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """A parameter without a state reads as ``{}``, as in torch's ``defaultdict(dict)``
        (``get`` still gives its default)."""
        found = self._slots.get(id(param))
        if found is None or not self._has([found]):
            return {}
        _, chunk, slot = found
        rt = self._opt._state.runtime
        entry = {"step": torch.tensor(float(slot.step), dtype=torch.float32)}
        for kind in (EXP_AVG, EXP_AVG_SQ):
            entry[kind] = slot.slice(rt.read(chunk.blocks[kind])).clone()
        return entry

    def get(self, param: object, default: Any = None) -> Any:
        return self[param] if param in self else default

    def __contains__(self, param: object) -> bool:
        found = self._slots.get(id(param))
        return found is not None and bool(self._has([found]))

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._has(self._slots.values()))

    def __len__(self) -> int:
        return len(self._has(self._slots.values()))

    def __repr__(self) -> str:
        return f"<hetero optimizer state: {len(self)} parameter(s) with a step>"


def _check_entry(key: Any, slot: ParamSlot, entry: Any) -> None:
    """Refuse, before anything is written, a saved per-parameter state that cannot be loaded."""
    if entry is None:
        return
    where = f"state_dict's state[{key!r}] (parameter {slot.names[0]!r}, shape {tuple(slot.shape)})"
    if not isinstance(entry, Mapping) or not all(k in entry for k in ("step", EXP_AVG, EXP_AVG_SQ)):
        raise HeteroConfigError(f"{where} is {_short(entry)}; expected a dict with 'step', 'exp_avg' "
                                "and 'exp_avg_sq' (torch Adam's state for one parameter)")
    step = entry["step"]
    if not (isinstance(step, (int, float)) and not isinstance(step, bool)
            or isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_complex()):
        raise HeteroConfigError(f"{where}: 'step' is {_short(step)}; expected a number or a one-element tensor")
    for kind in (EXP_AVG, EXP_AVG_SQ):
        t = entry[kind]
        if not isinstance(t, torch.Tensor) or t.shape != slot.shape or not (t.is_floating_point() or t.is_complex()):
            raise HeteroConfigError(f"{where}: {kind!r} is {_short(t)}; expected a floating-point (or "
                                    f"complex) tensor of the parameter's shape {tuple(slot.shape)}")


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"[:120]


def _has_states(chunk: Chunk) -> bool:
    """Whether ``chunk``'s Adam states exist (they are created by its first step, and a rolled
    back first step discards them again)."""
    return EXP_AVG in chunk.blocks and bool(chunk.blocks[EXP_AVG].tiers)


@dataclasses.dataclass(eq=False)
class _Update:
    """One chunk's update in one step: the kernel's keyword arguments per element range
    ``(start, end, kwargs)``, and the slots whose step counts it advances."""

    chunk: Chunk
    calls: list[tuple[int, int, dict[str, Any]]]
    slots: list[ParamSlot]

    def freeze(self) -> None:
        """Make the hyper-parameters plain numbers, for an update that runs later: a scheduler
        changes a tensor lr in place, the next clip sets a new grad scale."""
        for _, _, kwargs in self.calls:
            for k in ("lr", "beta1", "beta2", "eps", "weight_decay", "grad_scale"):
                if kwargs[k] is not None:
                    kwargs[k] = float(kwargs[k])
