"""Meta-device models: ``hetero.wrap`` materializes them chunk by chunk straight into their tiers,
with each module's ``reset_parameters()`` (matching the same model built on the CPU with the same
seed) or with ``param_init_fn=`` as in FSDP, and ties between parameters survive."""

from __future__ import annotations

import zlib

import pytest
import torch
from torch import nn

import hetero
from models import GPT, batches, state_bytes

KW = dict(vocab=64, d=32, n_layer=2)


def cpu_model(seed: int, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(**{**KW, **kw})


def meta_model(**kw) -> GPT:
    with torch.device("meta"):
        model = GPT(**{**KW, **kw})
    assert all(p.is_meta for p in model.parameters())
    return model


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].device.type == "cpu", k
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), f"{k} differs"


def assert_materialized(wrapped: hetero.HeteroModule, meta: GPT) -> None:
    assert wrapped.module is meta
    assert meta.lm_head.weight is meta.wte.weight, "the tie between lm_head and wte was lost"
    names = [n for n, _ in wrapped.named_parameters()]
    assert names == [n for n, _ in meta.named_parameters()]
    assert "lm_head.weight" not in names  # deduplicated, as the CPU model's
    with wrapped.summon_full_params(writeback=False):
        for n, p in meta.named_parameters():
            assert not p.is_meta, n
            assert torch.isfinite(p).all(), n


def train(model: hetero.HeteroModule, steps: int = 1) -> list[float]:
    opt = hetero.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in batches(steps):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# ------------------------------------------------------------------------------ reset_parameters


@pytest.mark.parametrize("seed", [0, 123])
def test_meta_equals_cpu_model(seed):
    ref = cpu_model(seed)
    meta = meta_model()
    torch.manual_seed(seed)
    wrapped = hetero.wrap(meta, device="cpu")
    assert_materialized(wrapped, meta)
    assert_same_state(wrapped.state_dict(), ref.state_dict())


#: A 4-layer GPT has ~210 KB of parameters; these budgets hold less than that together (so some
#: chunks must go to NVMe while materializing) but more than each tier's minimum.
SPREAD = dict(device_budget=90_000, host_budget=110_000, chunk_size="4KiB")


def assert_spread(wrapped: hetero.HeteroModule) -> None:
    rep = wrapped.placement_report().as_dict()
    tiers = {b["tier"] for b in rep["blocks"] if b["kind"] == "param"}
    assert tiers == {"device", "host", "nvme"}, f"param blocks only on {tiers}"
    for name, tier in rep["tiers"].items():
        assert tier["peak"] <= tier["capacity"], name


def test_meta_equals_cpu_model_spread_over_tiers(tmp_path):
    """Same, with budgets that put chunks on device, host and NVMe while materializing."""
    ref = cpu_model(5, n_layer=4)
    meta = meta_model(n_layer=4)
    torch.manual_seed(5)
    wrapped = hetero.wrap(meta, device="cpu", nvme_path=str(tmp_path), **SPREAD)
    assert_spread(wrapped)
    assert_materialized(wrapped, meta)
    assert_same_state(wrapped.state_dict(), ref.state_dict())


