"""Ctrl-C inside hetero's own bookkeeping, deferred to the end of the call it interrupted.

Python raises KeyboardInterrupt between any two bytecodes of the main thread. Inside the runtime
that can land half-way through moving a block (its copies, pins, slots and the transfers in
flight updated in part), and the usual ``except KeyboardInterrupt: torch.save(model.state_dict())``
then saves wrong weights, or fails. So hetero's entry points (the unit hooks, the optimizer's
and the module's methods, the runtime's) are :func:`critical`: a SIGINT that arrives inside one
is held until the outermost one returns, and raised there, with the bookkeeping whole. A call
that waits (for a transfer, an optimizer step) is interrupted when it returns.

This takes over Python's SIGINT handler from the main thread at ``wrap`` (:func:`install`),
calling the handler it found (``default_int_handler``, or the program's own) for each signal,
at once outside hetero's code. A program that sets its own handler after ``wrap`` replaces the
deferral; one that ignores SIGINT is left alone. The user's compute (a unit's forward, a loss)
is not critical: a Ctrl-C there raises at once, and hetero cleans up as for any exception.
"""

from __future__ import annotations

import functools
import signal
import threading
from typing import Any, Callable, Optional, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_MAIN = threading.main_thread().ident  # Python runs signal handlers in this thread only
_depth = 0  # critical calls open in the main thread
# a signal held until the outermost call returns: (its handler, signum, frame)
_pending: Optional[tuple[Callable[[int, Any], Any], int, Any]] = None
_previous: Optional[Callable[[int, Any], Any]] = None  # the handler install() found


def _handler(signum: int, frame: Any) -> Any:
    return deferring(_previous)(signum, frame)


def deferring(handler: Callable[[int, Any], Any]) -> Callable[[int, Any], Any]:
    """``handler`` as a signal handler that, as hetero's SIGINT deferral, waits for hetero's call
    to return (the CLI ends on SIGTERM this way, through the clean-ups that remove its swap)."""

    def run(signum: int, frame: Any) -> Any:
        global _pending
        if _depth:
            _pending = (handler, signum, frame)
            return None
        return handler(signum, frame)

    return run


def install() -> None:
    """Defer SIGINT inside hetero's calls from now on (from the main thread; elsewhere, or
    where SIGINT is ignored or kills, nothing is changed)."""
    global _previous
    if _previous is not None or threading.current_thread() is not threading.main_thread():
        return  # once per process: a handler set since may chain to ours (a loop if ours chained it)
    current = signal.getsignal(signal.SIGINT)
    if current is _handler or not callable(current):
        return
    _previous = current
    signal.signal(signal.SIGINT, _handler)


def critical(fn: F) -> F:
    """``fn`` runs whole: a SIGINT during it is raised when the outermost critical call returns
    (from its ``finally``: an exception of ``fn`` is then the KeyboardInterrupt's context)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        global _depth, _pending
        if threading.get_ident() != _MAIN:  # (a signal never interrupts another thread)
            return fn(*args, **kwargs)
        _depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _depth -= 1
            if not _depth and _pending is not None:
                (handler, *held), _pending = _pending, None
                handler(*held)

    return run  # type: ignore[return-value]
