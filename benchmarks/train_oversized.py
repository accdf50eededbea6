"""Train a model whose training state is 5x the device budget; optionally compare with eager PyTorch.

    python benchmarks/train_oversized.py                   # = python -m hetero train (same defaults)
    python benchmarks/train_oversized.py --compare-eager   # + the same model in eager PyTorch

The question: what does it cost to train with only a fifth of the training state on the device
(a quarter in host memory, the rest swapped to disk), against training the same model with
everything resident? ``--compare-eager`` also trains the same model with ``torch.optim.AdamW``
(same seed, same batches, one eager step after each hetero step, so both see the same machine
load) and reports the step-time ratio hetero / eager and whether the two loss curves agree (they
should, to float32 rounding: hetero changes where state lives, not the math).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch

from hetero import HeteroConfigError, cli, models
from hetero.config import parse_size

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling scripts and argtypes
import argtypes  # noqa: E402

LOSS_RTOL = 1e-3  # final losses "match" when within this relative tolerance


class EagerTwin:
    """The same model in plain PyTorch (everything resident, torch.optim.AdamW), stepped in
    lockstep with the hetero run on the same batches: both see the same machine load, so the
    step-time ratio is fair even on a shared machine."""

    def __init__(self, args: argparse.Namespace) -> None:
        cfg = models.get_config(args.model)
        self.device = cli.resolve_device(args.device)
        torch.manual_seed(args.seed)  # the same initial weights as cli.run builds
        self.model = models.GPT(cfg).to(self.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        self.losses: list[float] = []
        self.times: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        t0 = time.perf_counter()
        loss = self.model(x.to(self.device), y.to(self.device))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        value = loss.item()
        self.times.append(time.perf_counter() - t0)
        self.losses.append(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli._add_run_args(parser, steps=cli.DEFAULT_STEPS)
    parser.add_argument("--compare-eager", action="store_true",
                        help="also train the same model in eager PyTorch and compare")
    parser.add_argument("--json", metavar="PATH", help="write the report and figures as JSON")
    args = parser.parse_args(argv)
    argtypes.output_file(parser, "--json", args.json)
    argtypes.end_on_sigterm()
    # Bad values are usage errors up front, not tracebacks from inside the run.
    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size), ("--threads", args.threads)):
        if value is not None and value < 1:
            parser.error(f"argument {flag}: {value} is not accepted; expected a whole number >= 1")
    if not 0 <= args.lr < float("inf"):
        parser.error(f"argument --lr: {args.lr} is not a learning rate >= 0")
    try:
        for flag, value in (("--device-budget", args.device_budget), ("--host-budget", args.host_budget),
                            ("--chunk-size", args.chunk_size)):
            parse_size(value, flag)
        device = cli.resolve_device(args.device)
    except HeteroConfigError as exc:
        parser.error(str(exc))
    if not argtypes.usable(device):
        parser.error(f"argument --device: {args.device!r} is not a device this machine has; expected cpu"
                     f"{', cuda or cuda:N' if torch.cuda.is_available() else ''}")

    start = time.perf_counter()
    try:  # what hetero.wrap refuses (e.g. a budget too small for a block) it refuses before training
        twin = EagerTwin(args) if args.compare_eager else None
        res = cli._run_from_args(args, "hetero train", on_step=twin.step if twin else None)
    except HeteroConfigError as exc:
        parser.error(str(exc))
    cli._print_summary(res)
    out = res.json_dict()

    if twin is not None:
        losses, times = twin.losses, twin.times
        eager_median = statistics.median(times)
        ratio = res.median_step / eager_median
        diffs = [abs(a - b) for a, b in zip(res.losses, losses)]
        final_h, final_e = res.losses[-1], losses[-1]
        match = abs(final_h - final_e) <= LOSS_RTOL * max(1.0, abs(final_e))
        print(f"eager PyTorch (torch.optim.AdamW, all state resident, same batches, in lockstep): "
              f"median {eager_median:.3f} s/step")
        print(f"step-time ratio hetero / eager: {ratio:.2f}x (medians)")
        print(f"final loss: hetero {final_h:.6f}, eager {final_e:.6f}, max |diff| over "
              f"{len(diffs)} steps {max(diffs):.2e} -> {'MATCH' if match else 'MISMATCH'}")
        out["eager"] = {"median_step_seconds": eager_median, "step_times": times, "losses": losses,
                        "ratio_hetero_over_eager": ratio, "final_loss_hetero": final_h,
                        "final_loss_eager": final_e, "max_abs_loss_diff": max(diffs),
                        "losses_match": match}
        if not match:
            print("final losses differ beyond float32 rounding", file=sys.stderr)
    load = os.getloadavg()
    print(f"total wall time {time.perf_counter() - start:.1f} s, torch threads "
          f"{torch.get_num_threads()}, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    out["machine"] = {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                      "loadavg_at_end": load, "torch": torch.__version__}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if not args.compare_eager or out["eager"]["losses_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
