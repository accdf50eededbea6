"""An optimizer step whose states live in swap files, against max(compute, I/O at the disk's speed).

    python benchmarks/bench_nvme_step.py                  # 16M parameters (256 MiB of training state)
    python benchmarks/bench_nvme_step.py --params 4M --reps 3
    python benchmarks/bench_nvme_step.py --json out.json

A stack of linear layers is wrapped with small device and host budgets, so its optimizer states
(and most parameters and gradients) sit in swap files. Each round runs forward and backward
(untimed), then times ``opt.step()``, the updates it postponed to the next forward (run at once
here: ``Runtime.catch_up``, the step's whole work back to back, as ``HETERO_DEFER_STEP=0`` runs it)
plus the wait for its last write-backs. hetero.optim streams
the chunks through host slots: the runtime's prefetch reads the next chunks' states while the
current one is updated, and evictions write updated chunks back while later ones compute.

The step's swap traffic (bytes read and written, from the runtime's counters) is priced at the
disk's speed measured in the same run by fio in the same directory (O_DIRECT, 1 MiB, queue depth
32; the swap engine's own speed when fio is missing): the I/O time. The compute time is the C++
Adam kernel over the same number of parameters in memory. Target (issue 5): step <= 1.1x
max(compute, I/O).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch
from torch import nn
from tqdm import tqdm

import hetero
from hetero.optim import kernel as K

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling scripts and argtypes
import argtypes  # noqa: E402
from bench_overlap import disk_speed, io_seconds  # noqa: E402

WIDTH = 1024  # each layer: WIDTH x WIDTH fp32 = 1M parameters


def compute_time(n: int, reps: int) -> float:
    """Seconds of one AdamW step of ``n`` fp32 parameters in memory (the C++ kernel)."""
    p, g, m, v = (torch.randn(n) for _ in range(4))
    v.abs_()
    times = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        K.adam_step_(p, g, m, v, step=i + 1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                     weight_decay=0.01, decoupled=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def nvme_step(n_params: int, swap_dir: str, reps: int, chunk_size: str = "4MiB",
              progress: bool = True) -> dict:
    layers = max(1, n_params // (WIDTH * WIDTH))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)))
    state = 16 * layers * WIDTH * WIDTH
    chunk = hetero.config.parse_size(chunk_size, "chunk_size")
    wrapped = hetero.wrap(model, device="cpu", device_budget=4 * chunk, host_budget=8 * chunk,
                          nvme_path=swap_dir, chunk_size=chunk_size, prefetch=2)
    opt = hetero.optim.AdamW(wrapped.parameters(), lr=1e-3)
    rt = wrapped._hetero_state.runtime
    x = torch.randn(8, WIDTH)
    times, reads, writes = [], [], []
    for i in tqdm(range(reps + 2), desc="nvme step", disable=not progress):
        wrapped(x).square().mean().backward()
        rt.drain()
        before = dict(rt.tracker.traffic)
        t0 = time.perf_counter()
        opt.step()
        rt.catch_up()  # the updates step() postponed to the next forward, run now back to back
        rt.drain()
        times.append(time.perf_counter() - t0)
        reads.append(rt.tracker.traffic["nvme->host"] - before["nvme->host"])
        writes.append(rt.tracker.traffic["host->nvme"] - before["host->nvme"])
        opt.zero_grad()
    d = wrapped.placement_report().as_dict()
    on_nvme = sum(1 for b in d["blocks"] if b["kind"] in ("exp_avg", "exp_avg_sq") and b["tier"] == "nvme")
    n_states = sum(1 for b in d["blocks"] if b["kind"] in ("exp_avg", "exp_avg_sq"))
    wrapped.close()
    # The first two steps create the states and record the access sequence.
    return {"params": layers * WIDTH * WIDTH, "state_bytes": state, "step_s": statistics.median(times[2:]),
            "read_bytes": statistics.median(reads[2:]), "write_bytes": statistics.median(writes[2:]),
            "opt_state_blocks_on_nvme": on_nvme, "opt_state_blocks": n_states}


def _params(text: str) -> int:
    """argparse type of --params: at least one layer's parameters (fewer were silently 1M)."""
    try:
        n = int(float(text[:-1]) * 2**20) if text[-1:] in ("M", "m") else int(text)
    except (ValueError, OverflowError):
        n = 0
    if n < WIDTH * WIDTH:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count >= 1M (the model is a "
                                         f"stack of {WIDTH}x{WIDTH} layers)")
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=_params, default="16M", help="parameter count (M = 2**20)")
    p.add_argument("--reps", type=argtypes.whole("timed steps"), default=5, help="timed steps (median)")
    p.add_argument("--nvme-path", default=None, help="directory of the swap files' temporary directory, "
                   "made if missing, as hetero.wrap makes its nvme_path (default: the cwd)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    argtypes.output_file(p, "--json", args.json)
    argtypes.end_on_sigterm()
    n = args.params
    argtypes.make_dir(p, "--nvme-path", args.nvme_path)
    swap_dir = tempfile.mkdtemp(prefix="bench-nvme-step-", dir=args.nvme_path or ".")
    try:
        disk = disk_speed(swap_dir)
        res = nvme_step(n, swap_dir, args.reps, progress=not args.no_progress)
    finally:
        shutil.rmtree(swap_dir, ignore_errors=True)
    compute = compute_time(res["params"], args.reps)
    io_s = io_seconds(res["read_bytes"], res["write_bytes"], disk)
    res.update(compute_s=compute, io_s=io_s, disk=disk,
               ratio=res["step_s"] / max(compute, io_s))
    print(f"{res['params'] / 2**20:g}M params ({res['state_bytes'] / 2**20:.0f} MiB of training state); "
          f"optimizer state blocks on NVMe: {res['opt_state_blocks_on_nvme']} of {res['opt_state_blocks']}")
    print(f"disk ({disk['tool']}): read {disk['read_GBps']:.2f} GB/s, write {disk['write_GBps']:.2f} GB/s")
    print(f"step {res['step_s']:.3f} s: read {res['read_bytes'] / 2**20:.0f} MiB, write "
          f"{res['write_bytes'] / 2**20:.0f} MiB -> I/O at disk speed {io_s:.3f} s; compute {compute:.3f} s")
    if not res["opt_state_blocks_on_nvme"] or not res["read_bytes"] + res["write_bytes"]:
        # Nothing went through the swap files: the ratio measures no NVMe step at all.
        res["void"] = (f"no optimizer state block went to NVMe (0 of {res['opt_state_blocks']}): "
                       f"the {res['state_bytes'] / 2**20:.0f} MiB of training state fit the device and "
                       "host budgets; pass a larger --params" if not res["opt_state_blocks_on_nvme"] else
                       "no swap traffic in the timed steps")
        print(f"step / max(compute, I/O) = {res['ratio']:.3f}: VOID, not a measurement of the target "
              f"(<= 1.1): {res['void']}")
    else:
        print(f"step / max(compute, I/O) = {res['ratio']:.3f}  (target <= 1.1)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
        print(f"wrote {args.json}")
    return 1 if "void" in res else 0


if __name__ == "__main__":
    raise SystemExit(main())
