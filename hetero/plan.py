"""``hetero plan``: memory per tier and step time of a bundled model under given budgets, before
training it for real.

The placement half is not a model of the runtime but the runtime itself: the plan trains the
bundled GPT for a few steps at batch size 1 on the CPU under the same budgets, chunk size and
policy, and reads the tiers' peaks and the bytes moved per step from the runtime's own counters.
Placement does not depend on the batch size (activations are not budgeted) or on which device
computes (the CPU's device tier is the same budgeted pool), so these are the bytes a real run with
these budgets moves, up to the timing of asynchronous prefetches.

The time half prices that traffic on a machine (:class:`Machine`: measured here by default, or
given): the compute of one step at the rate the model's forward and backward reach on the device,
each link's bytes at its speed, the Adam updates at the rate hetero reaches where they run (the
host's C++ kernel, or the device), and the runtime's own decisions (the dry run's event log
replayed without tensors). Two figures frame the step
time: ``overlapped`` (every resource busy at once: what perfect prefetch would reach) and
``serial`` (the same costs one after another). Neither counts the Python around the runtime (hooks, issuing copies) or
cores shared between compute, copies and the host update: on a CPU they can dominate
(``benchmarks/RESULTS.md`` compares the plan with real runs).
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import tempfile
import time
from typing import Any, Optional

import torch

from . import cli, models
from .config import _parse_device, format_size, parse_size
from .errors import HeteroConfigError
from .wrap import minimum_budgets

#: traffic directions priced by the plan, as in the placement report
LINKS = ("host->device", "device->host", "nvme->host", "host->nvme")


@dataclasses.dataclass(frozen=True)
class Machine:
    """What the plan prices traffic and compute with. ``None`` for a figure the plan has no use
    for (no NVMe tier: no disk speeds)."""

    compute_tflops: float  # what the model's forward and backward reach on the compute device
    h2d_GBps: float
    d2h_GBps: float
    nvme_read_GBps: Optional[float]
    nvme_write_GBps: Optional[float]
    adam_Gparams: float  # CPU Adam updates per second (the kernel hetero steps host chunks with)
    device_adam_Gparams: float  # the same for chunks updated on the compute device
    source: str  # "measured", "given", or "measured, some given"


def train_flops(cfg: models.GPTConfig, params: int, tokens: int, seq_len: int) -> float:
    """FLOPs of one training step (forward and backward) of the GPT on ``tokens`` tokens of
    sequences of ``seq_len``: 6 per parameter and token, plus attention's 12 x layers x width x
    sequence length per token (the PaLM / nanoGPT estimate)."""
    return (6 * params + 12 * cfg.n_layer * cfg.n_embd * seq_len) * tokens


def price(traffic: dict[str, float], *, flops: float, host_params: int, machine: Machine,
          device_params: int = 0, runtime_s: float = 0.0) -> dict[str, float]:
    """Seconds per step of each cost for ``traffic`` (bytes per direction), ``flops`` of
    compute, ``host_params`` and ``device_params`` parameters updated by the CPU and on the
    device, and ``runtime_s`` of the runtime's own decisions (host CPU time); and two figures for
    the step: ``overlapped`` (the busiest resource: the device runs compute and its Adam updates
    one after the other, the NVMe reads and writes share one disk) and ``serial`` (every cost one
    after another)."""
    def at(nbytes: float, gbps: Optional[float], what: str) -> float:
        if not nbytes:
            return 0.0
        if not gbps:
            raise ValueError(f"{format_size(int(nbytes))} of {what} traffic per step but no speed for it")
        return nbytes / (gbps * 1e9)

    t = {
        "compute": flops / (machine.compute_tflops * 1e12),
        "host->device": at(traffic.get("host->device", 0), machine.h2d_GBps, "host->device"),
        "device->host": at(traffic.get("device->host", 0), machine.d2h_GBps, "device->host"),
        "nvme": (at(traffic.get("nvme->host", 0), machine.nvme_read_GBps, "NVMe read")
                 + at(traffic.get("host->nvme", 0), machine.nvme_write_GBps, "NVMe write")),
        "device_adam": device_params / (machine.device_adam_Gparams * 1e9),
        "host_adam": host_params / (machine.adam_Gparams * 1e9),
        "runtime": runtime_s,
    }
    busy = {k: v for k, v in t.items() if k not in ("compute", "device_adam")}
    t["overlapped"] = max(t["compute"] + t["device_adam"], *busy.values())
    t["serial"] = sum(v for k, v in t.items() if k != "overlapped")
    return t


# ---------------------------------------------------------------------------------- measuring


def _median_seconds(fn: Any, reps: int, sync: Any = None) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        if sync:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_compute(cfg: models.GPTConfig, device: torch.device, batch_size: int, seq_len: int,
                    reps: int = 3) -> float:
    """TFLOPS the GPT reaches in forward and backward on ``device`` at this batch (the plain
    model, everything resident): what its compute really costs, which small models spend far
    below the device's matmul peak."""
    torch.manual_seed(0)
    model = models.GPT(cfg).to(device)
    data = models.MarkovData(cfg.vocab_size, seed=0)
    x, y = (t.to(device) for t in data.batch(batch_size, seq_len))

    def step() -> None:
        model(x, y).backward()
        model.zero_grad(set_to_none=True)

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    seconds = _median_seconds(step, reps, sync)
    return train_flops(cfg, model.num_params(), batch_size * seq_len, seq_len) / seconds / 1e12


