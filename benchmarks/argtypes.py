"""Argument checks shared by the benchmark scripts in this folder (not a script itself).

The factories return argparse ``type=`` callables: a bad value raises ``argparse.ArgumentTypeError``,
which argparse reports as one usage error line naming the option (exit status 2), not a traceback.
``make_dir``, ``writable_dir`` and ``output_file`` check paths after parsing, through
``parser.error``; ``end_on_sigterm`` lets a terminated script run its clean-ups. The scripts
import this module as a sibling (``import argtypes``, with benchmarks/ put on sys.path), after the
checkout's root is on sys.path for ``hetero``.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from collections.abc import Callable

import torch

from hetero.config import parse_size


def _note(text: str) -> str:
    """`` (text)`` to end a message with, or nothing."""
    return f" ({text})" if text else ""


def whole(what: str, least: int = 1, why: str = "") -> Callable[[str], int]:
    """A whole number >= ``least``; refused as "'0' is not a number of {what} >= {least} ({why})"."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of {what} >= {least}{_note(why)}")
        return value
    return parse


def positive(what: str, example: str = "") -> Callable[[str], float]:
    """A finite number > 0; refused as "'0' is not {what} > 0 (e.g. {example})"."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = 0.0
        if not 0 < value < float("inf"):
            example_note = _note(f"e.g. {example}" if example else "")
            raise argparse.ArgumentTypeError(f"{text!r} is not {what} > 0{example_note}")
        return value
    return parse


def list_of(parse: Callable[[str], int], what: str) -> Callable[[str], list[int]]:
    """A comma-separated list of values >= 1 read by ``parse``; refused as "... is not a
    comma-separated list of {what}"."""
    def parse_list(text: str) -> list[int]:
        try:
            values = [parse(s) for s in text.split(",")]
        except (ValueError, OverflowError):
            values = []
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {what}")
        return values
    return parse_list


def size_bytes(example: str) -> Callable[[str], int]:
    """A size hetero.wrap accepts (hetero.config.parse_size: 4096, 64MiB, 1GB), in bytes."""
    def parse(text: str) -> int:
        try:
            return parse_size(text, "size", allow_none=False)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text!r} is not a size > 0 (e.g. {example})") from None
    return parse


def size(example: str) -> Callable[[str], str]:
    """A size hetero.wrap accepts, kept as written (it names the rows and goes to hetero.wrap)."""
    to_bytes = size_bytes(example)

    def parse(text: str) -> str:
        to_bytes(text)
        return text
    return parse


def sizes(example: str) -> Callable[[str], list[str]]:
    """A comma-separated list of sizes hetero.wrap accepts, each kept as written (stripped)."""
    def parse(text: str) -> list[str]:
        values = [s.strip() for s in text.split(",")]
        try:
            for value in values:
                parse_size(value, "size", allow_none=False)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of sizes > 0 "
                                             f"(e.g. {example})") from None
        return values
    return parse


def usable(dev: torch.device) -> bool:
    """Whether ``dev`` is the CPU or a CUDA device this machine has."""
    return dev.type == "cpu" or (dev.type == "cuda" and (dev.index or 0) < torch.cuda.device_count())


def device(text: str) -> str:
    """A device to compute on: cpu, or a CUDA device this machine has (cuda, cuda:N); kept as written."""
    try:
        dev = torch.device(text)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; expected cpu, cuda or cuda:N")
    if not usable(dev):
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} "
                                         "usable CUDA device(s)")
    return text


def make_dir(parser: argparse.ArgumentParser, option: str, path: str | None) -> None:
    """Make the directory ``path`` of ``option`` if it is missing, as hetero.wrap makes its
    nvme_path; a usage error if it cannot be made. None (the option not given) is left alone."""
    if path is None:
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        parser.error(f"argument {option}: {path!r}: {exc.strerror or exc}")


def writable_dir(parser: argparse.ArgumentParser, option: str, path: str) -> None:
    """A usage error unless ``path`` of ``option`` is an existing directory this process can write in."""
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        parser.error(f"argument {option}: {path!r} is not an existing writable directory")


def output_file(parser: argparse.ArgumentParser, option: str, path: str | None) -> None:
    """A usage error unless ``path`` of ``option`` (a file the script writes when it is done) can
    be written, checked as the hetero command checks its ``--json`` (hetero.cli.check_writable):
    before the run, whose results would otherwise be lost at its end. None (the option not
    given) is left alone."""
    from hetero.cli import check_writable
    from hetero.errors import HeteroConfigError

    try:
        check_writable(path, option)
    except HeteroConfigError as exc:
        parser.error(f"argument {option}: {str(exc).removeprefix(option + ' ')}")


def end_on_sigterm() -> None:
    """End the script on SIGTERM (``timeout``, a scheduler) as on an exception, exit status 143,
    so that its clean-ups run: the swap and scratch directories it made (bench_nvme writes a GiB
    per contender) are removed, not left behind as a kill leaves them. As the hetero command does,
    it waits for a call of hetero's own to finish, so its clean-ups find the runtime whole."""
    from hetero.interrupts import deferring

    def terminated(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():  # (held while hetero's bookkeeping runs)
        signal.signal(signal.SIGTERM, deferring(terminated))
