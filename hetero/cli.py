"""The ``hetero`` command line (also ``python -m hetero``).

``hetero train``    trains the bundled GPT (:mod:`hetero.models`) on learnable synthetic data with
                    its training state spread over device, host and NVMe, then prints the
                    placement report, the budgets and the step time.
``hetero profile``  runs the bundled model for a few steps under given budgets and policy and writes
                    the report (JSON), a Chrome/Perfetto trace, a plot and the access log.
``hetero plan``     estimates memory per tier, traffic and step time under given budgets on this
                    machine (:mod:`hetero.plan`).

Under torchrun (``torchrun --nproc_per_node=N -m hetero train``) ``train`` and ``profile`` run data
parallel: each rank trains its own batches (the data seeded by ``--seed`` and the rank) with the
gradients averaged over the ranks (gloo on CPUs, NCCL on GPUs), and rank 0 prints and writes.

By default the device budget is a fifth of the model's training state (16 bytes per parameter:
param, grad, exp_avg, exp_avg_sq in fp32), the host budget a quarter, and the rest goes to swap
files in a temporary directory that is removed afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from . import models
from .config import default_device, format_size, parse_size
from .errors import HeteroConfigError, HeteroError
from .interrupts import deferring

log = logging.getLogger(__name__)

DEFAULT_MODEL = "small"
DEFAULT_STEPS = 400
DEFAULT_BATCH = 8
DEFAULT_CHUNK = "1MiB"
DEVICE_FRACTION = 5  # device budget = state / 5
HOST_FRACTION = 4  # host budget = state / 4
MAX_THREADS = 1024  # --threads above this (and 4 per core) is a typo, not a machine


@dataclasses.dataclass
class Budgets:
    state: int  # Adam training-state bytes of the model
    device: int
    host: int
    nvme: int | None  # None: no NVMe tier

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        nvme = "off" if self.nvme is None else format_size(self.nvme)
        return (f"training state {format_size(self.state)} (16 B/param); budgets: device "
                f"{format_size(self.device)} (state/{self.state / self.device:.1f}), host "
                f"{format_size(self.host)}, nvme {nvme}")


@dataclasses.dataclass
class RunResult:
    model: str
    config: dict[str, Any]
    params: int
    budgets: Budgets
    device: str
    chunk_size: str
    policy: str
    seed: int
    batch_size: int
    lr: float
    losses: list[float]
    step_times: list[float]
    entropy: float  # the data's entropy rate: the lowest loss any model can reach
    wall_seconds: float
    report: Any  # hetero.Report
    rank: int = 0  # under torchrun: this process's rank among ``world``
    world: int = 1

    @property
    def median_step(self) -> float:
        return statistics.median(self.step_times) if self.step_times else float("nan")

    def final_loss(self, window: int = 10) -> float:
        tail = self.losses[-window:]
        return sum(tail) / len(tail) if tail else float("nan")

    def summary(self) -> dict[str, Any]:
        return {
            "model": self.model, "config": self.config, "params": self.params,
            "budgets": self.budgets.as_dict(), "device": self.device, "chunk_size": self.chunk_size,
            "policy_requested": self.policy, "seed": self.seed, "batch_size": self.batch_size,
            "lr": self.lr, "steps_run": len(self.losses), "median_step_seconds": self.median_step,
            "wall_seconds": self.wall_seconds, "step_times": self.step_times, "losses": self.losses,
            "final_loss": self.final_loss(), "entropy_floor": self.entropy, "ranks": self.world,
        }

    def json_dict(self) -> dict[str, Any]:
        """``report.as_dict()`` (its schema at the top level) plus the run's own figures."""
        d = self.report.as_dict()
        d["run"] = self.summary()
        return d


def resolve_device(device: str | None) -> torch.device:
    if device:
        try:
            return torch.device(device)
        except RuntimeError:
            raise HeteroConfigError(f"--device {device!r} is not a device; expected cpu, cuda or "
                                    "cuda:N") from None
    return default_device()


