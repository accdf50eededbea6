"""How much of a host or NVMe budget holds state: slot bytes over block bytes.

    python benchmarks/bench_slots.py                  # bundled GPTs x chunk sizes, fp32 and bf16
    python benchmarks/bench_slots.py --json /tmp/slots.json

The host arena and the swap files are carved into slots of about the chunk size (the largest
block that respects ``chunk_size``), so that a freed slot always fits the next block and free room
is never too fragmented to use. A block smaller than a slot wastes the rest of it unless it shares
the slot: hetero packs blocks of up to half a slot into shared slots (slabs) in units of a
sixteenth of a slot. For every block the bundled models have (parameters, gradients, Adam states,
fp32 masters under bf16 mixed precision) this sums the bytes the budgets charge against the
blocks' own bytes (the physical limit is 1.0), for the current allocator and for whole slots per
block (the allocator before slabs). Pure arithmetic on the wrapped model's blocks: nothing trains.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch

import hetero
from hetero import models
from hetero.runtime import expected_block_bytes
from hetero.tiers import slot_cost, slot_size_for, slots_for

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling scripts and argtypes
import argtypes  # noqa: E402


def overhead(model: str, chunk: str, bf16: bool) -> dict:
    mp = hetero.MixedPrecision(param_dtype=torch.bfloat16) if bf16 else None
    with torch.device("meta"):
        gpt = models.GPT(models.get_config(model))
    wrapped = hetero.wrap(gpt, device="cpu", chunk_size=chunk, mixed_precision=mp)
    try:
        sizes = expected_block_bytes(wrapped._hetero_state.chunks)
        slot = slot_size_for(wrapped._hetero_state.cfg.chunk_size, sizes)
        total = sum(sizes)
        return {"model": model, "chunk_size": chunk, "dtype": "bf16" if bf16 else "fp32",
                "blocks": len(sizes), "slot_bytes": slot, "block_bytes": total,
                "shared_slots": sum(slot_cost(n, slot) for n in sizes) / total,
                "whole_slots": sum(slots_for(n, slot) * slot for n in sizes) / total}
    finally:
        wrapped.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["small", "medium", "large"], choices=sorted(models.PRESETS))
    p.add_argument("--chunks", nargs="+", type=argtypes.size("256KiB, 64MiB"),
                   default=["256KiB", "1MiB", "4MiB", "64MiB"])
    p.add_argument("--json", default=None, help="write the rows as JSON")
    args = p.parse_args(argv)
    argtypes.output_file(p, "--json", args.json)
    argtypes.end_on_sigterm()
    try:
        rows = [overhead(m, c, bf16) for m in args.models for c in args.chunks for bf16 in (False, True)]
    except hetero.HeteroConfigError as exc:  # refused by hetero.wrap (arithmetic only: nothing ran)
        p.error(f"--chunks: {exc}")
    print(f"{'model':8s} {'chunk':>7s} {'dtype':5s} {'blocks':>6s} {'slot':>10s}  "
          f"{'shared slots':>12s} {'whole slots':>11s}   (bytes charged / block bytes)")
    for r in rows:
        print(f"{r['model']:8s} {r['chunk_size']:>7s} {r['dtype']:5s} {r['blocks']:6d} "
              f"{r['slot_bytes']:10d}  {r['shared_slots']:12.3f} {r['whole_slots']:11.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
