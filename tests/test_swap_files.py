"""Lifetime and permissions of the NVMe tier's swap files.

With ``nvme_path=DIR`` the runtime makes a private ``DIR/hetero-swap-*`` directory (0700) holding its
swap files (0600) while the module lives, and removes it when the module is garbage collected, on
``close()``, after an exception in a training step once the module is freed, and at interpreter exit
(normal or by an uncaught exception). Swap never outlives the process that wrote it, but for one
killed by a signal: the next swap directory made in the same place removes what such a process
left. It never holds more than ``nvme_budget`` bytes on disk.
"""

from __future__ import annotations

import errno
import gc
import os
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hetero
from models import GPT, batches, state_bytes

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def make_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(vocab=64, d=32, n_layer=2)


def wrap_on_nvme(nvme_path, seed: int = 0) -> hetero.HeteroModule:
    """A model whose budgets (device 20%, host 30% of the training state) force swapping."""
    model = make_model(seed)
    total = state_bytes(model)
    return hetero.wrap(model, device="cpu", device_budget=int(total * 0.20), host_budget=int(total * 0.30),
                       nvme_path=str(nvme_path), nvme_budget=4 * total, chunk_size="8KiB")


def train(model: hetero.HeteroModule, opt: torch.optim.Optimizer, steps: int = 2, seed: int = 0) -> list[float]:
    """Train in a function of its own, so no loss tensor (and its graph) outlives the call."""
    losses = []
    for x, y in batches(steps, seed=seed):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    return losses


def swap_dirs(parent) -> list[Path]:
    return sorted(p for p in Path(parent).iterdir() if p.name.startswith("hetero-swap-"))


def the_swap_dir(parent) -> Path:
    dirs = swap_dirs(parent)
    assert len(dirs) == 1, f"expected one hetero-swap-* directory in {parent}, found {dirs}"
    return dirs[0]


def used_nvme(model: hetero.HeteroModule) -> None:
    rep = model.placement_report().as_dict()
    assert rep["traffic"]["host->nvme"] > 0, rep["traffic"]
    assert "nvme" in rep["tiers"]


# ------------------------------------------------------------------------------ while alive


def test_private_directory_and_file_modes(tmp_path):
    model = wrap_on_nvme(tmp_path)
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt)
    used_nvme(model)
    d = the_swap_dir(tmp_path)
    assert d.parent == tmp_path
    assert d.is_dir() and not d.is_symlink()
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert d.stat().st_uid == os.geteuid()
    files = list(d.iterdir())
    assert files, "no swap files"
    for f in files:
        st = f.lstat()
        assert stat.S_ISREG(st.st_mode), f
        assert stat.S_IMODE(st.st_mode) == 0o600, (f, oct(st.st_mode))
    # nothing else was written next to the private directory
    assert [p.name for p in tmp_path.iterdir()] == [d.name]
    model.close()


def test_nvme_path_created_if_missing(tmp_path):
    parent = tmp_path / "a" / "b"
    model = wrap_on_nvme(parent)
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, 1)
    d = the_swap_dir(parent)
    model.close()
    assert not d.exists()
    assert parent.is_dir()  # the user's directory stays; only the private one goes


def test_two_models_get_separate_directories(tmp_path):
    a = wrap_on_nvme(tmp_path, seed=0)
    b = wrap_on_nvme(tmp_path, seed=1)
    opt_a = hetero.optim.AdamW(a.parameters(), lr=1e-3)
    opt_b = hetero.optim.AdamW(b.parameters(), lr=1e-3)
    train(a, opt_a)
    train(b, opt_b)
    dirs = swap_dirs(tmp_path)
    assert len(dirs) == 2
    a.close()
    left = swap_dirs(tmp_path)
    assert len(left) == 1
    train(b, opt_b, seed=1)  # the other model's swap is intact
    used_nvme(b)
    del b, opt_b
    gc.collect()
    assert swap_dirs(tmp_path) == []


# ------------------------------------------------------------------------------ removal


def test_removed_when_module_is_garbage_collected(tmp_path):
    model = wrap_on_nvme(tmp_path)
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt)
    used_nvme(model)
    d = the_swap_dir(tmp_path)
    assert any(d.iterdir())
    del model, opt
    gc.collect()
    assert not d.exists()
    assert swap_dirs(tmp_path) == []