def test_meta_model_trains_like_cpu_model(tmp_path):
    ref = cpu_model(1)
    total = state_bytes(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = []
    for x, y in batches(3):
        loss = ref(x, y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    meta = meta_model()
    torch.manual_seed(1)
    wrapped = hetero.wrap(meta, device="cpu", device_budget=int(total * 0.25), host_budget=int(total * 0.35),
                          nvme_path=str(tmp_path), chunk_size="8KiB")
    assert train(wrapped, 3) == pytest.approx(ref_losses, rel=1e-5)
    got, want = wrapped.state_dict(), ref.state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_meta_model_loads_cpu_state_dict():
    ref = cpu_model(3)
    wrapped = hetero.wrap(meta_model(), device="cpu")
    wrapped.load_state_dict(ref.state_dict())
    assert_same_state(wrapped.state_dict(), ref.state_dict())


# ------------------------------------------------------------------------------ param_init_fn


def seeded_init_fn(names: dict[int, str], calls: list[str]):
    """An FSDP-style param_init_fn: materializes the module if needed, then draws each parameter
    from a generator seeded by the module's name, so the result does not depend on call order."""

    def init(module: nn.Module) -> None:
        name = names[id(module)]
        calls.append(name)
        if any(t.is_meta for t in module.parameters(recurse=False)):
            module.to_empty(device="cpu", recurse=False)
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        with torch.no_grad():
            for pname, p in module.named_parameters(recurse=False):
                p.normal_(mean=float(len(pname)), std=1.0, generator=gen)

    return init


def expected_with_init_fn(model: GPT) -> dict[str, torch.Tensor]:
    """What seeded_init_fn gives: applied to every module owning parameters, except lm_head, whose
    weight is wte's (already initialized with wte)."""
    names = {id(m): n for n, m in model.named_modules()}
    init = seeded_init_fn(names, [])
    for name, m in model.named_modules():
        if name != "lm_head" and any(True for _ in m.parameters(recurse=False)):
            init(m)
    return model.state_dict()


def test_param_init_fn_values_land_on_every_tier(tmp_path):
    want = expected_with_init_fn(cpu_model(0, n_layer=4))
    meta = meta_model(n_layer=4)
    names = {id(m): n for n, m in meta.named_modules()}
    calls: list[str] = []
    wrapped = hetero.wrap(meta, device="cpu", nvme_path=str(tmp_path), param_init_fn=seeded_init_fn(names, calls),
                          **SPREAD)
    owners = {n for n, m in meta.named_modules() if n != "lm_head" and any(True for _ in m.parameters(recurse=False))}
    assert owners <= set(calls), f"param_init_fn was not called on {owners - set(calls)}"
    assert len(calls) == len(set(calls)), "param_init_fn called twice on a module"
    assert_spread(wrapped)
    assert_materialized(wrapped, meta)
    assert_same_state(wrapped.state_dict(), want)
    losses = train(wrapped, 2)
    assert all(torch.isfinite(torch.tensor(losses)))


def test_param_init_fn_constant():
    meta = meta_model()
    index = {id(m): i for i, m in enumerate(meta.modules())}

    def fill(module: nn.Module) -> None:
        if any(t.is_meta for t in module.parameters(recurse=False)):
            module.to_empty(device="cpu", recurse=False)
        with torch.no_grad():
            for p in module.parameters(recurse=False):
                p.fill_(float(index[id(module)]))

    wrapped = hetero.wrap(meta, device="cpu", chunk_size="4KiB", param_init_fn=fill)
    sd = wrapped.state_dict()
    for name, m in meta.named_modules():
        for pname, _ in m.named_parameters(recurse=False):
            key = f"{name}.{pname}"
            want = float(index[id(meta.wte)]) if key == "lm_head.weight" else float(index[id(m)])
            assert torch.all(sd[key] == want), key


def test_param_init_fn_not_called_for_cpu_model():
    calls = []
    ref = cpu_model(0)
    model = cpu_model(0)
    wrapped = hetero.wrap(model, device="cpu", param_init_fn=calls.append)
    assert calls == []
    assert_same_state(wrapped.state_dict(), ref.state_dict())


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


def test_meta_module_without_reset_parameters_needs_param_init_fn(tmp_path):
    with torch.device("meta"):
        model = nn.Sequential(NoReset(), NoReset())
    with pytest.raises(hetero.HeteroConfigError, match="param_init_fn"):
        hetero.wrap(model, device="cpu", nvme_path=str(tmp_path))
    assert list(tmp_path.iterdir()) == []
    assert all(p.is_meta for p in model.parameters())

    def init(m: nn.Module) -> None:
        if isinstance(m, NoReset):
            m.to_empty(device="cpu", recurse=False)
            with torch.no_grad():
                m.w.copy_(torch.eye(8))

    wrapped = hetero.wrap(model, device="cpu", param_init_fn=init)
    x = torch.randn(2, 8)
    torch.testing.assert_close(wrapped(x), x)


# ------------------------------------------------------------------------------ larger than RAM


def test_meta_model_larger_than_device_and_host_streams_to_nvme(tmp_path):
    """Device and host budgets together are below the model's parameter bytes: materializing must
    stream chunks into NVMe, never holding the whole model, and the result matches the CPU model."""
    kw = dict(n_layer=6)
    ref = cpu_model(7, **kw)
    param_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    device_budget, host_budget = 100_000, 100_000
    assert device_budget + host_budget < param_bytes
    meta = meta_model(**kw)
    torch.manual_seed(7)
    wrapped = hetero.wrap(meta, device="cpu", device_budget=device_budget, host_budget=host_budget,
                          nvme_path=str(tmp_path), chunk_size="8KiB")
    rep = wrapped.placement_report().as_dict()
    assert rep["tiers"]["nvme"]["used"] > 0
    assert rep["traffic"]["host->nvme"] > 0
    assert rep["tiers"]["device"]["peak"] <= device_budget
    assert rep["tiers"]["host"]["peak"] <= host_budget
    on_nvme = sum(b["bytes"] for b in rep["blocks"] if b["kind"] == "param" and b["tier"] == "nvme")
    assert on_nvme >= param_bytes - device_budget - host_budget
    assert_same_state(wrapped.state_dict(), ref.state_dict())
    losses = train(wrapped, 2)
    assert all(torch.isfinite(torch.tensor(losses)))
    rep = wrapped.placement_report().as_dict()
    assert rep["tiers"]["device"]["peak"] <= device_budget
    assert rep["tiers"]["host"]["peak"] <= host_budget


def test_a_failed_materialization_gives_the_meta_model_back(tmp_path):
    """An init that raises half-way (a module already materialized, the failing one holding
    to_empty's uninitialized memory): wrap raises it and the model is on the meta device again,
    every tensor, so wrapping it again initializes everything afresh (not garbage)."""
    meta = meta_model()
    calls = []

    def flaky_init(module: nn.Module) -> None:
        calls.append(module)
        if isinstance(module, nn.LayerNorm) and len(calls) > 2:
            raise RuntimeError("transient failure")
        module.reset_parameters()

    with pytest.raises(RuntimeError, match="transient"):
        hetero.wrap(meta, device="cpu", param_init_fn=flaky_init, nvme_path=str(tmp_path), **SPREAD)
    assert len(calls) >= 3  # (the embeddings were materialized before the failure)
    assert all(t.is_meta for t in list(meta.parameters()) + list(meta.buffers()))
    assert meta.lm_head.weight is meta.wte.weight
    torch.manual_seed(7)
    wrapped = hetero.wrap(meta, device="cpu", param_init_fn=lambda m: m.reset_parameters())
    assert_materialized(wrapped, meta)
    ref = cpu_model(7)
    want = ref.state_dict()
    got = wrapped.state_dict()
    for k, v in got.items():  # LayerNorms reset to ones and zeros: no uninitialized memory
        if ".ln" in k:
            assert torch.equal(v, want[k]), k


def test_materialized_parameters_are_let_go_chunk_by_chunk(tmp_path):
    """Each chunk's parameters point at the placeholder once the chunk is placed: the whole
    model was held in memory until every module was initialized (API.md: a model larger than
    RAM never exists whole in memory)."""
    with torch.device("meta"):
        meta = nn.Sequential(*[nn.Linear(64, 64) for _ in range(16)])
    live = []

    def init(m: nn.Module) -> None:
        m.reset_parameters()
        ptrs = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in meta.parameters() if not p.is_meta}
        live.append(sum(n for n in ptrs.values() if n > 64))  # (placeholders: one element)

    hetero.wrap(meta, device="cpu", chunk_size="16KiB", device_budget="40KiB", host_budget="64KiB",
                nvme_path=str(tmp_path), param_init_fn=init).close()
    model_bytes = 16 * (64 * 64 + 64) * 4
    assert len(live) == 16 and max(live) <= 3 * (64 * 64 + 64) * 4 < model_bytes // 4, live


class MaskAndScale(nn.Module):
    """A buffer made in __init__ (a mask, a rotary table) and a parameter set by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)), persistent=False)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.mask) * self.scale


def test_meta_buffers_need_an_initializer_and_other_tensors_are_kept():
    """A meta buffer in a module without reset_parameters() was left as uninitialized memory
    (silently), and materializing it wiped the module's CPU parameter."""
    with torch.device("meta"):
        model = nn.Sequential(MaskAndScale(), nn.Linear(4, 4))
    model[0].scale = nn.Parameter(torch.full((4,), 2.0))  # on the CPU, set by hand
    with pytest.raises(hetero.HeteroConfigError, match=r"'0' has meta-device tensors \(mask\)"):
        hetero.wrap(model, device="cpu")

    def init(m: nn.Module) -> None:
        if isinstance(m, MaskAndScale):
            m.mask.copy_(torch.tril(torch.ones(4, 4)))
        else:
            m.reset_parameters()

    wrapped = hetero.wrap(model, device="cpu", param_init_fn=init)
    torch.testing.assert_close(wrapped.state_dict()["0.scale"], torch.full((4,), 2.0))
    torch.testing.assert_close(model[0].mask, torch.tril(torch.ones(4, 4)))


@pytest.mark.parametrize("change", ["new_parameter", "dtype", "shape"])
def test_an_initializer_that_replaces_parameters_is_refused(change, tmp_path):
    """Parameters are packed as they are before initialization: a new Parameter object left the
    model unmanaged (found only by the optimizer), a new dtype or shape was ignored or a bare
    RuntimeError."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))

    def init(m: nn.Module) -> None:
        if change == "new_parameter":
            m.weight = nn.Parameter(torch.zeros(8, 8))
        elif change == "dtype":
            m.to(torch.float64)
        else:
            m.bias.data = torch.zeros(1)

    with pytest.raises(hetero.HeteroConfigError, match="replaced its parameter"):
        hetero.wrap(model, device="cpu", nvme_path=str(tmp_path), param_init_fn=init)
    assert all(p.is_meta for p in model.parameters())
    assert not list(tmp_path.glob("hetero-swap-*"))


def test_a_tied_head_with_its_own_meta_bias_materializes():
    """The head's reset_parameters() writes the tied embedding weight too: letting the
    embedding's chunk go before the head was initialized made that write fail ("more than one
    element of the written-to tensor refers to a single memory location")."""
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(64, 16)
            self.mid = nn.Linear(16, 16)
            self.head = nn.Linear(16, 64)
            self.head.weight = self.emb.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.mid(self.emb(x)))

    with torch.device("meta"):
        model = Tied()
    wrapped = hetero.wrap(model, device="cpu", chunk_size="4KiB", device_budget="16KiB")
    assert torch.isfinite(wrapped(torch.arange(8)[None])).all()
    assert model.head.weight is model.emb.weight


