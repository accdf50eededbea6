"""Ctrl-C (SIGINT) inside hetero's own bookkeeping is held until the call it interrupted ends,
so the runtime is whole when KeyboardInterrupt reaches the training loop: a checkpoint saved
then is right, and training goes on (it could leave half-moved blocks: wrong weights, NaN, or
a runtime that failed every later call)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

import hetero
from hetero import runtime as runtime_mod
from helpers import budgets, loss_of, seeded_gpt
from models import batches, state_bytes




def _eager_state(data) -> dict:
    """Eager weights after training on ``data``."""
    model = seeded_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in data:
        loss_of(model(x, y)).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.parametrize("nth", [3, 40, 170, 260])
def test_sigint_inside_a_transfer_issue_leaves_the_runtime_whole(tmp_path, monkeypatch, nth: int) -> None:
    data = batches(3, seed=2)
    model = hetero.wrap(seeded_gpt(), **budgets(state_bytes(seeded_gpt()), 0.2, 0.3, tmp_path), chunk_size="8KiB")
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)
    calls = [0]
    issue = runtime_mod.Runtime._issue

    def interrupted(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == nth:
            signal.raise_signal(signal.SIGINT)  # Python's handler runs at the next bytecode: in here
        return issue(self, *args, **kwargs)

    monkeypatch.setattr(runtime_mod.Runtime, "_issue", interrupted)
    applied, hit = [], False
    for x, y in data:
        try:
            loss_of(model(x, y)).backward()
            opt.step()
        except KeyboardInterrupt:
            hit = True
            saved = model.state_dict()  # the checkpoint a Ctrl-C handler saves: the batch's step
            if _same(saved, _eager_state(applied + [(x, y)])):  # applied in full, or not at all
                applied.append((x, y))
            else:
                assert _same(saved, _eager_state(applied))
        else:
            applied.append((x, y))
        opt.zero_grad()
    assert hit, f"only {calls[0]} transfers issued"
    final = model.state_dict()
    for k, v in _eager_state(applied).items():
        torch.testing.assert_close(final[k], v, msg=lambda m: f"{k}: {m}")
    model.close()


def test_a_program_handler_chaining_ours_then_another_wrap_does_not_loop(tmp_path) -> None:
    """A program's handler set after wrap that calls the one it found (ours), then a second wrap:
    installing again made ours call the program's, which called ours, to a RecursionError."""
    import hetero.interrupts as interrupts

    first = hetero.wrap(seeded_gpt(), device="cpu")
    previous = signal.getsignal(signal.SIGINT)
    calls = []

    def program(signum, frame):
        calls.append(signum)
        return previous(signum, frame)

    signal.signal(signal.SIGINT, program)
    try:
        second = hetero.wrap(seeded_gpt(), device="cpu")
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
            for _ in range(100):  # (the handler runs at a bytecode boundary)
                pass
        assert len(calls) == 1
        second.close()
    finally:
        signal.signal(signal.SIGINT, previous)
        first.close()
    assert interrupts._previous is not None


def test_sigint_during_the_exit_clean_up_still_removes_the_swap(tmp_path, monkeypatch) -> None:
    """The swap directory's removal at interpreter exit runs from atexit, outside hetero's
    calls: a second Ctrl-C landing in it interrupted the removal and left the directory (swap
    files half deleted). Held until the clean-up is done, as inside hetero's calls."""
    from hetero import engine

    model = hetero.wrap(seeded_gpt(), **budgets(state_bytes(seeded_gpt()), 0.2, 0.3, tmp_path), chunk_size="8KiB")
    swap = model._hetero_state.runtime.storage.swap
    assert os.path.isdir(swap.dir)
    shutdown = engine.SwapIO.shutdown

    def interrupted(self, *args, **kwargs):
        signal.raise_signal(signal.SIGINT)
        return shutdown(self, *args, **kwargs)

    monkeypatch.setattr(engine.SwapIO, "shutdown", interrupted)
    with pytest.raises(KeyboardInterrupt):
        swap._finalizer()  # as atexit calls it
    assert not os.path.exists(swap.dir)
