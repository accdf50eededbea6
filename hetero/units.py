"""Wrapped units and the hooks that fetch their parameters around forward and backward.

A *unit* is a module chosen by ``auto_wrap_policy`` (plus the root). It owns the parameters of its
sub-tree that no nested unit owns; its param blocks are those of every chunk holding one of them.

Around each call of a unit:

* forward pre-hook: acquire its param blocks on the device (pinned), prefetch the next units;
* forward post-hook: release them;
* the outputs pass through a ``_BackwardHook`` whose backward acquires the blocks again before
  the unit's backward runs (activation checkpointing re-runs the forward in between, which
  acquires once more: a recorded access, pinned until the re-run ends, or, where the backward
  already holds the blocks, released at once);
* the inputs pass through one whose backward releases them once the unit's backward has produced
  input gradients; a callback at the end of the backward pass releases any call whose inputs
  needed no gradient (the first unit, typically).

Pins nest, so a unit called twice, a tied parameter used by two units, or a unit inside another's
forward all stay correct.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.utils._pytree as pytree
from torch import nn

from .chunks import PARAM, Block
from .interrupts import critical

if TYPE_CHECKING:  # pragma: no cover
    from .wrap import HeteroState


@dataclasses.dataclass(eq=False)
class Unit:
    index: int
    name: str
    module: nn.Module
    param_blocks: list[Block] = dataclasses.field(default_factory=list)
    calls: list["Call"] = dataclasses.field(default_factory=list)  # open forward calls (a stack)
    backward_pins: int = 0  # calls whose backward currently holds the param blocks
    # Ids of its own trainable parameters, where their gradients end its backward (all of its
    # own are trainable, or it holds no other unit; else empty: wrap._done_by).
    trainable: frozenset[int] = frozenset()
    # Modules in its sub-tree, not units themselves, that hold its parameters: each called on
    # its own acts as a call of the unit (see _register_direct_hooks).
    holders: list[nn.Module] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class Call:
    """One forward call of a unit, tracked until its backward is done."""

    unit: Unit
    forward_pinned: bool = False  # holds the param blocks for its forward
    pinned: bool = False  # holds the param blocks for its backward
    forward_start: float = 0.0  # when its forward (its backward) had its blocks: the profiler's
    backward_start: float = 0.0  # compute spans (Tracker.compute)
    recompute: bool = False  # a forward activation checkpointing re-runs inside backward
    inputs_hooked: bool = False  # an input needs grad: its backward's end is signalled there
    versions: int = 0  # its parameters' version counters, summed, when its forward had them
    waiting: set[int] = dataclasses.field(default_factory=set)  # else: parameter grads still due


def _called(module: nn.Module) -> bool:
    """Whether ``module`` has a forward of its own (``nn.ModuleList``, ``nn.ModuleDict`` and
    ``nn.ParameterList`` have none: their children are called instead, so as units their
    parameters would never be fetched)."""
    return type(module).forward is not nn.Module.forward


def default_auto_wrap_policy(root: nn.Module) -> Callable[[nn.Module, bool, int], bool]:
    """Wrap the elements of ``nn.ModuleList`` / ``nn.Sequential`` containers that hold parameters:
    in transformer models those are the blocks (``h``, ``layers``), the natural unit to stream.
    An element without a forward (a ``ModuleDict`` of sublayers) stands for its children."""
    repeated: set[int] = set()

    def add(child: nn.Module) -> None:
        if not any(True for _ in child.parameters()):
            return
        if _called(child):
            repeated.add(id(child))
        else:
            for c in child.children():
                add(c)

    for m in root.modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)):
            for child in m.children():
                add(child)

    def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return True if recurse else id(module) in repeated

    return policy


def fsdp_policy(root: nn.Module, policy: Any) -> Callable[[nn.Module, bool, int], bool]:
    """One of FSDP's policy objects (``torch.distributed.fsdp.wrap._Policy``: ``ModuleWrapPolicy``,
    ``CustomPolicy``), which pick every module to wrap from the root at once, as an
    ``auto_wrap_policy`` callable."""
    chosen = {id(m) for m in policy._run_policy(root, set(), {})}

    def by_choice(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return True if recurse else id(module) in chosen

    return by_choice


def select_units(root: nn.Module, policy: Callable[..., bool]) -> list[tuple[str, nn.Module]]:
    """Modules to wrap, root first then pre-order, with FSDP's ``auto_wrap_policy`` semantics;
    never a module without a forward of its own, whatever the policy says (its parameters stay
    with the unit that calls its children)."""
    chosen: list[tuple[str, nn.Module]] = []

    def visit(name: str, module: nn.Module) -> int:
        nonwrapped = sum(p.numel() for p in module.parameters())
        if not policy(module=module, recurse=True, nonwrapped_numel=nonwrapped):
            return 0
        mark = len(chosen)
        wrapped = sum(visit(f"{name}.{n}" if name else n, c) for n, c in module.named_children())
        if module is not root and _called(module) and policy(module=module, recurse=False,
                                                             nonwrapped_numel=nonwrapped - wrapped):
            chosen.insert(mark, (name, module))
            return nonwrapped
        return wrapped

    visit("", root)
    return [("", root)] + chosen


def unit_params(units: list[tuple[str, nn.Module]]) -> list[list[tuple[nn.Parameter, str]]]:
    """For each unit, the parameters it uses directly (not through a nested unit), with names."""
    return [[(p, name) for p, name, _ in _owned(units, module, prefix)] for prefix, module in units]


def unit_holders(units: list[tuple[str, nn.Module]]) -> list[list[nn.Module]]:
    """For each unit, the modules of its sub-tree, units neither, that hold its parameters."""
    return [list({id(m): m for _, _, m in _owned(units, module, prefix) if m is not module}.values())
            for prefix, module in units]


def _owned(units: list[tuple[str, nn.Module]], module: nn.Module,
           name: str) -> list[tuple[nn.Parameter, str, nn.Module]]:
    """The parameters of unit ``module`` (not those of a nested unit): each with its name and
    the module holding it."""
    unit_ids = {id(m) for _, m in units}
    found: list[tuple[nn.Parameter, str, nn.Module]] = []

    def visit(prefix: str, m: nn.Module) -> None:
        for pname, p in m.named_parameters(recurse=False):
            found.append((p, f"{prefix}{pname}", m))
        for cname, c in m.named_children():
            if id(c) not in unit_ids:
                visit(f"{prefix}{cname}.", c)

    visit(f"{name}." if name else "", module)
    return found


def _map_tensors(fn: Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]], tree: Any,
                 into_dataclasses: bool = False) -> Any:
    """Apply ``fn`` once to all tensors in ``tree`` that require grad; return the new tree.
    Containers are pytree's, and with ``into_dataclasses`` (a unit's outputs, as FSDP's hooks
    do) dataclass instances too: a shallow copy with the changed fields set, so that nothing
    of the instance is rebuilt (no ``__init__`` or ``__post_init__`` run again, fields that are
    not init arguments and extra keys of a dict-like one kept)."""
    found: list[torch.Tensor] = []
    _rebuild(tree, lambda t: found.append(t) or t, into_dataclasses)  # (same tensors: nothing built)
    if not found:
        return tree
    out = iter(fn(tuple(found)))
    return _rebuild(tree, lambda t: next(out), into_dataclasses)


def _children(tree: Any, into_dataclasses: bool) -> Optional[list[tuple[Any, Any]]]:
    """(name, value) of the fields of a dataclass ``tree``, or None."""
    if into_dataclasses and _is_dataclass(tree):
        return [(f.name, getattr(tree, f.name)) for f in dataclasses.fields(tree) if hasattr(tree, f.name)]
    return None


def _rebuild(tree: Any, replace: Callable[[torch.Tensor], torch.Tensor], into_dataclasses: bool) -> Any:
    """``tree`` with each tensor that requires grad replaced by ``replace(tensor)``, in order;
    ``tree`` itself (no container or dataclass copied) where ``replace`` changes none."""
    fields = _children(tree, into_dataclasses)
    if fields is not None:
        copied = None
        for name, value in fields:
            new = _rebuild(value, replace, into_dataclasses)
            if new is not value:
                copied = copy.copy(tree) if copied is None else copied
                object.__setattr__(copied, name, new)  # (frozen ones too)
                if isinstance(copied, dict) and name in copied:  # a dict-like output (HF's)
                    dict.__setitem__(copied, name, new)
        return tree if copied is None else copied
    leaves, spec = pytree.tree_flatten(tree, is_leaf=_is_dataclass if into_dataclasses else None)
    if len(leaves) == 1 and leaves[0] is tree:
        return replace(tree) if isinstance(tree, torch.Tensor) and tree.requires_grad else tree
    new = [_rebuild(x, replace, into_dataclasses) for x in leaves]
    if all(a is b for a, b in zip(new, leaves)):
        return tree
    return pytree.tree_unflatten(new, spec)


def _is_dataclass(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


# The autograd graph (which may outlive the model, e.g. through a kept loss tensor or a failed
# backward) and the module hooks hold the state only weakly, so freeing the HeteroModule frees the
# state and its swap files at once.
StateRef = Callable[[], Optional["HeteroState"]]


class _BackwardHook(torch.autograd.Function):
    """Identity in forward; in backward calls ``state.<method>(call)`` once the gradients of all
    the tensors it was applied to are ready (on outputs: before the unit's backward; on inputs:
    after it).

    It returns aliases (``detach()``: same memory and version counter), not its inputs: autograd
    forbids in-place ops on a custom Function's output that is its input (``nn.ReLU(inplace=True)``
    after a unit), and allows them on an alias, still raising where eager would (the version
    counter is shared with the tensor a backward saved)."""

    @staticmethod
    def forward(ctx, state: StateRef, method: str, call: Call, *tensors: torch.Tensor):  # type: ignore[override]
        ctx.state, ctx.method, ctx.call = state, method, call
        # An output no gradient reached passes None on, as autograd does without this hook: made
        # zeros, it gave parameters that get no gradient in eager (an unused head) a zero one,
        # which the optimizer then stepped.
        ctx.set_materialize_grads(False)
        out = tuple(t.detach() for t in tensors)
        return out if len(out) > 1 else out[0]

    @staticmethod
    @critical
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        state = ctx.state()
        if state is not None:
            getattr(state, ctx.method)(ctx.call)
        return (None, None, None) + grads


def _hook_backward(state: StateRef, method: str, call: Call, tree: Any, into_dataclasses: bool = False) -> Any:
    """``tree`` with its grad-requiring tensors routed through one :class:`_BackwardHook`."""
    def apply(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        out = _BackwardHook.apply(state, method, call, *tensors)
        return out if isinstance(out, tuple) else (out,)

    return _map_tensors(apply, tree, into_dataclasses)


def register_hooks(state_ref: StateRef, unit: Unit) -> None:
    @critical
    def pre_forward(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        state = state_ref()
        if state is None:
            raise RuntimeError("this module's HeteroModule was freed; its parameters are gone")
        call = state.pre_forward(unit)
        unit.calls.append(call)
        if torch.is_grad_enabled():
            inputs = (args, kwargs)
            args, kwargs = hooked = _hook_backward(state_ref, "post_backward", call, inputs)
            call.inputs_hooked = hooked is not inputs
        return args, kwargs

    @critical
    def post_forward(module: nn.Module, args: tuple, output: Any) -> Any:
        state = state_ref()
        call = unit.calls.pop()
        if state is not None:
            state.post_forward(call)
        if torch.is_grad_enabled():
            output = _hook_backward(state_ref, "pre_backward", call, output, into_dataclasses=True)
        return output

    # Never traced by torch.compile (it ran the runtime's bookkeeping on fake tensors and left
    # the weights corrupted): a compiled module breaks its graph around them.
    pre_forward, post_forward = torch._dynamo.disable(pre_forward), torch._dynamo.disable(post_forward)
    # First: forward pre-hooks the model already had (weight_norm's, pruning's) read parameters.
    unit.module.register_forward_pre_hook(pre_forward, with_kwargs=True, prepend=True)
    unit.module.register_forward_hook(post_forward)
    for module in unit.holders:
        _register_direct_hooks(unit, module, pre_forward, post_forward)


def _register_direct_hooks(unit: Unit, module: nn.Module, pre_forward: Callable[..., Any],
                           post_forward: Callable[..., Any]) -> None:
    """``module`` holds parameters of ``unit`` without being it. Called on its own, outside the
    unit's forward and backward (HF's ``generate()`` runs an encoder-decoder's encoder so, and
    user code calls ``get_input_embeddings()``), it is a call of the unit, which fetches the
    unit's blocks (else its parameters read as NaN); inside them it costs one check."""
    acted: list[bool] = []  # per open call of ``module``: whether it was the unit's

    @critical
    def pre(mod: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        acted.append(not (unit.calls or unit.backward_pins))
        return pre_forward(mod, args, kwargs) if acted[-1] else None

    @critical
    def post(mod: nn.Module, args: tuple, output: Any) -> Any:
        return post_forward(mod, args, output) if acted.pop() else None

    module.register_forward_pre_hook(torch._dynamo.disable(pre), with_kwargs=True, prepend=True)
    module.register_forward_hook(torch._dynamo.disable(post))


def unit_blocks(chunks_of_params: list[Optional[Block]]) -> list[Block]:
    """Unique param blocks in first-seen order."""
    seen: dict[int, Block] = {}
    for b in chunks_of_params:
        if b is not None and id(b) not in seen:
            seen[id(b)] = b
    assert all(b.kind == PARAM for b in seen.values())
    return list(seen.values())