@pytest.mark.parametrize("init", ["reset_parameters", "param_init_fn"])
def test_a_module_whose_only_tensors_are_ties_is_initialized_in_its_turn(init):
    """A bias-free head tied to the embedding (GPT-2's layout) holds no meta tensor once the
    embedding is made real, yet its initializer still runs, as its constructor ran eagerly: the
    random numbers it draws put every module after it on the eager values (found in review:
    it was skipped, and the module after it differed from the CPU-built model)."""
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.head = nn.Linear(8, 16, bias=False)
            self.head.weight = self.emb.weight
            self.after = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.after(self.emb(x)))

    torch.manual_seed(0)
    want = Tied().state_dict()
    with torch.device("meta"):
        model = Tied()
    torch.manual_seed(0)
    fn = (lambda m: m.reset_parameters()) if init == "param_init_fn" else None
    wrapped = hetero.wrap(model, device="cpu", chunk_size="4KiB", device_budget="16KiB", param_init_fn=fn)
    got = wrapped.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items()), [k for k, v in want.items() if not torch.equal(got[k], v)]
    assert model.head.weight is model.emb.weight
    wrapped.close()


@pytest.mark.parametrize("init", ["reset_parameters", "fsdp"])
def test_a_parent_s_tie_to_a_child_s_parameter_takes_the_child_s_values(init):
    """A tie the root makes to a child's parameter (``self.w = self.emb.weight``) comes first in
    ``modules()`` order, but eagerly the child built the values: they are staged at the child
    (found in review: the root's ``to_empty`` was staged, and the embedding held garbage)."""
    class RootTie(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.w = self.emb.weight
            self.after = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.after(self.emb(x)) @ self.w.t()

    def fsdp_init(m: nn.Module) -> None:
        m.to_empty(device="cpu", recurse=False)
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()

    class ParentOwns(nn.Module):  # the parent made and initialized it; the child is tied to it
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(8, 8))
            self.reset_parameters()
            self.lin = nn.Linear(8, 8)
            self.lin.weight = self.w

        def reset_parameters(self) -> None:
            nn.init.normal_(self.w)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    for cls in (RootTie, ParentOwns):  # (the second: found in review of the first's fix)
        torch.manual_seed(0)
        want = cls().state_dict()
        with torch.device("meta"):
            model = cls()
        torch.manual_seed(0)
        wrapped = hetero.wrap(model, device="cpu", chunk_size="4KiB", device_budget="16KiB",
                              param_init_fn=fsdp_init if init == "fsdp" else None)
        got = wrapped.state_dict()
        assert [k for k, v in want.items() if not torch.equal(got[k], v)] == [], cls.__name__
        wrapped.close()
    assert model.w is model.lin.weight


