"""``hetero.wrap`` and :class:`HeteroModule`: the FSDP-shaped surface over the runtime.

``wrap`` validates its arguments, chooses the wrapped units, packs parameters into chunks (before
any byte moves, so every budget error is raised first), then materializes or moves the chunks into
their tiers and installs the hooks of :mod:`hetero.units`. :class:`HeteroState` is what the hooks
and the optimizer talk to; :class:`HeteroModule` is what the user holds.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Optional

import torch
import torch.utils._pytree as pytree
from torch.nn.modules.module import _IncompatibleKeys
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from . import config as config_mod
from .chunks import GRAD, MASTER, PARAM, Block, Chunk, ParamSlot, pack, placeholders_written
from .config import Config, ShardingStrategy, exact_size, format_budget, format_size, raise_budget_advice
from .distributed import (Replicas, average_gradients, broadcast_states, broadcast_updates, peer_failed,
                          resolve_group, taken)
from .errors import HeteroConfigError, HeteroOOMError, HeteroStateError
from .interrupts import critical, install as install_interrupts
from .policies import claim, make_policy, starting_copy
from .runtime import Runtime, expected_block_bytes
from .tiers import DEVICE, packed_bytes, slot_size_for, slots_for
from .units import (Call, Unit, default_auto_wrap_policy, fsdp_policy, register_hooks, select_units, unit_blocks,
                    unit_holders, unit_params)

if TYPE_CHECKING:  # pragma: no cover
    from .profiler import Report

log = logging.getLogger(__name__)

#: parameter -> weakref to the HeteroState managing it (weak both ways: no leak, no cycle).
_MANAGED: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def state_of(param: torch.Tensor) -> Optional["HeteroState"]:
    ref = _MANAGED.get(param)
    return ref() if ref is not None else None


@critical
def _call_if_alive(ref: "weakref.ref[HeteroState]", method: str, *args: Any) -> None:
    state = ref()
    if state is not None:
        getattr(state, method)(*args)


class HeteroState:
    """Everything hetero knows about one wrapped model; shared by the hooks and the optimizer."""

    def __init__(self, cfg: Config, root: nn.Module, units: list[Unit], chunks: list[Chunk],
                 runtime: Runtime, policy_start: Any, replicas: Optional[Replicas] = None) -> None:
        self.cfg = cfg
        self.root = root
        self.units = units
        self.chunks = chunks
        self.runtime = runtime
        self.slot_of: dict[int, tuple[Chunk, ParamSlot]] = {
            id(s.param): (c, s) for c in chunks for s in c.slots}
        self.summoned = False
        self._summoned_writeback = False  # (the outermost summon's)
        self.buffer_dtypes: dict[str, torch.dtype] = {}  # as wrap found them (state_dict gives those)
        self.sync_grads = True  # (False inside no_sync())
        self.replicas = replicas  # the ranks training the same model (None: one process)
        self.grads_due = False  # a backward outside no_sync() left gradients to average
        self.local_grads = False  # a backward inside no_sync() left gradients not averaged yet
        self._averaged: set[int] = set()  # chunks an averaging that failed half-way had done
        self._unshared: list[Chunk] = []  # sharded: chunks whose update is still to broadcast
        self.forwards = 0  # units' forwards run: one after a failed step ends it (Adam._ranks_step)
        self.policy_start = policy_start  # what a replay starts from (policies.starting_copy)
        # The grad block the backward is accumulating into, kept acquired on the device across
        # consecutive gradients of its chunk (see accumulate_grad).
        self._grad_pin: Optional[Block] = None
        self._waiting: list[Call] = []  # backward calls released by their last gradient

    # --------------------------------------------------------------- hooks (see hetero.units)

    @critical
    def pre_forward(self, unit: Unit) -> Call:
        _refuse_transforms()
        if self.summoned:
            raise HeteroStateError(
                "a forward inside summon_full_params() (or model.apply, state_dict, "
                "load_state_dict) is not supported, as FSDP's: the parameters there are full-"
                "precision host copies, which the units' forwards do not compute with (they fetch "
                "the chunks' own blocks, and release them to placeholders); expected the forward "
                "after the summon (writeback=True makes its changes the model's)")
        self.forwards += 1
        if self._unshared:
            self.share_updates([])
        self.check_rest_writes(list({id(b.chunk): b.chunk for b in unit.param_blocks}.values()), values=False)
        if torch._C._current_graph_task_id() == -1:  # a real forward
            self.runtime.acquire(unit.param_blocks)
            return Call(unit, forward_pinned=True, forward_start=self.runtime.tracker.now(),
                        versions=_versions(unit.param_blocks))
        # Activation checkpointing re-runs this forward inside backward: compute touches the
        # parameters again, an access of its own. Non-reentrant checkpoint may stop the re-run
        # early, so the post-forward hook is not guaranteed: rely on the backward pin when there
        # is one (the acquire only records the access), else pin until this backward pass ends.
        call = Call(unit, recompute=True)
        self.runtime.acquire(unit.param_blocks)
        if unit.backward_pins == 0:
            call.forward_pinned = True
        else:
            self.runtime.release(unit.param_blocks)
        call.forward_start = self.runtime.tracker.now()
        ref = weakref.ref(self)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _call_if_alive(ref, "_end_recompute", call))
        return call

    @critical
    def post_forward(self, call: Call) -> None:
        if call.forward_start:
            self.runtime.tracker.compute(call.unit.name, "recompute" if call.recompute else "forward",
                                         call.forward_start)
            call.forward_start = 0.0
        if call.forward_pinned:
            if not call.recompute:
                self._keep_changes(call)
            self.runtime.release(call.unit.param_blocks)
            call.forward_pinned = False

    def _keep_changes(self, call: Call) -> None:
        """A forward that changed its parameters in place (``nn.Embedding(max_norm=...)``
        renormalizes the rows it reads) made their device copies the only current ones: the
        others are dropped, so the change is written back when the block leaves the device."""
        blocks = call.unit.param_blocks
        if _versions(blocks) == call.versions:
            return
        changed = [b for b in blocks if len(b.tiers) > 1]
        if changed:
            self.runtime.acquire(changed, DEVICE, write=True, record=False, changed=True)
            self.runtime.release(changed, DEVICE)

    @critical
    def _end_recompute(self, call: Call) -> None:
        call.forward_start = 0.0  # (its span ended with the unit's backward, or is unknown)
        self.post_forward(call)
        if call in call.unit.calls:
            call.unit.calls.remove(call)

    @critical
    def pre_backward(self, call: Call) -> None:
        if call.pinned:
            return
        if torch.is_grad_enabled():  # (create_graph=True: the backward builds a graph)
            self._refuse_double_backward()
        self._backward_grads()
        # A gradient assigned to .grad since the last backward replaces the parameter's, before
        # this backward adds to it (torch's AccumulateGrad adds to what .grad holds).
        self.adopt_grads(s.param for b in call.unit.param_blocks for s in b.chunk.slots
                         if s.param.grad is not None)
        self.runtime.acquire(call.unit.param_blocks)
        call.pinned = True
        call.unit.backward_pins += 1
        call.backward_start = self.runtime.tracker.now()
        # Released by _PostBackward on its inputs; where none needs grad (token ids, a detached
        # input), once its own parameters' gradients are all in (accumulate_grad): else such
        # units would stay pinned together until the pass ends, more than the budget allows for.
        # At the latest when this backward pass ends.
        if not call.inputs_hooked and call.unit.trainable:
            call.waiting = set(call.unit.trainable)
            self._waiting.append(call)
        ref = weakref.ref(self)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _call_if_alive(ref, "post_backward", call))

    def _refuse_double_backward(self) -> None:
        """A backward that builds a graph (``create_graph=True``: gradient penalties, Hessian-
        vector products) leaves it reading each unit's parameters after the unit let them go:
        under a device budget below the parameters some are evicted by then, and the second
        backward failed inside torch (a storage of size 0). Refused before this backward moves
        anything (HeteroStateError)."""
        need = sum(c.blocks[PARAM].nbytes for c in self.chunks)
        budget = self.runtime.tiers[DEVICE].capacity
        if budget < need:
            raise HeteroStateError(
                f"a backward with create_graph=True (double backward: a gradient penalty, a "
                f"Hessian-vector product) keeps reading every unit's parameters after the unit's "
                f"own backward, and device_budget={budget} ({format_size(budget)}) is below the "
                f"parameters' {need} bytes ({format_size(need)}), so some are evicted before the "
                f"second backward reads them; expected device_budget >= {need}, or first-order "
                "gradients only")

    @critical
    def post_backward(self, call: Call) -> None:
        self.release_grad_pin()
        self._end_backward(call)

    def _end_backward(self, call: Call) -> None:
        if call in self._waiting:
            self._waiting.remove(call)
        for rerun in call.unit.calls:  # a re-run non-reentrant checkpointing stopped early (no
            if rerun.recompute and rerun.forward_start:  # post-forward): it ran inside this backward
                self.runtime.tracker.compute(call.unit.name, "recompute", rerun.forward_start)
                rerun.forward_start = 0.0
        if call.pinned:
            self.runtime.tracker.compute(call.unit.name, "backward", call.backward_start)
            self.runtime.release(call.unit.param_blocks)
            call.pinned = False
            call.unit.backward_pins -= 1

    @critical
    def accumulate_grad(self, param: nn.Parameter) -> None:
        """Move ``param.grad`` into its chunk's grad block (post-accumulate-grad hook).

        Gradients of one chunk arrive back to back, so its grad block stays acquired from the
        first of them until one of another chunk arrives, a unit's backward ends, or the
        backward pass ends: one acquire (and one recorded access) per run of a chunk's
        gradients rather than per parameter, with still at most one grad block pinned (what
        the minimum device budget allows for)."""
        chunk, slot = self.slot_of[id(param)]
        grad, param.grad = param.grad, None
        self._backward_grads()
        if grad is not None:  # (None: every path to it passed no gradient; it gets none, as in eager)
            self._accumulate(chunk, slot, grad)
        for call in [c for c in self._waiting if id(param) in c.waiting]:
            call.waiting.discard(id(param))
            if not call.waiting:  # the unit's backward is done (see pre_backward)
                self._end_backward(call)

    def _backward_grads(self) -> None:
        """A backward is adding gradients: due for averaging unless under no_sync(); a chunk an
        earlier, failed averaging had done is averaged again (linear: still exact)."""
        self.grads_due |= self.sync_grads
        self.local_grads |= not self.sync_grads
        if self._averaged:
            self._averaged.clear()

    def _accumulate(self, chunk: Chunk, slot: ParamSlot, grad: torch.Tensor) -> None:
        block = chunk.blocks[GRAD]
        if self._grad_pin is not block:
            self.release_grad_pin()
            self.runtime.acquire([block], DEVICE, write=True)  # created zero-filled on first use
            self._grad_pin = block
            ref = weakref.ref(self)
            torch.autograd.Variable._execution_engine.queue_callback(lambda: _call_if_alive(ref, "release_grad_pin"))
        with torch.no_grad():
            chunk.fold_pending(block.device)
            dst = slot.slice(block.device)
            if slot.has_grad:
                dst.add_(grad)
            else:
                dst.copy_(grad)
                slot.has_grad = True

    def adopt_grads(self, params: Iterable[nn.Parameter]) -> None:
        """Move gradients assigned to ``param.grad`` outside a backward (a hand-computed one, or
        the zeros torch.distributed.checkpoint's ``get_state_dict`` assigns to make a fresh
        optimizer's state) into the grad blocks, where the optimizer, ``clip_grad_norm_`` and
        the scaler read gradients: as assigning ``param.grad`` in torch, it replaces the
        parameter's gradient. (A backward's own gradients never stay in ``param.grad``.)"""
        by_chunk: dict[int, tuple[Chunk, list[tuple[nn.Parameter, ParamSlot]]]] = {}
        for p in params:
            if p.grad is None or id(p) not in self.slot_of:
                continue
            chunk, slot = self.slot_of[id(p)]
            if not chunk.requires_grad:
                raise HeteroStateError(
                    f"parameter {slot.names[0]!r} has a gradient assigned to .grad, but it was frozen "
                    "(requires_grad=False) when hetero.wrap packed it into a chunk without gradients; "
                    "expected requires_grad set before hetero.wrap for parameters that get gradients")
            by_chunk.setdefault(chunk.index, (chunk, []))[1].append((p, slot))
        for chunk, items in by_chunk.values():
            block = chunk.blocks[GRAD]
            self.runtime.acquire([block], DEVICE, write=True)  # (created zero-filled on first use)
            try:
                with torch.no_grad():
                    chunk.fold_pending(block.device)
                    for p, slot in items:
                        slot.slice(block.device).copy_(p.grad)
                        slot.has_grad = True
                        p.grad = None
            finally:
                self.runtime.release([block], DEVICE)

    def check_rest_writes(self, chunks: list[Chunk], values: bool = True) -> None:
        """Raise where a parameter at rest (a NaN placeholder off the device) was written in place
        (``p.fill_``, ``nn.init.*`` outside ``model.apply``): the write reached no block and is
        lost, which would otherwise go unnoticed. Once: the placeholder is NaN again after.
        ``values``: also read the placeholders, which a write through ``p.data`` alone changes
        (:meth:`Chunk.written_at_rest`): a wait for the device on a GPU, so once per forward at
        the root, not at each unit's."""
        self.runtime.check_open()
        written = placeholders_written(chunks) if values else [False] * len(chunks)
        for chunk, changed in zip(chunks, written):
            names = chunk.written_at_rest(changed)
            if names:
                raise HeteroStateError(
                    f"a parameter among {', '.join(repr(n) for n in names[:4])}"
                    f"{' and others' if len(names) > 4 else ''} was written in place while at rest (off "
                    "the device it reads as a NaN placeholder): the write reached none of hetero's "
                    "copies and is lost; expected writes inside summon_full_params() (or "
                    "model.apply(fn), which summons), or load_state_dict()")

    @critical
    def reduce_gradients(self) -> None:
        """Average the gradients over the ranks if a backward outside ``no_sync()`` ran since the
        last time (:mod:`hetero.distributed`): called by every reader of gradients (the
        optimizer's step, ``clip_grad_norm_``, the scaler's unscale) after adopt_grads. Sharded,
        gradients that backwards under ``no_sync()`` alone left are refused (HeteroStateError):
        each chunk's owner would update it with its own local gradient."""
        if self.replicas is None:
            return
        if not self.grads_due:
            if self.local_grads and self.replicas.sharded:
                # (Each rank raises alone: its peers ran the same loop, as DDP assumes of a
                # backward's collectives.)
                raise HeteroStateError(
                    f"gradients were read (step(), clip_grad_norm_ or a scaler's unscale) after "
                    f"backward passes that all ran under no_sync(): with sharding_strategy="
                    f"{self.cfg.sharding_strategy.name} each chunk is updated by the one rank that owns "
                    "its optimizer state, which cannot apply the other ranks' local gradients; "
                    "expected the step's last backward outside no_sync() (it averages all that was "
                    "accumulated, as DDP), or sharding_strategy='NO_SHARD', whose ranks each step "
                    "their own local gradients as DDP's do")
            return
        self.runtime.check_open()
        self.drop_stale_pins()
        average_gradients(self.replicas, self.runtime, self.chunks, self._averaged)
        self.grads_due = self.local_grads = False
        self._averaged.clear()

    @critical
    def share_updates(self, chunks: list[Chunk]) -> None:
        """Sharded data parallelism, after a step: run what it postponed (their owners' updates
        of ``chunks``), then broadcast the chunks' parameters from their owners
        (:func:`~hetero.distributed.broadcast_updates`). A failure on any rank raises on every
        rank with the step taken; what is left is shared at the next forward or step()."""
        assert self.replicas is not None
        self._unshared.extend(c for c in chunks if c not in self._unshared)
        self.replicas.together(self.runtime.catch_up, lambda: taken(None, self._unshared[0]),
                               own=lambda exc: taken(exc, self._unshared[0]))
        broadcast_updates(self.replicas, self.runtime, self._unshared)

    @functools.cached_property
    def minimums(self) -> dict[str, int]:
        """The smallest budgets ``wrap`` accepts for this model's units and chunks (fixed at
        ``wrap``): "device", "host" (without NVMe) and "host+nvme"."""
        parents = _parents([(u.name, u.module) for u in self.units])
        return {"device": _minimum_device_budget(self.units, parents),
                "host": _minimum_host_budget(self.cfg.chunk_size, False, self.chunks),
                "host+nvme": _minimum_host_budget(self.cfg.chunk_size, True, self.chunks)}

    def release_grad_pin(self) -> None:
        """Let the grad block being accumulated into go (it may be evicted again)."""
        if self._grad_pin is not None:
            block, self._grad_pin = self._grad_pin, None
            self.runtime.release([block], DEVICE)

    def end_step(self) -> None:
        self.runtime.end_step()

    @critical
    def zero_grad(self, params: Optional[set[int]], set_to_none: bool) -> None:
        """Clear the gradients of the parameters whose ids are in ``params`` (None: all), in
        their grad blocks, and any assigned to ``param.grad`` (:meth:`adopt_grads`)."""
        self.runtime.check_open()
        self.drop_stale_pins()
        if params is None:
            self.grads_due = self.local_grads = False  # (nothing left to average)
            self._averaged.clear()
        assigned = [s.param for c in self.chunks for s in c.slots
                    if s.param.grad is not None and (params is None or id(s.param) in params)]
        if set_to_none:
            for p in assigned:
                p.grad = None
        else:
            self.adopt_grads(assigned)
        for chunk in self.chunks:
            if not chunk.requires_grad:
                continue
            slots = [s for s in chunk.slots if s.has_grad and (params is None or id(s.param) in params)]
            if not slots:
                continue
            if len(slots) == sum(s.has_grad for s in chunk.slots):
                chunk.grad_scale = None  # (else the other gradients, another optimizer's, keep it)
                chunk.grad_world = 1
            if set_to_none:
                for s in slots:
                    s.has_grad = False
                # Dead bytes: free them everywhere (a postponed update frees them once it ran).
                if not any(s.has_grad for s in chunk.slots) and not self.runtime.postponed(chunk.blocks[GRAD].chunk_id):
                    self.runtime.discard(chunk.blocks[GRAD])
                continue
            block = chunk.blocks[GRAD]
            tier = self.runtime.working_tier(block)
            self.runtime.acquire([block], tier, write=True)
            try:
                flat = self.runtime.data(block, tier)
                for s in slots:
                    s.slice(flat).zero_()
            finally:
                self.runtime.release([block], tier)

    @critical
    def drop_stale_pins(self) -> None:
        """Nothing is pinned between passes: pins found outside forward and backward were left by
        a pass that raised half-way (its release hooks and end-of-backward callbacks never ran).
        Drop them so training can go on: called at the root before a forward, and by what reads,
        writes or drops blocks between passes (the optimizer's step and zero_grad, clipping)."""
        if torch._C._current_graph_task_id() != -1:
            return  # inside a backward (activation checkpointing re-runs forwards there): pins are live
        if self._grad_pin is not None or self.runtime.holds_pins:
            log.warning("hetero: dropping pins left by an interrupted forward or backward pass")
            self.forward_failed()

    @critical
    def forward_failed(self) -> None:
        """Undo the pins of a forward that raised half-way, so training can go on."""
        self.runtime.unpin_all()
        self._grad_pin = None
        self._waiting.clear()
        for unit in self.units:
            unit.calls.clear()
            unit.backward_pins = 0

    # --------------------------------------------------------------- whole-model views

    def param_names(self) -> dict[int, str]:
        return {id(s.param): s.names[0] for c in self.chunks for s in c.slots}

    @contextlib.contextmanager
    def full_params(self, writeback: bool) -> Iterator[None]:
        """Point every parameter at a full-precision CPU copy of its value (the master when mixed
        precision keeps one); optionally write changes back. Nested (``state_dict()`` inside
        ``summon_full_params()``), the inner call uses the outer one's copies as they are, and
        the outermost call alone writes back (or not)."""
        if self.summoned:
            if writeback and not self._summoned_writeback:
                raise HeteroStateError(
                    "this would write parameters back inside summon_full_params(writeback=False), "
                    "which discards every change when it ends; expected the write (a "
                    "load_state_dict, a summon with writeback) outside it, or writeback=True there")
            yield
            return
        self.check_rest_writes(self.chunks)
        self.runtime.catch_up()  # postponed optimizer updates first: their moves detach params
        copies: list[tuple[Chunk, torch.Tensor]] = []
        self.summoned, self._summoned_writeback = True, writeback
        try:
            for chunk in self.chunks:
                flat = self.runtime.read(chunk.full_precision)
                copies.append((chunk, flat))
                for s in chunk.slots:
                    s.param.data = s.slice(flat)
            yield
            if writeback:  # all or nothing: a failed transfer leaves every parameter as it was
                self.runtime.write_all(
                    ([(chunk.blocks[MASTER], flat)] if MASTER in chunk.blocks else [])
                    + [(chunk.blocks[PARAM], flat.to(chunk.dtype))] for chunk, flat in copies)
        finally:
            self.summoned = False
            for chunk, _ in copies:
                # Back to the device buffer only where it holds the data now (the runtime says
                # so once an acquire has waited for it); a copy still on its way stays poisoned
                # until the acquire that waits for it attaches it.
                if chunk.attached:
                    chunk.attach_params()
                else:
                    chunk.detach_params()


