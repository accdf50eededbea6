"""CPU Adam: hetero's fused C++ kernel against torch's AdamW (foreach, fused) and DeepSpeedCPUAdam.

    python benchmarks/bench_adam.py                          # 64M and 256M params, 1 and 2 threads
    python benchmarks/bench_adam.py --sizes 4M --reps 3      # a quick run
    python benchmarks/bench_adam.py --json results.json      # + the figures the issue tracks

The question: how many parameters per second does one AdamW step update on the CPU, for fp32
training and for mixed precision, and how close is that to what memory bandwidth allows? Before
timing, the kernel's selected code path (AVX-512, AVX2 or portable: whatever this CPU runs) must be
bit-identical to torch.optim.AdamW over 3 steps of 100,003 parameters, or the run fails.

What is measured, per size (M = 2**20 parameters) and thread count, as the median over ``--reps``
steps (each contender steps once per round, round-robin, so all see the same machine load):

fp32 (param, grad, exp_avg, exp_avg_sq all fp32; one shared set of buffers, so memory use is one
model's worth):
  hetero        ``hetero.optim.kernel.adam_step_`` with sqrt="torch": bit-identical to
                torch.optim.AdamW's default (single-tensor) step; what hetero.optim runs by default
  hetero_fused  the same kernel with sqrt="ieee": one pass with the hardware square root, as torch's
                fused=True AdamW computes it (what hetero.optim runs for param groups with fused=True)
  torch_foreach / torch_fused   torch.optim.AdamW(foreach=True) / (fused=True)
  deepspeed     DeepSpeedCPUAdam(adamw_mode=True) when the deepspeed package imports (its cpu_adam
                op is JIT-built on first use, which can take minutes)
  bound         the memory-bandwidth bound, measured in the same run by the extension's streaming
                kernel (``stream_update_``: read g, read and write back p, m, v -- the access pattern
                of an fp32 Adam step without its arithmetic, same threads, same software prefetch).
                Bytes per parameter: reads of p, g, m, v (16) + write-backs of p, m, v (12) = 28;
                write-allocate reads add nothing since every written line was just read.
                bound = measured GB/s / 28 B. (Its scale=0 form rewrites the state unchanged, so it
                runs over the same buffers as the contenders.)

mixed precision (bf16 grad in, fp32 master/exp_avg/exp_avg_sq, bf16 param out):
  hetero / hetero_fused   one pass: reads the bf16 grad, writes the bf16 param (2+12+12+2 = 28 B,
                          +2 B write-allocate read of the bf16 param)
  peers         need the passes torch/DeepSpeed users run: the bf16 grad converted into an fp32
                grad buffer (``g.copy_(g_bf16)``), the fp32 step, then the bf16 copy
                (``p_bf16.copy_(p)``): 28 + 6 + 6 B (+ write-allocate reads) per parameter.

``--json PATH`` writes ``{"fp32": {"hetero": P, "best_peer": P, "bound": P, ...},
"mixed": {"hetero": P, "best_peer": P, ...}}`` with P in params/s at the largest size and thread
count of the run. "hetero" is the faster of the kernel's two sqrt modes, named in "hetero_mode"
(in practice sqrt=ieee: the like-for-like comparison with torch's fused AdamW and DeepSpeed, which
also use the IEEE square root); "all" lists every contender, including the bit-exact default mode
("hetero"). Targets (issue 5): fp32 >= 1.0x best peer and >= 85% of the bound; mixed >= 1.25x
best peer.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch
from tqdm import tqdm

from hetero.optim import kernel as K

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling scripts and argtypes
import argtypes  # noqa: E402

LR, BETAS, EPS, WD = 1e-4, (0.9, 0.999), 1e-8, 0.01
FP32_BYTES = 28  # per parameter: read p, g, m, v; write p, m, v
PEERS = ("torch_foreach", "torch_fused", "deepspeed")


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def load_deepspeed() -> tuple[type | None, str]:
    """DeepSpeedCPUAdam and a note, or (None, why not)."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            import deepspeed
            from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam, f"deepspeed {deepspeed.__version__}"
    except Exception as exc:  # not installed, or its op does not build here
        return None, f"absent ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})"