def default_budgets(state: int, device_budget: Any, host_budget: Any, nvme: bool,
                    nvme_budget: Any = None) -> Budgets:
    dev = parse_size(device_budget, "device_budget") or state // DEVICE_FRACTION
    # Without NVMe the host holds what the device does not (else the defaults could not train).
    host = parse_size(host_budget, "host_budget") or (state // HOST_FRACTION if nvme else state)
    # NVMe holds the rest. Its default cap is twice the state: a block has at most one copy
    # there, so it never fills up, whatever mix of sole and clean copies (and swap-file
    # fragmentation) it holds.
    if nvme_budget is not None and not nvme:
        raise HeteroConfigError(f"nvme_budget={nvme_budget!r} with no_nvme=True: expected one of them")
    swap = (parse_size(nvme_budget, "nvme_budget") or 2 * state) if nvme else None
    return Budgets(state=state, device=dev, host=host, nvme=swap)


def check_batch(batch_size: int, seq_len: int) -> None:
    """Refuse a batch whose token ids alone (inputs and targets, int64) exceed the memory
    available now: it could only fail later, after the model was wrapped and its swap made."""
    import psutil

    need, available = 2 * 8 * batch_size * seq_len, psutil.virtual_memory().available
    if need > available:
        raise HeteroConfigError(
            f"batch_size={batch_size}: {batch_size} sequences of {seq_len} tokens need "
            f"{format_size(need)} for their token ids alone, more than the {format_size(available)} "
            f"of memory available; expected at most {available // (16 * seq_len)} sequences")


@contextlib.contextmanager
def ranks(device: torch.device) -> Iterator[tuple[int, int, torch.device]]:
    """(rank, world size, device): under torchrun (WORLD_SIZE > 1 with RANK and MASTER_ADDR) the
    default process group, made here (gloo for a CPU device, NCCL for CUDA, each rank on
    cuda:LOCAL_RANK) unless the caller made one, and destroyed after; else (0, 1, device)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        yield dist.get_rank(), dist.get_world_size(), device
        return
    text = os.environ.get("WORLD_SIZE", "1") or "1"
    try:
        world = int(text)
    except ValueError:
        raise HeteroConfigError(f"WORLD_SIZE={text!r} is not a number; expected torchrun's environment "
                                "or none") from None
    if world <= 1 or not {"RANK", "MASTER_ADDR"} <= os.environ.keys():
        if world > 1:
            log.info("WORLD_SIZE=%d without RANK and MASTER_ADDR (not torchrun): one process", world)
        yield 0, 1, device
        return
    if not dist.is_available():
        raise HeteroConfigError("WORLD_SIZE > 1 (torchrun) but this torch has no torch.distributed; "
                                "expected one process, or a torch build with distributed support")
    if device.type == "cuda":
        if device.index is None:
            device = default_device()
        torch.cuda.set_device(device)  # (NCCL and hetero's collectives use the current device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        yield dist.get_rank(), dist.get_world_size(), device
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def nvme_dir(path: str | None, disabled: bool) -> Iterator[str | None]:
    """The swap directory: the given one, else a temporary one removed afterwards."""
    if disabled:
        yield None
    elif path:
        yield path
    else:
        with tempfile.TemporaryDirectory(prefix="hetero-nvme-") as tmp:
            yield tmp


def run(model_name: str = DEFAULT_MODEL, steps: int = DEFAULT_STEPS, *, batch_size: int = DEFAULT_BATCH,
        lr: float = 1e-3, device: str | None = None, device_budget: Any = None,
        host_budget: Any = None, nvme_path: str | None = None, no_nvme: bool = False,
        nvme_budget: Any = None, chunk_size: str = DEFAULT_CHUNK, policy: str = "auto", seed: int = 0,
        progress: bool = True, desc: str = "hetero train",
        on_step: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
        on_wrap: Callable[[Any], None] | None = None) -> RunResult:
    """Train the bundled GPT preset ``model_name`` with hetero for ``steps`` steps.

    ``on_step(x, y)`` is called after each step with its batch (the benchmark trains an eager
    copy of the model in lockstep with it, so both see the same batches and the same machine load);
    ``on_wrap(module)`` once with the HeteroModule, before training (the planner reads its layout).
    """
    import hetero

    for name, value in (("steps", steps), ("batch_size", batch_size)):
        if not isinstance(value, int) or value < 1:
            raise HeteroConfigError(f"{name}={value!r} is not accepted; expected a whole number >= 1")
    cfg = models.get_config(model_name)
    check_batch(batch_size, cfg.block_size)
    dev = resolve_device(device)
    torch.manual_seed(seed)
    model = models.GPT(cfg)
    params = model.num_params()
    budgets = default_budgets(models.state_bytes(model), device_budget, host_budget, not no_nvme,
                              nvme_budget)
    losses: list[float] = []
    times: list[float] = []
    start = time.perf_counter()
    with ranks(dev) as (rank, world, dev), nvme_dir(nvme_path, no_nvme) as swap:
        # (one Markov chain for all ranks, each drawing its own batches from it)
        data = models.MarkovData(cfg.vocab_size, seed=seed, stream=rank)
        wrapped = hetero.wrap(model, device=dev, device_budget=budgets.device,
                              host_budget=budgets.host, nvme_path=swap, nvme_budget=budgets.nvme,
                              chunk_size=chunk_size, policy=policy)
        try:
            if on_wrap is not None:
                on_wrap(wrapped)
            opt = hetero.optim.AdamW(wrapped.parameters(), lr=lr)
            losses, times = train_loop(wrapped, opt, data, cfg.block_size, steps, batch_size, dev,
                                       progress=progress and rank == 0, desc=desc, on_step=on_step)
            report = wrapped.placement_report()
        finally:
            wrapped.close()
    return RunResult(model_name, dataclasses.asdict(cfg), params, budgets, str(dev), str(chunk_size),
                     policy, seed, batch_size, lr, losses, times, data.entropy(),
                     time.perf_counter() - start, report, rank, world)


def train_loop(model: torch.nn.Module, opt: torch.optim.Optimizer, data: models.MarkovData,
               seq_len: int, steps: int, batch_size: int, device: torch.device, *,
               progress: bool = True, desc: str = "train",
               on_step: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
               ) -> tuple[list[float], list[float]]:
    """``steps`` training steps on fresh batches; returns the loss and the seconds of each step
    (forward, backward, optimizer step and zero_grad; data generation and ``on_step`` excluded)."""
    from tqdm import tqdm

    losses: list[float] = []
    times: list[float] = []
    bar = tqdm(range(steps), desc=desc, unit="step", disable=not progress, dynamic_ncols=True)
    for _ in bar:
        x, y = (t.to(device) for t in data.batch(batch_size, seq_len))
        t0 = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.item()
        times.append(time.perf_counter() - t0)
        losses.append(value)
        bar.set_postfix_str(f"loss {value:.3f}, {times[-1]:.2f} s/step")
        if on_step is not None:
            on_step(x, y)
    bar.close()
    return losses, times


# ---------------------------------------------------------------------------------- commands


def _add_run_args(p: argparse.ArgumentParser, *, steps: int) -> None:
    p.add_argument("--steps", type=int, default=steps, help=f"training steps (default {steps})")
    p.add_argument("--lr", type=_learning_rate, default=1e-3, help="AdamW learning rate (default 1e-3)")
    _add_placement_args(p)
    p.add_argument("--seed", type=_seed, default=0, help="seed of the model init and the data (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _learning_rate(text: str) -> float:
    """A learning rate AdamW takes (a finite number >= 0), refused before anything is built."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; expected a learning rate such as 1e-3") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a learning rate; expected a finite number >= 0, such as 1e-3")
    return value


