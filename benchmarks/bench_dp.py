"""What does data parallelism through hetero cost? Step time of a bundled GPT trained by several ranks.

    python benchmarks/bench_dp.py                  # 2 ranks (gloo, CPU), small GPT, 20 steps each
    python benchmarks/bench_dp.py --quick          # fewer steps (a smoke run)
    python benchmarks/bench_dp.py --json out.json

Every rank trains its own batches; the configurations take turns of ``--turn`` steps so that all
see the same machine load:
  ddp        torch's DistributedDataParallel over the eager model, torch.optim.AdamW: the peer
  resident   hetero, NO_SHARD, no budget (everything on the device): gradients all-reduced
  sharded    hetero, SHARD_GRAD_OP, no budget: gradients reduced to each chunk's owner, which
             updates it and broadcasts its parameters (each rank holds its share of Adam states)
  device25   hetero, SHARD_GRAD_OP, device budget 25% of the training state, host the rest

Reported (rank 0's medians): each configuration's step time against ddp's, hetero's gradient
averaging per step (the runtime's own spans) against a bare ``all_reduce`` of the same gradient
bytes in hetero's chunks: the communication floor of a lazy average (DDP hides its all_reduce
behind the backward; hetero's runs after it, see README), and the Adam state bytes rank 0
holds (sharded: about 1/ranks of them).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hetero
from hetero import models

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling scripts and argtypes
import argtypes  # noqa: E402

CONFIGS = ("ddp", "resident", "sharded", "device25")


def _spans(wrapped: hetero.HeteroModule) -> list[tuple[str, str, float, float]]:
    """The runtime's compute spans (what the report's trace shows), read without a report."""
    return wrapped._hetero_state.runtime.tracker.computes


def _averaging_seconds(wrapped: hetero.HeteroModule, since: int) -> float:
    return sum(end - start for what, _, start, end in _spans(wrapped)[since:] if what == "distributed")


def _worker(rank: int, args: argparse.Namespace, rendezvous: str, out: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=args.ranks,
                            timeout=datetime.timedelta(seconds=600))
    cfg = models.get_config(args.model)
    torch.manual_seed(args.seed)
    base = models.GPT(cfg)
    state = models.state_bytes(base)
    data = models.MarkovData(cfg.vocab_size, seed=args.seed, stream=rank)
    batches = [data.batch(args.batch_size, cfg.block_size) for _ in range(args.steps)]
    eager = copy.deepcopy(base)
    ddp = torch.nn.parallel.DistributedDataParallel(eager)
    runs = {"ddp": (ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3))}
    for name, budget, strategy in (("resident", None, "NO_SHARD"), ("sharded", None, "SHARD_GRAD_OP"),
                                   ("device25", state // 4, "SHARD_GRAD_OP")):
        w = hetero.wrap(copy.deepcopy(base), device="cpu", device_budget=budget, chunk_size=args.chunk_size,
                        sharding_strategy=strategy)
        runs[name] = (w, hetero.optim.AdamW(w.parameters(), lr=1e-3))
    times: dict[str, list[float]] = {n: [] for n in CONFIGS}
    averaging: dict[str, list[float]] = {n: [] for n in CONFIGS if n != "ddp"}
    losses: dict[str, list[float]] = {n: [] for n in CONFIGS}
    order = [(n, i) for start in range(0, args.steps, args.turn) for n in CONFIGS
             for i in range(start, min(start + args.turn, args.steps))]
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=len(order), desc="bench_dp", unit="step")
    for name, i in order:
        model, opt = runs[name]
        x, y = batches[i]
        since = len(_spans(model)) if name in averaging else 0
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times[name].append(time.perf_counter() - t0)
        losses[name].append(loss.item())
        if name in averaging:
            averaging[name].append(_averaging_seconds(model, since))
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    # The floor: the same gradient bytes, in the same chunks, through a bare all_reduce.
    chunks = [c.blocks["grad"].numel for c in runs["resident"][0]._hetero_state.chunks if "grad" in c.blocks]
    flats = [torch.randn(n) for n in chunks]
    bare = []
    for _ in range(max(3, args.steps // 2)):
        dist.barrier()
        t0 = time.perf_counter()
        for f in flats:
            f.div_(args.ranks)
            dist.all_reduce(f)
        bare.append(time.perf_counter() - t0)
    adam_bytes = {n: sum(b.nbytes for c in runs[n][0]._hetero_state.chunks for k, b in c.blocks.items()
                         if k in ("exp_avg", "exp_avg_sq") and b.tiers) for n in averaging}
    for name in averaging:
        runs[name][0].close()
    if rank == 0:
        skip = min(2, args.steps - 1)  # (the first steps record the sequence and warm up)
        med = {n: statistics.median(times[n][skip:]) for n in CONFIGS}
        avg = {n: statistics.median(averaging[n][skip:]) for n in averaging}
        fig = {
            "model": args.model, "ranks": args.ranks, "steps": args.steps, "batch_size": args.batch_size,
            "chunk_size": args.chunk_size, "grad_bytes": 4 * sum(chunks), "chunks": len(chunks),
            "step_s": med, "vs_ddp": {n: med[n] / med["ddp"] for n in CONFIGS},
            "averaging_s": avg, "bare_all_reduce_s": statistics.median(bare),
            "averaging_vs_bare": {n: avg[n] / statistics.median(bare) for n in avg},
            "final_loss": {n: losses[n][-1] for n in CONFIGS},
            "adam_state_bytes_rank0": adam_bytes,
        }
        with open(out, "w") as f:
            json.dump(fig, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small", choices=sorted(models.PRESETS))
    p.add_argument("--ranks", type=argtypes.whole("ranks", 2, "data parallelism needs two"), default=2)
    p.add_argument("--threads", type=argtypes.whole("threads"), default=1, help="torch threads per rank")
    p.add_argument("--steps", type=argtypes.whole("steps", 3), default=20)
    p.add_argument("--turn", type=argtypes.whole("steps"), default=5,
                   help="steps a configuration trains before the next one's turn")
    p.add_argument("--batch-size", type=argtypes.whole("sequences"), default=8)
    p.add_argument("--chunk-size", type=argtypes.size("256KiB, 64MiB"), default="1MiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="6 steps per configuration")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    argtypes.output_file(p, "--json", args.json)
    argtypes.end_on_sigterm()
    if args.quick:
        args.steps, args.turn = 6, 3
    with tempfile.TemporaryDirectory(prefix="hetero-bench-dp-") as tmp:
        out = os.path.join(tmp, "figures.json")
        mp.spawn(_worker, args=(args, os.path.join(tmp, "rendezvous"), out), nprocs=args.ranks, join=True)
        with open(out) as f:
            fig = json.load(f)
    print(f"{fig['model']} GPT, {fig['ranks']} ranks (gloo, CPU), batch {fig['batch_size']} per rank, "
          f"{fig['steps']} steps each, chunk {fig['chunk_size']} ({fig['chunks']} grad blocks, "
          f"{fig['grad_bytes'] / 2**20:.2f} MiB)")
    print(f"{'config':10} {'s/step':>8} {'/ ddp':>7} {'avg s':>8} {'/ bare':>7} {'loss':>7} {'Adam MiB':>9}")
    for n in CONFIGS:
        avg = fig["averaging_s"].get(n)
        avg_s = "" if avg is None else f"{avg:8.4f}"
        vs_bare = "" if avg is None else f"{fig['averaging_vs_bare'][n]:7.2f}"
        adam = fig["adam_state_bytes_rank0"].get(n)
        adam_s = "" if adam is None else f"{adam / 2**20:9.2f}"
        print(f"{n:10} {fig['step_s'][n]:8.4f} {fig['vs_ddp'][n]:7.3f} {avg_s:>8} {vs_bare:>7} "
              f"{fig['final_loss'][n]:7.3f} {adam_s:>9}")
    print(f"bare all_reduce of the gradient bytes: {fig['bare_all_reduce_s']:.4f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(fig, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
