"""Data parallelism across the ranks of a torch.distributed process group.

Every rank holds the whole training state under its own budgets (its own device, host arena and
swap files) and trains on its own batches; the ranks' gradients are averaged before anything
reads them, so every rank takes the same step: the result of DDP, or of FSDP's ``NO_SHARD``.
The other sharding strategies are accepted and run the same way (the state is replicated, not
divided among ranks: each rank needs the budgets of the whole model).

The averaging is lazy: a backward outside ``no_sync()`` marks the gradients due, and the first
reader after it (``optimizer.step()``, ``clip_grad_norm_``, the scaler's unscale) averages every
grad block once, chunk by chunk in the same order on every rank, where the block lives (the
device for NCCL). Gradients accumulated under ``no_sync()`` are averaged with the next synced
backward's, as DDP does. Collectives are torch.distributed's (gloo on CPUs, NCCL on GPUs).
"""

from __future__ import annotations

import logging
import zlib
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from .chunks import GRAD, MASTER, PARAM
from .errors import HeteroConfigError
from .tiers import DEVICE

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from .chunks import Chunk
    from .config import Config
    from .runtime import Runtime

log = logging.getLogger(__name__)


def resolve_group(process_group: Any) -> Optional[Any]:
    """The process group ``wrap`` reduces over, or None for one process (``process_group=None``
    without torch.distributed initialized, or a group of one rank). Raises HeteroConfigError for
    anything that is not a ProcessGroup."""
    if process_group is not None and not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
        raise HeteroConfigError(f"process_group={process_group!r} is not accepted; expected a "
                                "torch.distributed ProcessGroup or None")
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        process_group = dist.group.WORLD
    return process_group if dist.get_world_size(process_group) > 1 else None


class Replicas:
    """The ranks of ``group``, each holding the whole state: averages gradients, broadcasts
    states, and checks that every rank wrapped the same model."""

    def __init__(self, group: Any, device: torch.device) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend = str(dist.get_backend(group)).lower()
        # NCCL reduces device tensors only; gloo reduces CPU (and CUDA) tensors where they are.
        self.on_device = "nccl" in self.backend
        if self.on_device and device.type != "cuda":
            raise HeteroConfigError(
                f"process_group uses the {self.backend} backend, which reduces CUDA tensors only, but "
                f"device={str(device)!r}; expected a gloo process group for a CPU device")
        self.comm_device = device if self.on_device else torch.device("cpu")

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.comm_device)

    def check_same_layout(self, chunks: list["Chunk"], cfg: "Config") -> None:
        """Raise HeteroConfigError on every rank unless all ranks packed the same chunks (same
        parameters, shapes, dtypes and chunk size): gradients are averaged chunk by chunk, so a
        rank with another model would mix unrelated bytes, or wait forever in a collective."""
        layout = repr([(c.numel, str(c.dtype), [(s.names[0], tuple(s.param.shape)) for s in c.slots])
                       for c in chunks] + [cfg.chunk_size])
        mine = zlib.crc32(layout.encode())
        lo, hi = self._tensor([mine]), self._tensor([mine])
        dist.all_reduce(lo, dist.ReduceOp.MIN, group=self.group)
        dist.all_reduce(hi, dist.ReduceOp.MAX, group=self.group)
        if lo.item() != hi.item():
            raise HeteroConfigError(
                f"module differs between the {self.world} ranks of process_group (rank {self.rank} "
                f"packed {len(chunks)} chunks of {sum(c.numel for c in chunks)} elements, and another "
                "rank something else): every rank must wrap the same model with the same chunk_size "
                "and mixed_precision; expected identical hetero.wrap calls on every rank")

    def average(self, flat: torch.Tensor) -> None:
        """Replace ``flat`` with its mean over the ranks, in place."""
        dist.all_reduce(flat, dist.ReduceOp.SUM, group=self.group)
        flat.div_(self.world)

    def any(self, flags: list[bool]) -> list[bool]:
        """Each flag OR-ed over the ranks."""
        t = self._tensor([int(f) for f in flags])
        dist.all_reduce(t, dist.ReduceOp.MAX, group=self.group)
        return [bool(v) for v in t.tolist()]

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Overwrite ``tensor`` with rank 0's (of the group), in place."""
        if self.on_device and tensor.device.type != "cuda":
            staged = tensor.to(self.comm_device)
            dist.broadcast(staged, dist.get_global_rank(self.group, 0), group=self.group)
            tensor.copy_(staged)
        else:
            dist.broadcast(tensor, dist.get_global_rank(self.group, 0), group=self.group)


def average_gradients(replicas: Replicas, runtime: "Runtime", chunks: list["Chunk"], due: bool) -> bool:
    """Average every grad block over the ranks if a backward outside ``no_sync()`` ran on any rank
    since the last averaging (``due`` is this rank's say; one small collective decides, so a rank
    whose backward reached none of its parameters still takes part). A parameter with a gradient
    on any rank has one on every rank after it (the others contribute zeros), as in DDP; one
    without a gradient anywhere keeps none (the optimizer skips it, as torch's). Idempotent, so a
    call that failed half-way (an I/O error) can simply run again. Returns whether it averaged."""
    chunks = [c for c in chunks if c.requires_grad and GRAD in c.blocks]
    due_anywhere, *found = replicas.any([due] + [s.has_grad for c in chunks for s in c.slots])
    if not due_anywhere:
        return False
    t0 = runtime.tracker.now()
    i = 0
    for chunk in chunks:
        flags, i = found[i:i + len(chunk.slots)], i + len(chunk.slots)
        if not any(flags):
            continue
        block = chunk.blocks[GRAD]
        tier = DEVICE if replicas.on_device or not block.tiers else runtime.working_tier(block)
        runtime.acquire([block], tier, write=True)  # (created zero-filled where this rank has none)
        try:
            with torch.no_grad():
                flat = runtime.data(block, tier)
                if chunk.grad_scale is not None:  # a pending clip or unscale: before the sum
                    flat.mul_(chunk.grad_scale.to(flat.device))
                    chunk.grad_scale = None
                for s, f in zip(chunk.slots, flags):
                    if f and not s.has_grad:
                        s.slice(flat).zero_()
                replicas.average(flat)
                for s, f in zip(chunk.slots, flags):
                    s.has_grad = s.has_grad or f
        finally:
            runtime.release([block], tier)
    runtime.tracker.compute("distributed", "all_reduce", t0)
    return True


def broadcast_states(replicas: Replicas, runtime: "Runtime", chunks: list["Chunk"], module: "nn.Module") -> None:
    """Give every rank rank 0's parameters and buffers (``sync_module_states=True``, as FSDP's):
    chunk by chunk, the parameter block and the fp32 master where mixed precision keeps one."""
    for chunk in chunks:
        for kind in (PARAM, MASTER):
            block = chunk.blocks.get(kind)
            if block is None or not block.tiers:
                continue
            tier = DEVICE if replicas.on_device else runtime.working_tier(block)
            runtime.acquire([block], tier, write=True, record=False)
            try:
                replicas.broadcast(runtime.data(block, tier))
            finally:
                runtime.release([block], tier)
    with torch.no_grad():
        for b in module.buffers():
            replicas.broadcast(b)