def _seed(text: str) -> int:
    """A seed torch.manual_seed takes: a whole number in [0, 2**64)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= value < 2 ** 64:
        raise argparse.ArgumentTypeError(f"{text} is out of range; expected 0 <= seed < 2**64")
    return value


def _add_placement_args(p: argparse.ArgumentParser) -> None:
    """The model, batch, device, budgets, policy and CPU threads: what train, profile and plan share."""
    p.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(models.PRESETS),
                   help=f"bundled GPT preset (default {DEFAULT_MODEL})")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH,
                   help=f"sequences per step (default {DEFAULT_BATCH})")
    p.add_argument("--device", default=None,
                   help="compute device (default: cuda when available, else cpu)")
    p.add_argument("--device-budget", default=None,
                   help=f"bytes of model state on the device, e.g. 16MiB (default: state/{DEVICE_FRACTION})")
    p.add_argument("--host-budget", default=None,
                   help=f"bytes of model state in host memory (default: state/{HOST_FRACTION}; "
                        "with --no-nvme the whole state)")
    nvme = p.add_mutually_exclusive_group()
    nvme.add_argument("--nvme-path", default=None,
                      help="directory for swap files (default: a temporary directory, removed afterwards)")
    nvme.add_argument("--no-nvme", action="store_true", help="disable the NVMe tier")
    p.add_argument("--nvme-budget", default=None,
                   help="bytes of swap files, e.g. 1GiB (default: 2x the state)")
    p.add_argument("--chunk-size", default=DEFAULT_CHUNK, help=f"chunk size (default {DEFAULT_CHUNK})")
    p.add_argument("--policy", default="auto", help="placement policy: auto, opt, hotness, lru, static")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's, one per core)")


def _set_threads(threads: int | None) -> None:
    if threads is not None:
        most = max(MAX_THREADS, 4 * (os.cpu_count() or 1))
        if not 1 <= threads <= most:
            raise HeteroConfigError(f"--threads {threads}: expected a number of CPU threads from 1 to {most}")
        torch.set_num_threads(threads)


def _run_from_args(args: argparse.Namespace, desc: str,
                   on_step: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> RunResult:
    _set_threads(args.threads)
    return run(args.model, args.steps, batch_size=args.batch_size, lr=args.lr, device=args.device,
               device_budget=args.device_budget, host_budget=args.host_budget,
               nvme_path=args.nvme_path, no_nvme=args.no_nvme, nvme_budget=args.nvme_budget,
               chunk_size=args.chunk_size, policy=args.policy, seed=args.seed, progress=not args.no_progress, desc=desc,
               on_step=on_step)


def _print_summary(res: RunResult) -> None:
    b = res.budgets
    print(res.report)
    print(f"model: {res.model} GPT, {res.params / 1e6:.2f}M parameters, "
          f"{res.config['n_layer']} blocks, on {res.device} ({torch.get_num_threads()} CPU threads)")
    if res.world > 1:
        print(f"data parallel: {res.world} ranks, each with these budgets (the report is rank 0's)")
    print(b.describe())
    print(f"state / device budget = {b.state / b.device:.1f}x")
    if res.losses:
        print(f"steps: {len(res.losses)}, median step {res.median_step:.3f} s/step, "
              f"wall {res.wall_seconds:.1f} s")
        print(f"loss: first {res.losses[0]:.3f}, final {res.final_loss():.3f} (mean of last "
              f"{min(10, len(res.losses))}), floor {res.entropy:.3f} (data entropy)")


def check_writable(path: str | None, what: str, directory: bool = False) -> None:
    """Refuse an output path (a file; with ``directory``, a directory made if missing) that
    cannot be written, before the run rather than after it."""
    if path is None:
        return
    if not path:
        raise HeteroConfigError(f"{what} '': expected a path")
    path = os.path.abspath(path)
    if os.path.isdir(path) != directory and os.path.exists(path):
        raise HeteroConfigError(f"{what} {path!r} exists and is {'not ' if directory else ''}a directory")
    if directory and os.path.isdir(path):
        existing = path
    else:
        existing = os.path.dirname(path)
        while directory and not os.path.exists(existing):  # (made, with its parents)
            existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
        raise HeteroConfigError(f"{what} {path!r}: {existing!r} is not a writable directory")
    if not directory:
        _probe_file(path, what)


def _make_dirs(path: str, made: list[str]) -> None:
    """Make the directory ``path`` and its missing parents, as ``os.makedirs`` does (the same
    walk, so ``new/../old`` makes only ``new``), appending each one made to ``made``."""
    if os.path.isdir(path):
        return
    head, tail = os.path.split(path)
    if not tail:
        head, tail = os.path.split(head)
    if head and tail and not os.path.exists(head):
        _make_dirs(head, made)
    if tail in (os.curdir, os.pardir) or os.path.isdir(path):
        return
    os.mkdir(path)
    made.append(path)


def _probe_file(path: str, what: str) -> None:
    """Open the file ``path`` for writing (and remove it again if it was not there) to find
    what only trying tells: a read-only file, a name too long, a file system that refuses."""
    try:
        if os.path.exists(path):
            with open(path, "a"):
                pass
        else:
            with open(path, "x"):
                pass
            os.remove(path)
    except OSError as exc:
        raise HeteroConfigError(f"{what} {path!r} cannot be written ({exc.strerror or exc}); expected "
                                "a path where a file can be written") from None


def cmd_train(args: argparse.Namespace) -> int:
    check_writable(args.json, "--json")
    res = _run_from_args(args, "hetero train")
    if res.rank != 0:  # (torchrun: rank 0 speaks for all)
        return 0
    _print_summary(res)
    _write_json(args.json, res.json_dict())
    return 0


def _write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
        print(f"wrote {path}")


def cmd_profile(args: argparse.Namespace) -> int:
    if not args.out:
        raise HeteroConfigError("--out '': expected a directory path")
    check_writable(args.out, "--out", directory=True)
    paths = {name: os.path.join(args.out, name)
             for name in ("report.json", "trace.json", "placement.png", "access_log.jsonl")}
    for name, path in paths.items():  # (a directory in the way would fail after the run)
        if os.path.isdir(path):
            raise HeteroConfigError(f"--out {args.out!r}: {path!r} is a directory; expected room for the "
                                    f"file {name}")
    made: list[str] = []  # the directories this makes, taken back (empty) if the run is refused
    try:
        try:
            _make_dirs(args.out, made)
        except OSError as exc:
            raise HeteroConfigError(f"--out {args.out!r} cannot be made ({exc.strerror or exc}); expected "
                                    "a directory path where files can be written") from None
        for path in paths.values():
            _probe_file(path, "--out")
        res = _run_from_args(args, "hetero profile")
    except BaseException:
        for d in reversed(made):
            with contextlib.suppress(OSError):
                os.rmdir(d)  # (only what this made, and only empty: never a directory the user had)
        raise
    if res.rank != 0:
        return 0
    with open(paths["report.json"], "w") as f:
        json.dump(res.json_dict(), f, indent=1)
    res.report.to_chrome_trace(paths["trace.json"])
    res.report.plot(paths["placement.png"])
    res.report.save_access_log(paths["access_log.jsonl"])
    _print_summary(res)
    for path in paths.values():
        print(f"wrote {path}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from .plan import plan

    check_writable(args.json, "--json")
    _set_threads(args.threads)
    result = plan(args.model, device_budget=args.device_budget, host_budget=args.host_budget,
                  nvme_path=args.nvme_path, no_nvme=args.no_nvme, nvme_budget=args.nvme_budget,
                  chunk_size=args.chunk_size, policy=args.policy, batch_size=args.batch_size, seq_len=args.seq_len,
                  device=args.device, steps=args.steps, compute_tflops=args.compute_tflops,
                  h2d_GBps=args.h2d_gbps, d2h_GBps=args.d2h_gbps, nvme_read_GBps=args.nvme_read_gbps,
                  nvme_write_GBps=args.nvme_write_gbps, adam_Gparams=args.adam_gparams,
                  device_adam_Gparams=args.device_adam_gparams)
    print(result)
    _write_json(args.json, result.as_dict())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetero", description="Place PyTorch training state across device, host and NVMe.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    train = sub.add_parser(
        "train", help="train the bundled GPT with its state spread over device, host and NVMe",
        description="Train the bundled GPT on learnable synthetic data (a random Markov chain) with "
                    "its training state spread over device, host and NVMe; print the placement "
                    "report, the budgets and the step time.")
    _add_run_args(train, steps=DEFAULT_STEPS)
    train.add_argument("--json", metavar="PATH", help="write report.as_dict() plus the run's figures")
    train.set_defaults(func=cmd_train)

    prof = sub.add_parser(
        "profile", help="run the bundled model and write report, trace, plot and access log",
        description="Run the bundled GPT for a few steps under the given budgets and policy; write "
                    "report.json, trace.json (Chrome/Perfetto), placement.png and access_log.jsonl.")
    _add_run_args(prof, steps=10)
    prof.add_argument("--out", default="hetero-profile", help="output directory (default hetero-profile)")
    prof.set_defaults(func=cmd_profile)

    pl = sub.add_parser(
        "plan", help="estimate memory per tier and step time for the bundled model and this machine",
        description="Estimate memory per tier, bytes moved per step and step time of training the "
                    "bundled GPT under the given budgets: a dry run of a few steps at batch size 1 on "
                    "the CPU gives the placement (hetero's own runtime: placement does not depend on "
                    "the batch or the device), then the traffic and compute are priced with this "
                    "machine's speeds, measured unless given.")
    _add_placement_args(pl)
    pl.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's block size)")
    pl.add_argument("--steps", type=int, default=4, help="steps of the dry run (default 4; the last one is priced)")
    for flag, what in (("--compute-tflops", "TFLOPS the model's forward and backward reach"),
                       ("--h2d-gbps", "host->device GB/s"), ("--d2h-gbps", "device->host GB/s"),
                       ("--nvme-read-gbps", "NVMe read GB/s"), ("--nvme-write-gbps", "NVMe write GB/s"),
                       ("--adam-gparams", "CPU Adam updates, G params/s"),
                       ("--device-adam-gparams", "Adam updates on the compute device, G params/s")):
        pl.add_argument(flag, type=float, default=None, help=f"{what} (default: measured here)")
    pl.add_argument("--json", metavar="PATH", help="write the plan as JSON")
    pl.set_defaults(func=cmd_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    # A termination (timeout, a scheduler's preemption) leaves as Ctrl-C does, through the
    # clean-ups that remove the temporary swap directory (hetero holds it until a call returns).
    main_thread = threading.current_thread() is threading.main_thread()  # (signals: there only)
    previous = signal.signal(signal.SIGTERM, deferring(_terminated)) if main_thread else None
    try:
        return args.func(args)
    except HeteroError as exc:
        print(f"hetero {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except _Terminated:
        print("terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised as an interrupt (hetero defers those until its bookkeeping is consistent)."""


def _terminated(signum: int, frame: Any) -> None:
    raise _Terminated()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
