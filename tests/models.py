"""Small models shared by the tests and benchmarks: a GPT with tied embeddings and variants that
exercise activation checkpointing, frozen parameters, a block applied twice and routing."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, d: int, n_head: int = 2, qkv_bias: bool = True) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.Linear(d, 3 * d, bias=qkv_bias)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.n_head = n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.attn(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-2 shaped model with tied input/output embeddings.

    ``checkpointing``: each block runs under non-reentrant activation checkpointing;
    ``repeat_block``: block 0 is applied a second time at the end of the stack;
    ``routed``: a per-batch router picks one of two expert MLPs, so the other one gets no gradient;
    ``qkv_bias=False``: no bias on the attention's q/k/v projection. The key third of that bias has
    a mathematically zero gradient (softmax ignores a shift shared by all keys), so what it gets is
    rounding noise (~1e-9), and Adam turns noise near ``eps`` into updates of a fair fraction of lr
    whose sign is the noise's. Runs whose arithmetic differs in the last bit (a CPU optimizer step against a
    GPU one) therefore drift apart there by ~lr; comparisons across such runs use this option.
    """

    def __init__(self, vocab: int = 64, d: int = 32, n_layer: int = 3, seq: int = 16, *,
                 checkpointing: bool = False, repeat_block: bool = False, routed: bool = False,
                 qkv_bias: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.h = nn.ModuleList(Block(d, qkv_bias=qkv_bias) for _ in range(n_layer))
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                     for _ in range(2)) if routed else None
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.checkpointing = checkpointing
        self.repeat_block = repeat_block

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        blocks = list(self.h) + ([self.h[0]] if self.repeat_block else [])
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
        if self.experts is not None:
            expert = int(idx[0, 0].item()) % 2  # data-dependent routing
            x = x + self.experts[expert](x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def batches(n: int, batch: int = 4, seq: int = 16, vocab: int = 64, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((idx[:, :-1], idx[:, 1:]))
    return out


def state_bytes(model: nn.Module) -> int:
    """Training-state bytes of ``model`` under Adam: param + grad + exp_avg + exp_avg_sq."""
    unique = {id(p): p for p in model.parameters()}
    return sum(4 * p.numel() * p.element_size() for p in unique.values())
