"""Data parallelism across the ranks of a torch.distributed process group.

Every rank places its training state under its own budgets (its own device, host arena and
swap files) and trains on its own batches; the ranks' gradients are averaged before anything
reads them, so every rank takes the same step: the result of DDP. With ``NO_SHARD`` every rank
holds the whole state. The other strategies shard by whole chunk (ZeRO-2, and PatrickStar's
chunk ownership): each trainable chunk has an owner rank, which alone keeps the averaged
gradient (reduced to it) and the Adam states, runs the chunk's update and broadcasts the updated
parameters; parameters, and gradients while they accumulate, are on every rank.

The averaging is lazy: a backward outside ``no_sync()`` marks the gradients due, and the first
reader after it (``optimizer.step()``, ``clip_grad_norm_``, the scaler's unscale) averages every
grad block once, chunk by chunk in the same order on every rank: with gloo where the block lives,
with NCCL on the device (a host-resident gradient travels there and back). Which reader does it
may differ between ranks under ``NO_SHARD`` (rank 0 alone measuring the norm before the step is
fine; sharded, the norm, the scaler's inf check and the optimizer's state dict gather from the
owners, so they are collectives, as FSDP's), but as with DDP and FSDP every rank must run the
synced backward. Gradients accumulated under ``no_sync()``
are averaged with the next synced backward's, as DDP does. Ranks agree before each chunk's
reduction that all of them hold it, so a rank whose swap read failed makes every rank raise,
instead of leaving its peers in a collective that never completes. Collectives are
torch.distributed's (gloo on CPUs, NCCL on GPUs).
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from .chunks import GRAD, MASTER, PARAM
from .errors import HeteroConfigError, HeteroError, HeteroIOError, HeteroOOMError
from .tiers import DEVICE

T = TypeVar("T")

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from .chunks import Block, Chunk
    from .config import Config
    from .runtime import Runtime

def resolve_group(process_group: Any) -> Optional[Any]:
    """The process group ``wrap`` averages over, or None for one process (``process_group=None``
    without torch.distributed initialized, or a group of one rank). FSDP's HYBRID_SHARD pair
    ``(intra_node_group, inter_node_group)`` is accepted when the two span the world (the usual
    layout), and stands for the world: hetero shards over all ranks alike. Raises
    HeteroConfigError for anything else that is not a ProcessGroup."""
    usable = dist.is_available() and dist.is_initialized()
    if usable and process_group is dist.GroupMember.NON_GROUP_MEMBER:
        raise HeteroConfigError(
            f"process_group: rank {dist.get_rank()} is not a member of this group (torch's new_group "
            "gives non-members a placeholder); expected a group holding this rank, or wrapping only "
            "on the group's ranks")
    if isinstance(process_group, tuple) and usable and len(process_group) == 2 and all(
            isinstance(g, dist.ProcessGroup) for g in process_group):
        sizes = [dist.get_world_size(g) for g in process_group]
        if sizes[0] * sizes[1] != dist.get_world_size():
            raise HeteroConfigError(
                f"process_group=(intra, inter) of {sizes[0]} x {sizes[1]} ranks does not span the "
                f"{dist.get_world_size()} ranks of the world; expected HYBRID_SHARD's pair of groups "
                "over the whole world, or one ProcessGroup")
        process_group = dist.group.WORLD
    elif process_group is not None and not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
        raise HeteroConfigError(f"process_group={process_group!r} is not accepted; expected a "
                                "torch.distributed ProcessGroup, HYBRID_SHARD's (intra_node, inter_node) "
                                "pair of them, or None")
    if process_group is None:
        if not usable:
            return None
        process_group = dist.group.WORLD
    return process_group if dist.get_world_size(process_group) > 1 else None


def peer_failed(kind: type = HeteroConfigError) -> HeteroError:
    """What a rank raises from ``wrap`` when another rank's failed: an error of the ``kind`` that
    rank raised, where the ranks agreed on it (an out-of-memory error where the failing rank's
    tiers could not hold the state), so that code catching one kind sees it on every rank."""
    return kind(
        "hetero.wrap failed on another rank of process_group (its error says why); this rank's "
        "module is given back as it was; expected the same wrap to succeed on every rank")


class Replicas:
    """The ranks of ``group`` and who owns which chunk's update (everyone, unless sharded):
    averages gradients, broadcasts states, and checks that every rank wrapped the same model."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend = str(dist.get_backend(group)).lower()
        # NCCL reduces device tensors only; gloo all-reduces and broadcasts CPU and CUDA tensors
        # (its reduce: CPU ones only); a group of both, "cpu:gloo,cuda:nccl", takes each tensor
        # to the backend of its device.
        self.on_device = self.backend == "nccl"
        self.comm_device = (torch.device("cuda", torch.cuda.current_device()) if self.on_device
                            else torch.device("cpu"))
        self.sharded = False  # (see shard())
        self.owner: dict[int, int] = {}  # chunk index -> the rank (of the group) owning its update

    def shard(self, chunks: list["Chunk"]) -> None:
        """Give each trainable chunk an owner, balancing bytes (the same on every rank): only the
        owner keeps the chunk's averaged gradient and optimizer states and runs its update, then
        broadcasts the updated parameters (ZeRO-2, by whole chunks as PatrickStar does)."""
        self.sharded = True
        load = [0] * self.world
        for c in chunks:
            if c.requires_grad:
                r = min(range(self.world), key=lambda k: (load[k], k))
                self.owner[c.index] = r
                load[r] += c.blocks[PARAM].nbytes

    def owns(self, chunk: "Chunk") -> bool:
        """Whether this rank updates ``chunk`` (every rank does, replicated)."""
        return not self.sharded or self.owner.get(chunk.index) == self.rank

    def owner_rank(self, chunk: "Chunk") -> int:
        """The global rank of ``chunk``'s owner."""
        return dist.get_global_rank(self.group, self.owner.get(chunk.index, 0))

    def check_device(self, device: torch.device) -> None:
        """Refuse a compute device NCCL cannot reduce on (before anything moves)."""
        if self.on_device and device != self.comm_device:
            raise HeteroConfigError(
                f"process_group uses the nccl backend, which reduces on this rank's current CUDA device "
                f"({self.comm_device}), but device={str(device)!r}; expected device={str(self.comm_device)!r} "
                "(torch.cuda.set_device(LOCAL_RANK) before hetero.wrap) or a gloo process group for a CPU device")

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.comm_device)

    def agree_layout(self, mine: Optional[tuple[list["Chunk"], "nn.Module", "Config", bool]],
                     failure: Optional[BaseException] = None) -> None:
        """The first collective of ``wrap``, after every check and plan and before any byte moves:
        ``mine`` is this rank's (chunks, module, config, sync_module_states), or None where its
        wrap failed (with ``failure``). Raises on every rank if any rank's wrap failed (a
        HeteroOOMError where one failed so, else HeteroConfigError), or HeteroConfigError unless
        all ranks packed the same chunks (parameters, shapes, dtypes of every block, frozen or
        not, chunk size), hold the same buffers and asked for the same sharding strategy and
        state sync: gradients are averaged chunk by chunk (reduced to an owner where sharded, on
        every rank where not) and states broadcast tensor by tensor, so a rank with another model
        or another strategy would mix unrelated bytes, or wait forever in a collective."""
        code = 0
        if mine is not None:
            chunks, module, cfg, sync = mine
            layout = repr([(c.numel, c.requires_grad, sorted((k, str(b.dtype)) for k, b in c.blocks.items()),
                            [(s.names[0], tuple(s.param.shape)) for s in c.slots]) for c in chunks]
                          + [(n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()]
                          + [cfg.chunk_size, cfg.sharding_strategy.value, sync])
            code = zlib.crc32(layout.encode())
        failed = 0 if mine is not None else 2 if isinstance(failure, HeteroOOMError) else 1
        t = self._tensor([failed, code, -code])
        dist.all_reduce(t, dist.ReduceOp.MAX, group=self.group)
        if mine is None:
            return  # (this rank raises its own error)
        if t[0].item():
            raise peer_failed(HeteroOOMError if t[0].item() == 2 else HeteroConfigError)
        if t[1].item() != -t[2].item():
            raise HeteroConfigError(
                f"module differs between the {self.world} ranks of process_group (rank {self.rank} "
                f"packed {len(chunks)} chunks of {sum(c.numel for c in chunks)} elements, and another "
                "rank something else): every rank must wrap the same model (the same parameters "
                "frozen, the same buffers) with the same chunk_size, mixed_precision, "
                "sharding_strategy and sync_module_states; expected identical hetero.wrap calls on "
                "every rank")

    def agree(self, ok: bool) -> bool:
        """Whether every rank is ok (one small collective every rank must reach)."""
        return not self.any([not ok])[0]

    def together(self, work: Callable[[], T], peer: Callable[[], BaseException], *,
                 own: Callable[[BaseException], BaseException] = lambda exc: exc,
                 undo: Callable[[], None] = lambda: None) -> T:
        """Run this rank's ``work`` (its I/O before a collective), then agree that every rank's
        succeeded: a HeteroIOError or HeteroOOMError on any rank raises on every rank, so none is
        left waiting in the collective that follows. This rank raises ``own(its error)``, or,
        where another rank failed, ``peer()`` after ``undo()`` (what ``work`` holds), of the
        kind the failing rank raised (HeteroIOError where ranks failed both ways), so that code
        catching one kind sees it on every rank."""
        failure: Optional[BaseException] = None
        result: Any = None
        try:
            result = work()
        except (HeteroIOError, HeteroOOMError) as exc:
            failure = exc
        io, oom = self.any([isinstance(failure, HeteroIOError), isinstance(failure, HeteroOOMError)])
        if io or oom:
            if failure is not None:
                raise own(failure)
            undo()
            exc = peer()
            kind = HeteroIOError if io else HeteroOOMError
            raise exc if isinstance(exc, kind) else kind(*exc.args)
        return result

    def average(self, flat: torch.Tensor, chunk: Optional["Chunk"] = None) -> None:
        """Replace ``flat`` with its mean over the ranks, in place (sharded: on ``chunk``'s owner
        only; the others' ``flat`` is garbage after). Floating-point values are divided before
        the sum, as DDP's default hook does (no fp16 overflow of the sum)."""
        flat.div_(self.world)  # (gradients are floating-point or complex: wrap refuses others)
        if self.sharded and chunk is not None:
            if flat.is_cuda and self.backend == "gloo":  # (gloo's reduce takes CPU tensors only)
                staged = flat.cpu()
                dist.reduce(staged, self.owner_rank(chunk), dist.ReduceOp.SUM, group=self.group)
                flat.copy_(staged)
            else:
                dist.reduce(flat, self.owner_rank(chunk), dist.ReduceOp.SUM, group=self.group)
        else:
            dist.all_reduce(flat, dist.ReduceOp.SUM, group=self.group)

    def broadcast_from_owner(self, tensor: torch.Tensor, chunk: "Chunk") -> None:
        """Overwrite ``tensor`` with ``chunk``'s owner's, in place."""
        self.broadcast_from(tensor, self.owner_rank(chunk))

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks (a new tensor on ``t``'s device)."""
        out = t.to(self.comm_device, copy=True)
        dist.all_reduce(out, dist.ReduceOp.SUM, group=self.group)
        return out.to(t.device)

    def any(self, flags: list[bool]) -> list[bool]:
        """Each flag OR-ed over the ranks."""
        t = self._tensor([int(f) for f in flags])
        dist.all_reduce(t, dist.ReduceOp.MAX, group=self.group)
        return [bool(v) for v in t.tolist()]

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Overwrite ``tensor`` with rank 0's (of the group), in place."""
        self.broadcast_from(tensor, dist.get_global_rank(self.group, 0))

    def broadcast_from(self, tensor: torch.Tensor, src: int) -> None:
        """Overwrite ``tensor`` with global rank ``src``'s, in place (staged through the device
        for NCCL)."""
        if self.on_device and tensor.device.type != "cuda":
            staged = tensor.to(self.comm_device)
            dist.broadcast(staged, src, group=self.group)
            tensor.copy_(staged)
        else:
            dist.broadcast(tensor, src, group=self.group)


def average_gradients(replicas: Replicas, runtime: "Runtime", chunks: list["Chunk"], done: set[int]) -> None:
    """Average every grad block not in ``done`` (chunk indices, added to as they are averaged)
    over the ranks (sharded: into its owner's, the others dropping theirs). A parameter with a
    gradient on any rank has one after it (on every rank, or its owner), the others contributing
    zeros, as in DDP; one without a gradient anywhere keeps none (the optimizer skips it, as
    torch's). Before each chunk the ranks agree that all of them acquired
    it: if one could not (HeteroIOError, HeteroOOMError), every rank raises, and a retry on
    every rank resumes at that chunk."""
    chunks = [c for c in chunks if c.requires_grad and GRAD in c.blocks and c.index not in done]
    found = replicas.any([s.has_grad for c in chunks for s in c.slots])
    t0 = runtime.tracker.now()
    i = 0
    for chunk in chunks:
        flags, i = found[i:i + len(chunk.slots)], i + len(chunk.slots)
        if not any(flags):
            done.add(chunk.index)
            continue
        block = chunk.blocks[GRAD]
        tier = DEVICE if replicas.on_device or not block.tiers else runtime.working_tier(block)
        replicas.together(
            lambda: runtime.acquire([block], tier, write=True),  # (created zero-filled where this rank has none)
            lambda: HeteroIOError(
                f"another rank of the process group could not read its gradients of chunk {chunk.index} "
                "for averaging (its error says why); nothing was averaged from this chunk on; the "
                "next optimizer step, clip or unscale on every rank resumes here"),
            undo=lambda: runtime.release([block], tier))
        try:
            with torch.no_grad():
                flat = runtime.data(block, tier)
                chunk.fold_pending(flat)  # (before the sum)
                for s, f in zip(chunk.slots, flags):
                    if f and not s.has_grad:
                        s.slice(flat).zero_()
                replicas.average(flat, chunk)
                mine = replicas.owns(chunk)
                for s, f in zip(chunk.slots, flags):
                    s.has_grad = (s.has_grad or f) and mine
                if replicas.sharded and mine:
                    chunk.grad_world = replicas.world
            done.add(chunk.index)
        finally:
            runtime.release([block], tier)
        if not replicas.owns(chunk):
            runtime.discard(block)  # (its owner alone keeps the average)
    runtime.tracker.compute("distributed", "all_reduce" if not replicas.sharded else "reduce", t0)


def broadcast_states(replicas: Replicas, runtime: "Runtime", chunks: list["Chunk"], module: "nn.Module") -> None:
    """Give every rank rank 0's parameters and buffers (``sync_module_states=True``, as FSDP's):
    chunk by chunk, the parameter block and the fp32 master where mixed precision keeps one. A
    failure on one rank raises on all (the peers' HeteroConfigError says another rank failed)."""
    first = dist.get_global_rank(replicas.group, 0)
    _share(replicas, runtime, list(chunks), lambda c: replicas.rank == 0, lambda c: first,
           lambda failure, c: failure if failure is not None else peer_failed())
    with torch.no_grad():
        for b in module.buffers():
            replicas.broadcast(b)


def broadcast_updates(replicas: Replicas, runtime: "Runtime", chunks: list["Chunk"]) -> None:
    """After a sharded step: every rank gets each of ``chunks``' parameters from its owner (the
    full-precision values, and the compute copy under mixed precision), removing each chunk from
    ``chunks`` once shared. The ranks agree before each chunk that all of them hold its blocks:
    if one could not (HeteroIOError, HeteroOOMError), every rank raises (:func:`taken`), and
    ``chunks`` keeps what is left to share."""
    _share(replicas, runtime, chunks, lambda c: replicas.owns(c), lambda c: replicas.owner_rank(c), taken)


def _share(replicas: Replicas, runtime: "Runtime", chunks: list["Chunk"], mine: Callable[["Chunk"], bool],
           src: Callable[["Chunk"], int],
           failed: Callable[[Optional[BaseException], "Chunk"], BaseException]) -> None:
    """Broadcast each of ``chunks``' parameter blocks (and master) from ``src(chunk)`` (a global
    rank), popping each chunk once done, after the ranks agree all hold its blocks (else every
    rank raises ``failed(its own failure or None, chunk)``)."""
    while chunks:
        chunk = chunks[0]
        sending = mine(chunk)
        blocks = [chunk.full_precision] + ([chunk.blocks[PARAM]] if MASTER in chunk.blocks else [])
        held: list[tuple["Block", str]] = []

        def hold() -> None:
            for block in blocks:
                tier = DEVICE if replicas.on_device or not block.tiers else runtime.working_tier(block)
                runtime.acquire([block], tier, write=not sending, record=False)
                held.append((block, tier))

        try:
            replicas.together(hold, lambda: failed(None, chunk), own=lambda exc: failed(exc, chunk))
            for block, tier in held:
                replicas.broadcast_from(runtime.data(block, tier), src(chunk))
        finally:
            for block, tier in held:
                runtime.release([block], tier)
        chunks.pop(0)


def noted(failure: BaseException, note: str) -> BaseException:
    """``failure`` again (its type, caused by it) with ``note`` on what it means for the ranks."""
    exc = type(failure)(f"{failure}; {note}")
    exc.__cause__ = failure
    return exc


def taken(failure: Optional[BaseException], chunk: "Chunk") -> BaseException:
    """What every rank raises when one could not finish a sharded step after its updates (a
    postponed update, or a block for the broadcast of ``chunk``): this rank's own error, or
    HeteroIOError naming the other's, each saying that the step is taken."""
    after = (f"the step itself is taken on every rank; call step() again on every rank to share "
             f"the parameters from chunk {chunk.index} on (it does not update twice; else the next "
             "forward on every rank shares them)")
    if failure is not None:
        return noted(failure, after)
    return HeteroIOError(f"another rank of the process group could not finish its part of the "
                         f"step (its error says why); {after}")


def gather_states(replicas: Replicas, runtime: "Runtime", chunks: list["Chunk"],
                  kinds: tuple[str, ...]) -> dict[int, tuple[list[int], dict[str, torch.Tensor]]]:
    """A sharded optimizer's whole state on every rank (its ``state_dict`` is, as FSDP's full
    optimizer state dict, a collective): per chunk, from its owner, each slot's step count and,
    where any is above 0, CPU copies of the ``kinds`` blocks."""
    out: dict[int, tuple[list[int], dict[str, torch.Tensor]]] = {}
    for chunk in chunks:
        mine = replicas.owns(chunk)
        steps = replicas._tensor([s.step if mine else 0 for s in chunk.slots])
        replicas.broadcast_from_owner(steps, chunk)
        counts = [int(v) for v in steps.tolist()]
        flats: dict[str, torch.Tensor] = {}
        if any(counts):

            def read() -> None:
                for kind in kinds:
                    block = chunk.blocks.get(kind) if mine else None
                    flats[kind] = (runtime.read(block) if block is not None and block.tiers
                                   else torch.zeros(chunk.numel, dtype=chunk.state_dtype))

            replicas.together(read, lambda: HeteroIOError(  # (an owner's read failed: all raise)
                f"another rank of the process group could not read its optimizer states of chunk "
                f"{chunk.index} (its error says why); expected state_dict() again on every rank"))
            for flat in flats.values():
                replicas.broadcast_from_owner(torch.view_as_real(flat) if flat.is_complex() else flat, chunk)
        out[chunk.index] = (counts, flats)
    return out
