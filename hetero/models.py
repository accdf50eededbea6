"""A compact GPT and a learnable synthetic data set, bundled for the CLI, demos and benchmarks.

The model is nanoGPT-shaped: token and position embeddings, ``n_layer`` pre-norm transformer
blocks in an ``nn.ModuleList`` named ``h`` (so hetero's default auto-wrap policy makes each block
a wrapped unit), a final LayerNorm and an output head tied to the token embedding.

The data are sequences drawn from a fixed random Markov chain (each token has a few likely
successors), so a model can learn them: the loss falls from ``log(vocab_size)`` towards the
chain's entropy rate, :meth:`MarkovData.entropy`.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64  # maximum sequence length
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    bias: bool = True
    tied: bool = True  # output head shares the token embedding
    checkpointing: bool = False  # re-run each block's forward in backward (activation checkpointing)
    n_expert: int = 0  # > 0: each block's MLP is a routed mixture of this many experts


#: Named presets. ``small`` is what ``hetero train`` trains by default.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=128, block_size=32, n_layer=8, n_head=2, n_embd=64),
    "small": GPTConfig(vocab_size=256, block_size=64, n_layer=8, n_head=4, n_embd=128),
    "medium": GPTConfig(vocab_size=512, block_size=128, n_layer=8, n_head=8, n_embd=512),
    "large": GPTConfig(vocab_size=1024, block_size=256, n_layer=12, n_head=12, n_embd=768),
}


def get_config(name: str) -> GPTConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"model={name!r} is not a preset; expected one of {', '.join(PRESETS)}") from None


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.mlp_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then a 4x MLP, each with a residual.

    With ``n_expert`` the MLP is a mixture of experts routed per batch: the router's mean logits
    pick one expert, whose output is scaled by its gate, so which parameters a step uses depends
    on the data (the case trace-driven placement has to survive).
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        if cfg.n_expert:
            self.router = nn.Linear(cfg.n_embd, cfg.n_expert, bias=False)
            self.experts = nn.ModuleList(MLP(cfg) for _ in range(cfg.n_expert))
        else:
            self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, d))
        h = self.ln_2(x)
        if not hasattr(self, "experts"):
            return x + self.mlp(h)
        gate = F.softmax(self.router(h).mean(dim=(0, 1)), dim=0)
        e = int(gate.argmax())
        return x + gate[e] * self.experts[e](h)


class GPT(nn.Module):
    """GPT-2 shaped language model with tied input/output embeddings.

    ``forward(idx)`` returns logits; ``forward(idx, targets)`` returns the mean cross-entropy loss.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tied:
            self.lm_head.weight = self.wte.weight
        if not self.wte.weight.is_meta:
            self.apply(self._init_weights)
            for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
                if name.endswith(("c_proj.weight", "mlp_proj.weight")):
                    nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def num_params(self) -> int:
        """Unique parameters (the tied embedding counted once)."""
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.config.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            if self.config.checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def state_bytes(model: nn.Module) -> int:
    """Adam training-state bytes of ``model``: param + grad + exp_avg + exp_avg_sq per parameter."""
    unique = {id(p): p for p in model.parameters()}
    return sum(4 * p.numel() * p.element_size() for p in unique.values())


class MarkovData:
    """Token sequences from a fixed random first-order Markov chain.

    Every token has ``branching`` possible successors with random (Dirichlet) probabilities, so the
    next token is predictable from the current one and a model's loss can fall from
    ``log(vocab_size)`` to the chain's entropy rate (:meth:`entropy`). The chain is a function of
    ``seed`` only; batches come from a separate generator seeded with ``seed + 1``, or for
    ``stream`` > 0 (another rank's batches from the same chain) from ``(seed + 1, stream)``.
    """

    def __init__(self, vocab_size: int, seed: int = 0, branching: int = 4, stream: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        succ = torch.stack([torch.randperm(vocab_size, generator=g)[:branching] for _ in range(vocab_size)])
        expo = -torch.rand(vocab_size, branching, generator=g, dtype=torch.float64).log()
        probs = expo / expo.sum(1, keepdim=True)  # Dirichlet(1, ..., 1)
        self.transition = torch.zeros(vocab_size, vocab_size, dtype=torch.float64).scatter_(1, succ, probs)
        self._cdf = self.transition.cumsum(1)
        self._cdf[:, -1] = 1.0
        self._gen = torch.Generator().manual_seed(seed + 1 if stream == 0 else hash((seed + 1, stream)))

    def sample(self, batch_size: int, length: int) -> torch.Tensor:
        """A ``(batch_size, length)`` int64 tensor of token sequences."""
        out = torch.empty(batch_size, length, dtype=torch.long)
        cur = torch.randint(0, self.vocab_size, (batch_size,), generator=self._gen)
        u = torch.rand(length, batch_size, 1, generator=self._gen, dtype=torch.float64)
        for t in range(length):
            out[:, t] = cur
            nxt = torch.searchsorted(self._cdf[cur], u[t]).squeeze(1)
            cur = nxt.clamp_(max=self.vocab_size - 1)
        return out

    def batch(self, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each ``(batch_size, seq_len)``."""
        seq = self.sample(batch_size, seq_len + 1)
        return seq[:, :-1], seq[:, 1:]

    def entropy(self) -> float:
        """Entropy rate of the chain in nats: the lowest expected loss any model can reach."""
        pi = torch.full((self.vocab_size,), 1.0 / self.vocab_size, dtype=torch.float64)
        for _ in range(2000):  # lazy power iteration from the uniform start the samples use
            pi = 0.5 * pi + 0.5 * (pi @ self.transition)
        p = self.transition
        row = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(1)
        return float((pi * row).sum())
