"""Safetensors checkpoint io: single-file and sharded save/load, lazy reads, config round-trip."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from mcore_agentic.models.hf_io import (
    INDEX_FILE,
    SafetensorsState,
    load_hf_config,
    save_hf_checkpoint,
)
from tests.helpers.hf import load_hf_state_dict


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.w": torch.randn(16, 8, generator=gen) for i in range(5)}


def test_single_file_roundtrip_with_config(tmp_path) -> None:
    config = transformers.Qwen2Config(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=16)
    config.architectures = ["Qwen2ForCausalLM"]
    tensors = _tensors()
    files = save_hf_checkpoint(tmp_path, iter(tensors.items()), config)
    assert [f.name for f in files] == ["model.safetensors"]
    loaded = load_hf_state_dict(tmp_path)
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert load_hf_config(tmp_path).architectures == ["Qwen2ForCausalLM"]


def test_sharded_roundtrip(tmp_path) -> None:
    tensors = _tensors()
    files = save_hf_checkpoint(tmp_path, tensors, max_shard_bytes=2 * 16 * 8 * 4)
    assert len(files) == 3 and files[0].name == "model-00001-of-00003.safetensors"
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(tensors)
    state = SafetensorsState(tmp_path)
    assert len(state) == 5 and "model.layers.4.w" in state
    assert torch.equal(state["model.layers.3.w"], tensors["model.layers.3.w"])
    with pytest.raises(KeyError):
        state["nope"]


def test_errors(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="safetensors"):
        SafetensorsState(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_config(tmp_path)
    with pytest.raises(ValueError, match="given twice"):
        save_hf_checkpoint(tmp_path, [("a", torch.zeros(1)), ("a", torch.zeros(1))])
