"""Tiny random Hugging Face checkpoints (Qwen2 / Qwen3 / Qwen3-MoE / Llama) built from a config,
saved together with the matching offline Qwen tokenizer. For tests, the embedded
default job and benchmarks; never downloads anything.

A checkpoint directory holds config.json, model.safetensors (fp32), generation_config.json
and the tokenizer files. The model's vocabulary is ``len(tokenizer)`` rounded up to a
multiple of 64; the padding ids are never produced by ``generate`` (they are listed in
``generation_config.suppress_tokens``; other samplers must mask logits >= ``len(tokenizer)``).
The same arguments give byte-identical files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from mcore_agentic.models.tokenizer import ChatTemplateName, load_qwen_tokenizer
from mcore_agentic.utils.errors import ConfigError

TinyArch = Literal["qwen2", "qwen3", "qwen3_moe", "llama"]
VOCAB_MULTIPLE = 64

# Named size presets: keyword arguments for make_tiny_hf_model.
TINY_PRESETS: dict[str, dict[str, Any]] = {
    # The unit-test size: logits over ~4k ids, a forward pass in milliseconds on CPU.
    "tiny": dict(
        vocab_size=4096,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 32: the smallest vLLM's CPU attention kernels take
        num_key_value_heads=2,
        intermediate_size=128,
    ),
    # The unit-test size as a mixture of experts: Qwen3-MoE, 8 experts of 32 (top-2) in each of the 2 layers.
    "tiny_moe": dict(
        arch="qwen3_moe",
        vocab_size=4096,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
    # The tiny Qwen2 with a 32k context and 16384 BPE ranks, for agent harnesses' long prompts (configs/harness_tiny.yaml).
    "tiny_long": dict(
        vocab_size=16384,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=32768,
    ),
    # ~101M parameters with the qwen2 arch (untied, 16384 BPE ranks -> 16448 ids); for bench/.
    "100m": dict(
        vocab_size=16384,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
        max_position_embeddings=4096,
    ),
}


def padded_vocab_size(num_tokens: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """``num_tokens`` rounded up to a multiple of ``multiple`` (the embedding table's rows)."""
    return -(-num_tokens // multiple) * multiple


def tiny_hf_config(
    arch: TinyArch,
    *,
    model_vocab_size: int,
    bos_token_id: int,
    eos_token_id: int,
    pad_token_id: int,
    hidden_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    tie_word_embeddings: bool,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int | None = None,
):
    """The transformers config object for ``arch`` (no weights). The ``*expert*`` arguments are Qwen3-MoE's
    (``moe_intermediate_size`` None: ``intermediate_size // 4``); every layer of the tiny MoE is sparse."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    if hidden_size % num_attention_heads:
        raise ConfigError("num_attention_heads", f"{num_attention_heads} does not divide hidden_size={hidden_size}")
    if num_attention_heads % num_key_value_heads:
        raise ConfigError(
            "num_key_value_heads",
            f"{num_key_value_heads} does not divide num_attention_heads={num_attention_heads}",
        )
    common = dict(
        vocab_size=model_vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        dtype="float32",
    )
    if arch == "qwen2":
        return Qwen2Config(**common, rms_norm_eps=1e-6, rope_theta=1_000_000.0, use_sliding_window=False)
    if arch == "qwen3":
        head_dim = hidden_size // num_attention_heads
        return Qwen3Config(
            **common, head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=1_000_000.0, use_sliding_window=False
        )
    if arch == "qwen3_moe":
        head_dim = hidden_size // num_attention_heads
        return Qwen3MoeConfig(
            **common, head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=1_000_000.0, use_sliding_window=False,
            num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=moe_intermediate_size or intermediate_size // 4, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
        )
    if arch == "llama":
        return LlamaConfig(**common, rms_norm_eps=1e-5, rope_theta=500_000.0)
    raise ConfigError("arch", f"unknown tiny-model arch {arch!r}; use one of qwen2, qwen3, qwen3_moe, llama")


def make_tiny_hf_model(
    out_dir: str | os.PathLike,
    arch: TinyArch = "qwen2",
    *,
    vocab_size: int | None = 4096,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    chat_template: ChatTemplateName = "qwen2_5",
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int | None = None,
) -> Path:
    """Write a random fp32 HF checkpoint of ``arch`` plus its tokenizer to ``out_dir``; return it.

    ``vocab_size`` is the tokenizer's BPE rank count (see
    :func:`mcore_agentic.models.tokenizer.build_qwen_tokenizer`; None = full Qwen vocab).
    Weights come from transformers' own initialisation under ``torch.manual_seed(seed)``.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = load_qwen_tokenizer(chat_template, vocab_size)
    num_tokens = len(tokenizer)
    model_vocab = padded_vocab_size(num_tokens)
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id
    config = _config_for(tokenizer, arch, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                         num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
                         intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
                         tie_word_embeddings=tie_word_embeddings, num_experts=num_experts,
                         num_experts_per_tok=num_experts_per_tok, moe_intermediate_size=moe_intermediate_size)
    # fork_rng keeps the caller's global RNG state untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        # ids past the tokenizer exist only to pad the embedding table
        suppress_tokens=list(range(num_tokens, model_vocab)) or None,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out), save_jinja_files=False)
    return out


def _config_for(tokenizer: Any, arch: TinyArch, **sizes: Any) -> Any:
    """The HF config of a tiny model over ``tokenizer``'s vocabulary (padded), with Qwen's special ids."""
    pad_id = tokenizer.pad_token_id
    return tiny_hf_config(
        arch,
        model_vocab_size=padded_vocab_size(len(tokenizer)),
        bos_token_id=pad_id,  # Qwen uses <|endoftext|> as bos and never prepends it
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad_id,
        **sizes,
    )


def preset_for_path(path: str | os.PathLike) -> str:
    """The preset a missing checkpoint under ``outputs/`` is created from: ``100m``, ``moe`` or ``long`` in its name
    pick those, anything else the tiny Qwen2."""
    name = Path(path).name
    if "100m" in name:
        return "100m"
    return "tiny_moe" if "moe" in name else ("tiny_long" if "long" in name else "tiny")


def tiny_preset_hf_config(preset: str) -> Any:
    """The HF config :func:`make_tiny_hf_model_from_preset` writes for ``preset`` (no weights, nothing written)."""
    if preset not in TINY_PRESETS:
        raise ConfigError("preset", f"unknown tiny-model preset {preset!r}; use one of {sorted(TINY_PRESETS)}")
    kwargs = dict(TINY_PRESETS[preset])
    tokenizer = load_qwen_tokenizer("qwen2_5", kwargs.pop("vocab_size"))
    arch = kwargs.pop("arch", "qwen2")
    kwargs.setdefault("max_position_embeddings", 2048)
    kwargs.setdefault("tie_word_embeddings", False)
    config = _config_for(tokenizer, arch, **kwargs)
    config.architectures = [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                             "llama": "LlamaForCausalLM"}[arch]]
    return config


def make_tiny_hf_model_from_preset(out_dir: str | os.PathLike, preset: str, **overrides: Any) -> Path:
    """:func:`make_tiny_hf_model` with the keyword arguments of ``TINY_PRESETS[preset]`` (then ``overrides``)."""
    if preset not in TINY_PRESETS:
        raise ConfigError("preset", f"unknown tiny-model preset {preset!r}; use one of {sorted(TINY_PRESETS)}")
    return make_tiny_hf_model(out_dir, **{**TINY_PRESETS[preset], **overrides})
