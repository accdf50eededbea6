"""Gradient-norm clipping over gradients kept in grad blocks, wherever those blocks live."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch

from ..chunks import GRAD
from ..errors import HeteroIOError

if TYPE_CHECKING:  # pragma: no cover
    from ..chunks import Chunk
    from ..wrap import HeteroState


def clip_grad_norm_(state: "HeteroState", params: Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0) -> torch.Tensor:
    """As ``torch.nn.utils.clip_grad_norm_``: per-parameter norms, the norm of those (in parameter
    order, so the result rounds as torch's does), then every gradient scaled by
    ``min(1, max_norm / (total + 1e-6))`` (lazily: see the end). Parameters without a gradient are
    skipped."""
    norm_type = float(norm_type)
    params = list(dict.fromkeys(params))
    chunks = [c for c in state.chunks if GRAD in c.blocks and c.blocks[GRAD].tiers
              and any(s.has_grad for s in c.slots)]
    rep = state.replicas
    if rep is not None and rep.sharded:  # each parameter's gradient is on its chunk's owner
        per_param = rep.together(  # (every rank raises if one cannot read: none waits in the sum)
            lambda: _local_norms(state, chunks, norm_type),
            lambda: HeteroIOError(
                "another rank of the process group could not read its gradients for clip_grad_norm_ "
                "(its error says why); nothing was clipped; expected the call again on every rank"))
        zero = torch.zeros((), device=state.cfg.device)
        found = rep.sum(torch.stack([per_param.get(id(p), zero).float() for p in params] + [zero]))
        has = rep.sum(torch.tensor([float(id(p) in per_param) for p in params] + [0.0])).tolist()
        per_param = {id(p): found[i] for i, p in enumerate(params) if has[i] > 0}
    else:
        per_param = _local_norms(state, chunks, norm_type)
    norms = [per_param[id(p)] for p in params if id(p) in per_param]
    if not norms:
        return torch.tensor(0.0, device=state.cfg.device)
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    # Not applied here: each chunk's gradient is scaled where it is next read (the optimizer's
    # kernel, an accumulation into it, the next clip), one fp32 multiply as torch's in-place
    # scaling makes. So clipping writes nothing (but a pending scale, above): a failed read
    # leaves every gradient as it was, and no grad block moves twice.
    for chunk in chunks:
        chunk.grad_scale = coef if chunk.grad_scale is None else chunk.grad_scale * coef
    return total


def _local_norms(state: "HeteroState", chunks: list["Chunk"], norm_type: float) -> dict[int, torch.Tensor]:
    """Each gradient's norm in ``chunks`` (those holding gradients on this rank), by id(param)."""
    rt = state.runtime
    per_param: dict[int, torch.Tensor] = {}
    for chunk in chunks:
        block = chunk.blocks[GRAD]
        tier = rt.working_tier(block)
        scale = chunk.grad_scale
        low = block.dtype in (torch.float16, torch.bfloat16)
        # A scale pending from an earlier clip is applied to fp32 gradients first, rounded as
        # torch's in-place clips round ((g * c1) * c2, not g * (c1 * c2)): the same gradient,
        # so a failure after it changes nothing. Low-precision gradients keep the product (their
        # masters' update applies it in fp32).
        fold = scale is not None and not low
        rt.acquire([block], tier, write=fold)
        try:
            flat = rt.data(block, tier)
            if fold:
                with torch.no_grad():
                    for s in chunk.slots:
                        if s.has_grad:
                            s.slice(flat).mul_(scale.to(flat.device))
                chunk.grad_scale = scale = None
            for s in chunk.slots:
                if s.has_grad:
                    g = s.slice(flat)  # low-precision gradients are measured in fp32, as on their masters
                    g = g.float() if g.dtype in (torch.float16, torch.bfloat16) else g
                    g = g if scale is None else g * scale.to(g.device)
                    per_param[id(s.param)] = torch.linalg.vector_norm(g, norm_type)
        finally:
            rt.release([block], tier)
    return dict(zip(per_param, _moved(list(per_param.values()), state.cfg.device)))


def _moved(norms: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``norms`` (0-dim, each where its gradient is) on ``device``, in order: one copy per device
    they come from (one copy each would wait for the GPU at every parameter on the host)."""
    out: list[torch.Tensor] = list(norms)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(norms):
        by_device.setdefault(t.device, []).append(i)
    for src, idx in by_device.items():
        if src != device:
            moved = torch.stack([norms[i] for i in idx]).to(device)
            for j, i in enumerate(idx):
                out[i] = moved[j]
    return out