@pytest.mark.parametrize("budget", [None, 0.3])
def test_an_initializer_that_materializes_the_whole_subtree_works_as_with_fsdp(budget, tmp_path):
    """Found in review: ``param_init_fn=lambda m: m.to_empty(device="cpu")`` (recurse=True, torch's
    default, as FSDP users write it) on a module with tensors of its own and meta children
    (nn.MultiheadAttention) replaced the children's parameters with new objects, and wrap failed
    with a bare AssertionError. hetero keeps its objects, with the new values; the children are not
    initialized in their turn (as with FSDP), and after a state-dict load training equals eager."""

    def make() -> nn.Module:
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)

    torch.manual_seed(0)
    eager = make()
    with torch.device("meta"):
        model = make()
    objects = [id(p) for p in model.parameters()]
    calls = []
    kw = {} if budget is None else dict(device_budget=int(state_bytes(eager) * budget),
                                        host_budget=int(state_bytes(eager) * 0.3), nvme_path=str(tmp_path))
    wrapped = hetero.wrap(model, device="cpu", chunk_size="2KiB",
                          param_init_fn=lambda m: calls.append(m) or m.to_empty(device="cpu"), **kw)
    assert [id(p) for p in wrapped.parameters()] == objects
    # As FSDP, every module holding tensors of its own, an attention's out_proj included (the
    # attention's to_empty materialized it: initialized in its turn all the same).
    assert calls == [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    wrapped.load_state_dict(eager.state_dict())
    opts = (torch.optim.AdamW(eager.parameters(), lr=1e-2), hetero.optim.AdamW(wrapped.parameters(), lr=1e-2))
    for x in torch.randn(3, 4, 5, 16, generator=torch.Generator().manual_seed(1)):
        for m, opt in zip((eager, wrapped), opts):
            m(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    got = wrapped.state_dict()
    for k, v in eager.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)
    wrapped.close()


def test_an_initializer_that_replaces_a_parameter_below_with_another_shape_is_refused(tmp_path):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model.scale = nn.Parameter(torch.ones(1, device="meta"))  # the root holds a meta tensor

    def init(m: nn.Module) -> None:
        m.to_empty(device="cpu", recurse=False)
        if m is model:
            m[1].weight = nn.Parameter(torch.zeros(4, 4))

    with pytest.raises(hetero.HeteroConfigError, match=r"replaced parameter 'weight' \(\(8, 8\).*module '1'"):
        hetero.wrap(model, device="cpu", nvme_path=str(tmp_path), param_init_fn=init)
    assert model[1].weight.is_meta and model[1].weight.shape == (8, 8)
    assert not list(tmp_path.glob("hetero-swap-*"))


def test_modules_an_initializer_materialized_from_above_are_initialized_in_their_turn(tmp_path):
    """Found in review of the fix above: an init that materializes its subtree and fills only its
    own module's tensors left the children's values as to_empty's garbage (silently). As FSDP,
    param_init_fn runs on each of them too; and an init that fails gives every object back."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.empty(4))
            self.lin = nn.Linear(4, 4)
            self.bn = nn.BatchNorm1d(4)

    def init(m: nn.Module) -> None:
        m.to_empty(device="cpu")
        with torch.no_grad():
            for name, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
                t.fill_(len(name))  # (its own tensors only)

    with torch.device("meta"):
        model = nn.Sequential(Block())
    wrapped = hetero.wrap(model, device="cpu", param_init_fn=init)
    for k, v in wrapped.state_dict().items():
        assert torch.equal(v, torch.full_like(v, len(k.split(".")[-1]))), k
    wrapped.close()

    with torch.device("meta"):
        model = nn.Sequential(Block())
    objects = {n: p for n, p in model.named_parameters()}

    def failing(m: nn.Module) -> None:
        m.to_empty(device="cpu")
        raise RuntimeError("user init failed")

    with pytest.raises(RuntimeError, match="user init failed"):
        hetero.wrap(model, device="cpu", nvme_path=str(tmp_path), param_init_fn=failing)
    assert {n: p for n, p in model.named_parameters()} == objects
    assert all(p.is_meta for p in model.parameters())