def open_descriptors_under(path) -> list[str]:
    """What this process's open descriptors point at under ``path`` (deleted files included)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(path)):
            found.append(target)
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_garbage_collection_closes_the_swap_files(tmp_path):
    """Removing the directory is not enough: a removed file's reserved space is only freed when
    its last descriptor is closed, so a dropped model must close its files too."""
    model = wrap_on_nvme(tmp_path)
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt)
    d = the_swap_dir(tmp_path)
    assert len(open_descriptors_under(d)) >= 1
    del model, opt
    gc.collect()
    assert not d.exists()
    assert open_descriptors_under(d) == []


def test_removed_when_wrapped_but_never_trained(tmp_path):
    model = wrap_on_nvme(tmp_path)
    d = the_swap_dir(tmp_path)
    del model
    gc.collect()
    assert not d.exists()


def test_removed_by_close(tmp_path):
    model = wrap_on_nvme(tmp_path)
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt)
    used_nvme(model)
    d = the_swap_dir(tmp_path)
    model.close()
    assert not d.exists()
    model.close()  # idempotent
    del model, opt
    gc.collect()
    assert swap_dirs(tmp_path) == []


def test_a_closed_model_refuses_further_use(tmp_path):
    """After close() the swap files are gone: forward, the optimizer's step (with gradients
    pending) and the state dicts raise HeteroStateError instead of failing on dead files or
    dropping the step in silence; the report still reads."""
    model = wrap_on_nvme(tmp_path)
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt)
    x, y = batches(1, seed=3)[0]
    model(x, y).backward()
    model.close()
    for call in (lambda: model(x, y), opt.step, model.state_dict, opt.state_dict):
        with pytest.raises(hetero.HeteroStateError, match="closed"):
            call()
    assert model.placement_report().as_dict()["steps"] == 2
    # Closed right after the first step: its updates were still postponed (close drops them), so
    # no state had a step count, and opt.state_dict() returned an empty state, silently.
    model = wrap_on_nvme(tmp_path)
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, steps=1)
    model.close()
    with pytest.raises(hetero.HeteroStateError, match="closed"):
        opt.state_dict()


class Boom(RuntimeError):
    pass


def raise_in_block(module, args):
    raise Boom("forward failed half-way")


def failing_forwards(model: hetero.HeteroModule) -> None:
    """Forwards that raise half-way: in a hook of the second block, and on bad input."""
    x, y = batches(1, seed=7)[0]
    handle = model.module.h[1].register_forward_pre_hook(raise_in_block)
    try:
        with pytest.raises(Boom):
            model(x, y)
    finally:
        handle.remove()
    with pytest.raises((IndexError, RuntimeError)):
        model(torch.full_like(x, 10_000), y)  # token ids out of the embedding's range
    bad_targets = torch.full_like(y, 10_000)
    with pytest.raises((IndexError, RuntimeError)):
        model(x, bad_targets)  # fails after every block ran


def test_removed_after_exception_in_training_step(tmp_path):
    model = wrap_on_nvme(tmp_path)
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt)
    d = the_swap_dir(tmp_path)
    failing_forwards(model)
    assert d.exists()
    del model, opt
    gc.collect()
    assert not d.exists()


def test_training_continues_after_failed_forward(tmp_path):
    """A failed forward leaves no block pinned and no state changed: training afterwards matches
    eager training that never saw the failure, under budgets that make every block move."""
    torch.manual_seed(0)
    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model = wrap_on_nvme(tmp_path)
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)

    ref_losses = train(ref, ref_opt, 2)
    losses = train(model, opt, 2)
    for _ in range(3):  # repeated failures must not accumulate pins
        failing_forwards(model)
    ref_losses += train(ref, ref_opt, 3, seed=1)
    losses += train(model, opt, 3, seed=1)
    used_nvme(model)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    sd, ref_sd = model.state_dict(), ref.state_dict()
    assert sd.keys() == ref_sd.keys()
    for k in ref_sd:
        torch.testing.assert_close(sd[k], ref_sd[k], rtol=1e-5, atol=1e-6, msg=k)
    rep = model.placement_report().as_dict()
    for name, tier in rep["tiers"].items():
        assert tier["peak"] <= tier["capacity"], name
    model.close()


def test_removed_after_exception_in_backward(tmp_path):
    model = wrap_on_nvme(tmp_path)
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, 1)
    d = the_swap_dir(tmp_path)

    def fail_backward(grad):
        raise Boom("backward failed half-way")

    x, y = batches(1)[0]
    handle = model.module.h[1].fc.weight.register_hook(fail_backward)  # after h[1]'s backward began
    try:
        loss = model(x, y)
        with pytest.raises(Boom):
            loss.backward()
        del loss
    finally:
        handle.remove()
    del model, opt
    gc.collect()
    assert not d.exists()


# ------------------------------------------------------------------------------ interpreter exit

# The head of the scripts run in subprocesses below: a model swapping to ``sys.argv[1]``, and what
# the script does, ``sys.argv[2]``, as ``mode``.
WRAPPED = textwrap.dedent("""
    import gc, os, sys
    import torch
    import hetero
    from models import GPT, batches, state_bytes

    nvme_path, mode = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = GPT(vocab=64, d=32, n_layer=2)
    total = state_bytes(model)
    model = hetero.wrap(model, device="cpu", device_budget=int(total * 0.20), host_budget=int(total * 0.30),
                        nvme_path=nvme_path, nvme_budget=4 * total, chunk_size="8KiB")
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-3)
""")


def launch(script: str, path, mode: str) -> subprocess.Popen:
    """Run ``script`` (after :data:`WRAPPED`) in a fresh interpreter, swapping to ``path``."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, "-c", WRAPPED + script, str(path), mode], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


