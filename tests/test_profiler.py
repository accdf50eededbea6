"""The profiler's outputs: the report's schema, the Chrome/Perfetto trace (compute units, stalls,
moves, tier counters), the PNG plot (usage, moves, stalls) and ``hetero profile``, which writes
all of them for a bundled model."""

from __future__ import annotations

import json
import pickle
import re
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import hetero
from hetero import cli
from helpers import seeded_gpt, tight_budgets
from models import GPT, batches, state_bytes

STEPS = 3


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> hetero.Report:
    """Three steps of a GPT with activation checkpointing whose budgets force NVMe swapping, with
    a slowed copy engine so that compute waits (stalls) for some blocks."""
    torch.manual_seed(0)
    model = GPT(checkpointing=True)
    total = state_bytes(model)
    wrapped = hetero.wrap(model, device="cpu", chunk_size="8KiB", device_budget=int(total * 0.2),
                          host_budget=int(total * 0.3), nvme_path=str(tmp_path_factory.mktemp("swap")))
    opt = hetero.optim.AdamW(wrapped.parameters(), lr=1e-3)
    for x, y in batches(STEPS):
        wrapped(x, y).backward()
        opt.step()
        opt.zero_grad()
    rep = wrapped.placement_report()
    wrapped.close()
    assert rep.stalls and rep.moves, "the budgets should make compute wait for some blocks"
    return rep


def test_as_dict_follows_the_schema(report) -> None:
    d = report.as_dict()
    json.dumps(d)
    assert isinstance(d["policy"], str) and d["steps"] == STEPS
    assert isinstance(d["stall_seconds"], float)
    assert set(d["tiers"]) == {"device", "host", "nvme"}
    for t in d["tiers"].values():
        assert all(isinstance(t[k], int) for k in ("capacity", "used", "peak"))
    assert set(d["traffic"]) == {"host->device", "device->host", "nvme->host", "host->nvme"}
    kinds = {"param", "grad", "master", "exp_avg", "exp_avg_sq"}
    for b in d["blocks"]:
        assert isinstance(b["id"], str) and b["kind"] in kinds and isinstance(b["bytes"], int)
        assert isinstance(b["tier"], str) and isinstance(b["hotness"], float)


def test_each_block_s_recency_and_reuse_distance_come_from_the_access_log(report) -> None:
    """Per block (beyond API.md): the seq of its last access and the accesses between two of its
    uses in a row, smoothed (half the last distance, half the earlier ones), from the log."""
    seqs: dict[str, list[int]] = {}
    for a in report.accesses:
        seqs.setdefault(a.block, []).append(a.seq)
    blocks = report.as_dict()["blocks"]
    assert any(b["reuse_distance"] is not None for b in blocks)
    for b in blocks:
        mine = seqs.get(b["id"], [])
        assert b["last_access"] == (mine[-1] if mine else -1)
        smoothed = None
        for d in (y - x for x, y in zip(mine, mine[1:])):
            smoothed = d if smoothed is None else 0.5 * smoothed + 0.5 * d
        assert b["reuse_distance"] == smoothed, b["id"]


def test_stall_seconds_is_a_float_before_any_stall() -> None:
    wrapped = hetero.wrap(torch.nn.Linear(4, 4), device="cpu")
    d = wrapped.placement_report().as_dict()
    assert d["stall_seconds"] == 0.0 and isinstance(d["stall_seconds"], float)


