"""Test helpers over Hugging Face checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mcore_agentic.models.hf_io import SafetensorsState


def load_hf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the (small) checkpoint at ``path``, eagerly."""
    state = SafetensorsState(path)
    return {name: state[name] for name in state}


def tiny_qwen2_config(*, vocab: int, layers: int = 2, max_positions: int = 128, tied: bool = False) -> Any:
    """A tiny Qwen2 config (hidden 64, ffn 96, GQA 4/2, fp32, no sliding window) for ``Qwen2ForCausalLM``."""
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_positions, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=tied, torch_dtype="float32", use_sliding_window=False,
    )
    config.architectures = ["Qwen2ForCausalLM"]
    return config


def redraw_weights(model: torch.nn.Module, scale: float) -> torch.nn.Module:
    """Re-draw every parameter from torch's global generator with a visible scale, so that log-probs carry signal
    (the std-0.02 init is near uniform): norm weights ``1 + 0.2 * N(0, 1)``, every other one ``scale * N(0, 1)``."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(scale * torch.randn_like(param))
    return model