SCRIPT = textwrap.dedent("""
    for x, y in batches(2):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert model.placement_report().as_dict()["traffic"]["host->nvme"] > 0
    (swap,) = [p for p in os.listdir(nvme_path) if p.startswith("hetero-swap-")]
    swap = os.path.join(nvme_path, swap)
    assert os.listdir(swap)
    print("SWAPDIR", swap, flush=True)
    if mode == "raise":  # an uncaught exception raised half-way through a forward
        model.module.h[1].register_forward_pre_hook(lambda m, a: 1 / 0)
        model(x, y)
    if mode in ("sigterm", "sigkill"):  # kill, timeout, a scheduler's preemption: no exit handlers
        import signal, time
        os.kill(os.getpid(), getattr(signal, mode.upper()))
        time.sleep(60)
    # mode "exit": fall off the end with model, opt and loss alive
""")


def test_removed_at_interpreter_exit(tmp_path):
    modes = {"exit": 0, "raise": 1, "sigterm": -15, "sigkill": -9}
    procs = {}
    for mode in modes:  # run concurrently: each pays for importing torch
        path = tmp_path / mode
        path.mkdir()
        procs[mode] = (path, launch(SCRIPT, path, mode))
    for mode, (path, proc) in procs.items():
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == modes[mode], f"{mode}: rc={proc.returncode}\n{out}\n{err}"
        lines = [line for line in out.splitlines() if line.startswith("SWAPDIR ")]
        assert len(lines) == 1, f"{mode}:\n{out}\n{err}"
        swap = Path(lines[0].split(" ", 1)[1])
        assert swap.parent == path
        if mode.startswith("sig"):  # killed: nothing of it ran; the next wrap there removes it
            assert swap.exists()
            model = wrap_on_nvme(path)
            assert swap_dirs(path) == [the_swap_dir(path)] != [swap]
            model.close()
        assert not swap.exists(), f"{mode}: {swap} survived interpreter exit"
        assert list(path.iterdir()) == [], f"{mode}: left {list(path.iterdir())}"
        if mode == "raise":
            assert "ZeroDivisionError" in err


