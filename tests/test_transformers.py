"""Hugging Face transformers models built from a config (random weights, nothing downloaded)
train through hetero exactly as eagerly."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_same_model, assert_within_budgets, budgets, train_pair
from models import batches, state_bytes

transformers = pytest.importorskip("transformers")


def gpt2(checkpointing: bool = False):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    if checkpointing:
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    return model.train()


def llama(checkpointing: bool = False):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                   tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg)
    if checkpointing:
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    return model.train()


def hf_step(model, opt, batch):
    x, _ = batch
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("split", ["device25_host", "device20_host30_nvme"])
@pytest.mark.parametrize("family", [gpt2, llama], ids=["gpt2", "llama"])
def test_transformers_model_trains_like_eager(family, split, checkpointing, tmp_path) -> None:
    total = state_bytes(family())
    kw = budgets(total, 0.25, None) if split == "device25_host" else budgets(total, 0.2, 0.3, tmp_path)
    e, h, eager, wrapped = train_pair(lambda: family(checkpointing), kw | {"chunk_size": "8KiB"},
                                      batches(3, seed=4), step_fn=hf_step)
    assert h == pytest.approx(e, rel=1e-5)
    assert_same_model(eager, wrapped)
    rep = assert_within_budgets(wrapped)
    assert len(wrapped._hetero_state.units) == 3  # root + one unit per decoder layer
    if "nvme" in split:
        assert rep["traffic"]["nvme->host"] > 0 and rep["traffic"]["host->nvme"] > 0
