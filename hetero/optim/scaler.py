"""Loss scaling (fp16 training) for hetero's optimizers: ``torch.amp.GradScaler`` that finds the
gradients where hetero keeps them.

torch's scaler unscales and checks ``param.grad``, which hetero leaves None (gradients live in
grad blocks, on whatever tier holds them), so with a hetero optimizer it finds no gradient and
fails ("No inf checks were recorded"). :class:`GradScaler` replaces the one method that looks
for them: the check reads each chunk's gradient where it lives, and the unscale is a pending
per-chunk scale applied where the gradient is next read (the optimizer's kernel, the next
clip), one multiply as torch's in-place unscale makes, so the results are the same and the
unscale itself moves and writes nothing (a chunk that also holds another optimizer's gradients
is unscaled in place for this one's). Everything else (the scale's growth and backoff,
skipping a step with inf/NaN gradients, ``unscale_`` before clipping, state dicts) is torch's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..chunks import GRAD
from ..errors import HeteroIOError

if TYPE_CHECKING:  # pragma: no cover
    from ..wrap import HeteroState


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for :mod:`hetero.optim` optimizers (the same arguments; other
    optimizers are handled as torch's). Use it as torch's::

        scaler = hetero.optim.GradScaler("cuda")
        scaler.scale(loss).backward()
        scaler.unscale_(opt); model.clip_grad_norm_(1.0)   # optional
        scaler.step(opt); scaler.update(); opt.zero_grad()
    """

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                        found_inf: torch.Tensor, allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        state = getattr(optimizer, "_state", None) if getattr(optimizer, "_hetero", False) else None
        if state is None:
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        # (fp16 gradients are fine: the pending scale is applied in fp32 where they are read)
        ours = {id(p) for g in optimizer.param_groups for p in g["params"]}
        state.adopt_grads(p for g in optimizer.param_groups for p in g["params"])
        state.reduce_gradients()  # (inf/NaN on any rank is then on every rank: all skip the step)
        rep = state.replicas
        if rep is None or not rep.sharded:
            bad = _check_and_unscale(state, ours, inv_scale)
        else:  # each rank checks its own chunks; all raise if one cannot, else all see any inf
            bad = rep.together(lambda: _check_and_unscale(state, ours, inv_scale), lambda: HeteroIOError(
                "another rank of the process group could not read its gradients for the "
                "scaler's unscale (its error says why); expected unscale_/step again on every rank"))
            bad = rep.sum(bad.to(torch.int64)) > 0
        found_inf += bad.to(found_inf.device, found_inf.dtype)
        return {found_inf.device: found_inf}

    def __repr__(self) -> str:
        return f"hetero.optim.GradScaler(scale={self.get_scale()})"


def _check_and_unscale(state: "HeteroState", ours: set[int], inv_scale: torch.Tensor) -> torch.Tensor:
    """Whether any of this optimizer's gradients (ids ``ours``) on this rank is inf/NaN; unscales
    mixed chunks in place and leaves the others' unscale pending (see the module docstring)."""
    rt = state.runtime
    bad: dict[torch.device, torch.Tensor] = {}  # where the gradients are (read once, at the end)
    scale = inv_scale.to(torch.float32)
    for chunk in state.chunks:
        slots = [s for s in chunk.slots if s.has_grad and id(s.param) in ours]
        if not slots or GRAD not in chunk.blocks or not chunk.blocks[GRAD].tiers:
            continue
        # A chunk holding another optimizer's gradients too (torch's recipe for several
        # optimizers: scaler.step(a); scaler.step(b)) is unscaled now, in place, for this
        # optimizer's parameters only; else the unscale is pending, for the whole chunk.
        mixed = any(s.has_grad and id(s.param) not in ours for s in chunk.slots)
        block = chunk.blocks[GRAD]
        tier = rt.working_tier(block)
        rt.acquire([block], tier, write=mixed)  # (compute reading the gradients: an access, as clip's)
        try:
            flat = rt.data(block, tier)
            for s in slots:
                found = ~torch.isfinite(s.slice(flat)).all()
                bad[flat.device] = found if flat.device not in bad else bad[flat.device] | found
                if mixed:
                    with torch.no_grad():
                        s.slice(flat).mul_(scale.to(flat.device))
        finally:
            rt.release([block], tier)
        if not mixed:
            chunk.grad_scale = scale if chunk.grad_scale is None else chunk.grad_scale * scale
    return torch.stack([b.cpu() for b in bad.values()]).any() if bad else torch.zeros((), dtype=torch.bool)


__all__ = ["GradScaler"]