def measure_link(device: torch.device, block: int, total: int = 64 << 20, reps: int = 5) -> tuple[float, float]:
    """(host->device, device->host) GB/s of the copy engine the runtime uses, moving ``total``
    bytes in copies of ``block`` bytes (a chunk's block) all issued at once, between host memory
    (pinned when CUDA is present, as the host arena is) and ``device``."""
    from .copies import CopyEngine
    from .engine import aligned_empty

    block = max(4096, min(block, total))
    n = max(1, total // block)
    host = aligned_empty(n * block, pin=device.type == "cuda" and device)
    dev = torch.empty(n * block, dtype=torch.uint8, device=device)
    out = []
    with CopyEngine(2) as eng:
        for dst, src in ((dev, host), (host, dev)):
            def copy_all() -> None:
                for h in [eng.copy(dst[i:i + block], src[i:i + block]) for i in range(0, n * block, block)]:
                    h.wait()
            out.append(n * block / _median_seconds(copy_all, reps) / 1e9)
    return out[0], out[1]


def measure_disk(directory: str, nbytes: int = 64 << 20, block: int = 1 << 20) -> tuple[float, float]:
    """(read, write) GB/s of hetero's swap engine in ``directory`` (O_DIRECT where the file
    system allows), 1 MiB requests all in flight."""
    from .engine import SwapIO, aligned_empty

    buf = aligned_empty(nbytes)
    buf.fill_(1)
    speeds = {}
    # a private directory (0700, removed afterwards), as the swap files get
    with tempfile.TemporaryDirectory(prefix="hetero-plan-", dir=directory) as tmp, SwapIO() as io:
        f = io.open(os.path.join(tmp, "probe"), nbytes)
        try:
            for op in ("write", "read"):
                t0 = time.perf_counter()
                for h in [getattr(io, op)(f, i, buf[i:i + block]) for i in range(0, nbytes, block)]:
                    h.wait()
                speeds[op] = nbytes / (time.perf_counter() - t0) / 1e9
        finally:
            io.close(f)
    return speeds["read"], speeds["write"]


def measure_adam(device: torch.device = torch.device("cpu"), numel: int = 1 << 22, reps: int = 3) -> float:
    """G parameters per second of the Adam update hetero runs on ``device`` (the fused C++
    kernel on the CPU, torch ops on a GPU)."""
    from .optim.kernel import adam_step_

    w, g, m, v = (torch.rand(numel, device=device) for _ in range(4))
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    step = lambda: adam_step_(w, g, m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,  # noqa: E731
                              weight_decay=0.0, decoupled=True)
    return numel / _median_seconds(step, reps, sync) / 1e9


def measure_machine(cfg: models.GPTConfig, device: torch.device, batch_size: int, seq_len: int,
                    nvme_dir: Optional[str], block: int, **given: Optional[float]) -> Machine:
    """This machine's figures for training ``cfg`` at this batch with blocks of about ``block``
    bytes, each measured unless given (keyword: a :class:`Machine` field)."""
    def pick(name: str, measure: Any) -> float:
        value = given.get(name)
        return float(value) if value is not None else measure()

    link: Optional[tuple[float, float]] = None
    disk: Optional[tuple[float, float]] = None

    def link_speed(i: int) -> float:
        nonlocal link
        link = link or measure_link(device, block)
        return link[i]

    def disk_speed(i: int) -> Optional[float]:
        nonlocal disk
        if nvme_dir is None:
            return None
        disk = disk or measure_disk(nvme_dir)
        return disk[i]

    known = [k for k, v in given.items() if v is not None]
    fields = dict(
        compute_tflops=pick("compute_tflops", lambda: measure_compute(cfg, device, batch_size, seq_len)),
        h2d_GBps=pick("h2d_GBps", lambda: link_speed(0)),
        d2h_GBps=pick("d2h_GBps", lambda: link_speed(1)),
        nvme_read_GBps=pick("nvme_read_GBps", lambda: disk_speed(0)) if nvme_dir else None,
        nvme_write_GBps=pick("nvme_write_GBps", lambda: disk_speed(1)) if nvme_dir else None,
        adam_Gparams=pick("adam_Gparams", measure_adam),
    )
    fields["device_adam_Gparams"] = pick("device_adam_Gparams", lambda: (
        fields["adam_Gparams"] if device.type == "cpu" else measure_adam(device)))
    needed = [k for k, v in fields.items() if v is not None]
    source = "given" if set(needed) <= set(known) else "measured, some given" if known else "measured"
    return Machine(**fields, source=source)


# ---------------------------------------------------------------------------------- the plan


@dataclasses.dataclass
class Plan:
    model: str
    params: int
    state: dict[str, int]  # training-state bytes per block kind
    budgets: dict[str, Optional[int]]  # device, host, nvme (None: no NVMe tier)
    minimums: dict[str, int]  # the smallest device and host budgets wrap accepts here
    peaks: dict[str, int]  # bytes per tier at the fullest moment of the dry run
    traffic: dict[str, int]  # bytes per step and direction, the dry run's last step
    host_params: int  # parameters the CPU updates per step (their chunks' Adam states live below the device)
    device_params: int  # parameters updated on the device per step (their states live there)
    batch_size: int
    seq_len: int
    flops: float
    machine: Machine
    seconds: dict[str, float]  # per cost, and the step's overlapped and serial figures (see price)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        total = sum(self.state.values())
        lines = [f"plan: {self.model} GPT, {self.params / 1e6:.2f}M parameters, training state "
                 f"{format_size(total)} ({', '.join(f'{k} {format_size(v)}' for k, v in self.state.items())})"]
        budgets = ", ".join(f"{k} {'off' if v is None else format_size(v)}" for k, v in self.budgets.items())
        lines.append(f"budgets: {budgets}; the least wrap accepts: device "
                     f"{format_size(self.minimums['device'])}, host {format_size(self.minimums['host'])}")
        lines.append("memory per tier (peak): " + ", ".join(
            f"{k} {format_size(v)}" for k, v in self.peaks.items()))
        lines.append("traffic per step: " + ", ".join(
            f"{k} {format_size(self.traffic.get(k, 0))}" for k in LINKS))
        m = self.machine
        disk = ("" if m.nvme_read_GBps is None else
                f", NVMe read {m.nvme_read_GBps:.2f} / write {m.nvme_write_GBps:.2f} GB/s")
        lines.append(f"machine ({m.source}): compute {m.compute_tflops:.3g} TFLOPS, host->device "
                     f"{m.h2d_GBps:.2f} GB/s, device->host {m.d2h_GBps:.2f} GB/s{disk}, CPU Adam "
                     f"{m.adam_Gparams:.2f} G params/s, device Adam {m.device_adam_Gparams:.2f} G params/s")
        s = self.seconds
        lines.append(f"step at batch {self.batch_size} x {self.seq_len} tokens: compute {s['compute']:.4f} s, "
                     f"host->device {s['host->device']:.4f} s, device->host {s['device->host']:.4f} s, "
                     f"NVMe {s['nvme']:.4f} s, host Adam ({self.host_params / 1e6:.2f}M params) "
                     f"{s['host_adam']:.4f} s, device Adam ({self.device_params / 1e6:.2f}M params) "
                     f"{s['device_adam']:.4f} s, runtime decisions {s['runtime']:.4f} s")
        lines.append(f"estimated step time: {s['overlapped']:.4f} s with every transfer hidden behind "
                     f"the busiest resource, {s['serial']:.4f} s with nothing overlapped")
        return "\n".join(lines)


def plan(model_name: str, *, device_budget: Any = None, host_budget: Any = None,
         nvme_path: Optional[str] = None, no_nvme: bool = False, nvme_budget: Any = None,
         chunk_size: Any = "1MiB",
         policy: str = "auto", batch_size: int = 8, seq_len: Optional[int] = None,
         device: Optional[str] = None, steps: int = 4, machine: Optional[Machine] = None,
         **given: Optional[float]) -> Plan:
    """Plan training the bundled GPT ``model_name`` (budgets as ``hetero train`` takes them) at
    ``batch_size`` sequences of ``seq_len`` tokens (default: the model's block size) on
    ``device``: a dry run of ``steps`` steps on the CPU at batch size 1 gives the memory per tier
    and the traffic per step (see the module docstring); ``machine`` (default: measured here,
    with any :class:`Machine` field given as a keyword) prices them. Bad budgets raise what
    ``hetero.wrap`` raises, before anything runs."""
    if steps < 2:
        raise HeteroConfigError(f"steps={steps}: expected >= 2 (the first step records the access sequence)")
    compute_device = _parse_device(device)  # a bad device is refused before the dry run
    cfg = models.get_config(model_name)
    seq_len = cfg.block_size if seq_len is None else seq_len
    if not 1 <= seq_len <= cfg.block_size:
        raise HeteroConfigError(f"seq_len={seq_len}: expected 1..{cfg.block_size} (the {model_name} model's block size)")
    if batch_size < 1:
        raise HeteroConfigError(f"batch_size={batch_size}: expected >= 1")
    cli.check_batch(batch_size, seq_len)
    fields = {f.name for f in dataclasses.fields(Machine)} - {"source"}
    for name, value in given.items():
        if name not in fields:
            raise TypeError(f"plan() got an unexpected keyword argument {name!r}")
        if value is not None and not 0 < value < math.inf:
            raise HeteroConfigError(f"{name}={value!r}: expected a finite speed > 0 (or None to measure it)")
    minimums: dict[str, int] = {}

    def layout(module: Any) -> None:
        minimums["device"], minimums["host"] = minimum_budgets(module, nvme=not no_nvme)

    with cli.nvme_dir(nvme_path, no_nvme) as swap:
        res = cli.run(model_name, steps, batch_size=1, device="cpu", device_budget=device_budget,
                      host_budget=host_budget, nvme_path=swap, no_nvme=no_nvme, nvme_budget=nvme_budget,
                      chunk_size=chunk_size,
                      policy=policy, progress=False, desc="hetero plan", on_wrap=layout)
        if machine is None:
            machine = measure_machine(cfg, compute_device, batch_size, seq_len, swap,
                                      parse_size(chunk_size, "chunk_size"), **given)
    report = res.report.as_dict()
    # The runtime's decisions (placement, eviction, prefetch planning) cost host CPU time per
    # step: timed by replaying the dry run's event log, the same code without tensors.
    t0 = time.perf_counter()
    res.report.simulate()
    runtime_s = (time.perf_counter() - t0) / steps
    state: dict[str, int] = {}
    for b in report["blocks"]:
        state[b["kind"]] = state.get(b["kind"], 0) + b["bytes"]
    last = steps - 1
    traffic = dict(report["step_traffic"][last]) if len(report["step_traffic"]) > last else {}
    # Adam runs where a chunk's states are: the last step's exp_avg accesses (fp32) say where
    updated = [(a.tier, a.bytes // 4) for a in res.report.accesses
               if a.step == last and a.block.endswith(".exp_avg")]
    host_params = sum(n for tier, n in updated if tier != "device")
    device_params = sum(n for tier, n in updated if tier == "device")
    flops = train_flops(cfg, res.params, batch_size * seq_len, seq_len)
    b = res.budgets
    return Plan(model_name, res.params, state, {"device": b.device, "host": b.host, "nvme": b.nvme}, minimums,
                {n: t["peak"] for n, t in report["tiers"].items()}, traffic, host_params, device_params,
                batch_size, seq_len, flops, machine,
                price(traffic, flops=flops, host_params=host_params, device_params=device_params,
                      machine=machine, runtime_s=runtime_s))