def test_the_trace_has_compute_units_stalls_moves_and_tier_counters(report, tmp_path) -> None:
    path = tmp_path / "trace.json"
    report.to_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    assert isinstance(events, list)
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["ts"] >= 0 and e["dur"] > 0 for e in spans)
    by_cat = {c: [e for e in spans if e["cat"] == c] for c in ("compute", "stall", "move")}
    assert len(by_cat["stall"]) == len(report.stalls) > 0
    assert len(by_cat["move"]) == len(report.moves) > 0
    assert {e["args"]["direction"] for e in by_cat["move"]} >= {"host->device", "nvme->host", "host->nvme"}
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert counters == {"device bytes", "host bytes", "nvme bytes"}

    compute = by_cat["compute"]
    phases: dict[str, list[dict]] = {}
    for e in compute:
        phases.setdefault(e["args"]["phase"], []).append(e)
    units = {e["args"]["unit"] for e in phases["forward"]}
    assert {"h.0", "h.1"} <= units and "" in units  # the blocks and the root
    for phase in ("forward", "backward"):  # each unit, once per step
        assert sorted(e["args"]["unit"] for e in phases[phase]) == sorted(list(units) * STEPS)
    blocks = [u for u in units if u.startswith("h.")]  # checkpointing re-runs each block's forward
    assert sorted(e["args"]["unit"] for e in phases["recompute"]) == sorted(blocks * STEPS)
    assert [e["args"]["unit"] for e in phases["step"]] == ["optimizer"] * STEPS
    roots = [e for e in phases["forward"] if e["args"]["unit"] == ""]
    for e in phases["forward"]:  # nested as the units are: inside its step's root forward
        assert any(r["ts"] <= e["ts"] and e["ts"] + e["dur"] <= r["ts"] + r["dur"] + 1e-3 for r in roots)
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in compute)  # one track: nested or apart
    for i, (s1, e1) in enumerate(spans):
        for s2, e2 in spans[i + 1:]:
            assert s2 >= e1 - 1e-3 or e2 <= e1 + 1e-3, f"spans {s1}-{e1} and {s2}-{e2} overlap"
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"compute", "stalls", "host->device"} <= names
    moves: dict[int, list[tuple[float, float]]] = {}  # concurrent transfers: on tracks of their own
    for e in by_cat["move"]:
        moves.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    assert len(moves) > 4  # (some overlapped)
    for track in moves.values():
        track.sort()
        assert all(s2 >= e1 - 1e-3 for (_, e1), (s2, _) in zip(track, track[1:]))


def test_the_plot_is_written_where_asked_as_a_png(report, tmp_path) -> None:
    """Whatever the suffix (matplotlib followed it: a JPEG, a PDF, or 'name' + '.png'), and
    without changing the program's matplotlib backend; a directory raises as for the trace."""
    import matplotlib

    backend = matplotlib.get_backend()
    for name in ("placement", "placement.pdf"):
        report.plot(str(tmp_path / name))
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["placement", "placement.pdf"]
    with pytest.raises(IsADirectoryError):
        report.plot(str(tmp_path))
    assert matplotlib.get_backend() == backend


def test_the_plot_is_a_png_with_the_stalls_marked(report, tmp_path) -> None:
    import matplotlib.image

    path = tmp_path / "placement.png"
    report.plot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(str(path))
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    red = np.array([0.839, 0.153, 0.157])  # tab:red, the stalls' colour
    assert (np.abs(img[..., :3] - red).max(axis=-1) < 0.05).sum() > 50


def test_the_plot_draws_only_budgets_within_its_axis_and_names_every_budget(report, tmp_path, monkeypatch) -> None:
    """The axis ends at 1.5x the peak: a budget far above it (NVMe's, a CPU device's) was a
    legend entry with no line; every tier's label now says its budget."""
    from matplotlib.figure import Figure

    drawn = {}
    monkeypatch.setattr(Figure, "savefig", lambda fig, f, **kw: drawn.update(fig=fig))
    report.plot(str(tmp_path / "p.png"))
    ax = drawn["fig"].axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    top = ax.get_ylim()[1]
    for name, tier in report.as_dict()["tiers"].items():
        assert any(label.startswith(f"{name} used (budget ") for label in labels), labels
        assert (f"{name} budget" in labels) == (tier["capacity"] / 2**20 <= top), (name, labels)


