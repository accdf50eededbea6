"""hetero plan: the dry run's placement is the placement a real run makes, and the pricing is
bytes over speeds."""

from __future__ import annotations

import json

import pytest
import torch

import hetero
from hetero import cli, models
from hetero.plan import Machine, plan, price, train_flops

GIVEN = Machine(compute_tflops=2.0, h2d_GBps=10.0, d2h_GBps=5.0, nvme_read_GBps=1.0,
                nvme_write_GBps=2.0, adam_Gparams=0.5, device_adam_Gparams=4.0, source="given")


def test_price_is_bytes_over_speeds() -> None:
    traffic = {"host->device": 1e9, "device->host": 1e9, "nvme->host": 1e9, "host->nvme": 2e9}
    t = price(traffic, flops=4e12, host_params=10 ** 9, device_params=2 * 10 ** 9, machine=GIVEN,
              runtime_s=0.5)
    assert t["compute"] == pytest.approx(2.0)
    assert t["device_adam"] == pytest.approx(0.5)
    assert t["host->device"] == pytest.approx(0.1)
    assert t["device->host"] == pytest.approx(0.2)
    assert t["nvme"] == pytest.approx(1.0 + 1.0)  # reads and writes share the disk
    assert t["host_adam"] == pytest.approx(2.0)
    assert t["runtime"] == 0.5
    assert t["overlapped"] == pytest.approx(2.5)  # the device computes, then updates
    assert t["serial"] == pytest.approx(7.3)


def test_price_refuses_traffic_it_has_no_speed_for() -> None:
    no_disk = Machine(1.0, 1.0, 1.0, None, None, 1.0, 1.0, "given")
    assert price({"host->device": 1e6}, flops=1e9, host_params=0, machine=no_disk)["nvme"] == 0
    with pytest.raises(ValueError, match="NVMe read"):
        price({"nvme->host": 1e6}, flops=1e9, host_params=0, machine=no_disk)


def test_train_flops_counts_parameters_and_attention() -> None:
    cfg = models.get_config("tiny")
    # 6 per parameter and token, plus 12 x layers x width x sequence per token
    assert train_flops(cfg, 1000, tokens=64, seq_len=32) == (6 * 1000 + 12 * 8 * 64 * 32) * 64


@pytest.mark.parametrize("device, host, nvme", [("500KiB", "1MiB", True), ("500KiB", "8MiB", False),
                                                ("2MiB", "2MiB", True)])
def test_the_plan_moves_what_a_real_run_moves(tmp_path, device: str, host: str, nvme: bool) -> None:
    """The plan's dry run (batch size 1) and a real run at batch size 8 under the same budgets move
    the same bytes in their fourth step, and the plan's peaks respect the budgets."""
    swap = str(tmp_path) if nvme else None
    p = plan("tiny", device_budget=device, host_budget=host, nvme_path=swap, no_nvme=not nvme,
             steps=4, machine=GIVEN)
    cfg = models.get_config("tiny")
    torch.manual_seed(0)
    model = hetero.wrap(models.GPT(cfg), device="cpu", device_budget=p.budgets["device"],
                        host_budget=p.budgets["host"], nvme_path=swap, nvme_budget=p.budgets["nvme"],
                        chunk_size=cli.DEFAULT_CHUNK)
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-3)
    data = models.MarkovData(cfg.vocab_size, seed=0)
    for _ in range(4):
        x, y = data.batch(8, cfg.block_size)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    report = model.placement_report()
    d = report.as_dict()
    assert {k: sum(s[k] for s in d["step_traffic"]) for k in d["traffic"]} == d["traffic"]
    real = d["step_traffic"][3]
    updated_below = sum(a.bytes // 4 for a in report.accesses
                        if a.step == 3 and a.block.endswith(".exp_avg") and a.tier != "device")
    model.close()
    assert p.traffic == real
    assert p.traffic["host->device"] > 0
    assert (p.traffic["nvme->host"] > 0) == nvme
    assert sum(p.state.values()) == models.state_bytes(models.GPT(cfg))
    for tier, peak in p.peaks.items():
        assert peak <= p.budgets[tier], tier
    assert p.host_params == updated_below
    if device == "500KiB":  # no room beside the working set: every chunk is updated by the CPU
        assert p.host_params == models.GPT(cfg).num_params()
    assert p.host_params + p.device_params == models.GPT(cfg).num_params()  # every chunk, once
    assert p.seconds == price(p.traffic, flops=p.flops, host_params=p.host_params,
                              device_params=p.device_params, machine=GIVEN, runtime_s=p.seconds["runtime"])
    assert p.seconds["runtime"] > 0


