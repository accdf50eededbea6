"""Packing parameters into chunks, and the blocks that are the unit of placement.

A :class:`Chunk` is a flat buffer holding several parameters of one dtype back to back. Each chunk
has one :class:`Block` per kind of state: ``param`` always, ``grad`` when its parameters are
trainable, ``exp_avg`` / ``exp_avg_sq`` once an optimizer creates them (``master`` is reserved
for fp32 copies kept by mixed precision). A block moves between tiers as a whole.

Parameters stay ``nn.Parameter`` objects; while their param block is on the device their ``.data``
is a view into the block's device buffer. That buffer's *storage* is freed and re-allocated in
place (the storage-resize technique FSDP uses), so views that autograd saved during forward are
valid again when the block comes back for backward. While the block is not on the device the
parameter's data is a same-shaped read-only placeholder filled with NaN, so a stray read is
visibly wrong instead of a crash, and a stray in-place update raises.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterable, Optional

import torch
from torch import nn

PARAM, GRAD, MASTER, EXP_AVG, EXP_AVG_SQ = "param", "grad", "master", "exp_avg", "exp_avg_sq"
KINDS = (PARAM, GRAD, MASTER, EXP_AVG, EXP_AVG_SQ)


@dataclasses.dataclass
class ParamSlot:
    """Where one parameter lives inside its chunk."""

    param: nn.Parameter
    names: list[str]  # every fully qualified name it has (tied parameters have several)
    offset: int  # in elements
    numel: int
    shape: torch.Size
    has_grad: bool = False  # a gradient was accumulated since the last zero_grad
    step: int = 0  # optimizer steps taken (torch keeps this per parameter)
    rest_version: int = 0  # the parameter's version counter when it was last pointed at the placeholder
    # The hetero optimizer whose state (step, moments) the slot holds: a weakref.ref, or None.
    owner: Optional[Callable[[], object]] = None

    def slice(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset:self.offset + self.numel].view(self.shape)


class Block:
    """One kind of state of one chunk: the thing the runtime places, moves and accounts.

    Where its bytes are is described by ``device`` (a flat tensor on the compute device whose
    storage is allocated only while ``DEVICE in tiers``), ``host_offset`` (a slot in the host
    arena) and ``nvme_loc`` (a range of a swap file, or for a block larger than a slot possibly
    slots of several: :class:`~hetero.tiers.Scattered`). ``tiers`` lists the tiers holding a valid
    copy; only the runtime changes any of these.
    """

    def __init__(self, chunk: "Chunk", kind: str, dtype: torch.dtype) -> None:
        self.chunk = chunk
        self.kind = kind
        self.dtype = dtype
        self.chunk_id = f"c{chunk.index}"
        self.id = f"{self.chunk_id}.{kind}"  # simulator.SimBlock reads the chunk back from it
        self.numel = chunk.numel
        self.nbytes = chunk.numel * torch.empty((), dtype=dtype).element_size()
        self.device: Optional[torch.Tensor] = None
        self.host_offset: Optional[int] = None
        self.nvme_loc: Optional[tuple] = None  # (file, offset), or Scattered
        self.tiers: set[str] = set()
        self.pins: dict[str, int] = {}  # tier -> how many acquirers hold the copy there

    def __repr__(self) -> str:
        return f"Block({self.id}, {self.nbytes} B, tiers={sorted(self.tiers)}, pins={self.pins})"


class Chunk:
    """Parameters of one dtype (and one ``requires_grad``) packed into a flat buffer.

    ``dtype`` is the compute dtype of the param block. With mixed precision the parameters'
    original values are kept at full precision in a ``master`` block (``master_dtype``), and the
    param block holds their low-precision compute copy; gradients are in ``grad_dtype``.
    """

    def __init__(self, index: int, dtype: torch.dtype, requires_grad: bool,
                 slots: list[ParamSlot], device: torch.device,
                 master_dtype: Optional[torch.dtype] = None, grad_dtype: Optional[torch.dtype] = None) -> None:
        self.index = index
        self.dtype = dtype
        self.requires_grad = requires_grad
        self.slots = slots
        self.numel = sum(s.numel for s in slots)
        self.compute_device = device
        self.blocks: dict[str, Block] = {PARAM: Block(self, PARAM, dtype)}
        if master_dtype is not None:
            self.blocks[MASTER] = Block(self, MASTER, master_dtype)
        if requires_grad:
            self.blocks[GRAD] = Block(self, GRAD, grad_dtype or dtype)
        # Pending gradient scale (from clipping) for low-precision gradients: applied in fp32 by the
        # optimizer, as it would be on fp32 master gradients, instead of rounding it into the block.
        self.grad_scale: Optional[torch.Tensor] = None
        # With sharded data parallelism the owner's grad block holds the mean over this many ranks
        # (hetero.distributed): a gradient added to it first turns it back into their sum.
        self.grad_world = 1
        # NaN placeholder shown by parameters whose block is off the device (expand: no memory):
        # an element of a buffer the chunks of a model share (pack), so that one read sees them
        # all (placeholders_written).
        self._placeholders = torch.full((1,), math.nan, dtype=dtype, device=device)
        self._placeholder_at = 0
        self.attached = False  # the parameters point at the param block's device buffer

    def fold_pending(self, flat: torch.Tensor) -> None:
        """Before the grad block's data ``flat`` is added to or averaged: apply a pending clip or
        unscale (``grad_scale``), and turn a sharded owner's mean back into the ranks' sum
        (``grad_world``)."""
        if self.grad_scale is not None:
            flat.mul_(self.grad_scale.to(flat.device))
            self.grad_scale = None
        if self.grad_world != 1:
            flat.mul_(self.grad_world)
            self.grad_world = 1

    @property
    def _poison(self) -> torch.Tensor:
        return self._placeholders[self._placeholder_at]

    @property
    def full_precision(self) -> Block:
        """The block holding the parameters' authoritative values: master if any, else param."""
        return self.blocks.get(MASTER, self.blocks[PARAM])

    @property
    def state_dtype(self) -> torch.dtype:
        """dtype of optimizer states (as torch: the dtype of the parameter being updated)."""
        return self.full_precision.dtype

    def add_block(self, kind: str, dtype: torch.dtype) -> Block:
        block = self.blocks.get(kind)
        if block is None:
            block = self.blocks[kind] = Block(self, kind, dtype)
        return block

    def attach_params(self) -> None:
        """Point every parameter at its slice of the (resident) device buffer."""
        flat = self.blocks[PARAM].device
        for s in self.slots:
            s.param.data = s.slice(flat)
        self.attached = True

    def detach_params(self) -> None:
        """Point every parameter at the NaN placeholder (the device buffer is being freed, or the
        parameters are at rest)."""
        for s in self.slots:
            s.param.data = self._poison.expand(s.shape)
            s.rest_version = s.param._version
        self.attached = False

    def advance_versions(self) -> None:
        """Advance the parameters' version counters for a write of the param block (hetero's own,
        not one at rest: :meth:`written_at_rest` still sees a write at rest made before)."""
        for s in self.slots:
            torch.autograd.graph.increment_version(s.param)
            s.rest_version += 1

    def written_at_rest(self, placeholder_written: bool = False) -> list[str]:
        """Names of the parameters at rest if one of them was written in place since it was
        detached (the write went to the shared placeholder, not to the chunk's blocks: lost);
        the placeholder is NaN again afterwards. Else []. A write through the parameter
        (``p.fill_``, ``nn.init.*``) moves its version counter, which is read here; one through
        ``p.data`` moves no counter and shows in the placeholder's value only, which the caller
        reads (``placeholder_written``, :func:`placeholders_written`): on a GPU reading it waits
        for the device, so that is not done at every unit's forward."""
        at_rest = [s for s in self.slots if s.param.data_ptr() == self._poison.data_ptr()]
        if not placeholder_written and all(s.param._version == s.rest_version for s in at_rest):
            return []
        self._poison.fill_(math.nan)
        for s in at_rest:
            s.rest_version = s.param._version
        # (None at rest any more, the write seen in the value only: a module called on its own
        # brought the chunk to the device since; the write was to one of them, and is lost.)
        return [s.names[0] for s in at_rest or self.slots]

    def __repr__(self) -> str:
        return f"Chunk({self.index}, {self.dtype}, numel={self.numel}, params={len(self.slots)})"