def _reject_plain_optimizers(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer pre-step hook: a torch optimizer must not step hetero-managed params."""
    if getattr(optimizer, "_hetero", False):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = state_of(p)
            if state is None or state.summoned:
                continue
            chunk, slot = state.slot_of[id(p)]
            where = "/".join(sorted(chunk.blocks[PARAM].tiers)) or "nowhere"
            raise HeteroStateError(
                f"{type(optimizer).__name__}.step() was given parameter {slot.names[0]!r}, which "
                f"hetero manages: its data is not resident for a plain optimizer (its block is on "
                f"{where}) and its gradient lives in hetero's grad blocks, so the step would update "
                "garbage. Use hetero.optim.AdamW or hetero.optim.Adam (same arguments), which step "
                "each chunk where its state lives.")


register_optimizer_step_pre_hook(_reject_plain_optimizers)


class HeteroModule(nn.Module):
    """A module whose training state is placed across device, host and NVMe by hetero.

    Behaves as the wrapped module: ``forward``, ``parameters()`` and ``named_parameters()`` (the
    original parameters under their original names), ``state_dict()`` / ``load_state_dict()``
    (full, original keys, CPU tensors). Outside forward/backward a parameter whose block is not on
    the device reads as NaN; use :meth:`summon_full_params` or :meth:`state_dict` to read values.
    """

    def __init__(self, module: nn.Module, state: HeteroState) -> None:
        super().__init__()
        self.module = module
        self._hetero_state = state
        self._loading_under: Optional[str] = None  # see _load_from_state_dict
        self.register_load_state_dict_post_hook(HeteroModule._forget_inner_keys)
        # The wrapped module's own load_state_dict (``model.module.load_state_dict``, a DDP
        # habit) loads through the chunks too: see _inner_load.
        me = weakref.ref(self)
        self._inner_loaded: Optional[tuple[str, set[str]]] = None
        module.register_load_state_dict_pre_hook(functools.partial(HeteroModule._inner_load, me))
        module.register_load_state_dict_post_hook(functools.partial(HeteroModule._inner_loaded_keys, me))

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        mp = self._hetero_state.cfg.mixed_precision
        if mp is not None and mp.param_dtype is not None:  # as FSDP: cast floating inputs at the root
            args, kwargs = pytree.tree_map_only(
                torch.Tensor, lambda t: t.to(mp.param_dtype) if t.is_floating_point() else t, (args, kwargs))
        _refuse_transforms()
        self._hetero_state.drop_stale_pins()  # (not in a checkpoint's re-run of the root inside backward)
        self._hetero_state.check_rest_writes(self._hetero_state.chunks)
        try:
            return self.module(*args, **kwargs)
        except BaseException:
            self._hetero_state.forward_failed()
            raise

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def _fqn_modifiers(self) -> dict[str, str]:
        """For ``torch.distributed.checkpoint.state_dict`` (``get_state_dict`` /
        ``set_state_dict``): each top-level name of the wrapped module is found under
        ``module``, which the names (as ``named_parameters`` and ``state_dict`` give them) leave
        out."""
        m = self.module
        names = itertools.chain(m.named_children(), m.named_parameters(recurse=False),
                                m.named_buffers(recurse=False))
        return {name: "module" for name, _ in names}

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    @critical
    def state_dict(self, *args: Any, destination: Optional[dict] = None, prefix: str = "",  # type: ignore[override]
                   keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """The full state dict: original keys, CPU tensors, parameters in full precision and
        buffers in the dtypes they had before ``mixed_precision``'s ``buffer_dtype`` (as FSDP's
        full state dict; their values were rounded to it, as there). As torch's: into
        ``destination`` where given (a parent module's ``state_dict`` gets the same), and the
        state-dict hooks registered on this module run."""
        if args:  # torch's deprecated positional form
            destination, prefix, keep_vars = (*args, *(destination, prefix, keep_vars)[len(args):])
        if destination is None:
            destination = collections.OrderedDict()
            destination._metadata = collections.OrderedDict()  # type: ignore[attr-defined]
        for hook in self._state_dict_pre_hooks.values():
            hook(self, prefix, keep_vars)
        with self._hetero_state.full_params(writeback=False):
            inner = self.module.state_dict(prefix=prefix, keep_vars=keep_vars)
        dtypes = self._hetero_state.buffer_dtypes
        for k, v in inner.items():
            destination[k] = v.detach().to("cpu", dtype=dtypes.get(k[len(prefix):], v.dtype), copy=True)
        local_metadata = inner._metadata.get(prefix[:-1], dict(version=self._version))
        if hasattr(destination, "_metadata"):
            destination._metadata.update(inner._metadata)  # (the wrapped module's, under the same names)
        for hook in self._state_dict_hooks.values():
            result = hook(self, destination, prefix, local_metadata)
            if not getattr(hook, "_from_public_api", False):  # (the private kind may replace it)
                destination = destination if result is None else result
            elif result is not None:
                raise RuntimeError("state_dict post-hook must return None")
        return destination

    @critical
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):  # type: ignore[override]
        """torch's, with the original keys (with or without the ``module.`` level), copying the
        values into the chunks wherever they live; all or nothing where a swap transfer fails.
        ``assign=True`` is refused: hetero's parameters are views of its chunks, not tensors to
        replace."""
        if assign:
            raise HeteroConfigError("load_state_dict(assign=True) is not supported by hetero; "
                                    "expected assign=False (values are copied into the chunks)")
        missing: list[str] = []
        unexpected: list[str] = []
        errors: list[str] = []
        if self._load_state_dict_pre_hooks:  # (torch runs them inside _load_from_state_dict)
            metadata = getattr(state_dict, "_metadata", None)
            state_dict = collections.OrderedDict(state_dict)  # as torch: the hooks may edit it
            if metadata is not None:
                state_dict._metadata = metadata  # type: ignore[attr-defined]
            for pre in self._load_state_dict_pre_hooks.values():
                pre(state_dict, "", {} if metadata is None else metadata.get("", {}), strict,
                    missing, unexpected, errors)
        return self._load_into_chunks(self._own_keys(state_dict), strict, (missing, unexpected, errors))

    def _own_keys(self, state_dict: Mapping[str, Any], prefix: str = "", take: bool = False) -> dict[str, Any]:
        """``state_dict``'s entries under ``prefix``, keyed as the wrapped module's own
        ``state_dict`` keys them: a key with the ``module.`` level in between (this module's
        ``nn.Module`` name for them) loses it where the rest is one of them. ``take``: and out of
        ``state_dict`` (so that torch's recursion copies nothing of them)."""
        names = set(self.module.state_dict(keep_vars=True))  # (reads no block)
        mine: dict[str, Any] = collections.OrderedDict()
        for key in [k for k in state_dict if k.startswith(prefix)]:
            name = key[len(prefix):]
            if name.startswith("module.") and name not in names and name[len("module."):] in names:
                name = name[len("module."):]
            mine[name] = state_dict.pop(key) if take else state_dict[key]  # type: ignore[attr-defined]
        metadata = getattr(state_dict, "_metadata", None)
        if metadata is not None:  # (modules' versions, by module path: BatchNorm reads its own)
            level = "module" not in self.module._modules
            own = collections.OrderedDict()
            for path, meta in metadata.items():
                if prefix and path != prefix[:-1] and not path.startswith(prefix):
                    continue
                path = path[len(prefix):] if prefix and path != prefix[:-1] else ("" if prefix else path)
                if level and (path == "module" or path.startswith("module.")):
                    path = path[len("module."):]
                own[path] = meta
            mine._metadata = own  # type: ignore[attr-defined]
        return mine

    def _load_into_chunks(self, state_dict: Mapping[str, Any], strict: bool,
                          hooks: Optional[tuple[list[str], list[str], list[str]]] = None) -> Any:
        """The wrapped module's load, into the chunks, all or nothing: a refused load (a size
        mismatch, or keys missing or unexpected where ``strict``) changes nothing. With
        ``hooks``, what this module's pre-hooks reported (missing, unexpected, errors), which its
        post-hooks then see and may change before the strict check, as in torch."""
        missing, unexpected, errors = hooks or ([], [], [])
        # Torch copies buffers at once, and inside summon_full_params the parameters too (the
        # summon writes them back): kept, to be put back where the load is refused.
        kept = list(self.module.buffers()) + (list(self.module.parameters()) if self._hetero_state.summoned else [])
        buffers = [(b, b.detach().clone()) for b in kept]
        try:
            return self._load_under_full_params(state_dict, strict, hooks, missing, unexpected, errors)
        except BaseException:
            with torch.no_grad():
                for b, was in buffers:
                    b.copy_(was)
            raise

    def _load_under_full_params(self, state_dict: Mapping[str, Any], strict: bool, hooks: Any,
                                missing: list[str], unexpected: list[str], errors: list[str]) -> Any:
        with self._hetero_state.full_params(writeback=True):
            if hooks is None:
                return self.module.load_state_dict(state_dict, strict=strict)
            try:
                result = self.module.load_state_dict(state_dict, strict=False)
                missing += result.missing_keys
                unexpected += result.unexpected_keys
            except RuntimeError as exc:  # (size mismatches: torch's message, one error a line)
                head, *lines = str(exc).split("\n\t")
                if not head.startswith("Error(s) in loading state_dict"):
                    raise
                errors += lines
            result = _IncompatibleKeys(missing, unexpected)
            for post in self._load_state_dict_post_hooks.values():
                if post(self, result) is not None:
                    raise RuntimeError("load_state_dict post-hook must return None")
            if strict and unexpected:
                errors.insert(0, "Unexpected key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in unexpected)))
            if strict and missing:
                errors.insert(0, "Missing key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in missing)))
            if errors:  # (raised inside: nothing is written back)
                raise RuntimeError("Error(s) in loading state_dict for {}:\n\t{}".format(
                    type(self.module).__name__, "\n\t".join(errors)))
            return result

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: dict,
                              strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        """A parent module's ``load_state_dict`` (this module nested in another): its keys,
        ``prefix`` + the wrapped module's own keys as :meth:`state_dict` saves them (or with the
        ``module.`` level in between), load through :meth:`load_state_dict`, into the chunks.
        They are taken out of ``state_dict`` so that torch's recursion does not copy them a
        second time into the parameters' at-rest tensors; the keys it then reports missing there
        are dropped again by :meth:`_forget_inner_keys`."""
        for pre in self._load_state_dict_pre_hooks.values():  # (torch's own would run them here)
            pre(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        mine = self._own_keys(state_dict, prefix, take=True)
        self._loading_under = prefix
        if not mine:  # nothing of this module's: no need to read and rewrite every chunk
            missing_keys.extend(prefix + k for k in sorted(self.module.state_dict(keep_vars=True)))
            return
        result = self._load_into_chunks(mine, strict=False)
        missing_keys.extend(prefix + k for k in result.missing_keys)
        unexpected_keys.extend(prefix + k for k in result.unexpected_keys)

    @staticmethod
    def _inner_load(me: "weakref.ref[HeteroModule]", inner: nn.Module, state_dict: dict[str, Any], prefix: str,
                    local_metadata: dict, strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                    error_msgs: list[str]) -> None:
        """A load_state_dict of the wrapped module itself, outside hetero's own loads (which
        materialize every parameter first): its parameters are views of chunks that may not be
        resident (torch's copies into them failed or were lost, half the model loaded). Its
        keys load into the chunks instead (:meth:`_load_into_chunks`), all or nothing, and leave
        ``state_dict`` so that torch's recursion copies nothing; the missing keys the recursion
        reports for them are dropped again by :meth:`_inner_loaded_keys`."""
        self = me()
        if self is None or inner is not self.module or self._hetero_state.summoned:
            return  # (a deep copy of the wrapped module keeps these hooks: it loads as torch loads)
        mine = {k[len(prefix):]: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(prefix)]}
        if not mine:  # (a parent's load through this module took them already)
            return
        result = self._load_into_chunks(mine, strict=False)
        unexpected_keys.extend(prefix + k for k in result.unexpected_keys)  # (the missing: torch's recursion)
        self._inner_loaded = (prefix, set(mine))

    @staticmethod
    def _inner_loaded_keys(me: "weakref.ref[HeteroModule]", inner: nn.Module, incompatible: Any) -> None:
        """Drop the keys torch's recursion reported missing that :meth:`_inner_load` loaded."""
        self = me()
        if self is None or inner is not self.module or self._inner_loaded is None:
            return
        (prefix, loaded), self._inner_loaded = self._inner_loaded, None
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys
                                        if not (k.startswith(prefix) and k[len(prefix):] in loaded)]

    @staticmethod
    def _forget_inner_keys(module: "HeteroModule", incompatible: Any) -> None:
        """Drop the keys torch's recursion reported missing under ``prefix.module.`` (see
        :meth:`_load_from_state_dict`: they were loaded under ``prefix.``)."""
        if module._loading_under is None:
            return
        inner, module._loading_under = module._loading_under + "module.", None
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if not k.startswith(inner)]

    @contextlib.contextmanager
    def summon_full_params(self, writeback: bool = True) -> Iterator[None]:
        """Every parameter materialized (on CPU) and readable in ``module``; with ``writeback``,
        in-place changes made inside the context are written back to the chunks."""
        with self._hetero_state.full_params(writeback=writeback):
            yield

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without averaging them across ranks: backwards inside it leave
        their gradients local, to be averaged together with those of the next backward outside
        it (as DDP's and FSDP's ``no_sync``; one process: nothing to average)."""
        prev, self._hetero_state.sync_grads = self._hetero_state.sync_grads, False
        try:
            yield
        finally:
            self._hetero_state.sync_grads = prev

    def apply(self, fn: Callable[[nn.Module], None]) -> "HeteroModule":  # type: ignore[override]
        """As ``nn.Module.apply``, with every parameter summoned (as FSDP's ``apply``): an
        initializer writes into the chunks, not into placeholders."""
        st = self._hetero_state
        if st.summoned:  # inside summon_full_params: its copies, its write-back (or not)
            return super().apply(fn)
        with st.full_params(writeback=True):
            return super().apply(fn)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "HeteroModule":
        """``.to()``, ``.half()``, ``.cuda()`` and the like: hetero places the parameters and
        fixes their dtypes at wrap (``device=``, ``mixed_precision=``), so only a conversion that
        changes nothing is accepted."""
        seen = set()
        for t in itertools.chain(self.module.parameters(), self.module.buffers()):
            if (t.dtype, t.device) in seen:
                continue
            seen.add((t.dtype, t.device))
            out = fn(torch.empty(0, dtype=t.dtype, device=t.device))
            if out.dtype != t.dtype or out.device != t.device:
                raise HeteroStateError(
                    f"a HeteroModule's tensors cannot be converted ({t.dtype} on {t.device} -> "
                    f"{out.dtype} on {out.device}): hetero places them and fixes their dtypes at wrap; "
                    "expected device= and mixed_precision= given to hetero.wrap instead")
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise HeteroStateError("a HeteroModule cannot be pickled or copied: its state lives in hetero's "
                               "tiers and swap files; expected model.state_dict() (and the optimizer's) "
                               "saved instead, loaded into a freshly wrapped module")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``nn.Module.zero_grad``: the gradients live in hetero's grad blocks."""
        self._hetero_state.zero_grad(None, set_to_none)

    @critical
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients in place wherever they live; returns the total norm (as torch's
        ``clip_grad_norm_`` over this module's parameters)."""
        from .optim.clip import clip_grad_norm_  # the optimizer package owns gradient math

        self._hetero_state.runtime.check_open()
        self._hetero_state.drop_stale_pins()
        self._hetero_state.adopt_grads(self.module.parameters())
        self._hetero_state.reduce_gradients()
        return clip_grad_norm_(self._hetero_state, self.module.parameters(), max_norm, norm_type)

    def placement_report(self) -> "Report":
        """Where the state is and what moved so far (:class:`hetero.Report`: ``as_dict``,
        Chrome trace, plot, access log, replay); a snapshot, readable after ``close()`` too."""
        from .profiler import Report

        return Report.from_state(self._hetero_state)

    @critical
    def close(self) -> None:
        """Remove the swap files and give back the memory the model's state took (otherwise done
        when the module is garbage collected); the parameters read as NaN placeholders after."""
        state = self._hetero_state
        state.runtime.close()
        for chunk in state.chunks:
            chunk.detach_params()
        # The optimizers' update threads too: nothing can be queued for a closed model (an
        # optimizer kept referenced, in a sweep's results, kept its thread).
        owners = {id(o): o for o in (s.owner() for c in state.chunks for s in c.slots if s.owner is not None)
                  if o is not None}
        for opt in owners.values():
            opt.stop_updates()


# ------------------------------------------------------------------------------ wrap


def _done_by(found: list[tuple[nn.Parameter, str]], leaf: bool) -> frozenset[int]:
    """The parameters whose gradients end a unit's backward when its inputs need none
    (:attr:`Unit.trainable`): its trainable ones, where all are trainable, or where it holds
    no other unit (a leaf: nothing in it is on the gradients' way anywhere else then, so a
    frozen layer of its own, a LoRA base weight, is not needed after them). Empty otherwise:
    a frozen layer of a unit that holds others may lie between them."""
    mine = frozenset(id(p) for p, _ in found if p.requires_grad)
    return mine if mine and (leaf or len(mine) == len(found)) else frozenset()


def _versions(blocks: list[Block]) -> int:
    """The version counters of the parameters of param ``blocks``, summed: they only grow, so
    the sum changes exactly when one of them was updated in place."""
    return sum(s.param._version for b in blocks for s in b.chunk.slots)


def _refuse_transforms() -> None:
    """torch.func's transforms (grad, vmap, jacrev, functional_call under grad) cannot run through
    the hooks that fetch and release units; refused before anything is fetched (a transform's
    failure inside them left the model unusable: a later forward crashed the process)."""
    if torch._C._are_functorch_transforms_active():
        raise HeteroStateError(
            "torch.func transforms (grad, vmap, jacrev, jvp, ...) are not supported through a "
            "HeteroModule: its units are fetched and released by hooks those transforms cannot "
            "run; expected loss.backward() or torch.autograd.grad for gradients")


def _check_params(module: nn.Module) -> None:
    """Refuse what chunks cannot hold: parameters that are not floating-point or complex
    (chunks are NaN-filled at rest), and sparse gradients (grad blocks are dense)."""
    for name, p in module.named_parameters():
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise HeteroConfigError(
                f"parameter {name!r} is uninitialized (a lazy module's); expected its shape known: "
                "run one forward (or initialize it) before hetero.wrap")
        if p.layout != torch.strided:
            raise HeteroConfigError(f"parameter {name!r} has layout {p.layout}; hetero.wrap manages dense "
                                    "parameters; expected a strided (dense) tensor")
        if not (p.is_floating_point() or p.is_complex()):
            raise HeteroConfigError(
                f"parameter {name!r} has dtype {p.dtype}; hetero.wrap manages floating-point and complex "
                "parameters; expected a tensor of another dtype as a buffer (register_buffer)")
    _check_aliases(module)
    for name, m in module.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
            raise HeteroConfigError(
                f"module {name or type(m).__name__!r} has sparse=True: its gradients are sparse, and "
                "hetero keeps gradients in dense blocks; expected sparse=False")


def _check_aliases(module: nn.Module) -> None:
    """Refuse two parameter objects over the same memory (``nn.Parameter(other.data)``, a view
    of another): eager updates that memory through both, hetero packs each into chunks of its own
    and would silently part them. A parameter tied by object (the same ``nn.Parameter`` in two
    places) is one parameter and packed once; parameters over separate elements of one tensor
    (column blocks of a fused weight, every other element) share nothing and are accepted."""
    spans: dict[int, list[tuple[int, int, str, torch.Tensor]]] = {}
    for name, p in module.named_parameters():
        if p.is_meta or p.numel() == 0:
            continue
        size = p.element_size()
        start = p.storage_offset() * size
        end = start + size * (1 + sum((n - 1) * abs(st) for n, st in zip(p.shape, p.stride())))
        spans.setdefault(p.untyped_storage().data_ptr(), []).append((start, end, name, p))
    for found in spans.values():  # runs of parameters whose spans overlap, each checked whole
        found.sort(key=lambda e: e[:2])
        cluster: list[tuple[int, int, str, torch.Tensor]] = []
        end = 0
        for entry in found:
            if entry[0] >= end:
                if len(cluster) > 1:
                    _shared_elements(cluster)
                cluster = []
            cluster.append(entry)
            end = max(end, entry[1])
        if len(cluster) > 1:
            _shared_elements(cluster)


def _shared_elements(cluster: list[tuple[int, int, str, torch.Tensor]]) -> None:
    """Of parameters whose byte spans overlap, the first two that share a byte: refused."""
    lo = cluster[0][0]
    owner = torch.full((max(e[1] for e in cluster) - lo,), -1, dtype=torch.int16)
    for i, (start, _, name, p) in enumerate(cluster):
        size = p.element_size()
        view = owner.as_strided(tuple(p.shape) + (size,), tuple(st * size for st in p.stride()) + (1,),
                                start - lo)
        hits = view[view >= 0]
        if hits.numel():
            first = cluster[int(hits[0])][2]
            raise HeteroConfigError(
                f"parameters {first!r} and {name!r} are two parameter objects over the same "
                "memory (one made from the other's data, or a view of it): eager training updates "
                "that memory through both, hetero.wrap gives each its own; expected one parameter "
                "object in both places (tie by assignment: b.weight = a.weight) or separate tensors")
        view.fill_(i)  # (a parameter overlapping itself, stride 0, is its own business)


def _check_norm_buffers(module: nn.Module, given: Any, mp: Any) -> None:
    """Every module computes in ``param_dtype``. A norm layer with running statistics (BatchNorm,
    InstanceNorm with ``track_running_stats``) computes with its buffers too: left in another
    dtype (``buffer_dtype`` unset, buffers fp32), its first forward fails with a bare dtype error.
    FSDP runs torch's ``MixedPrecision._module_classes_to_ignore`` (BatchNorm by default) in full
    precision instead, which hetero does not; so such a module is refused here, with either
    MixedPrecision. Modules of the ignored classes count too, whatever they are."""
    if mp is None or mp.param_dtype in (None, torch.float32) or mp.buffer_dtype == mp.param_dtype:
        return
    ignored = tuple(getattr(given, "_module_classes_to_ignore", ()) or ())
    for name, m in module.named_modules():
        if not isinstance(m, (nn.modules.batchnorm._NormBase, *ignored)):
            continue
        kept = [b.dtype for b in m.buffers(recurse=False) if b.is_floating_point() and b.dtype != mp.param_dtype]
        if not kept:
            continue
        why = ("is of a class in torch's MixedPrecision._module_classes_to_ignore, which FSDP runs in "
               "full precision" if ignored and isinstance(m, ignored) else "computes with its running "
               "statistics")
        raise HeteroConfigError(
            f"mixed_precision: module {name!r} ({type(m).__name__}) {why}; hetero runs every module "
            f"in param_dtype={mp.param_dtype}, and its buffers would stay {kept[0]}, which fails in "
            f"its first forward; expected buffer_dtype={mp.param_dtype} (buffers in the compute dtype)")


def _minimum_device_budget(units: list[Unit], parents: list[Optional[int]]) -> int:
    """Bytes the device must hold: the param blocks of a unit and of every unit enclosing it
    (their forwards are still running), plus one grad block being accumulated."""
    need = 0
    for u in units:
        blocks: dict[int, Block] = {}
        i: Optional[int] = u.index
        while i is not None:
            blocks.update({id(b): b for b in units[i].param_blocks})
            i = parents[i]
        grads = [b.chunk.blocks[GRAD].nbytes for b in blocks.values() if GRAD in b.chunk.blocks]
        need = max(need, sum(b.nbytes for b in blocks.values()) + max(grads, default=0))
    return need


def _parents(units: list[tuple[str, nn.Module]]) -> list[Optional[int]]:
    index = {id(m): i for i, (_, m) in enumerate(units)}
    parents: list[Optional[int]] = [None] * len(units)

    def visit(m: nn.Module, owner: Optional[int]) -> None:
        for c in m.children():
            if id(c) in index:
                parents[index[id(c)]] = owner
                visit(c, index[id(c)])
            else:
                visit(c, owner)

    visit(units[0][1], 0)
    return parents


def _minimum_host_budget(chunk_size: int, nvme: bool, chunks: list[Chunk]) -> int:
    """Bytes the host tier must hold. With NVMe: an optimizer step's blocks for one chunk, all in
    host slots at once, plus slack so a block spanning several slots still finds a contiguous run
    among them; and at least the largest block staged there for the device beside the largest
    the device writes back to make room for it. Without NVMe: one block (a device eviction lands
    there)."""
    sizes = expected_block_bytes(chunks)
    slot = slot_size_for(chunk_size, sizes)
    if not nvme:
        return slots_for(max(sizes, default=0), slot) * slot
    # A block staged through the host onto the device while the device's room for it is made:
    # the blocks it evicts are written back to the host, one at a time, beside it.
    largest = sorted((slots_for(n, slot) for n in sizes), reverse=True)[:2]
    need = sum(largest)
    for c in chunks:
        if c.requires_grad:
            step = [slots_for(b.nbytes, slot) for b in c.blocks.values()]
            step += [slots_for(c.full_precision.nbytes, slot)] * 2  # exp_avg, exp_avg_sq
            need = max(need, sum(step) + (len(step) - 1) * (max(step) - 1))
    return need * slot


def minimum_budgets(module: "HeteroModule", nvme: bool) -> tuple[int, int]:
    """The smallest ``device_budget`` and ``host_budget`` ``hetero.wrap`` accepts for this wrapped
    module's units and chunks, with an NVMe tier or without (the minimums its errors name)."""
    least = module._hetero_state.minimums
    return least["device"], least["host+nvme" if nvme else "host"]


def _check_budgets(cfg: Config, units: list[Unit], parents: list[Optional[int]], chunks: list[Chunk]) -> None:
    device_min = _minimum_device_budget(units, parents)
    if cfg.device_budget < device_min:
        # Smaller chunks share less of a unit's chunk with other units' parameters, down to the
        # largest parameter's size: a parameter is never split.
        largest = max((s.numel * c.blocks[PARAM].dtype.itemsize for c in chunks for s in c.slots), default=0)
        smaller = (f" a chunk_size below {cfg.chunk_size} (down to {largest}, the largest parameter's bytes),"
                   if cfg.chunk_size > largest else "")
        raise HeteroConfigError(
            f"device_budget={cfg.device_budget} ({format_size(cfg.device_budget)}) is too small: the "
            f"largest wrapped unit (with the units enclosing it and one grad block) needs "
            f"{device_min} bytes ({format_size(device_min)}); pass device_budget>={device_min},"
            f"{smaller} or an auto_wrap_policy with smaller units")
    host_min = _minimum_host_budget(cfg.chunk_size, cfg.nvme_path is not None, chunks)
    if cfg.host_budget < host_min:
        why = ("stages blocks to and from NVMe and runs the optimizer step of a chunk" if cfg.nvme_path is not None
               else "takes the blocks the device gives up, the largest of them whole")
        raise HeteroConfigError(
            f"host_budget={cfg.host_budget} ({format_size(cfg.host_budget)}) is too small: the host "
            f"tier {why}, which needs {host_min} bytes ({format_size(host_min)}) at "
            f"chunk_size={cfg.chunk_size}; pass host_budget>={host_min} (at another chunk_size the "
            "minimum differs: the largest block sets the slot size, and blocks spanning slots need "
            "slack, so a smaller chunk_size does not always lower it)")
    # As the optimizer's check (Adam._check_capacity) counts: below the device each block takes
    # whole slots, or units of shared ones as packed, and the budgets hold whole slots.
    sizes = [b.nbytes for c in chunks for b in c.blocks.values()]
    slot = slot_size_for(cfg.chunk_size, expected_block_bytes(chunks))
    total = sum(sizes)
    if total > cfg.device_budget:
        total = packed_bytes(sizes, slot)
    nvme = cfg.nvme_path is not None
    held = {"device": cfg.device_budget, "host": cfg.host_budget // slot * slot}
    if nvme:
        held["nvme"] = cfg.nvme_budget // slot * slot
    if total > sum(held.values()):
        kinds = {b.kind for c in chunks for b in c.blocks.values()}
        words = [w for k, w in (("param", "parameters"), ("grad", "gradients"),
                                ("master", "fp32 master copies")) if k in kinds]
        raise HeteroOOMError(
            f"the model's {', '.join(words[:-1]) + ' and ' if len(words) > 1 else ''}{words[-1]} need "
            f"{exact_size(total)} (below the device in "
            f"{format_size(slot)} slots) but the tiers hold {exact_size(sum(held.values()))} "
            f"({', '.join(f'{n} {exact_size(b)}' for n, b in held.items())}); {raise_budget_advice(nvme)}")


def _own_meta(module: nn.Module) -> dict[str, torch.Tensor]:
    """The meta tensors ``module`` holds of its own (parameters and buffers), by name."""
    own = dict(module._parameters) | dict(module._buffers)
    return {k: t for k, t in own.items() if t is not None and t.is_meta}


def _tied_from_below(module: nn.Module, t: torch.Tensor) -> bool:
    """Whether ``t``, held by ``module``, is a parameter of a module below it that ``module``
    has no ``reset_parameters`` of its own to initialize: a tie a parent made to a child's
    parameter (``self.w = self.emb.weight``), made after the child built it, which the child
    initializes."""
    return not hasattr(module, "reset_parameters") and any(
        p is t for d in module.modules() if d is not module for p in d._parameters.values())


def _adopt_below(below: dict[tuple[nn.Module, str], nn.Parameter], names: dict[int, str]) -> None:
    """After an initializer ran on a module: where it replaced meta parameters of modules below
    it with new materialized ones (``module.to_empty(device=...)``, whose ``recurse`` is True by
    default, as FSDP users write it), the original objects take the new values and their places
    back: hetero packed those objects, and a tie is one object in two places. A replacement of
    another shape or dtype, or by a meta tensor, is refused (the caller puts every one back)."""
    for (d, k), p in below.items():
        now = d._parameters.get(k)
        if now is p:
            continue
        if now is None or now.shape != p.shape or now.dtype != p.dtype or (p.is_meta and now.is_meta):
            raise HeteroConfigError(
                f"initializing modules replaced parameter {k!r} ({tuple(p.shape)}, {p.dtype}) of module "
                f"{names[id(d)] or type(d).__name__!r} below them with "
                f"{'nothing' if now is None else f'({tuple(now.shape)}, {now.dtype}, {now.device})'}; expected "
                "param_init_fn to fill the parameters in place, or to materialize them with their shape and "
                "dtype (module.to_empty(device=...))")
        if p.is_meta:  # (else a tie's second place: the first adopted the values)
            with torch.no_grad():
                torch.utils.swap_tensors(p, nn.Parameter(now.detach().to("cpu"), requires_grad=p.requires_grad))
        d._parameters[k] = p


def _materialize(root: nn.Module, chunks: list[Chunk], runtime: Runtime,
                 param_init_fn: Optional[Callable[[nn.Module], None]], device: torch.device,
                 buffer_dtype: Optional[torch.dtype]) -> None:
    """Fill each chunk's param (and master) block, streaming: a meta-device module is initialized
    module by module into a per-chunk staging buffer, and a chunk goes to its tiers as soon as it
    is full, its parameters then pointing at the placeholder (so the whole model never exists in
    memory at once). A module holding meta tensors of its own has them materialized (empty, on
    the CPU; its other tensors are kept), then ``param_init_fn(module)`` or else its
    ``reset_parameters()`` runs, which must fill them in place. Buffers move to the device (cast
    to ``buffer_dtype`` when given)."""
    slot_of = {id(s.param): (c, s) for c in chunks for s in c.slots}
    staging: dict[int, torch.Tensor] = {}
    missing = {c.index: len(c.slots) for c in chunks}
    done: set[int] = set()
    modules = list(root.modules())
    names = {id(m): name for name, m in root.named_modules()}
    # A chunk is let go once placed and once every module holding one of its parameters was
    # initialized: a tied head's reset_parameters() writes the embedding's weight too (lost,
    # as the tie made it: the values staged first stand).
    last_holder = {id(p): i for i, m in enumerate(modules) for p in m.parameters(recurse=False)}
    # A tie's values are those of the first holder that initializes it, as in eager construction
    # (a tied head's own draw is lost) - but not a parent's tie to a child's parameter
    # (_tied_from_below).
    placed: list[Chunk] = []
    materialized: set[int] = set()  # modules an initializer of a module above them materialized
    # Modules built on meta whose tensors are all ties an earlier module made real (a tied
    # head): still initialized, for the random numbers their initializer draws, as the eager
    # constructor drew them (the modules after them would get other values); the tie's values
    # staged first stand.
    was_meta = {id(m) for m in modules if _own_meta(m)}

    def stage(p: nn.Parameter) -> None:
        chunk, slot = slot_of[id(p)]
        flat = staging.get(chunk.index)
        if flat is None:
            flat = staging[chunk.index] = torch.empty(chunk.numel, dtype=chunk.full_precision.dtype)
        with torch.no_grad():
            slot.slice(flat).copy_(p.detach())
        missing[chunk.index] -= 1
        if missing[chunk.index] == 0:
            flat = staging.pop(chunk.index)
            if MASTER in chunk.blocks:
                runtime.create(chunk.blocks[MASTER], flat)
            runtime.create(chunk.blocks[PARAM], flat.to(chunk.dtype))
            placed.append(chunk)

    for i, m in enumerate(modules):
        meta = _own_meta(m)
        if meta:
            with torch.no_grad():
                for k, t in meta.items():  # in the existing objects (identity and ties kept)
                    if k in m._parameters:
                        torch.utils.swap_tensors(t, nn.Parameter(torch.empty_like(t, device="cpu"),
                                                                 requires_grad=t.requires_grad))
                    else:
                        m._buffers[k] = torch.empty_like(t, device="cpu")
        before = {k: (p, p.shape, p.dtype) for k, p in m._parameters.items() if p is not None}
        if param_init_fn is not None and (meta or id(m) in materialized or id(m) in was_meta):
            # An FSDP-style initializer may materialize the whole subtree (``to_empty`` recurses
            # by default), replacing the meta parameters below with new objects: see
            # _adopt_below. As FSDP, the modules it materialized are initialized in their turn.
            unmade = [d for d in m.modules() if d is not m and _own_meta(d)]
            below = {(d, k): p for d in unmade for k, p in d._parameters.items() if p is not None and p.is_meta}
            try:
                param_init_fn(m)
                _adopt_below(below, names)
            except BaseException:
                for (d, k), p in below.items():  # (wrap gives the model back as it was)
                    d._parameters[k] = p
                raise
            materialized.update(id(d) for d in unmade if not _own_meta(d))
        elif (meta or id(m) in was_meta) and hasattr(m, "reset_parameters"):
            m.reset_parameters()
        for k, (p, shape, dtype) in before.items():
            if m._parameters.get(k) is not p or p.shape != shape or p.dtype != dtype:
                now = m._parameters.get(k)
                m._parameters[k] = p  # (wrap gives the model back as it was)
                raise HeteroConfigError(
                    f"initializing module {names[id(m)] or type(m).__name__!r} replaced its parameter {k!r} "
                    f"({tuple(shape)}, {dtype}) with {'a new object' if now is not p else 'another shape or dtype'}"
                    f"{'' if now is None else f' ({tuple(now.shape)}, {now.dtype})'}; hetero packs the "
                    "parameters as they are before initialization; expected param_init_fn / "
                    "reset_parameters to fill them in place (nn.init.*, copy_ under torch.no_grad())")
        for p in m.parameters(recurse=False):
            if id(p) in slot_of and id(p) not in done and not _tied_from_below(m, p):  # ties: once
                done.add(id(p))
                stage(p)
        for name, b in list(m._buffers.items()):
            if b is not None:
                cast = buffer_dtype if buffer_dtype is not None and b.is_floating_point() else b.dtype
                m._buffers[name] = b.to(device=device, dtype=cast)
        for chunk in [c for c in placed if all(last_holder[id(s.param)] <= i for s in c.slots)]:
            placed.remove(chunk)
            chunk.detach_params()  # (the memory of those materialized here goes)
    assert not staging and all(v == 0 for v in missing.values())


def wrap(
    module: nn.Module,
    *,
    device: Any = None,
    device_budget: config_mod.SizeLike = None,
    host_budget: config_mod.SizeLike = None,
    nvme_path: Any = None,
    nvme_budget: config_mod.SizeLike = None,
    policy: Any = "auto",
    chunk_size: config_mod.SizeLike = "64MiB",
    prefetch: int = 2,
    auto_wrap_policy: Any = None,
    sharding_strategy: Any = "FULL_SHARD",
    mixed_precision: Any = None,
    process_group: Any = None,
    param_init_fn: Optional[Callable[[nn.Module], None]] = None,
    sync_module_states: bool = False,
    log_steps: Optional[int] = None,
) -> HeteroModule:
    """Place ``module``'s training state across device, host and NVMe under hard budgets.

    See ``shared/API.md`` for every argument. With a process group of several ranks, each rank
    places its state under its own budgets and gradients are averaged over the ranks
    (:mod:`hetero.distributed`: data parallelism; ``NO_SHARD`` replicates everything, the other
    strategies give each chunk's gradient, optimizer states and update to one owner rank).
    ``sync_module_states`` (beyond API.md, as FSDP's): every rank starts from rank 0's
    parameters and buffers. ``log_steps`` (beyond API.md): the report's logs
    (events, accesses, moves, tier usage, stalls, compute spans) keep only about the last
    ``log_steps`` optimizer steps, so that a long run's memory does not grow with it (the
    per-step totals, a few hundred bytes a step, are kept whole; a loop of forwards without
    optimizer steps, such as a long evaluation, still grows the logs); the access log is then
    complete for those steps only, and a report cannot be replayed. None (the default) keeps
    everything. Raises HeteroConfigError (before anything moves) for invalid arguments
    and budgets below the minimum, HeteroOOMError when the tiers together cannot hold the
    parameters and gradients.
    """
    group = resolve_group(process_group)  # (a bad one fails every rank alike)
    replicas = Replicas(group) if group is not None else None
    try:
        cfg, chunks, units = _prepare(
            module, replicas, sync_module_states, device=device, device_budget=device_budget,
            host_budget=host_budget, nvme_path=nvme_path, nvme_budget=nvme_budget, policy=policy,
            chunk_size=chunk_size, prefetch=prefetch, auto_wrap_policy=auto_wrap_policy,
            sharding_strategy=sharding_strategy, mixed_precision=mixed_precision,
            process_group=process_group, param_init_fn=param_init_fn, log_steps=log_steps)
    except BaseException as exc:
        if replicas is not None:  # (its peers must not wait for it in a collective)
            replicas.agree_layout(None, exc)
        raise
    if replicas is not None:
        replicas.agree_layout((chunks, module, cfg, sync_module_states))
        if cfg.sharding_strategy is not ShardingStrategy.NO_SHARD:
            replicas.shard(chunks)
        if cfg.sharding_strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD) and replicas.rank == 0:
            log.warning("hetero.wrap: sharding_strategy=%s shards gradients and optimizer states by "
                        "chunk over the %d ranks (as SHARD_GRAD_OP); parameters are replicated",
                        cfg.sharding_strategy.value, replicas.world)
    mp = cfg.mixed_precision

    # Nothing has moved so far; from here on the runtime places the state.
    policy_start = starting_copy(cfg.policy)  # for Report.simulate(): the policy before the run
    try:
        runtime = Runtime.for_chunks(cfg, chunks, make_policy(cfg.policy))
    except BaseException:
        if replicas is not None:  # (the host arena or the swap files: its peers must not wait)
            replicas.agree(False)
        raise
    claim(runtime.policy, runtime)  # (until close: no other model may run the same instance)
    install_interrupts()  # a Ctrl-C inside hetero's calls waits for their end (hetero.interrupts)
    runtime.tracker.keep_steps = cfg.log_steps
    original = {id(p): p.data for c in chunks for s in c.slots for p in [s.param] if not p.is_meta}
    on_meta = [s.param for c in chunks for s in c.slots if s.param.is_meta]
    buffer_dtypes = {name: b.dtype for name, b in module.named_buffers()}  # (before buffer_dtype)
    buffers = [(m, name, b) for m in module.modules() for name, b in m._buffers.items() if b is not None]
    agreed = replicas is None
    try:
        _materialize(module, chunks, runtime, cfg.param_init_fn, cfg.device,
                     mp.buffer_dtype if mp else None)
        runtime.drain()  # (a failed write of the state placed here fails wrap, not a later call)
        if replicas is not None:
            agreed = True
            if not replicas.agree(True):
                raise peer_failed()
            if sync_module_states:
                broadcast_states(replicas, runtime, chunks, module)
                replicas.together(runtime.drain, peer_failed)
    except BaseException:
        if not agreed:
            replicas.agree(False)
        runtime.close()
        for c in chunks:  # give the caller's model back as it was
            for s in c.slots:
                if id(s.param) in original:
                    s.param.data = original[id(s.param)]
        for p in on_meta:  # (materialized before the failure: on the meta device again)
            if not p.is_meta:
                torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(p, device="meta"),
                                                         requires_grad=p.requires_grad))
        for m, name, b in buffers:
            m._buffers[name] = b
        raise
    state = HeteroState(cfg, module, units, chunks, runtime, policy_start, replicas)
    state.buffer_dtypes = buffer_dtypes
    for c in chunks:  # at rest, as off the device: the caller's tensors are not the state any more
        c.detach_params()
    ref = weakref.ref(state)
    for unit in units:
        register_hooks(ref, unit)
    module.register_state_dict_post_hook(_module_state_dict_hook(ref))
    for c in chunks:
        for s in c.slots:
            _MANAGED[s.param] = ref
            if c.requires_grad:
                s.param.register_post_accumulate_grad_hook(_grad_hook(ref))
    log.info("hetero.wrap: %d units, %d chunks, %s of parameters; budgets device %s, host %s, nvme %s",
             len(units), len(chunks), format_size(sum(c.blocks[PARAM].nbytes for c in chunks)),
             format_budget(cfg.device_budget), format_size(cfg.host_budget), format_size(cfg.nvme_budget))
    return HeteroModule(module, state)


def _prepare(module: nn.Module, replicas: Optional[Replicas], sync_module_states: Any,
             **kwargs: Any) -> tuple[Config, list[Chunk], list[Unit]]:
    """Everything ``wrap`` checks and plans before any byte moves: the config, the chunks and the
    units. Raises HeteroConfigError (HeteroOOMError) naming what to change."""
    if not isinstance(module, nn.Module):
        raise HeteroConfigError(f"module={type(module).__name__} is not accepted; expected a torch.nn.Module")
    if isinstance(module, HeteroModule):
        raise HeteroConfigError("module is already a HeteroModule; expected an unwrapped torch.nn.Module")
    cfg = config_mod.resolve(**kwargs)
    bad = [n for n, p in module.named_parameters() if p.device.type not in ("cpu", "meta")]
    if bad:
        raise HeteroConfigError(f"module has parameters on {module.get_parameter(bad[0]).device} "
                                f"({bad[0]!r}); expected a module on the CPU or the meta device")
    if not isinstance(sync_module_states, bool):
        raise HeteroConfigError(f"sync_module_states={sync_module_states!r} is not accepted; expected True or False")
    if replicas is not None:
        replicas.check_device(cfg.device)
    if any(state_of(p) is not None for p in module.parameters()):  # (their storages are chunks)
        raise HeteroConfigError("module's parameters are already managed by another HeteroModule")
    _check_params(module)
    _check_norm_buffers(module, kwargs["mixed_precision"], cfg.mixed_precision)

    wrap_policy = cfg.auto_wrap_policy or default_auto_wrap_policy(module)
    if hasattr(wrap_policy, "_run_policy"):
        wrap_policy = fsdp_policy(module, wrap_policy)
    chosen = select_units(module, wrap_policy)
    per_unit = unit_params(chosen)
    names: dict[int, list[str]] = {}
    owner: dict[int, nn.Parameter] = {}
    for found in per_unit:
        for p, name in found:
            names.setdefault(id(p), []).append(name)
            owner[id(p)] = p
    packed: set[int] = set()
    groups = []
    for found in per_unit:
        group = []
        for p, _ in found:
            if id(p) not in packed:
                packed.add(id(p))
                group.append((p, names[id(p)]))
        groups.append(group)
    mp = cfg.mixed_precision
    chunks = pack(groups, cfg.chunk_size, cfg.device,
                  compute_dtype=mp.param_dtype if mp else None,
                  grad_dtype=(mp.reduce_dtype or mp.param_dtype) if mp else None)
    param_block = {id(s.param): c.blocks[PARAM] for c in chunks for s in c.slots}
    parents = _parents(chosen)
    units = [Unit(i, name, m, unit_blocks([param_block[id(p)] for p, _ in found]),
                  trainable=_done_by(found, leaf=i not in parents), holders=holders)
             for i, ((name, m), found, holders) in enumerate(zip(chosen, per_unit, unit_holders(chosen)))]
    _check_budgets(cfg, units, parents, chunks)
    if cfg.param_init_fn is None:
        for name, m in module.named_modules():
            # (a tie to a parameter below is initialized there)
            meta = [k for k, t in _own_meta(m).items() if not _tied_from_below(m, t)]
            if meta and not hasattr(m, "reset_parameters"):
                raise HeteroConfigError(
                    f"module {name or type(m).__name__!r} has meta-device tensors ({', '.join(meta)}) and no "
                    "reset_parameters() to initialize them (as FSDP, hetero materializes a meta "
                    "module empty and calls it); pass param_init_fn=callable(module) to initialize them")
    return cfg, chunks, units


def _module_state_dict_hook(ref: "weakref.ref[HeteroState]") -> Callable[..., None]:
    """The wrapped module's own ``state_dict()`` (the object passed to ``wrap``, and HF's
    ``save_pretrained``, which calls it) has the parameters' values, not the NaN placeholders
    they point at while off the device: each is replaced by a copy of its value, as
    ``HeteroModule.state_dict()`` gives it (whose own call, summoned already, needs nothing)."""
    @critical
    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        state = ref()
        if state is None or state.summoned:
            return
        with state.full_params(writeback=False):
            for name, p in module.named_parameters(remove_duplicate=False):  # (tied: each name)
                key = prefix + name
                if key in state_dict and state_dict[key] is not p:  # (keep_vars: the objects)
                    state_dict[key] = p.detach().clone()

    return hook


def _grad_hook(ref: "weakref.ref[HeteroState]") -> Callable[[nn.Parameter], None]:
    @critical
    def hook(param: nn.Parameter) -> None:
        state = ref()
        if state is not None:
            state.accumulate_grad(param)

    return hook