def test_hetero_profile_writes_report_trace_plot_and_access_log(tmp_path, capsys) -> None:
    out = tmp_path / "prof"
    rc = cli.main(["profile", "--model", "tiny", "--steps", "2", "--batch-size", "2", "--chunk-size", "64KiB",
                   "--nvme-path", str(tmp_path / "swap"), "--out", str(out), "--no-progress"])
    assert rc == 0
    files = {p.name for p in out.iterdir()}
    assert files == {"report.json", "trace.json", "placement.png", "access_log.jsonl"}
    rep = json.loads((out / "report.json").read_text())
    assert rep["steps"] == 2 and "nvme" in rep["tiers"] and rep["traffic"]["host->nvme"] > 0
    trace = json.loads((out / "trace.json").read_text())
    assert any(e.get("cat") == "compute" for e in trace["traceEvents"])
    assert (out / "placement.png").read_bytes()[:4] == b"\x89PNG"
    lines = [json.loads(line) for line in (out / "access_log.jsonl").read_text().splitlines()]
    assert [a["seq"] for a in lines] == list(range(len(lines))) and lines
    assert set(lines[0]) >= {"step", "seq", "block", "bytes", "tier"}
    assert "wrote" in capsys.readouterr().out
    assert not list(Path(tmp_path / "swap").glob("hetero-swap-*"))  # the run's swap is gone


@pytest.mark.parametrize("argv", [["train", "--steps", "0"], ["profile", "--batch-size", "-1"],
                                  ["train", "--steps", "-3"], ["train", "--device", "tpu"],
                                  ["train", "--json", "/nonexistent-dir/x.json"],
                                  ["plan", "--json", "/nonexistent-dir/x.json"],
                                  ["profile", "--out", __file__ + "/out"],  # (under a file)
                                  ["profile", "--out", ""],
                                  ["train", "--json", "/"],
                                  ["train", "--json", "x" * 300 + ".json"],  # (a name too long:
                                  ["plan", "--json", "x" * 300 + ".json"],  # found by trying it)
                                  ["profile", "--out", "a/" + "x" * 300],
                                  ["profile", "--steps", "0", "--out", "a/b"]])
def test_the_cli_refuses_bad_arguments_before_running(argv, capsys, tmp_path, monkeypatch) -> None:
    """One line naming the argument, exit code 2, before any training (so an unwritable --json
    does not waste the run), leaving no output directory behind (profile makes its own, and its
    parents, before the run, and removes them when the run is refused)."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "HeteroConfigError" in err and "Traceback" not in err
    assert argv[1].lstrip("-").replace("-", "_") in err.replace("-", "_")
    assert list(tmp_path.iterdir()) == []  # (profile's default --out included)


def test_profile_refuses_an_output_file_it_could_not_write_before_running(tmp_path, capsys) -> None:
    """A directory where trace.json goes failed after the run, with a traceback and half the
    output written."""
    (tmp_path / "trace.json").mkdir()
    assert cli.main(["profile", "--model", "tiny", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "trace.json" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]


@pytest.mark.parametrize("argv, option", [(["train", "--seed", str(2 ** 70)], "--seed"),
                                          (["train", "--no-nvme", "--nvme-path", "x"], "--nvme-path"),
                                          (["plan", "--nvme-path", "x", "--no-nvme"], "--no-nvme"),
                                          (["profile", "--lr", "-1"], "--lr"), (["train", "--lr", "nan"], "--lr")])
def test_the_cli_refuses_arguments_argparse_checks(argv, option, capsys) -> None:
    """A seed torch cannot take (it was a traceback), --no-nvme with --nvme-path (the path was
    ignored in silence), and a learning rate AdamW refuses (refused only after the model was
    built, wrapped and its swap files reserved)."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert option in err and "Traceback" not in err


