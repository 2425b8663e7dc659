"""Tiny random HF checkpoints (Qwen2, Qwen3, Qwen3-MoE, Llama) for the bridge tests, saved as safetensors.

Every parameter is re-drawn with a visible scale (norm weights around 1, biases
non-zero) so that a swapped or transposed mapping changes the logits.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from tests.helpers.hf import redraw_weights

VOCAB = 500  # not a multiple of 128: exercises vocabulary padding


def make_tiny_hf(
    arch: str, path: Path, *, tied: bool = False, layers: int = 2, kv_heads: int = 2, seed: int = 0
) -> Path:
    """Build and save a tiny random ``arch`` model under ``path`` (4 query heads, ``kv_heads`` KV heads)."""
    import transformers

    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=128, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=tied, torch_dtype="float32",
    )
    if arch == "Qwen2ForCausalLM":
        config = transformers.Qwen2Config(**common)
    elif arch == "Qwen3ForCausalLM":
        config = transformers.Qwen3Config(head_dim=24, **common)  # head_dim != hidden/heads, as in real Qwen3
    elif arch == "Qwen3MoeForCausalLM":
        config = transformers.Qwen3MoeConfig(
            head_dim=24, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[], **common,
        )
    elif arch == "LlamaForCausalLM":
        # Llama-3 rope scaling with Megatron's fixed constants; head_dim 16 has wavelengths beyond 8192.
        rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}
        config = transformers.LlamaConfig(rope_scaling=rope_scaling, **common)
    else:
        raise ValueError(arch)
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = redraw_weights(getattr(transformers, arch)(config).eval(), 0.15)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def hf_logits(path: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [b, s, vocab] of the saved HF model (eager attention, fp32)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), torch_dtype=torch.float32, attn_implementation="eager", local_files_only=True
    ).eval()
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def eval_chunks(path: str | Path, par: Any) -> tuple[Any, list[Any]]:
    """``(bridge, chunks)``: the checkpoint's Megatron model chunks for the parallel layout ``par`` (parallel state
    already initialised), in eval mode, with the checkpoint's weights."""
    from mcore_agentic.models.hf_io import load_hf_config
    from mcore_agentic.models.registry import get_bridge

    hf_config = load_hf_config(path)
    bridge = get_bridge(hf_config)
    tcfg = bridge.transformer_config(hf_config, par)
    chunks = bridge.build_model(hf_config, tcfg)
    for chunk in chunks:
        chunk.eval()
    bridge.load_hf_weights(chunks, path)
    return bridge, chunks


def pack(obj: object) -> bytes:
    """Serialize a rank's result to plain bytes.

    ``run_distributed`` sends results through a torch multiprocessing queue, which shares
    tensors through the sending process; once that rank has exited the parent can fail to
    fetch them (FileNotFoundError under load). Bytes travel by value.
    """
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def unpack(data: bytes) -> object:
    """Inverse of :func:`pack`."""
    return torch.load(io.BytesIO(data), weights_only=False)
