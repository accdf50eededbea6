"""NVMe tier I/O: hetero's swap engine against fio, plain Python file I/O and aiofiles.

    python benchmarks/bench_nvme.py                         # 1 GiB per contender, 5 rounds
    python benchmarks/bench_nvme.py --quick                 # 256 MiB, 3 rounds
    python benchmarks/bench_nvme.py --dir /mnt/nvme --json nvme.json

The question: does the engine read and write swap files at the disk's limit? The limit is what fio
reaches in the same directory with the settings the issue names (io_uring, O_DIRECT, 1 MiB blocks,
queue depth 32); the target is engine >= 0.95x fio for both reads and writes, with the engine's
default settings (backend "auto", block size and queue depth from its auto-tuning probe).

Contenders, each on its own file of ``--size`` bytes in one temporary directory made inside
``--dir`` (default: the repository's directory, i.e. the file system the project lives on), all
removed at the end:

  fio       ``fio --ioengine=io_uring --direct=1 --bs=1M --iodepth=32`` (--rw=write, then
            --rw=read of the same file); GB/s from its JSON ``bw_bytes``. Skipped with a note when
            fio is not installed and cannot be (``apt-get install fio`` is tried when running as
            root with apt-get; ``.ci/run`` installs it too).
  hetero    ``hetero.engine.SwapIO()`` with no arguments: the file opened (and its space reserved)
            as a swap file, then written / read as ``--request``-sized requests (64 MiB, the
            runtime's default chunk size), all submitted at once and then waited, from one
            aligned buffer (as the runtime moves chunks between the host arena and swap files).
  python    plain ``open()``: ``write`` of 1 MiB blocks + fsync, then ``readinto`` 1 MiB blocks
            after evicting the file from the page cache (``posix_fadvise(DONTNEED)``), so reads
            come from the disk.
  aiofiles  the same through ``aiofiles`` (asyncio; its I/O runs in a thread pool), when installed
            (``pip install '.[bench]'``).

Each round runs every contender's write then read, round-robin, so all see the same machine load;
the figure is the median over rounds. Each write goes to a fresh file (its space reserved where the
tool does so: fio and hetero fallocate), so no round overwrites already-written blocks.

``--json PATH`` writes ``{"fio": {"read_GBps", "write_GBps"}, "hetero": {"read_GBps",
"write_GBps", "backend", "block_size", "queue_depth", "tuning"}, "python": {...},
"aiofiles": {...}, "ratio_to_fio": {name: {"read", "write"}}, "config": {...}}`` (GB = 1e9 bytes;
a skipped contender is absent, with the reason under "skipped").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch
from tqdm import tqdm

from hetero import engine
from hetero.config import format_size

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling scripts and argtypes
import argtypes  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 1 << 20  # fio's and the plain contenders' block size


def ensure_fio() -> str | None:
    """Path of fio, installing it with apt-get when possible; None (with a note) otherwise."""
    found = shutil.which("fio")
    if found:
        return found
    if shutil.which("apt-get") and os.geteuid() == 0:
        print("fio not found: trying apt-get install -y fio", file=sys.stderr)
        subprocess.run(["apt-get", "install", "-y", "-qq", "fio"], capture_output=True,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        found = shutil.which("fio")
    return found


class Fio:
    name = "fio"

    def __init__(self, fio: str, directory: str, size: int) -> None:
        self.fio, self.dir, self.size = fio, directory, size
        self.path = os.path.join(directory, "fio.bin")

    def _run(self, rw: str) -> float:
        cmd = [self.fio, "--name=bench", f"--filename={self.path}", "--ioengine=io_uring",
               "--direct=1", f"--bs={BLOCK}", "--iodepth=32", f"--rw={rw}", f"--size={self.size}",
               "--output-format=json"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"fio failed: {' '.join(cmd)}\n{done.stderr.strip()}")
        job = json.loads(done.stdout[done.stdout.index("{"):])["jobs"][0]
        return job[rw]["bw_bytes"] / 1e9

    def write(self) -> float:
        if os.path.exists(self.path):
            os.unlink(self.path)  # a fresh file each round, like every contender
        return self._run("write")

    def read(self) -> float:
        return self._run("read")


class Hetero:
    name = "hetero"

    def __init__(self, directory: str, size: int, request: int) -> None:
        self.path, self.size, self.request = os.path.join(directory, "hetero.bin"), size, request
        self.io = engine.SwapIO()  # the defaults under test: auto backend, auto-tuned
        self.buf = engine.aligned_empty(min(size, 256 << 20))
        self.buf.copy_(torch.randint(0, 256, (self.buf.numel(),), dtype=torch.uint8))
        self.file: engine.SwapFile | None = None
        self._open()  # runs (or reads the cache of) the tuning probe, outside any timing

    def _open(self) -> None:
        if self.file is not None:
            self.io.close(self.file)
            os.unlink(self.path)
        self.file = self.io.open(self.path, self.size)

    def _run(self, write: bool) -> float:
        submit = self.io.write if write else self.io.read
        n = self.buf.numel()
        start = time.perf_counter()
        handles = []
        for off in range(0, self.size, self.request):
            length = min(self.request, self.size - off)
            lo = off % n if off % n + length <= n else 0
            handles.append(submit(self.file, off, self.buf[lo:lo + length]))
        for h in handles:
            h.wait()
        return self.size / (time.perf_counter() - start) / 1e9

    def write(self) -> float:
        self._open()  # fresh reserved space, as a swap file at wrap time
        return self._run(True)

    def read(self) -> float:
        return self._run(False)

    def info(self) -> dict:
        t = self.io.tuning
        return {"backend": self.io.backend, "block_size": self.io.block_size,
                "queue_depth": self.io.queue_depth, "checksum": self.io.checksum,
                "direct": self.file.direct, "tuning": t.source if t else None}

    def close(self) -> None:
        if self.file is not None:
            self.io.close(self.file)
        self.io.shutdown()


def _evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class PlainPython:
    name = "python"

    def __init__(self, directory: str, size: int) -> None:
        self.path, self.size = os.path.join(directory, "python.bin"), size
        self.block = memoryview(bytearray(os.urandom(BLOCK)))

    def write(self) -> float:
        if os.path.exists(self.path):
            os.unlink(self.path)
        start = time.perf_counter()
        with open(self.path, "wb") as f:
            for off in range(0, self.size, BLOCK):
                f.write(self.block[:min(BLOCK, self.size - off)])
            f.flush()
            os.fsync(f.fileno())  # until it is on the disk, as the O_DIRECT contenders' writes
        return self.size / (time.perf_counter() - start) / 1e9

    def read(self) -> float:
        _evict(self.path)
        buf = memoryview(bytearray(BLOCK))
        start = time.perf_counter()
        with open(self.path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
        return self.size / (time.perf_counter() - start) / 1e9


class AioFiles:
    name = "aiofiles"

    def __init__(self, directory: str, size: int) -> None:
        import aiofiles  # noqa: F401  (ImportError: skipped by the caller)

        self.path, self.size = os.path.join(directory, "aiofiles.bin"), size
        self.block = bytes(os.urandom(BLOCK))

    async def _write(self) -> None:
        import aiofiles

        async with aiofiles.open(self.path, "wb") as f:
            for off in range(0, self.size, BLOCK):
                await f.write(self.block[:min(BLOCK, self.size - off)])
            await f.flush()
            await asyncio.get_running_loop().run_in_executor(None, os.fsync, f.fileno())

    async def _read(self) -> None:
        import aiofiles

        buf = bytearray(BLOCK)
        async with aiofiles.open(self.path, "rb", buffering=0) as f:
            while await f.readinto(buf):
                pass

    def write(self) -> float:
        if os.path.exists(self.path):
            os.unlink(self.path)
        start = time.perf_counter()
        asyncio.run(self._write())
        return self.size / (time.perf_counter() - start) / 1e9

    def read(self) -> float:
        _evict(self.path)
        start = time.perf_counter()
        asyncio.run(self._read())
        return self.size / (time.perf_counter() - start) / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=ROOT,
                   help="an existing directory on the disk to measure (a temporary directory is "
                        "made inside it and removed); default: the repository's directory")
    p.add_argument("--size", type=argtypes.size_bytes("64MiB, 1GiB"), default=None,
                   help="bytes per contender and round, a multiple of 1MiB (default 1GiB)")
    p.add_argument("--rounds", type=argtypes.whole("rounds"), default=None,
                   help="rounds; the median is reported (default 5)")
    p.add_argument("--request", type=argtypes.size_bytes("64MiB, 1GiB"), default="64MiB",
                   help="hetero's request size (the runtime's chunk size; default 64MiB)")
    p.add_argument("--quick", action="store_true", help="256MiB and 3 rounds")
    p.add_argument("--only", nargs="+", choices=["fio", "hetero", "python", "aiofiles"],
                   help="run only these contenders")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = p.parse_args(argv)
    argtypes.output_file(p, "--json", args.json)
    argtypes.end_on_sigterm()

    size = args.size or (256 << 20 if args.quick else 1 << 30)
    request = args.request
    rounds = args.rounds or (3 if args.quick else 5)
    if size % BLOCK or request % engine.ALIGNMENT:
        p.error("--size must be a multiple of 1 MiB and --request of 4 KiB")
    argtypes.writable_dir(p, "--dir", args.dir)
    wanted = set(args.only or ["fio", "hetero", "python", "aiofiles"])
    work = tempfile.mkdtemp(prefix=".bench_nvme-", dir=args.dir)
    skipped: dict[str, str] = {}
    contenders: list = []
    try:
        if "fio" in wanted:
            fio = ensure_fio()
            if fio:
                contenders.append(Fio(fio, work, size))
            else:
                skipped["fio"] = "fio is not installed (apt-get install fio)"
        if "hetero" in wanted:
            contenders.append(Hetero(work, size, request))
        if "python" in wanted:
            contenders.append(PlainPython(work, size))
        if "aiofiles" in wanted:
            try:
                contenders.append(AioFiles(work, size))
            except ImportError:
                skipped["aiofiles"] = "aiofiles is not installed (pip install '.[bench]')"
        results: dict[str, dict[str, list[float]]] = {
            c.name: {"write": [], "read": []} for c in contenders}
        steps: list[tuple[object, str, Callable[[], float]]] = [
            (c, op, getattr(c, op)) for _ in range(rounds) for c in contenders
            for op in ("write", "read")]
        with tqdm(steps, desc="bench_nvme", unit="pass", leave=False) as bar:
            for c, op, run in bar:
                bar.set_postfix_str(f"{c.name} {op}")
                results[c.name][op].append(run())
        info = next((c.info() for c in contenders if isinstance(c, Hetero)), None)
    finally:
        for c in contenders:
            if isinstance(c, Hetero):
                c.close()
        shutil.rmtree(work, ignore_errors=True)

    med = {name: {f"{op}_GBps": round(statistics.median(v[op]), 3) for op in ("read", "write")}
           for name, v in results.items()}
    base = med.get("fio")
    ratio = ({name: {op: round(m[f"{op}_GBps"] / base[f"{op}_GBps"], 3) for op in ("read", "write")}
              for name, m in med.items()} if base else {})

    print(f"\nNVMe tier I/O in {os.path.realpath(args.dir)}: {format_size(size)} per contender, "
          f"median of {rounds} rounds (GB/s = 1e9 B/s; min-max in brackets)")
    if info:
        print(f"hetero: backend {info['backend']}, block size {format_size(info['block_size'])}, "
              f"queue depth {info['queue_depth']} ({info['tuning']}), O_DIRECT {info['direct']}, "
              f"checksum {info['checksum']}, requests of {format_size(request)}")
    print(f"{'contender':<10} {'write GB/s':>22} {'read GB/s':>22} {'write/fio':>10} {'read/fio':>9}")
    for name, v in results.items():
        cells = [f"{med[name][f'{op}_GBps']:.3f} [{min(v[op]):.2f}-{max(v[op]):.2f}]"
                 for op in ("write", "read")]
        rw = ratio.get(name, {})
        print(f"{name:<10} {cells[0]:>22} {cells[1]:>22} "
              f"{rw.get('write', float('nan')):>10.3f} {rw.get('read', float('nan')):>9.3f}")
    for name, why in skipped.items():
        print(f"{name:<10} skipped: {why}")

    if args.json:
        out: dict = {name: dict(m) for name, m in med.items()}
        if info and "hetero" in out:
            out["hetero"].update(info)
        out["ratio_to_fio"] = ratio
        out["skipped"] = skipped
        out["config"] = {"dir": os.path.realpath(args.dir), "size": size, "rounds": rounds,
                         "request": request, "block": BLOCK, "fio_iodepth": 32,
                         "all": {name: v for name, v in results.items()}}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