def test_a_terminated_run_removes_its_temporary_swap(tmp_path) -> None:
    """SIGTERM (timeout, a scheduler) ends the CLI as Ctrl-C does, through the clean-ups: its
    temporary swap directory (2x the state of the model) was left behind."""
    import signal
    import subprocess
    import sys
    import time

    env = dict(os.environ, TMPDIR=str(tmp_path), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "hetero", "train", "--model", "tiny", "--steps", "100000",
                             "--batch-size", "2", "--no-progress"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("hetero-nvme-*/hetero-swap-*")) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # (training)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "terminated" in err and "Traceback" not in err
    assert not list(tmp_path.glob("hetero-nvme-*"))


def test_the_cli_trains_without_nvme_on_its_default_budgets(capsys) -> None:
    assert cli.main(["train", "--model", "tiny", "--steps", "1", "--batch-size", "2", "--no-nvme",
                     "--no-progress"]) == 0
    report = capsys.readouterr().out.split("model:")[0]
    assert "nvme   capacity" not in report and "host->nvme 0 B" in report


def test_the_cli_takes_an_nvme_budget(capsys, tmp_path) -> None:
    """--nvme-budget caps the swap files (it was fixed at 2x the state: on a small file system
    the CLI refused what the API trains, advising an option it did not have)."""
    assert cli.main(["train", "--model", "tiny", "--steps", "1", "--batch-size", "2", "--nvme-budget", "8MiB",
                     "--nvme-path", str(tmp_path), "--no-progress", "--json", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["tiers"]["nvme"]["capacity"] == 8 << 20
    assert cli.main(["train", "--model", "tiny", "--nvme-budget", "8MiB", "--no-nvme"]) == 2
    assert "nvme_budget='8MiB' with no_nvme=True" in capsys.readouterr().err


def test_hetero_profile_makes_a_nested_output_directory(tmp_path) -> None:
    out = tmp_path / "a" / "b"
    assert cli.main(["profile", "--model", "tiny", "--steps", "1", "--batch-size", "2", "--chunk-size", "64KiB",
                     "--nvme-path", str(tmp_path / "swap"), "--out", str(out), "--no-progress"]) == 0
    assert (out / "trace.json").exists()


def test_log_steps_bounds_the_logs_and_changes_nothing_else(tmp_path) -> None:
    """``log_steps=N``: a long run's logs hold about the last N steps (between N and 2N), the
    access log of those steps complete and numbered as in a full run, the trace and plot drawn
    from them; training, traffic and placement are those of a run that keeps everything; and a
    replay, which needs the whole log, says so."""
    runs = {}
    for keep in (None, 2):
        torch.manual_seed(0)
        model = GPT()
        total = state_bytes(model)
        wrapped = hetero.wrap(model, device="cpu", chunk_size="8KiB", device_budget=int(total * 0.25),
                              host_budget=int(total * 0.3), nvme_path=str(tmp_path / str(keep)), log_steps=keep)
        opt = hetero.optim.AdamW(wrapped.parameters(), lr=1e-3)
        sizes = []
        for x, y in batches(9, seed=2):
            wrapped(x, y).backward()
            opt.step()
            opt.zero_grad()
            tr = wrapped._hetero_state.runtime.tracker
            sizes.append(len(tr.events))
        runs[keep] = (wrapped.placement_report(), wrapped.state_dict(), sizes)
        wrapped.close()
    (full, full_sd, full_sizes), (window, window_sd, window_sizes) = runs[None], runs[2]
    for k, v in full_sd.items():
        assert torch.equal(window_sd[k], v), k
    assert window.as_dict()["traffic"] == full.as_dict()["traffic"]
    for rep in (window.as_dict(), full.as_dict()):  # totals over the whole run, window or not
        assert rep["stall_seconds"] == pytest.approx(sum(rep["step_stall_seconds"]))
        assert rep["stall_seconds_optimizer"] <= rep["stall_seconds"] + 1e-9
    assert full.as_dict()["log_first_step"] == 0 and window.as_dict()["log_first_step"] >= 9 - 4
    assert max(window_sizes) < max(full_sizes) / 2  # bounded, where the full log keeps growing
    first = window.log_first_step
    kept = [a.as_dict() for a in window.accesses]
    assert kept == [a.as_dict() for a in full.accesses if a.step >= first]
    window.to_chrome_trace(str(tmp_path / "trace.json"))
    window.plot(str(tmp_path / "plot.png"))
    for replay in (window.simulate, window.belady_bound, window.coresident_bound):
        with pytest.raises(hetero.HeteroStateError, match="log_steps"):
            replay()
    assert full.simulate().traffic == full.as_dict()["traffic"]
    with pytest.raises(hetero.HeteroConfigError, match="log_steps"):
        hetero.wrap(torch.nn.Linear(2, 2), device="cpu", log_steps=0)


@pytest.mark.parametrize("keep", [None, 2])
def test_a_report_is_a_snapshot_its_logs_shared_until_read(keep, tmp_path) -> None:
    """A report keeps the logs as they were when it was taken while training goes on (also where
    log_steps drops their old entries), without copying them then (a report per step of a long
    run copied every log each time); blocks' hotness is the access log's count per step."""
    wrapped = hetero.wrap(seeded_gpt(), **tight_budgets("device20_host30_nvme", tmp_path), log_steps=keep)
    opt = hetero.optim.AdamW(wrapped.parameters(), lr=1e-3)
    names = ("accesses", "moves", "usage", "stalls", "computes", "events")
    taken = []
    for x, y in batches(7, seed=3):
        wrapped(x, y).backward()
        opt.step()
        opt.zero_grad()
        tr = wrapped._hetero_state.runtime.tracker
        report = wrapped.placement_report()
        assert report._logs["events"].entries is tr.events  # (shared, not copied)
        taken.append((report, {n: list(getattr(tr, n)) for n in names}, report.as_dict(),
                      len(pickle.dumps(report))))
    for report, logs, summary, pickled in taken:
        assert len(pickle.dumps(report)) == pickled  # (the snapshot, not the run's whole log)
        for n in names:
            assert getattr(report, n) == logs[n], n
        assert report.as_dict() == summary
        steps = max(summary["steps"] - summary["log_first_step"], 1)
        counts: dict[str, int] = {}
        for a in report.accesses:
            counts[a.block] = counts.get(a.block, 0) + 1
        assert {b["id"]: b["hotness"] for b in summary["blocks"]} == pytest.approx(
            {b["id"]: counts.get(b["id"], 0) / steps for b in summary["blocks"]})
    assert keep is None or taken[-1][0].log_first_step > 0
    summary = taken[-1][0].as_dict()
    summary["step_traffic"][0]["host->device"] = -1  # (the caller's copy: the report's unchanged)
    assert taken[-1][0].as_dict() == taken[-1][2] and json.loads(json.dumps(summary)) == summary
    wrapped.close()


def test_step_traffic_has_an_entry_per_step() -> None:
    """Also where the last steps moved nothing (here: nothing ever moves, no budget)."""
    torch.manual_seed(0)
    model = hetero.wrap(GPT(), device="cpu")
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-3)
    for x, y in batches(3):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    d = model.placement_report().as_dict()
    assert len(d["step_traffic"]) == len(d["step_stall_seconds"]) == d["steps"] == 3
    assert all(v == 0 for t in d["step_traffic"] for v in t.values())


def test_the_cli_runs_from_another_thread(capsys) -> None:
    """Its SIGTERM handler is the main thread's only (signal.signal raised elsewhere)."""
    import threading

    rc = []
    t = threading.Thread(target=lambda: rc.append(cli.main(["train", "--model", "tiny", "--steps", "1",
                                                            "--batch-size", "2", "--no-nvme", "--no-progress"])))
    t.start()
    t.join()
    assert rc == [0]


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("budget", [None, 0.4])
def test_a_checkpointed_units_recompute_is_an_access(reentrant: bool, budget) -> None:
    """API.md: the access log holds every time compute touched a block. Activation checkpointing
    re-runs a unit's forward inside the backward, touching its parameters a third time: per step
    they are read by the forward, the recompute and the backward, and updated by the optimizer.
    The recompute went unlogged where the unit's backward already held its blocks (non-reentrant
    checkpointing, the usual case)."""
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self, checkpointing: bool) -> None:
            super().__init__()
            # (the Linear last: its backward starts, holding its blocks, before the recompute)
            self.layers = nn.ModuleList(nn.Sequential(nn.Tanh(), nn.Linear(16, 16)) for _ in range(4))
            self.checkpointing = checkpointing

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.layers[0](x)  # (a reentrant checkpoint needs an input that requires grad)
            for layer in self.layers[1:]:
                x = checkpoint(layer, x, use_reentrant=reentrant) if self.checkpointing else layer(x)
            return x.pow(2).mean()

    counts = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = Net(checkpointing)
        state = state_bytes(model)
        kw = {} if budget is None else dict(device_budget=int(state * budget))
        wrapped = hetero.wrap(model, device="cpu", chunk_size="1KiB", **kw)
        opt = hetero.optim.AdamW(wrapped.parameters(), lr=1e-3)
        for x in torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(1)):
            wrapped(x).backward()
            opt.step()
            opt.zero_grad()
        units = {u.name: [b.id for b in u.param_blocks] for u in wrapped._hetero_state.units}
        per_step: dict[tuple[int, str], int] = {}
        for a in wrapped.placement_report().accesses:
            if a.block.endswith(".param"):
                per_step[a.step, a.block] = per_step.get((a.step, a.block), 0) + 1
        wrapped.close()
        counts.append(per_step)
    rerun = {b for name, ids in units.items() if name.startswith(("layers.1", "layers.2", "layers.3")) for b in ids}
    assert rerun and units["layers.0.1"]
    assert set(counts[0].values()) == {3}  # forward, backward, optimizer
    assert counts[1] == {k: n + (k[1] in rerun) for k, n in counts[0].items()}


