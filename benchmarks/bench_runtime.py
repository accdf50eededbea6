"""The runtime's own decision cost per training step, against chunk size.

    python benchmarks/bench_runtime.py                      # GPT "large", device budget 25%, 4/16/64 MiB
    python benchmarks/bench_runtime.py --chunks 64MiB --json /tmp/runtime.json

On a GPU the step's kernels run asynchronously, but every placement decision (which block to
evict, what to prefetch, which transfers may start) is Python on the host thread that launches
them; where it takes longer than the kernels, it is the step time. This measures that host time
on its own: a few training steps of a bundled GPT are recorded on the CPU under a device budget
(with a tiny batch: decisions do not depend on the batch), then the run's event log is replayed in
the simulator, which runs the same runtime and policy code without tensors (median of --reps
replays). Reported per step: runtime logic in ms, the number of blocks, and bytes moved onto and
off the device; and, as a ratio, logic time over a GPU step of the same model
(``--gpu-step-s``; default 0.1086 s, the resident GPT "large" batch-32 step measured on an H200
in benchmarks/RESULTS.md): the fraction of the step the runtime's host work would add if none of
it overlapped the kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from tqdm import tqdm

from hetero import HeteroConfigError, models

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling scripts and argtypes
import argtypes  # noqa: E402
from bench_policy import run  # noqa: E402  (a recorded training run)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="large", choices=sorted(models.PRESETS))
    p.add_argument("--chunks", type=argtypes.sizes("4MiB,64MiB"), default="4MiB,16MiB,64MiB",
                   help="chunk sizes, comma-separated")
    p.add_argument("--device-budget", type=argtypes.positive("a fraction of the training state"),
                   default=0.25, help="fraction of the training state")
    p.add_argument("--steps", default=5, help="steps recorded, >= 2 (the first records the sequence)",
                   type=argtypes.whole("steps", 2, "the first records the sequence"))
    p.add_argument("--reps", type=argtypes.whole("replays"), default=7,
                   help="replays timed (median)")
    p.add_argument("--gpu-step-s", type=argtypes.positive("a step time in seconds"), default=0.1086,
                   help="GPU step time to compare with (default: the resident GPT 'large' at batch 32 "
                        "on an H200; for another --model pass its step on your GPU)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    argtypes.output_file(p, "--json", args.json)
    argtypes.end_on_sigterm()
    chunks = args.chunks
    rows = {}
    for name in tqdm(chunks, desc="chunk sizes", disable=args.no_progress):
        try:
            report = run(models.get_config(args.model), "auto", args.device_budget, None, args.steps, name,
                         None, batch=(1, 16))
        except HeteroConfigError as exc:  # refused by hetero.wrap, before the steps: a budget too small
            p.error(f"--chunks {name} / --device-budget {args.device_budget:g}: {exc}")
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            sim = report.simulate()
            times.append(time.perf_counter() - t0)
        logic = statistics.median(times) / args.steps
        rows[name] = {"logic_ms_per_step": logic * 1e3, "blocks": len(report.catalog),
                      "h2d_MiB_per_step": sim.traffic["host->device"] / args.steps / 2 ** 20,
                      "d2h_MiB_per_step": sim.traffic["device->host"] / args.steps / 2 ** 20,
                      "logic_over_gpu_step": logic / args.gpu_step_s}
    print(f"model {args.model}, device budget {args.device_budget:.0%} of the training state, "
          f"{args.steps} steps recorded on the CPU, median of {args.reps} replays; "
          f"GPU step for the ratio: {args.gpu_step_s * 1e3:.1f} ms")
    print(f"{'chunk':>8} {'logic ms/step':>14} {'blocks':>7} {'h2d MiB/step':>13} {'d2h MiB/step':>13} "
          f"{'logic / GPU step':>17}")
    for name, r in rows.items():
        print(f"{name:>8} {r['logic_ms_per_step']:14.1f} {r['blocks']:7d} {r['h2d_MiB_per_step']:13.1f} "
              f"{r['d2h_MiB_per_step']:13.1f} {r['logic_over_gpu_step']:17.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "device_budget": args.device_budget, "steps": args.steps,
                       "gpu_step_s": args.gpu_step_s, "cpus": os.cpu_count(), "chunks": rows}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
