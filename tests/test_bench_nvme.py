"""Argument handling of benchmarks/bench_nvme.py: a bad value is an argparse usage error (exit
status 2, naming the option), never a traceback or a silently different run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_nvme.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_nvme", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("args, message", [
    (["--rounds", "0"], "argument --rounds: '0' is not a number of rounds >= 1"),  # ran 5
    (["--rounds", "-1"], "argument --rounds: '-1' is not a number of rounds >= 1"),  # crashed
    (["--rounds", "many"], "argument --rounds: 'many' is not a number of rounds >= 1"),
    (["--size", "0"], "argument --size: '0' is not a size > 0"),
    (["--size", "garbage"], "argument --size: 'garbage' is not a size > 0"),
    (["--request", "0"], "argument --request: '0' is not a size > 0"),
    (["--size", "5000"], "--size must be a multiple of 1 MiB"),
])
def test_bad_arguments_are_usage_errors(bench, capsys, tmp_path, args, message):
    with pytest.raises(SystemExit) as info:
        bench.main(["--dir", str(tmp_path), "--only", "hetero"] + args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage:") and message in err
    assert list(tmp_path.iterdir()) == []  # refused before anything was made
