"""Placement quality: bytes each policy moves onto the device against Belady's bound.

For each bundled model shape (dense GPT, tied embeddings, activation checkpointing, a routed
mixture of experts) and each device budget (10%, 25%, 50% of the training state, with a host
budget small enough to force NVMe), one real run records the runtime's event log. Every policy
is then replayed on that log in the simulator (the same runtime and policy code, no tensors),
and compared with two clairvoyant lower bounds for the same accesses: Belady's page-level MIN
(``belady_bound``) and the same with the constraints every placement obeys, co-residency of an
acquire's blocks and free placement only at creation (``coresident_bound``, tighter, still a
lower bound). Real runs of each policy give stall seconds (the time compute waited for blocks;
transfers are asynchronous, so a prefetched transfer stalls nothing; ``steady``: the part from
step ``WARMUP`` on, after the recording and the routing's first picks), and their device bytes
against the co-resident bound of their own log (``ratio_real``): where a policy decides where
the optimizer updates a chunk (Adam runs where the chunk's states are, and ``opt``/``auto``
settle states on the device after a step), its own run accesses differently from the ``auto``
log, which the replay follows as recorded. ``ws`` is the largest device working set of a step (distinct bytes
acquired on the device) over the budget: above 1 the budget is below the working set.

With ``--seeds N`` each cell pools N runs (model initialization and data from seeds 0..N-1):
bytes, bounds, misses and stalls are summed over the seeds before any ratio is taken. A routed
model's transient (which experts the router picks first, and when) differs from seed to seed,
and over a dozen steps the whole device traffic of a wide budget is a few of those picks.

    python benchmarks/bench_policy.py --plot benchmarks/policy.png   # full table and its plot
    python benchmarks/bench_policy.py --quick        # fewer steps and budgets
    python benchmarks/bench_policy.py --models moe --seeds 4 --steps 24 --plot moe.png
    python benchmarks/bench_policy.py --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

import torch

torch.set_num_threads(1)  # tiny models: one thread is faster and steadier
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import hetero  # noqa: E402
from hetero.models import GPT, GPTConfig, MarkovData, state_bytes  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling scripts and argtypes
import argtypes  # noqa: E402

POLICIES = ["auto", "opt", "hotness", "lru", "static"]
BASE = GPTConfig(vocab_size=128, block_size=32, n_layer=8, n_head=2, n_embd=64)
MODELS = {
    "dense": dataclasses.replace(BASE, tied=False),
    "tied": BASE,
    "checkpointing": dataclasses.replace(BASE, checkpointing=True),
    "moe": dataclasses.replace(BASE, n_layer=4, n_expert=4),
}


def run(cfg: GPTConfig, policy: str, device_frac: float, host_frac: float | None, steps: int,
        chunk: str, swap_dir: str | None, batch: tuple[int, int] | None = None,
        seed: int = 0) -> hetero.Report:
    """The report of ``steps`` training steps of a GPT under these budgets (fractions of its
    training state; ``host_frac`` None: no host budget and no swap) on batches of ``batch``
    (sequences, tokens; default 8 x the model's block size); ``seed`` picks the model's
    initialization and the data."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    total = state_bytes(model)
    tiers = {} if host_frac is None else dict(host_budget=int(total * host_frac), nvme_path=swap_dir)
    wrapped = hetero.wrap(model, device="cpu", device_budget=int(total * device_frac), chunk_size=chunk,
                          policy=policy, **tiers)
    opt = hetero.optim.AdamW(wrapped.parameters(), lr=1e-3)
    data = MarkovData(cfg.vocab_size, seed=seed + 1)
    b, t = batch or (8, cfg.block_size)
    for _ in range(steps):
        x, y = data.batch(b, t)
        wrapped(x, y).backward()
        opt.step()
        opt.zero_grad()
    rep = wrapped.placement_report()
    wrapped.close()
    return rep


# argparse type of a budget as a fraction of the training state
FRACTION = argtypes.positive("a fraction of the training state", "0.25")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=argtypes.whole("steps"), default=12)
    ap.add_argument("--budgets", type=FRACTION, nargs="+", default=[0.10, 0.25, 0.50])
    ap.add_argument("--host", type=FRACTION, default=0.30, help="host budget, fraction of the state")
    ap.add_argument("--chunk-size", type=argtypes.size("16KiB, 1MiB"), default="16KiB")
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--seeds", type=argtypes.whole("seeds"), default=1,
                    help="runs pooled per cell (seeds 0..N-1)")
    ap.add_argument("--quick", action="store_true", help="6 steps, 25%% budget only")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--plot", metavar="PNG", default=None,
                    help="write the plot there (the committed one: benchmarks/policy.png)")
    args = ap.parse_args(argv)
    argtypes.output_file(ap, "--json", args.json)
    argtypes.output_file(ap, "--plot", args.plot)
    argtypes.end_on_sigterm()
    if args.quick:
        args.steps, args.budgets = 6, [0.25]
    results = []
    cases = [(m, b, seed) for m in args.models for b in args.budgets for seed in range(args.seeds)]
    cells: dict[tuple[str, float, str], dict] = {}
    with tempfile.TemporaryDirectory(prefix="hetero-bench-") as swap:
        for model_name in args.models:  # budgets too small for a model: refused before any run
            for frac in args.budgets:
                try:
                    run(MODELS[model_name], "auto", frac, args.host, 0, args.chunk_size, swap)
                except hetero.HeteroConfigError as exc:
                    ap.error(f"--budgets {frac:g} / --host {args.host:g} / --chunk-size {args.chunk_size} "
                             f"on model {model_name}: {exc}")
        for model_name, frac, seed in tqdm(cases, desc="policy benchmark"):
            cfg = MODELS[model_name]
            real = {p: run(cfg, p, frac, args.host, args.steps, args.chunk_size, swap, seed=seed)
                    for p in POLICIES}
            log = real["auto"]  # the recorded access log every policy is replayed on
            bound = log.belady_bound()
            tight = log.coresident_bound()
            ws = working_set(log.events, log.catalog) / log.capacities()["device"]
            for p in POLICIES:
                sim = log.simulate(p)
                d = real[p].as_dict()
                own = tight if real[p] is log else real[p].coresident_bound()  # auto's: computed above
                cell = cells.setdefault((model_name, frac, p), {
                    "model": model_name, "device_frac": frac, "policy": p, "seeds": 0, "working_set": 0.0,
                    "oom": None, **{k: 0 for k in _SUMMED}})
                cell["seeds"] += 1
                cell["working_set"] = max(cell["working_set"], ws)
                cell["oom"] = cell["oom"] or sim.oom
                for k, v in {"bound_bytes": bound, "coresident_bytes": tight,
                             "sim_device_bytes": sim.device_fetch_bytes, "sim_misses": sim.misses,
                             "real_device_bytes": d["traffic"]["host->device"], "real_coresident_bytes": own,
                             "real_nvme_bytes": d["traffic"]["nvme->host"] + d["traffic"]["host->nvme"],
                             "stall_seconds": d["stall_seconds"],
                             "stall_optimizer_seconds": d["stall_seconds_optimizer"],
                             "stall_steady_seconds": sum(d["step_stall_seconds"][WARMUP:]),
                             "prefetch_hits": d["prefetch"]["hits"]}.items():
                    cell[k] += v
    for r in cells.values():
        r["ratio"] = r["sim_device_bytes"] / r["bound_bytes"] if r["bound_bytes"] else None
        r["ratio_coresident"] = r["sim_device_bytes"] / r["coresident_bytes"] if r["coresident_bytes"] else None
        r["ratio_real"] = r["real_device_bytes"] / r["real_coresident_bytes"] if r["real_coresident_bytes"] else None
        results.append(r)
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")
    return {"results": results}


