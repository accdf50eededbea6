"""Copy engine: GB/s of hetero.copies against torch's own copies, and how well copies overlap compute.

    python benchmarks/bench_copy.py                        # CPU (and CUDA when available)
    python benchmarks/bench_copy.py --quick                # smaller sizes, fewer reps (~20 s)
    python benchmarks/bench_copy.py --json /tmp/copy.json  # + the figures as JSON

Bandwidth (GB/s = bytes copied / seconds, 1 GB = 1e9 B; a host copy reads and writes each byte, so
its memory traffic is twice that), median over --reps calls, contenders called round-robin so that
all see the same machine load; every call is submit + wait, from the calling thread:
  CPU (host -> host, into pre-touched memory):
    engine         hetero.copies.CopyEngine, native backend (memcpy on its worker threads; a copy
                   of more than 8 MiB is split across them)
    engine_python  the same API on its pure-Python backend (Tensor.copy_ on a worker thread)
    torch_copy     dst.copy_(src) in the calling thread (torch's intra-op threads)
  CUDA (pinned host memory; H2D and D2H separately, then both directions at once):
    engine         CopyEngine: cudaMemcpyAsync on its stream + event, handle.wait()
    cuda_memcpy    the baseline: dst.copy_(src, non_blocking=True) on a side stream, which is one
                   plain cudaMemcpyAsync for contiguous same-dtype tensors, then stream.synchronize()

Overlap (is a prefetch really hidden behind compute?): a matmul loop on the calling thread (CPU)
or the current stream (CUDA), calibrated to take about as long as a batch of copies through the
engine; timed alone (compute_s), the copies alone (copy_s), and both at once (together_s: submit
the copies, run the compute, wait for both). efficiency = (compute_s + copy_s) / together_s: 1.0 is
no overlap, ideal = (compute_s + copy_s) / max(compute_s, copy_s) (about 2 when balanced). On the
CPU the compute runs on cpu_count - 1 torch threads and the engine on --overlap-threads workers;
for reference, "sync" does the same copies with copy_ in the calling thread (efficiency 1 by
construction). On CUDA, "torch_side_stream" issues them with copy_(non_blocking=True) on side
streams, the plain-PyTorch way of overlapping.

``--json PATH`` writes {"cpu": {"h2h": {size: {contender: GB/s}}, "overlap": {...}},
"cuda": {"h2d": ..., "d2h": ..., "bidirectional": ..., "overlap": ...} or null, "machine": {...}}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch

from hetero import copies

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling scripts and argtypes
import argtypes  # noqa: E402


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


# argparse type of --sizes: copy sizes > 0 (a 0-byte copy made a 0.00 GB/s row)
_sizes = argtypes.list_of(parse_size, "sizes > 0 (e.g. 64K,1M,16M)")


def size_name(n: int) -> str:
    for unit, scale in (("G", 2 ** 30), ("M", 2 ** 20), ("K", 2 ** 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def engine(backend: str, threads: int) -> copies.CopyEngine | None:
    """A CopyEngine on the given backend, or None when that backend is not available."""
    old = os.environ.get("HETERO_FORCE_PYTHON_COPY")
    os.environ["HETERO_FORCE_PYTHON_COPY"] = "1" if backend == "python" else "0"
    try:
        eng = copies.CopyEngine(threads)
    finally:
        if old is None:
            del os.environ["HETERO_FORCE_PYTHON_COPY"]
        else:
            os.environ["HETERO_FORCE_PYTHON_COPY"] = old
    if eng.backend != backend:
        eng.shutdown()
        return None
    return eng


def median_seconds(fns: dict[str, Callable[[], None]], reps: int, sync: Callable[[], None]
                   ) -> dict[str, float]:
    """Median seconds per call of each function, round-robin, after one warm-up round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rnd in range(reps + 1):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if rnd:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def nothing() -> None:
    pass


def waiter(handles: list[copies.CopyHandle]) -> Callable[[], None]:
    def wait() -> None:
        for h in handles:
            h.wait()
    return wait


# ---- CPU