class Buffers:
    """One model's worth of optimizer buffers, shared by every contender (their state dicts point
    at the same exp_avg / exp_avg_sq), so a 256M-parameter run needs ~5 GB instead of ~25."""

    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.n = n
        self.p = torch.randn(n, generator=gen)
        self.g = torch.randn(n, generator=gen) * 1e-3
        self.m = torch.zeros(n)
        self.v = torch.zeros(n)
        self.g_bf16 = self.g.bfloat16()
        self.p_bf16 = torch.empty(n, dtype=torch.bfloat16)
        self.param = torch.nn.Parameter(self.p, requires_grad=True)  # shares p's storage
        self.param.grad = self.g
        self.step = 0

    def torch_opt(self, cls: type, **kw) -> torch.optim.Optimizer:
        opt = cls([self.param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kw)
        return opt

    def share_state(self, opt: torch.optim.Optimizer, step: object) -> None:
        opt.state[self.param] = {"step": step, "exp_avg": self.m, "exp_avg_sq": self.v}


def contenders(buf: Buffers, threads: int, deepspeed_cls: type | None) -> dict[str, dict[str, Callable[[], None]]]:
    """name -> step function, for the fp32 and the mixed-precision case."""
    def hetero(mixed: bool, sqrt: str) -> Callable[[], None]:
        def run() -> None:
            buf.step += 1
            K.adam_step_(buf.p, buf.g_bf16 if mixed else buf.g, buf.m, buf.v, step=buf.step, lr=LR,
                         beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD, decoupled=True,
                         param_out=buf.p_bf16 if mixed else None, threads=threads, sqrt=sqrt)
        return run

    peers: dict[str, Callable[[], None]] = {}
    for name, kw in (("torch_foreach", dict(foreach=True)), ("torch_fused", dict(fused=True))):
        opt = buf.torch_opt(torch.optim.AdamW, **kw)
        buf.share_state(opt, torch.tensor(1.0))
        peers[name] = opt.step
    if deepspeed_cls is not None:
        with contextlib.redirect_stdout(io.StringIO()):
            opt = deepspeed_cls([buf.param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)
        buf.share_state(opt, 1)
        peers["deepspeed"] = opt.step

    def with_conversions(step: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            buf.g.copy_(buf.g_bf16)  # bf16 grads -> the fp32 grad buffer the optimizer reads
            step()
            buf.p_bf16.copy_(buf.p)  # fp32 master -> bf16 compute copy
        return run

    def bound() -> None:  # the bytes of an fp32 step without its arithmetic; scale 0 keeps the state
        K.stream_update_([buf.g], [buf.p, buf.m, buf.v], scale=0.0, threads=threads)

    fp32 = {"hetero": hetero(False, "torch"), "hetero_fused": hetero(False, "ieee"), **peers, "bound": bound}
    mixed = {"hetero": hetero(True, "torch"), "hetero_fused": hetero(True, "ieee"),
             **{name: with_conversions(step) for name, step in peers.items()}}
    return {"fp32": fp32, "mixed": mixed}


def measure(fns: dict[str, Callable[[], None]], reps: int, bar: tqdm) -> dict[str, float]:
    """Median seconds per call of each function, called round-robin (one warm-up round first)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rnd in range(reps + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if rnd:
                times[name].append(dt)
            bar.update(1)
    return {name: statistics.median(ts) for name, ts in times.items()}


def kernel_check(n: int = 100_003, steps: int = 3) -> str | None:
    """Whether the kernel's selected code path is right on this CPU before timing it: ``steps``
    AdamW steps over ``n`` fp32 parameters (an odd length: a vector tail) must be bit-identical to
    torch.optim.AdamW's default step. Returns None when they are, else what differs."""
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) * torch.logspace(-10, 1, n) for _ in range(steps)]
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for step, g in enumerate(grads, 1):
        ref.grad = g.clone()
        opt.step()
        K.adam_step_(p, g.clone(), m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                     weight_decay=0.1, decoupled=True, grad_scale=None, param_out=None, sqrt="torch")
    if torch.equal(p, ref.detach()):
        return None
    diff = (p - ref.detach()).abs()
    return f"{int((diff > 0).sum())} of {n} parameters differ, by up to {float(diff.max()):.3g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=argtypes.list_of(parse_size, "parameter counts >= 1 (e.g. 4M,64M)"),
                        default="64M,256M", help="parameter counts (M = 2**20), comma-separated")
    parser.add_argument("--threads", type=argtypes.list_of(int, "thread counts >= 1 (e.g. 1,2)"),
                        default="1,2", help="thread counts, comma-separated")
    parser.add_argument("--reps", type=argtypes.whole("timed steps"), default=7,
                        help="timed steps per contender (median)")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam")
    parser.add_argument("--json", metavar="PATH", help="write the tracked figures here")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    argtypes.output_file(parser, "--json", args.json)
    argtypes.end_on_sigterm()
    sizes, threads = args.sizes, args.threads

    if not K.has_kernel():
        print("hetero._C is not built with the CPU Adam kernel: pip install --no-build-isolation -e .")
        return 1
    ds_cls, ds_note = (None, "skipped (--no-deepspeed)") if args.no_deepspeed else load_deepspeed()
    numerics = K.torch_numerics()
    print(f"torch {torch.__version__}, kernel path {K.selected_isa()} (available {K.available_isas()}), "
          f"torch numerics {numerics}, DeepSpeedCPUAdam: {ds_note}")
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start")
    wrong = kernel_check()
    if wrong is not None:
        print(f"FAIL: the kernel's {K.selected_isa()} path is not bit-identical to torch.optim.AdamW "
              f"on this CPU ({wrong}); not timing a wrong kernel", file=sys.stderr)
        return 1
    print(f"kernel check: the {K.selected_isa()} path is bit-identical to torch.optim.AdamW (3 steps)")

    results: dict[tuple[int, int], dict[str, dict[str, float]]] = {}
    n_fns = 9 + 2 * (ds_cls is not None)  # fp32: 4 + bound (+ deepspeed); mixed: 4 (+ deepspeed)
    total = len(sizes) * len(threads) * (args.reps + 1) * n_fns
    with tqdm(total=total, desc="bench_adam", unit="step", disable=args.no_progress) as bar:
        for n in sizes:
            buf = Buffers(n)
            for t in threads:
                torch.set_num_threads(t)
                fns = contenders(buf, t, ds_cls)
                bar.set_postfix_str(f"{n / 2 ** 20:g}M params, {t} thread(s)")
                secs = {case: measure(f, args.reps, bar) for case, f in fns.items()}
                results[(n, t)] = {case: {name: n / s for name, s in r.items()} for case, r in secs.items()}
                del fns
            del buf
    load_end = os.getloadavg()[0]

    def g(x: float) -> str:
        return f"{x / 1e9:.3f}"

    print(f"\nG params/s (median of {args.reps}); bound = stream GB/s / {FP32_BYTES} B; load average at end {load_end:.2f}")
    for (n, t), r in results.items():
        f, m = r["fp32"], r["mixed"]
        peers_f = {k: v for k, v in f.items() if k in PEERS}
        peers_m = {k: v for k, v in m.items() if k in PEERS}
        best_f, best_m = max(peers_f.values()), max(peers_m.values())
        gbps = f["bound"] * FP32_BYTES / 1e9
        print(f"\n{n / 2 ** 20:g}M params, {t} thread(s): stream {gbps:.1f} GB/s -> bound {g(f['bound'])}")
        print("  fp32 : " + ", ".join(f"{k} {g(v)}" for k, v in f.items() if k != "bound"))
        print("         " + ", ".join(f"{k} {v / best_f:.2f}x best peer / {v / f['bound']:.0%} of bound"
                                      for k, v in f.items() if k.startswith("hetero")))
        print("  mixed: " + ", ".join(f"{k} {g(v)}" for k, v in m.items()))
        print("         " + ", ".join(f"{k} {v / best_m:.2f}x best peer" for k, v in m.items() if k.startswith("hetero")))

    if args.json:
        n, t = max(sizes), max(threads)
        r = results[(n, t)]
        out: dict[str, dict] = {}
        for case in ("fp32", "mixed"):
            c = r[case]
            mode = max(("hetero", "hetero_fused"), key=lambda k: c[k])
            entry = {"hetero": c[mode], "hetero_mode": {"hetero": "sqrt=torch", "hetero_fused": "sqrt=ieee"}[mode],
                     "best_peer": max(v for k, v in c.items() if k in PEERS),
                     "best_peer_name": max((k for k in c if k in PEERS), key=lambda k: c[k])}
            if case == "fp32":
                entry["bound"] = c["bound"]
            entry["all"] = dict(c)
            out[case] = entry
        out["config"] = {"params": n, "threads": t, "reps": args.reps, "deepspeed": ds_note,
                         "torch": torch.__version__, "isa": K.selected_isa(), "torch_numerics": numerics,
                         "load_average_end": load_end}
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
