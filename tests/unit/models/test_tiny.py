"""Tiny random HF checkpoints: build, offline load, generate, determinism, presets."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from mcore_agentic.models.tiny import (
    TINY_PRESETS,
    make_tiny_hf_model,
    make_tiny_hf_model_from_preset,
    padded_vocab_size,
    tiny_hf_config,
)
from mcore_agentic.utils.errors import ConfigError

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


@pytest.fixture(autouse=True)
def _offline_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MCORE_AGENTIC_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_builds_loads_offline_and_generates(arch, tmp_path):
    path = make_tiny_hf_model(tmp_path / arch, arch, vocab_size=1024)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path))
    assert model.config.architectures == [ARCHITECTURES[arch]]
    assert model.dtype == torch.float32
    assert len(tokenizer) == 1024 + 26
    assert model.config.vocab_size == padded_vocab_size(len(tokenizer)) == 1088
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>") == 1026
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id == 1024

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+1?"}], add_generation_prompt=True, return_tensors="pt", return_dict=False
    )
    out = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert out.shape[1] > prompt.shape[1]
    assert torch.equal(out[:, : prompt.shape[1]], prompt)


def test_padding_ids_are_never_generated(tmp_path):
    path = make_tiny_hf_model(tmp_path / "m", "qwen2", vocab_size=512)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path))
    num_tokens = len(tokenizer)
    with torch.no_grad():  # make the padding rows dominate the logits
        model.lm_head.weight[num_tokens:] *= 1000.0
    prompt = torch.tensor([tokenizer.encode("hello there")])
    out = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert int(out[0, prompt.shape[1] :].max()) < num_tokens
    model.generation_config.suppress_tokens = None  # the same model without the guard picks a padding id
    out = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert int(out[0, prompt.shape[1] :].max()) >= num_tokens


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = make_tiny_hf_model(tmp_path / "a", "qwen3", vocab_size=512, seed=3)
    b = make_tiny_hf_model(tmp_path / "b", "qwen3", vocab_size=512, seed=3)
    c = make_tiny_hf_model(tmp_path / "c", "qwen3", vocab_size=512, seed=4)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "config.json").read_bytes() == (c / "config.json").read_bytes()


def test_tied_embeddings_and_qwen3_template(tmp_path):
    path = make_tiny_hf_model(tmp_path / "t", "qwen2", vocab_size=512, tie_word_embeddings=True, chat_template="qwen3")
    model = AutoModelForCausalLM.from_pretrained(str(path))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    assert "<think>" in tokenizer.chat_template


def test_100m_preset_size():
    preset = TINY_PRESETS["100m"]
    config = tiny_hf_config(
        "qwen2",
        model_vocab_size=padded_vocab_size(preset["vocab_size"] + 26),
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
        **{k: v for k, v in preset.items() if k != "vocab_size"},
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert 95e6 < sum(p.numel() for p in model.parameters()) < 105e6


def test_preset_builder_and_errors(tmp_path):
    path = make_tiny_hf_model_from_preset(tmp_path / "p", "tiny", vocab_size=256, num_hidden_layers=1)
    config = AutoConfig.from_pretrained(str(path))
    assert config.num_hidden_layers == 1 and config.hidden_size == TINY_PRESETS["tiny"]["hidden_size"]
    with pytest.raises(ConfigError, match="preset"):
        make_tiny_hf_model_from_preset(tmp_path / "q", "huge")
    with pytest.raises(ConfigError, match="num_attention_heads"):
        make_tiny_hf_model(tmp_path / "r", hidden_size=60, num_attention_heads=8)
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        make_tiny_hf_model(tmp_path / "s", num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ConfigError, match="arch"):
        make_tiny_hf_model(tmp_path / "u", "gpt2")