def bench_cpu_bandwidth(sizes: list[int], reps: int, threads: int) -> dict[str, dict[str, float]]:
    engines = {name: engine(backend, threads) for name, backend in
               (("engine", "extension"), ("engine_python", "python"))}
    out: dict[str, dict[str, float]] = {}
    for n in sizes:
        src = torch.randint(0, 256, (n,), dtype=torch.uint8)
        dst = torch.zeros_like(src)  # touched: no page faults inside the timings
        fns: dict[str, Callable[[], None]] = {
            name: (lambda e=e: e.copy(dst, src).wait()) for name, e in engines.items() if e
        }
        fns["torch_copy"] = lambda: dst.copy_(src)
        secs = median_seconds(fns, reps, nothing)
        out[size_name(n)] = {name: n / s / 1e9 for name, s in secs.items()}
        assert torch.equal(dst, src)
    for e in engines.values():
        if e:
            e.shutdown()
    return out


def calibrate(fn_one: Callable[[], None], target_s: float, sync: Callable[[], None]) -> int:
    """How many calls of fn_one take about target_s (median of 5 timed batches of 3 calls)."""
    fn_one()
    sync()
    per = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(3):
            fn_one()
        sync()
        per.append((time.perf_counter() - t0) / 3)
    return max(1, round(target_s / statistics.median(per)))


def median_time(fn: Callable[[], None], sync: Callable[[], None], reps: int = 3) -> float:
    ts = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def overlap(copy_batch: dict[str, Callable[[], Callable[[], None]]], compute: Callable[[], None],
            reps: int, sync: Callable[[], None]) -> dict[str, dict[str, float]]:
    """compute_s, copy_s, together_s, efficiency, ideal for each way of copying.

    copy_batch[name]() submits the copies and returns the function that waits for them."""
    times = {name: ([], [], []) for name in copy_batch}  # compute, copies alone, together
    for rnd in range(reps + 1):  # round-robin, so that every way of copying sees the same load
        for name, submit in copy_batch.items():
            sync()
            t0 = time.perf_counter()
            compute()
            sync()
            t1 = time.perf_counter()
            submit()()
            sync()
            t2 = time.perf_counter()
            wait = submit()
            compute()
            wait()
            sync()
            t3 = time.perf_counter()
            if rnd:
                for series, dt in zip(times[name], (t1 - t0, t2 - t1, t3 - t2)):
                    series.append(dt)
    out: dict[str, dict[str, float]] = {}
    for name, series in times.items():
        c, k, tg = (statistics.median(x) for x in series)
        out[name] = {"compute_s": c, "copy_s": k, "together_s": tg,
                     "efficiency": (c + k) / tg, "ideal": (c + k) / max(c, k)}
    return out


def bench_cpu_overlap(copy_bytes: int, n_copies: int, reps: int, engine_threads: int) -> dict:
    compute_threads = max(1, (os.cpu_count() or 2) - engine_threads)
    torch.set_num_threads(compute_threads)
    srcs = [torch.randint(0, 256, (copy_bytes,), dtype=torch.uint8) for _ in range(n_copies)]
    dsts = [torch.zeros_like(s) for s in srcs]
    a, b = torch.randn(384, 384), torch.randn(384, 384)

    def one_matmul() -> None:
        torch.mm(a, b)

    engines = {name: engine(backend, engine_threads) for name, backend in
               (("engine", "extension"), ("engine_python", "python"))}

    def via(e: copies.CopyEngine) -> Callable[[], Callable[[], None]]:
        def submit() -> Callable[[], None]:
            return waiter([e.copy(d, s) for d, s in zip(dsts, srcs)])
        return submit

    def sync_copies() -> Callable[[], None]:
        for d, s in zip(dsts, srcs):
            d.copy_(s)
        return nothing

    batch = {name: via(e) for name, e in engines.items() if e}
    first = next(iter(batch.values()))
    first()()  # warm-up
    iters = calibrate(one_matmul, median_time(lambda: first()(), nothing), nothing)

    def compute() -> None:
        for _ in range(iters):
            one_matmul()

    batch["sync"] = sync_copies
    res = overlap(batch, compute, reps, nothing)
    for e in engines.values():
        if e:
            e.shutdown()
    return {"copy_bytes": copy_bytes, "copies": n_copies, "matmuls": iters,
            "compute_threads": compute_threads, "engine_threads": engine_threads, **res}


# ---- CUDA


