"""The optimizer's queue of deferred host updates: :func:`~hetero.optim.kernel.adam_step_` calls
run later, in the order submitted, on a thread of its own that never takes the GIL
(``csrc/adam_queue.h``).

Why not a Python thread: the optimizer defers a host chunk's update so that ``step()`` returns at
once and the next forward waits only for the chunks it uses (:meth:`hetero.runtime.Runtime.defer`).
A Python thread starts each update only when the training loop's Python code lets go of the GIL,
up to the interpreter's switch interval (5 ms) every time, and on small and medium chunks that
delay, not the arithmetic, is what the forward waited for.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Optional

import torch

from hetero.native import _C as _ext

from ..transfers import Job
from .kernel import _kernel_applies, adam_step_, native_args

Call = tuple[tuple[torch.Tensor, ...], dict[str, Any]]  # (args, kwargs) of adam_step_


class AdamQueue:
    """Runs :func:`~hetero.optim.kernel.adam_step_` calls later, in the order submitted, on the
    C++ queue's thread (started on first use). A job some call of which the C++ kernel cannot
    run (no extension; a parameter that is not fp32) runs at once in the caller's thread
    instead: same results, no overlap."""

    def __init__(self) -> None:
        self._queue: Optional[Any] = None
        _LIVE.add(self)

    def submit(self, calls: list[Call]) -> Job:
        """Queue ``calls`` as one job and return its handle. Their arguments are checked now
        (errors raise here, as do those of a job run at once); the default ``threads`` is this
        thread's torch thread count, not the queue thread's. The handle keeps the tensors alive
        until the job ran."""
        if not all(_kernel_applies(list(args), args[1], kw.get("param_out")) for args, kw in calls):
            with torch.no_grad():
                for args, kw in calls:
                    adam_step_(*args, **kw)
            return _DONE
        return _Queued(self._native().submit([native_args(*args, **kw) for args, kw in calls]), calls)

    def _set_test_hook(self, delay: float, fail_call: int = 0) -> None:
        """Tests only: every queued call from now on first sleeps ``delay`` seconds, and the
        ``fail_call``-th (1-based; 0: none) raises RuntimeError("injected kernel failure")."""
        self._native().set_test_hook(float(delay), int(fail_call))

    @property
    def calls(self) -> int:
        """Calls the current thread has started."""
        return 0 if self._queue is None else int(self._queue.calls)

    def shutdown(self) -> None:
        """Let the queued jobs run, then stop the thread (a later submit starts a new one)."""
        if self._queue is not None:
            self._queue.shutdown()
            self._queue = None

    def _native(self) -> Any:
        if self._queue is None:
            self._queue = _ext.AdamQueue()
        return self._queue

    def _forget_after_fork(self) -> None:
        """In a forked child the queue's thread does not exist: the next submit starts one
        (the inherited object, left unreferenced, knows it is in a child and does not join)."""
        self._queue = None


_LIVE: "weakref.WeakSet[AdamQueue]" = weakref.WeakSet()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: [q._forget_after_fork() for q in list(_LIVE)])


class _Queued:
    """A queued job and the tensors its calls point into, kept alive until it ran: a handle
    dropped early waits for it (it never needs the GIL, so that cannot deadlock). In a child
    forked while it was queued the job never runs: waiting there raises."""

    __slots__ = ("_job", "_calls", "_pid")

    def __init__(self, job: Any, calls: list[Call]) -> None:
        self._job, self._calls, self._pid = job, calls, os.getpid()

    def done(self) -> bool:
        return self._job.done()

    def wait(self) -> None:
        if os.getpid() != self._pid and not self._job.done():
            raise RuntimeError("an optimizer update queued before fork() never runs in the child")
        self._job.wait()

    def __del__(self) -> None:
        try:
            self.wait()
        except Exception:  # reported by wait() to whoever kept the handle
            pass


class _Done:
    """The handle of a job that already ran."""

    __slots__ = ()

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        pass


_DONE = _Done()
