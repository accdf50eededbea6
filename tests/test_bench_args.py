"""Argument handling of the benchmark scripts: a bad value is an argparse usage error (exit status
2, usage and one line naming the option), never a traceback, a silently different run, or a
directory left behind. Every case calls the script's main(argv); one case per script also runs
it as a user would, as its own process."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
MISSING = "missing-dir"  # a path under the test's tmp_path; must stay missing

# (script, arguments, what the error line must say)
CASES = [
    ("bench_adam.py", ["--sizes", "0"], "argument --sizes: '0' is not"),  # ZeroDivisionError
    ("bench_adam.py", ["--sizes", "abc"], "argument --sizes: 'abc' is not"),
    ("bench_adam.py", ["--reps", "0"], "argument --reps: '0' is not"),  # empty median
    ("bench_adam.py", ["--threads", "0"], "argument --threads: '0' is not"),
    ("bench_adam.py", ["--json", f"{MISSING}/x.json"], "argument --json:"),  # after the whole run
    ("bench_copy.py", ["--threads", "0"], "argument --threads: '0' is not"),
    ("bench_copy.py", ["--sizes", "0"], "argument --sizes: '0' is not"),  # a 0.00 GB/s row
    ("bench_copy.py", ["--reps", "0"], "argument --reps: '0' is not"),  # ran 5
    ("bench_runtime.py", ["--reps", "0"], "argument --reps: '0' is not"),
    ("bench_runtime.py", ["--chunks", "64KiB,0"], "argument --chunks: '64KiB,0' is not"),
    ("bench_runtime.py", ["--steps", "1"], "argument --steps: '1' is not a number of steps >= 2"),
    ("bench_slots.py", ["--chunks", "abc"], "argument --chunks: 'abc' is not"),
    ("bench_policy.py", ["--budgets", "0.25", "0"], "argument --budgets: '0' is not"),
    ("bench_policy.py", ["--seeds", "0"], "argument --seeds: '0' is not"),  # an empty table
    ("bench_policy.py", ["--steps", "0"], "argument --steps: '0' is not"),  # an all-zero table
    ("bench_policy.py", ["--host", "0"], "argument --host: '0' is not"),
    ("bench_policy.py", ["--chunk-size", "abc"], "argument --chunk-size: 'abc' is not"),
    # A budget hetero.wrap refuses: before the first run, naming the options it came from.
    ("bench_policy.py", ["--models", "dense", "--budgets", "0.001"], "--budgets 0.001 / --host 0.3"),
    ("train_oversized.py", ["--steps", "0"], "argument --steps: 0 is not accepted"),
    ("train_oversized.py", ["--device-budget", "0"], "--device-budget='0' must be a positive size"),
    ("train_oversized.py", ["--device", "garbage"], "--device 'garbage' is not a device"),
    ("mp_diag.py", ["--device", "garbage"], "argument --device: 'garbage' is not a device"),
    ("bench_overlap.py", ["--steps", "5", "--turn", "2"], "--steps 5 with --turn 2: expected at least 6"),
    ("bench_overlap.py", ["--chunk-size", "0"], "argument --chunk-size: '0' is not"),
    ("bench_nvme_step.py", ["--reps", "0"], "argument --reps: '0' is not"),
    ("bench_nvme_step.py", ["--params", "1000"], "argument --params: '1000' is not"),
    ("bench_nvme.py", ["--dir", MISSING, "--only", "hetero"], f"argument --dir: '{MISSING}' is not"),
    ("bench_dp.py", ["--ranks", "1"], "argument --ranks: '1' is not a number of ranks >= 2"),
    ("bench_dp.py", ["--steps", "2"], "argument --steps: '2' is not"),
    ("bench_dp.py", ["--json", f"{MISSING}/x.json"], "argument --json:"),
] + [  # Every output path is checked before the run (these wrote it after, and lost the results).
    (script, [option, f"{MISSING}/x.out"], f"argument {option}:")
    for script, option in (("bench_copy.py", "--json"), ("bench_runtime.py", "--json"),
                           ("bench_slots.py", "--json"), ("bench_policy.py", "--json"),
                           ("bench_policy.py", "--plot"), ("train_oversized.py", "--json"),
                           ("bench_nvme.py", "--json"), ("bench_overlap.py", "--json"),
                           ("bench_nvme_step.py", "--json"))
]


def _resolved(case: tuple[str, list[str], str], tmp: Path) -> tuple[str, list[str], str]:
    script, args, message = case
    missing = str(tmp / MISSING)
    return script, [a.replace(MISSING, missing) for a in args], message.replace(MISSING, missing)


def _check(err: str, message: str, tmp: Path) -> None:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert lines[0].startswith("usage:"), err
    assert [line for line in lines if ": error: " in line] == [lines[-1]], err  # one error line
    assert message in lines[-1], err
    assert not (tmp / MISSING).exists()  # bench_nvme --dir made it and left it behind


@pytest.fixture(scope="module")
def load():
    """The scripts as modules (the pytest process has imported torch already, so this is quick)."""
    loaded = {}
    sys.path.insert(0, str(BENCH))  # the scripts import each other

    def get(script: str):
        if script not in loaded:
            spec = importlib.util.spec_from_file_location(script[:-3], BENCH / script)
            loaded[script] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(loaded[script])
        return loaded[script]

    yield get
    sys.path.remove(str(BENCH))


@pytest.mark.parametrize("case", CASES, ids=[f"{s}:{' '.join(a)}" for s, a, _ in CASES])
def test_bad_argument_is_a_usage_error(load, capsys, tmp_path, case):
    script, args, message = _resolved(case, tmp_path)
    with pytest.raises(SystemExit) as info:
        load(script).main(args)
    assert info.value.code == 2
    _check(capsys.readouterr().err, message, tmp_path)


# The command line itself, once per script: exit status 2 and no traceback (each process mostly
# imports torch before argparse refuses its arguments, so they run concurrently).
FIRST = {}
for _case in CASES:
    FIRST.setdefault(_case[0], _case)


def test_command_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")

    def run(case):
        script, args, message = _resolved(case, tmp_path)
        proc = subprocess.run([sys.executable, str(BENCH / script), *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=240, check=False)
        return script, message, proc

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        for script, message, proc in pool.map(run, FIRST.values()):
            assert proc.returncode == 2, (script, proc.stderr)
            _check(proc.stderr, message, tmp_path)
            assert proc.stderr.strip().splitlines()[-1].startswith(f"{script}: error: "), proc.stderr


def test_overlap_least_steps_is_true(load):
    """bench_overlap refuses too few steps naming the fewest it accepts ("at least N"): every count
    from N on leaves a timed turn (it used to say "more than 4 steps" and refuse 5)."""
    turns = load("bench_overlap.py").turns
    for turn in range(1, 40):
        least = next(n for n in range(200) if turns(n, turn)[2] >= 1)
        assert all(turns(n, turn)[2] >= 1 for n in range(least, 400)), turn


def test_a_terminated_benchmark_removes_its_scratch_directory(tmp_path):
    """SIGTERM (``timeout``, a scheduler) ends a benchmark through its clean-ups, exit status
    143: bench_nvme killed mid-run left its .bench_nvme-* directory (a GiB per contender by
    default, in the checkout by default)."""
    import signal
    import time

    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(BENCH / "bench_nvme.py"), "--dir", str(tmp_path), "--only",
                             "python", "--size", "64MiB", "--rounds", "50"], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(".bench_nvme-*/*")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
    finally:
        proc.kill()
    assert not list(tmp_path.glob(".bench_nvme-*"))