def bench_cuda(sizes: list[int], reps: int, threads: int, overlap_bytes: int, overlap_copies: int
               ) -> dict:
    dev = torch.device("cuda", torch.cuda.current_device())
    sync = torch.cuda.synchronize
    eng = engine("extension", threads) or engine("python", threads)
    eng_py = engine("python", threads) if eng.backend == "extension" else None
    side = {"h2d": torch.cuda.Stream(dev), "d2h": torch.cuda.Stream(dev)}
    out: dict = {"engine_backend": eng.backend, "h2d": {}, "d2h": {}, "bidirectional": {}}
    for n in sizes:
        host_src = torch.randint(0, 256, (n,), dtype=torch.uint8).pin_memory()
        host_dst = torch.zeros(n, dtype=torch.uint8).pin_memory()
        dev_buf = torch.empty(n, dtype=torch.uint8, device=dev)
        dev_src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev)

        def torch_side(direction: str, dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
            def run() -> None:
                s = side[direction]
                with torch.cuda.stream(s):
                    dst.copy_(src, non_blocking=True)
                s.synchronize()
            return run

        def both_engine() -> None:
            h1 = eng.copy(dev_buf, host_src)
            h2 = eng.copy(host_dst, dev_src)
            h1.wait()
            h2.wait()

        def both_torch() -> None:
            with torch.cuda.stream(side["h2d"]):
                dev_buf.copy_(host_src, non_blocking=True)
            with torch.cuda.stream(side["d2h"]):
                host_dst.copy_(dev_src, non_blocking=True)
            side["h2d"].synchronize()
            side["d2h"].synchronize()

        key = size_name(n)
        for direction, dst, src in (("h2d", dev_buf, host_src), ("d2h", host_dst, dev_src)):
            fns = {"engine": lambda d=dst, s=src: eng.copy(d, s).wait(),
                   "cuda_memcpy": torch_side(direction, dst, src)}
            if eng_py is not None:
                fns["engine_python"] = lambda d=dst, s=src: eng_py.copy(d, s).wait()
            secs = median_seconds(fns, reps, sync)
            out[direction][key] = {name: n / s / 1e9 for name, s in secs.items()}
        secs = median_seconds({"engine": both_engine, "cuda_memcpy": both_torch}, reps, sync)
        out["bidirectional"][key] = {name: 2 * n / s / 1e9 for name, s in secs.items()}
        assert torch.equal(dev_buf.cpu(), host_src) and torch.equal(host_dst, dev_src.cpu())
        del host_src, host_dst, dev_buf, dev_src

    # Overlap: H2D + D2H batches on the engine's streams while matmuls run on the current stream.
    h_src = [torch.randint(0, 256, (overlap_bytes,), dtype=torch.uint8).pin_memory()
             for _ in range(overlap_copies)]
    d_dst = [torch.empty(overlap_bytes, dtype=torch.uint8, device=dev) for _ in h_src]
    d_src = [torch.randint(0, 256, (overlap_bytes,), dtype=torch.uint8, device=dev) for _ in h_src]
    h_dst = [torch.empty(overlap_bytes, dtype=torch.uint8).pin_memory() for _ in h_src]
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    compute_stream = torch.cuda.current_stream(dev)

    def one_matmul() -> None:
        torch.mm(a, b)

    def via_engine() -> Callable[[], None]:
        after = compute_stream.cuda_stream
        hs = [eng.copy(d, s, after_stream=after) for d, s in zip(d_dst, h_src)]
        hs += [eng.copy(d, s, after_stream=after) for d, s in zip(h_dst, d_src)]
        return waiter(hs)

    def via_torch_side() -> Callable[[], None]:
        for direction, pairs in (("h2d", zip(d_dst, h_src)), ("d2h", zip(h_dst, d_src))):
            s = side[direction]
            s.wait_stream(compute_stream)
            with torch.cuda.stream(s):
                for d, src in pairs:
                    d.copy_(src, non_blocking=True)
        def wait() -> None:
            side["h2d"].synchronize()
            side["d2h"].synchronize()
        return wait

    def via_compute_stream() -> Callable[[], None]:  # no overlap: the copies queue behind compute
        for d, s in list(zip(d_dst, h_src)) + list(zip(h_dst, d_src)):
            d.copy_(s, non_blocking=True)
        return nothing

    via_engine()()  # warm-up
    iters = calibrate(one_matmul, median_time(lambda: via_engine()(), sync), sync)

    def compute() -> None:
        for _ in range(iters):
            one_matmul()

    res = overlap({"engine": via_engine, "torch_side_stream": via_torch_side,
                   "compute_stream": via_compute_stream}, compute, reps, sync)
    out["overlap"] = {"copy_bytes": overlap_bytes, "copies_each_way": overlap_copies,
                      "matmuls_8192_bf16": iters, **res}
    eng.shutdown()
    if eng_py is not None:
        eng_py.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=_sizes, default=None, help="copy sizes (K/M/G), comma-separated; "
                        "default 64K,1M,16M,256M (--quick: 1M,64M)")
    parser.add_argument("--reps", type=argtypes.whole("calls"), default=None,
                        help="timed calls per contender (median); default 9 (--quick: 5)")
    parser.add_argument("--threads", type=argtypes.whole("threads"), default=2, help="engine worker threads")
    parser.add_argument("--overlap-threads", type=argtypes.whole("threads"), default=1,
                        help="engine worker threads in the CPU overlap test")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer reps")
    parser.add_argument("--no-cuda", action="store_true", help="skip the CUDA part")
    parser.add_argument("--json", metavar="PATH", help="write the figures here")
    args = parser.parse_args(argv)
    argtypes.output_file(parser, "--json", args.json)
    argtypes.end_on_sigterm()
    sizes = args.sizes or _sizes("1M,64M" if args.quick else "64K,1M,16M,256M")
    reps = args.reps or (5 if args.quick else 9)
    cuda = torch.cuda.is_available() and not args.no_cuda
    machine = {"cpus": os.cpu_count(), "torch": torch.__version__, "cuda": torch.version.cuda,
               "gpu": torch.cuda.get_device_name() if cuda else None,
               "native_engine": copies._C is not None, "native_cuda": bool(copies._C and copies._C.COPY_CUDA),
               "extension_error": copies.EXTENSION_ERROR, "load_start": os.getloadavg()[0]}
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), {os.cpu_count()} CPUs, "
          f"native engine: {machine['native_engine']} (CUDA path: {machine['native_cuda']}), "
          f"gpu: {machine['gpu']}, load average {machine['load_start']:.2f}")
    t_start = time.perf_counter()
    torch_threads = torch.get_num_threads()

    def table(title: str, rows: dict[str, dict[str, float]]) -> None:
        names = list(next(iter(rows.values())))
        print(f"\n{title} (GB/s, median of {reps})")
        print(f"{'size':>6} " + " ".join(f"{n:>14}" for n in names))
        for key, r in rows.items():
            print(f"{key:>6} " + " ".join(f"{r[n]:>14.2f}" for n in names))

    def overlap_table(title: str, res: dict) -> None:
        print(f"\n{title}")
        print(f"{'copies via':>18} {'compute s':>10} {'copy s':>8} {'together s':>11} "
              f"{'efficiency':>11} {'ideal':>6}")
        for name, r in res.items():
            if isinstance(r, dict):
                print(f"{name:>18} {r['compute_s']:>10.4f} {r['copy_s']:>8.4f} "
                      f"{r['together_s']:>11.4f} {r['efficiency']:>11.2f} {r['ideal']:>6.2f}")

    result: dict = {"machine": machine, "reps": reps}
    cpu_h2h = bench_cpu_bandwidth(sizes, reps, args.threads)
    table(f"CPU host->host, engine {args.threads} threads, torch {torch_threads} threads", cpu_h2h)
    ov_bytes, ov_n = (8 << 20, 8) if args.quick else (32 << 20, 8)
    cpu_ov = bench_cpu_overlap(ov_bytes, ov_n, max(reps, 7), args.overlap_threads)
    torch.set_num_threads(torch_threads)
    overlap_table(f"CPU overlap: {ov_n} x {size_name(ov_bytes)} host copies vs {cpu_ov['matmuls']} "
                  f"384x384 matmuls on {cpu_ov['compute_threads']} torch thread(s), engine "
                  f"{cpu_ov['engine_threads']} thread(s)", cpu_ov)
    result["cpu"] = {"h2h": cpu_h2h, "overlap": cpu_ov}
    result["cuda"] = None
    if cuda:
        cu = bench_cuda(sizes, reps, args.threads, 64 << 20, 4 if args.quick else 8)
        for direction in ("h2d", "d2h", "bidirectional"):
            table(f"CUDA {direction}, pinned host memory", cu[direction])
        overlap_table(f"CUDA overlap: {cu['overlap']['copies_each_way']} x 64M each way vs "
                      f"{cu['overlap']['matmuls_8192_bf16']} 8192^3 bf16 matmuls", cu["overlap"])
        result["cuda"] = cu
    result["machine"]["load_end"] = os.getloadavg()[0]
    result["seconds"] = time.perf_counter() - t_start
    print(f"\n{result['seconds']:.1f} s, load average at the end {result['machine']['load_end']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
