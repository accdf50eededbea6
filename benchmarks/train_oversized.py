"""Train a model whose training state is 5x the device budget; optionally compare with eager PyTorch.

    python benchmarks/train_oversized.py                   # = python -m hetero train (same defaults)
    python benchmarks/train_oversized.py --compare-eager   # + the same model in eager PyTorch

The question: what does it cost to train with only a fifth of the training state on the device (a
quarter in host memory, the rest swapped to disk), against training the same model with everything
resident? ``--compare-eager`` trains the same model (same seed, same batches) with
``torch.optim.AdamW`` and reports the step-time ratio hetero / eager and whether the two loss
curves agree (they should, to float32 rounding: hetero changes where state lives, not the math).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402

from hetero import cli, models  # noqa: E402

LOSS_RTOL = 1e-3  # final losses "match" when within this relative tolerance


def run_eager(args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """The same training run in plain PyTorch: everything resident, torch.optim.AdamW."""
    cfg = models.get_config(args.model)
    dev = cli.resolve_device(args.device)
    torch.manual_seed(args.seed)
    model = models.GPT(cfg).to(dev)
    data = models.MarkovData(cfg.vocab_size, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    return cli.train_loop(model, opt, data, cfg.block_size, args.steps, args.batch_size, dev,
                          progress=not args.no_progress, desc="eager train")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli._add_run_args(parser, steps=cli.DEFAULT_STEPS)
    parser.add_argument("--compare-eager", action="store_true",
                        help="also train the same model in eager PyTorch and compare")
    parser.add_argument("--json", metavar="PATH", help="write the report and figures as JSON")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    res = cli._run_from_args(args, "hetero train")
    cli._print_summary(res)
    out = res.json_dict()

    if args.compare_eager:
        losses, times = run_eager(args)
        eager_median = statistics.median(times)
        ratio = res.median_step / eager_median
        diffs = [abs(a - b) for a, b in zip(res.losses, losses)]
        final_h, final_e = res.losses[-1], losses[-1]
        match = abs(final_h - final_e) <= LOSS_RTOL * max(1.0, abs(final_e))
        print(f"eager PyTorch (torch.optim.AdamW, all state resident): median {eager_median:.3f} s/step")
        print(f"step-time ratio hetero / eager: {ratio:.2f}x")
        print(f"final loss: hetero {final_h:.6f}, eager {final_e:.6f}, max |diff| over "
              f"{len(diffs)} steps {max(diffs):.2e} -> {'MATCH' if match else 'MISMATCH'}")
        out["eager"] = {"median_step_seconds": eager_median, "step_times": times, "losses": losses,
                        "ratio_hetero_over_eager": ratio, "final_loss_hetero": final_h,
                        "final_loss_eager": final_e, "max_abs_loss_diff": max(diffs),
                        "losses_match": match}
        if not match:
            print("final losses differ beyond float32 rounding", file=sys.stderr)
    print(f"total wall time {time.perf_counter() - start:.1f} s, torch threads {torch.get_num_threads()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if not args.compare_eager or out["eager"]["losses_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