@pytest.mark.parametrize("nvme", [True, False])
def test_the_plan_names_the_least_budgets_wrap_accepts(tmp_path, nvme: bool) -> None:
    p = plan("tiny", device_budget="500KiB", host_budget="8MiB", nvme_path=str(tmp_path) if nvme else None,
             no_nvme=not nvme, steps=2, machine=GIVEN)
    dev, host = p.minimums["device"], p.minimums["host"]
    assert 0 < dev <= p.budgets["device"] and 0 < host <= p.budgets["host"]
    kw = dict(device="cpu", chunk_size=cli.DEFAULT_CHUNK, nvme_path=str(tmp_path) if nvme else None)
    roomy = 8 << 20  # the other tier: room for the whole state, so only the budget under test binds
    for name, least, make_budgets in (("device_budget", dev, lambda n: (n, roomy)),
                                      ("host_budget", host, lambda n: (roomy, n))):
        d, h = make_budgets(least)
        hetero.wrap(models.GPT(models.get_config("tiny")), device_budget=d, host_budget=h, **kw).close()
        d, h = make_budgets(least - 1)
        with pytest.raises(hetero.HeteroConfigError, match=f"{name}=.*pass {name}>={least}"):
            hetero.wrap(models.GPT(models.get_config("tiny")), device_budget=d, host_budget=h, **kw)


def test_a_model_that_fits_moves_nothing() -> None:
    total = models.state_bytes(models.GPT(models.get_config("tiny")))
    p = plan("tiny", device_budget=2 * total, host_budget=total, no_nvme=True, steps=2, machine=GIVEN)
    assert not any(p.traffic.values()) and p.host_params == 0
    assert p.device_params == models.GPT(models.get_config("tiny")).num_params()
    s = p.seconds
    assert s["overlapped"] == max(s["compute"] + s["device_adam"], s["runtime"])
    assert s["serial"] == pytest.approx(s["compute"] + s["device_adam"] + s["runtime"])


def test_cli_plan_measures_this_machine_and_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    rc = cli.main(["plan", "--model", "tiny", "--device-budget", "500KiB", "--host-budget", "1MiB",
                   "--nvme-path", str(tmp_path), "--batch-size", "2", "--steps", "3",
                   "--nvme-write-gbps", "3.5", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "estimated step time" in text and "memory per tier" in text
    d = json.loads(out.read_text())
    m = d["machine"]
    assert m["nvme_write_GBps"] == 3.5 and m["source"] == "measured, some given"
    for key in ("compute_tflops", "h2d_GBps", "d2h_GBps", "nvme_read_GBps", "adam_Gparams", "device_adam_Gparams"):
        assert m[key] > 0, key
    assert d["batch_size"] == 2 and d["seq_len"] == models.get_config("tiny").block_size
    assert 0 < d["seconds"]["overlapped"] <= d["seconds"]["serial"]
    assert not list(tmp_path.glob("hetero-*")), "the dry run and the disk probe leave no files behind"


@pytest.mark.parametrize("args, names", [
    (["--device-budget", "5KiB"], "device_budget"),
    (["--seq-len", "999"], "seq_len"),
    (["--batch-size", "0"], "batch_size"),
    (["--steps", "1"], "steps"),
    (["--compute-tflops", "-1"], "compute_tflops"),
    (["--compute-tflops", "inf"], "compute_tflops"),  # (priced compute at 0 s)
    (["--h2d-gbps", "nan"], "h2d_GBps"),
    (["--device", "foo"], "device"),
    (["--threads", "0"], "--threads"),
    (["--threads", "99999999999999"], "--threads"),  # (torch's overflow traceback)
    (["--batch-size", str(10 ** 23)], "batch_size"),  # (a traceback after the dry run)
    (["--host-budget", "0.4"], "rounds down to 0"),  # (said "must be positive" of 0.4)
    (["--json", ""], "--json ''"),  # (named the current directory)
])
def test_cli_plan_refuses_bad_input_by_name(capsys, args: list[str], names: str) -> None:
    assert cli.main(["plan", "--model", "tiny", "--no-nvme", *args]) == 2
    err = capsys.readouterr().err
    assert "HeteroConfigError" in err and names in err