# Per-cell figures summed over the seeds (the ratios are taken of the sums).
_SUMMED = ("bound_bytes", "coresident_bytes", "sim_device_bytes", "sim_misses", "real_device_bytes",
           "real_coresident_bytes", "real_nvme_bytes", "stall_seconds", "stall_optimizer_seconds",
           "stall_steady_seconds", "prefetch_hits")
WARMUP = 3  # steps before the steady state: the first records the sequence, the next lock on


def working_set(events: list[tuple], catalog: dict) -> int:
    """The most bytes of distinct blocks any one step acquires on the device."""
    best, step = 0, set()
    for op, *args in events:
        if op == "acquire" and args[1] == "device" and args[3]:
            step.update(args[0])
        elif op == "end_step":
            best, step = max(best, sum(catalog[b][1] for b in step)), set()
    return max(best, sum(catalog[b][1] for b in step))


def print_table(results: list[dict]) -> None:
    print(f"{'model':14s} {'device':>6s} {'ws':>5s} {'policy':8s} {'sim MiB':>9s} {'/co-res':>8s} {'/Belady':>8s} "
          f"{'misses':>7s} {'real MiB':>9s} {'/own':>6s} {'nvme MiB':>9s} {'stall s':>8s} {'steady':>7s} {'pf hits':>8s}")
    for r in results:
        ratios = [f"{r[k]:.3f}" if r[k] is not None else "n/a" for k in ("ratio_coresident", "ratio", "ratio_real")]
        print(f"{r['model']:14s} {r['device_frac']:6.0%} {r['working_set']:5.2f} {r['policy']:8s} "
              f"{r['sim_device_bytes'] / 2**20:9.2f} {ratios[0]:>8s} {ratios[1]:>8s} {r['sim_misses']:7d} "
              f"{r['real_device_bytes'] / 2**20:9.2f} {ratios[2]:>6s} {r['real_nvme_bytes'] / 2**20:9.2f} "
              f"{r['stall_seconds']:8.3f} {r['stall_steady_seconds']:7.3f} {r['prefetch_hits']:8d}")