def test_an_unlimited_budget_reads_as_unlimited() -> None:
    """Found in review: the CPU device's default budget (none) printed as '4294967296.00 GiB' in
    the report and the plot's legend."""
    from torch import nn

    from hetero.config import UNLIMITED

    wrapped = hetero.wrap(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), device="cpu")
    wrapped(torch.randn(2, 8)).sum().backward()
    rep = wrapped.placement_report()
    wrapped.close()
    assert rep.as_dict()["tiers"]["device"]["capacity"] == UNLIMITED
    assert re.search(r"device capacity +unlimited ", str(rep)) and "GiB  used" in str(rep)  # (the host's is a size)


@pytest.mark.parametrize("method", ["to_chrome_trace", "plot", "save_access_log", "save_event_log"])
def test_an_output_path_that_is_not_a_path_is_refused(report, method: str, tmp_path) -> None:
    """Found in review: open() takes an int as a file descriptor, writes to it and closes it;
    given one of the swap files' numbers, the engine went on swapping into whatever file the
    program opened next under it (silently wrong weights). Refused, naming the method."""
    import os

    from hetero.simulator import load_event_log

    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR)
    for bad in (fd, True, None, ""):
        with pytest.raises(hetero.HeteroConfigError, match=rf"{method}\(path="):
            getattr(report, method)(bad)
    os.fstat(fd)  # still open
    os.close(fd)
    getattr(report, method)(tmp_path / "out")  # an os.PathLike is a path
    assert (tmp_path / "out").stat().st_size > 0
    if method == "save_event_log":
        with pytest.raises(hetero.HeteroConfigError, match=r"load_event_log\(path="):
            load_event_log(3)
        assert len(load_event_log(tmp_path / "out")[0]) == len(report.events)
