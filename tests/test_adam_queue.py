"""The optimizer's queue of deferred host updates (csrc/adam_queue.h via hetero.optim.queue.AdamQueue):
the same bits as calling the kernel, in order, errors at every wait, arguments checked at submit,
tensors kept alive by the handle, a thread that never needs the GIL, and a forked child."""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
import weakref

import pytest
import torch

from hetero.optim import kernel as K
from hetero.optim.queue import AdamQueue

pytestmark = pytest.mark.skipif(not K.has_kernel(), reason="hetero._C built without the CPU Adam kernel")

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True)


def state(n: int, seed: int, grad_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    p, m, v = (torch.randn(n, generator=g) for _ in range(3))
    return p, torch.randn(n, generator=g).to(grad_dtype), m, v.abs()


def calls_over(tensors, steps: int, **extra):
    """One call per step over the same tensors (each reads what the one before wrote)."""
    return [(tensors, dict(HYPER, step=s, **extra)) for s in range(1, steps + 1)]


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_queued_jobs_equal_the_kernel_in_order(grad_dtype) -> None:
    """Jobs over the same tensors run in submission order, each as adam_step_ would."""
    q = AdamQueue()
    mine, ref = state(70001, 0, grad_dtype), state(70001, 0, grad_dtype)
    out = torch.empty(70001, dtype=torch.bfloat16) if grad_dtype != torch.float32 else None
    ref_out = None if out is None else out.clone()
    sqrts = ("torch", "ieee", "torch")
    jobs = [q.submit(calls_over(mine, 2, grad_scale=0.5, param_out=out, sqrt=sqrt)) for sqrt in sqrts]
    for sqrt in sqrts:
        for args, kw in calls_over(ref, 2, grad_scale=0.5, param_out=ref_out, sqrt=sqrt):
            K.adam_step_(*args, **kw)
    for job in jobs:
        job.wait()
        assert job.done()
    for a, b in zip(mine, ref):
        assert torch.equal(a, b)
    if out is not None:
        assert torch.equal(out, ref_out)
    q.shutdown()


def test_bad_arguments_raise_at_submit_and_queue_nothing() -> None:
    q = AdamQueue()
    p, g, m, v = state(64, 1)
    before = p.clone()
    with pytest.raises(ValueError, match="step"):
        q.submit([((p, g, m, v), dict(HYPER, step=0))])
    with pytest.raises(ValueError, match="sqrt"):
        q.submit([((p, g, m, v), dict(HYPER, step=1, sqrt="fast"))])
    with pytest.raises((ValueError, TypeError)):
        q.submit([((p, g, m[:10], v), dict(HYPER, step=1))])
    q.submit([((p, g, m, v), dict(HYPER, step=1))]).wait()  # the queue still works
    assert not torch.equal(p, before)
    assert q.calls == 1


def test_a_failed_job_raises_at_every_wait_and_later_jobs_still_run() -> None:
    q = AdamQueue()
    q._set_test_hook(0.0, fail_call=2)
    a, b = state(256, 2), state(256, 3)
    b_before = [t.clone() for t in b]
    first = q.submit(calls_over(a, 1))
    failed = q.submit(calls_over(b, 1))  # call 2: fails before touching b
    after = q.submit(calls_over(b, 1))
    first.wait()
    for _ in range(2):
        with pytest.raises(RuntimeError, match="injected kernel failure"):
            failed.wait()
    after.wait()
    ref = [t.clone() for t in b_before]
    K.adam_step_(*ref, **calls_over(None, 1)[0][1])
    for x, y in zip(b, ref):
        assert torch.equal(x, y)
    assert q.calls == 3


def test_shutdown_runs_what_is_queued_and_a_later_submit_starts_afresh() -> None:
    q = AdamQueue()
    q._set_test_hook(0.01, 0)
    t = state(128, 4)
    jobs = [q.submit(calls_over(t, 1)) for _ in range(5)]
    q.shutdown()
    assert all(j.done() for j in jobs)
    q.submit(calls_over(t, 1)).wait()  # a new thread, without the old one's test hook
    assert q.calls == 1


def test_a_handle_dropped_early_keeps_its_tensors_until_the_job_ran() -> None:
    """The C++ job holds raw pointers: the handle owns the tensors, and dropping it waits."""
    q = AdamQueue()
    q._set_test_hook(0.05, 0)
    p, g, m, v = state(4096, 5)
    ref = [t.clone() for t in (p, g, m, v)]
    K.adam_step_(*ref, **dict(HYPER, step=1))
    gone = weakref.ref(g)
    t0 = time.perf_counter()
    job = q.submit([((p, g, m, v), dict(HYPER, step=1))])
    del g, m, v
    gc.collect()
    assert gone() is not None  # the handle holds the gradient the job reads
    del job
    gc.collect()
    assert time.perf_counter() - t0 >= 0.05  # the drop waited for the (slowed) job
    assert gone() is None
    assert torch.equal(p, ref[0])


def test_the_queue_runs_while_python_holds_the_gil() -> None:
    """A Python worker thread would wait for the interpreter's switch interval (here 5 s) before
    it could start; the C++ thread finishes while this thread spins in Python."""
    q = AdamQueue()
    t = state(1 << 16, 6)
    old = sys.getswitchinterval()
    sys.setswitchinterval(5.0)
    try:
        job = q.submit(calls_over(t, 3))
        t0 = time.perf_counter()
        while not job.done() and time.perf_counter() - t0 < 2.0:
            pass
        took = time.perf_counter() - t0
    finally:
        sys.setswitchinterval(old)
    job.wait()
    assert took < 1.0, f"the queued job took {took:.3f} s while Python held the GIL"


def test_a_job_the_kernel_cannot_run_runs_at_once() -> None:
    """A float64 parameter: the torch-ops path, in the caller's thread, same results as the
    kernel function; its errors raise at submit, like a queued job's argument errors."""
    q = AdamQueue()
    p, g, m, v = (t.double() for t in state(100, 7))
    ref = [t.clone() for t in (p, g, m, v)]
    job = q.submit([((p, g, m, v), dict(HYPER, step=1))])
    assert job.done()
    job.wait()
    K.adam_step_(*ref, **dict(HYPER, step=1))
    assert torch.equal(p, ref[0])
    with pytest.raises(ValueError, match="step"):
        q.submit([((p, g, m, v), dict(HYPER, step=0))])


def child_status(pid: int, timeout: float = 20.0) -> int:
    """The forked child's exit status; a child still running after ``timeout`` (hung) is killed."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    return os.waitpid(pid, 0)[1]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() here")
@pytest.mark.parametrize("busy", [True, False], ids=["job_queued", "idle"])
def test_a_forked_child_gets_a_queue_of_its_own(busy) -> None:
    """A child forked from a process with a queue (a DataLoader worker, say) does not inherit
    the queue's thread: its next submit starts one, and a job queued before the fork raises
    instead of hanging. Forked while the thread waits for work (found in review), destroying
    the inherited queue must not block on the thread's condition variable."""
    q = AdamQueue()
    t = state(256, 8)
    if busy:
        q._set_test_hook(0.5, 0)
        queued = q.submit(calls_over(t, 1))
    else:
        q.submit(calls_over(t, 1)).wait()
        time.sleep(0.05)  # the thread is back to waiting for work
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        code = 1
        try:
            if busy:
                try:
                    queued.wait()
                except RuntimeError:
                    code = 3
            mine = state(256, 9)
            q.submit(calls_over(mine, 1)).wait()
            code = 0 if q.calls == 1 and code == (3 if busy else 1) else 2
        finally:
            os._exit(code)
    status = child_status(pid)
    if busy:
        queued.wait()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