YMAX = 2.0  # the plot's ratio axis ends here


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in results))
    fracs = list(dict.fromkeys(r["device_frac"] for r in results))
    fig, axes = plt.subplots(4, len(models), figsize=(4 * len(models), 12.5), sharey="row", squeeze=False)
    width = 0.8 / len(POLICIES)
    ticks = ([i + 0.4 - width / 2 for i in range(len(fracs))], [f"{f:.0%}" for f in fracs])
    for row, (key, label) in enumerate([("ratio_coresident", "replay / co-resident bound"),
                                        ("ratio", "replay / Belady page bound"),
                                        ("ratio_real", "real run / its own\nco-resident bound")]):
        for ax, m in zip(axes[row], models):
            for k, p in enumerate(POLICIES):
                ys = [next((r[key] or 1.0) for r in results if r["model"] == m and r["policy"] == p
                           and r["device_frac"] == f) for f in fracs]
                xs = [i + k * width for i in range(len(fracs))]
                ax.bar(xs, ys, width, label=p)
                for x, y in zip(xs, ys):  # bars above the axis: their value at the top
                    if y > YMAX:
                        ax.text(x, YMAX, f"{y:.1f}", rotation=90, ha="center", va="top", fontsize="x-small")
            ax.axhline(1.0, color="k", lw=0.8)
            ax.axhline(1.2 if m == "moe" else 1.05, color="r", lw=0.8, ls="--")
            ax.set_xticks(*ticks)
            ax.set_title(m)
            ax.set_ylim(0.9, YMAX)
        axes[row][0].set_ylabel(label)
    # The bytes themselves: a ratio hides them where the bound is near zero (a routed model whose
    # experts all fit on the device once the router has picked them).
    for ax, m in zip(axes[3], models):
        for k, p in enumerate(POLICIES):
            ys = [next((r["real_device_bytes"] or 0) / 2**20 for r in results if r["model"] == m
                       and r["policy"] == p and r["device_frac"] == f) for f in fracs]
            ax.bar([i + k * width for i in range(len(fracs))], ys, width, label=p)
        ax.set_yscale("log")
        ax.set_xticks(*ticks)
        ax.set_title(m)
        ax.set_xlabel("device budget (of state)")
    axes[3][0].set_ylabel("real run: MiB fetched\nonto the device")
    axes[0][-1].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    t = time.time()
    main()
    print(f"done in {time.time() - t:.0f}s")
