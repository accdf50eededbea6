"""Host <-> device copies off the compute thread (interim pure-Python engine).

``CopyEngine().copy(dst, src, after_stream=None) -> CopyHandle`` queues ``dst.copy_(src)`` on a
worker thread (torch releases the GIL inside ``copy_``) and returns at once; ``CopyHandle.wait()``
blocks until it is done, ``done()`` polls.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch


class CopyHandle:
    __slots__ = ("_future",)

    def __init__(self, future: Future) -> None:
        self._future = future

    def wait(self) -> None:
        self._future.result()

    def done(self) -> bool:
        return self._future.done()


class CopyEngine:
    backend = "python"

    def __init__(self, num_threads: int = 2) -> None:
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="hetero-copy")

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, after_stream: int | None = None) -> CopyHandle:
        if dst.nbytes != src.nbytes or dst.dtype != src.dtype:
            raise ValueError("copy: dst and src need the same dtype and size")
        return CopyHandle(self._pool.submit(_copy, dst, src))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    with torch.no_grad():
        dst.copy_(src)