def test_a_swap_directory_whose_owner_holds_its_lock_is_never_taken(tmp_path):
    """A process in another PID namespace on this host (a container sharing the directory) has
    ids of its own: its directory's mark can name a process id that is dead here. Such a
    directory is left alone while its owner holds the lock on the mark; one whose lock nobody
    holds is removed (found in review: a wrap deleted a live container's swap directory)."""
    import fcntl
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(child.stdout)  # (exited: no process of this namespace has that id now)
    mark = f"{socket.gethostname()} {dead}\n"
    locked, stale = tmp_path / "hetero-swap-other-namespace", tmp_path / "hetero-swap-stale"
    for d in (locked, stale):
        d.mkdir()
        (d / "owner").write_text(mark)
    fd = os.open(locked / "owner", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        model = wrap_on_nvme(tmp_path)
        assert locked.exists() and not stale.exists()
        model.close()
    finally:
        os.close(fd)
    wrap_on_nvme(tmp_path).close()  # (now nobody holds it)
    assert not locked.exists()


def test_a_file_system_without_locks_falls_back_on_the_process_id(tmp_path, monkeypatch):
    """Where flock is unsupported (ENOLCK, EOPNOTSUPP: some FUSE or cluster file systems) the
    NVMe tier still works, and the process id alone tells an orphan; any other failure to take
    the lock reads as held (found in review: NFS refuses a lock on a file opened read-only, and
    that was taken for "nobody holds it")."""
    import errno
    import fcntl

    from hetero import tiers

    owner = tmp_path / "owner"
    owner.write_text("x 1\n")
    for code, held in ((errno.ENOLCK, False), (errno.EOPNOTSUPP, False), (errno.EBADF, True), (errno.EIO, True)):
        def refuse(fd, op, code=code):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(fcntl, "flock", refuse)
        assert tiers._locked(str(owner)) is held, code
    monkeypatch.setattr(fcntl, "flock", lambda fd, op: (_ for _ in ()).throw(OSError(errno.ENOLCK, "no locks")))
    model = wrap_on_nvme(tmp_path / "nolocks")  # (no lock taken: works all the same)
    model.close()


def test_a_live_or_foreign_swap_directory_is_never_taken(tmp_path):
    """What a new swap directory's cleanup leaves alone: one of a live process (here another
    model of this one), one whose owner was on another host (a shared file system), and
    anything without an owner mark."""
    first = wrap_on_nvme(tmp_path)
    live = the_swap_dir(tmp_path)
    foreign = tmp_path / "hetero-swap-foreign"
    foreign.mkdir()
    (foreign / "owner").write_text("some-other-host 1\n")
    unmarked = tmp_path / "hetero-swap-unmarked"
    unmarked.mkdir()
    second = wrap_on_nvme(tmp_path)
    assert live.exists() and foreign.exists() and unmarked.exists() and len(swap_dirs(tmp_path)) == 4
    first.close()
    second.close()


def test_a_forked_child_leaves_its_parents_swap_alone(tmp_path):
    """A child forked from the process (a data loader's worker) inherits the exit handler that
    removes the swap directory; run in the child, it must not remove the parent's."""
    model = wrap_on_nvme(tmp_path)
    d = the_swap_dir(tmp_path)
    remove = model._hetero_state.runtime.storage.swap._finalizer
    pid = os.fork()
    if pid == 0:  # the child: what its exit would run
        try:
            remove()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert d.exists()
    model.close()
    assert not d.exists()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() here")
def test_a_forked_child_does_not_hold_its_parents_swap_lock(tmp_path):
    """The owner file's lock lives while any descriptor of it is open: a forked child (a data
    loader's worker) that inherited one kept a parent killed by a signal looking alive, so its
    swap directory was never removed as orphaned while the child lived. The child closes its
    copies at once."""
    from hetero import tiers

    model = wrap_on_nvme(tmp_path)
    owner = str(the_swap_dir(tmp_path) / tiers.OWNER_FILE)
    assert tiers._locked(owner)
    ready, go = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: lives on while the parent lets go of its lock
        os.write(ready[1], b"x")  # (its fork handlers ran)
        os.read(go[0], 1)
        os._exit(0)
    try:
        assert os.read(ready[0], 1) == b"x"
        (lock,) = [fd for fd in tiers._owner_locks if os.fstat(fd).st_ino == os.stat(owner).st_ino]
        spare = os.open(owner, os.O_RDONLY)  # (unlocked: for close() to close in the lock's place)
        os.close(lock)  # (as the parent's death would)
        assert not tiers._locked(owner)
        os.dup2(spare, lock)
        os.close(spare)
    finally:
        os.write(go[1], b"x")
        os.waitpid(pid, 0)
        for fd in ready + go:
            os.close(fd)
    model.close()
    assert lock not in tiers._owner_locks


@pytest.mark.parametrize("budget_slots", [1.5, 4.25, 9.75, 0.5])
def test_swap_files_never_exceed_the_nvme_budget(tmp_path, budget_slots):
    """``nvme_budget`` caps the bytes on disk too: the files hold whole slots within it (and a
    budget under one slot makes no file), yet training with blocks swapped out still works."""
    model = make_model()
    total = state_bytes(model)
    slot = 8 << 10
    budget = int(budget_slots * slot)
    wrapped = hetero.wrap(model, device="cpu", device_budget=int(total * 0.6), host_budget=int(total * 0.9),
                          nvme_path=str(tmp_path), nvme_budget=budget, chunk_size="8KiB")
    opt = hetero.optim.AdamW(wrapped.parameters(), lr=1e-3)
    d = the_swap_dir(tmp_path)
    files = sorted(d.glob("swap-*.bin"))
    assert sum(f.stat().st_size for f in files) <= budget
    assert sum(f.stat().st_size for f in files) == int(budget_slots) * slot
    train(wrapped, opt)
    assert wrapped.placement_report().as_dict()["tiers"]["nvme"]["peak"] <= budget
    wrapped.close()


def test_the_tuning_probe_stays_within_the_nvme_budget(tmp_path, monkeypatch):
    """The first wrap on a file system probes the disk inside the swap directory: the probe's
    file (64 MiB by default) must fit what the swap files will hold, so ``nvme_budget`` caps the
    bytes on disk during wrap too. Here that is 1 MiB: too little to probe, so none runs."""
    from hetero import engine

    if not engine.has_extension():
        pytest.skip("only the native backends are tuned")
    monkeypatch.setenv("HETERO_IO_TUNING_CACHE", str(tmp_path / "fresh" / "io_tuning.json"))
    for name in ("HETERO_IO_BLOCK_SIZE", "HETERO_IO_QUEUE_DEPTH", "HETERO_IO_AUTOTUNE",
                 "HETERO_IO_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(engine, "_tune_memo", {})
    probed = []

    def probe(directory, **kwargs):
        probed.append(kwargs)
        return engine.Tuning(256 << 10, 12, "probe", 1.0, 1.0)

    monkeypatch.setattr(engine, "probe", probe)
    model = make_model()
    total = state_bytes(model)
    wrapped = hetero.wrap(model, device="cpu", device_budget=int(total * 0.3),
                          host_budget=int(total * 0.3), nvme_path=str(tmp_path / "swap"),
                          nvme_budget="1MiB", chunk_size="8KiB")
    swap = wrapped._hetero_state.runtime.storage.swap
    assert probed == [] and swap.io.tuning.source == "default"
    wrapped.close()


@pytest.mark.parametrize("name, value", [
    ("HETERO_IO_BACKEND", "uring"), ("HETERO_IO_BLOCK_SIZE", "1000"),
    ("HETERO_IO_BLOCK_SIZE", "garbage"), ("HETERO_IO_QUEUE_DEPTH", "0"),
    ("HETERO_IO_CHECKSUM", "yes please"), ("HETERO_IO_AUTOTUNE", "maybe"),
])
def test_a_bad_io_environment_value_is_a_config_error_from_wrap(tmp_path, monkeypatch, name, value):
    """wrap refuses an invalid HETERO_IO_* value with a HeteroConfigError naming it, before
    anything moves; without an NVMe tier the variables are not used, so not checked."""
    monkeypatch.setenv(name, value)
    model = make_model()
    total = state_bytes(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kwargs = dict(device="cpu", device_budget=int(total * 0.3), host_budget=int(total * 0.3),
                  chunk_size="8KiB")
    with pytest.raises(hetero.HeteroConfigError,
                       match=f"environment variable {name}={value!r} is not accepted; expected"):
        hetero.wrap(model, nvme_path=str(tmp_path / "swap"), nvme_budget=4 * total, **kwargs)
    assert not (tmp_path / "swap").exists()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    wrapped = hetero.wrap(model, device="cpu", device_budget=total, host_budget=total,
                          chunk_size="8KiB")
    wrapped.close()


def test_a_wrap_the_disk_cannot_hold_gives_its_space_back(tmp_path):
    """Swap files are reserved at wrap; where the disk runs out at the second file, the first is
    closed and removed too (its space free at once, not when the process ends), so a retry
    with a budget that fits works."""
    import shutil

    from test_engine import small_filesystem

    with small_filesystem(tmp_path / "fs", "1m") as fs:
        model = make_model()
        total = state_bytes(model)
        kwargs = dict(device="cpu", device_budget=int(total * 0.5), host_budget=int(total * 0.6),
                      nvme_path=str(fs / "swap"), chunk_size="8KiB")
        with pytest.raises(hetero.HeteroIOError, match="nvme_budget: .* reserves .* bytes free") as err:
            hetero.wrap(model, nvme_budget=3 << 20, **kwargs)  # (it named a swap file alone)
        assert err.value.errno == errno.ENOSPC
        assert shutil.disk_usage(fs).used < 64 << 10
        assert swap_dirs(fs / "swap") == []
        wrapped = hetero.wrap(model, nvme_budget=600 << 10, **kwargs)
        opt = hetero.optim.AdamW(wrapped.parameters(), lr=1e-3)
        train(wrapped, opt)
        wrapped.close()


FORK_SCRIPT = textwrap.dedent("""
    data = batches(3)

    def step(x, y):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()

    step(*data[0])
    pid = os.fork()
    if pid == 0:  # the child leaves through the interpreter's exit: handlers and finalizers run
        if mode == "use":
            try:
                step(*data[1])
            except hetero.HeteroStateError as exc:
                assert "forked" in str(exc), exc
            else:
                sys.exit(3)
        elif mode == "drop":
            del model, opt
            gc.collect()
        elif mode == "close":
            model.close()
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    print("CHILD", os.waitstatus_to_exitcode(status), flush=True)
    step(*data[1])  # the parent trains on, its swap intact
    print("PARENT OK", flush=True)
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() here")
def test_a_forked_child_exits_cleanly_and_cannot_use_the_parents_model(tmp_path):
    """The engines' threads exist only in the parent: a child forked from it (exiting normally,
    so that its finalizers run) crashed or hung joining them, and a forward there hung. Now
    the child exits at once, its use of the model raises, and the parent goes on."""
    procs = {}
    for action in ("exit", "drop", "close", "use"):
        path = tmp_path / action
        path.mkdir()
        procs[action] = (path, launch(FORK_SCRIPT, path, action))
    for action, (path, proc) in procs.items():
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"{action}: hung\n{out}\n{err}")
        assert proc.returncode == 0 and "CHILD 0" in out and "PARENT OK" in out, f"{action}:\n{out}\n{err}"
        assert not swap_dirs(path), f"{action}: the parent's swap was left behind"


def test_close_gives_back_memory_and_descriptors_while_the_model_is_referenced(tmp_path):
    """close() removed the swap files only: a closed model kept (a sweep's results list, or the
    old model while the next one is wrapped) held its host arena, device buffers and swap engine
    (an io_uring and an eventfd each) until garbage collected."""
    import weakref

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def dead_finalizers() -> int:  # (kept alive by atexit's list after they ran)
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, weakref.finalize) and not o.alive)

    torch.manual_seed(0)
    total = state_bytes(GPT(vocab=64, d=32, n_layer=2))
    closed = []
    before = fds()
    for i in range(3):
        model = hetero.wrap(GPT(vocab=64, d=32, n_layer=2), device="cpu", device_budget=int(total * 0.3),
                            host_budget=int(total * 0.3), nvme_path=str(tmp_path / str(i)), chunk_size="8KiB")
        opt = hetero.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = batches(1)[0]
        model(x, y).backward()
        opt.step()
        model.close()
        closed.append(model)
        st = model._hetero_state
        assert st.runtime.storage.arena.buffer.numel() == 0
        assert all(b.device is None for b in st.runtime.blocks())
        assert all(p.isnan().all() for p in model.parameters())
    assert fds() == before
    del model, opt, st, closed
    dead = dead_finalizers()
    for i in range(3):  # dropped without close(): nothing stays registered at exit either
        hetero.wrap(GPT(vocab=64, d=32, n_layer=2), device="cpu", device_budget=int(total * 0.3),
                    host_budget=int(total * 0.3), nvme_path=str(tmp_path / f"d{i}"), chunk_size="8KiB")
        gc.collect()
    assert fds() == before and dead_finalizers() == dead