def placeholders_written(chunks: list[Chunk]) -> list[bool]:
    """For each chunk, whether its NaN placeholder reads other than NaN (a parameter at rest was
    written through ``p.data``): one read of each buffer of placeholders (:func:`pack` makes one
    per dtype), a wait for the device each on a GPU."""
    written = [False] * len(chunks)
    buffers: dict[int, tuple[torch.Tensor, list[tuple[int, int]]]] = {}
    for i, c in enumerate(chunks):
        buffers.setdefault(id(c._placeholders), (c._placeholders, []))[1].append((i, c._placeholder_at))
    for buffer, members in buffers.values():
        flags = buffer.isnan().logical_not().tolist()
        for i, at in members:
            written[i] = flags[at]
    return written


def pack(groups: Iterable[list[tuple[nn.Parameter, list[str]]]], chunk_bytes: int,
         device: torch.device, compute_dtype: Optional[torch.dtype] = None,
         grad_dtype: Optional[torch.dtype] = None) -> list[Chunk]:
    """Pack parameters into chunks of about ``chunk_bytes`` (measured in their own dtype).

    With ``compute_dtype`` (mixed precision), floating-point chunks of another dtype compute in
    ``compute_dtype`` and keep a master block in their own dtype; gradients are in ``grad_dtype``
    (default: the compute dtype).

    ``groups`` yields one list of ``(param, names)`` per wrapped unit in the order units are
    expected to run; chunks never span two units, so fetching a unit fetches only its own bytes. A
    parameter bigger than ``chunk_bytes`` gets a chunk of its own. Each parameter must appear once.
    """
    chunks: list[Chunk] = []
    for group in groups:
        open_by_key: dict[tuple[torch.dtype, bool], list[ParamSlot]] = {}
        open_bytes: dict[tuple[torch.dtype, bool], int] = {}

        def close(key: tuple[torch.dtype, bool]) -> None:
            slots = open_by_key.pop(key)
            open_bytes.pop(key)
            dtype, requires_grad = key
            if compute_dtype is not None and dtype.is_floating_point and dtype != compute_dtype:
                chunks.append(Chunk(len(chunks), compute_dtype, requires_grad, slots, device,
                                    master_dtype=dtype, grad_dtype=grad_dtype))
            else:
                chunks.append(Chunk(len(chunks), dtype, requires_grad, slots, device))

        for p, names in group:
            key = (p.dtype, p.requires_grad)
            nbytes = p.numel() * p.element_size()
            if key in open_by_key and open_bytes[key] + nbytes > chunk_bytes:
                close(key)
            slots = open_by_key.setdefault(key, [])
            offset = sum(s.numel for s in slots)
            slots.append(ParamSlot(p, names, offset, p.numel(), p.shape))
            open_bytes[key] = open_bytes.get(key, 0) + nbytes
        for key in list(open_by_key):
            close(key)
    shared: dict[torch.dtype, list[Chunk]] = {}
    for c in chunks:
        shared.setdefault(c.dtype, []).append(c)
    for dtype, group in shared.items():
        buffer = torch.full((len(group),), math.nan, dtype=dtype, device=device)
        for at, c in enumerate(group):
            c._placeholders, c._placeholder_at = buffer, at
    return chunks
