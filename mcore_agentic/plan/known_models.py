"""The ``config.json`` of the models ``configs/model/`` names, for planning before the checkpoint is downloaded.

:func:`resolve_hf_config` reads ``model.model_path``'s ``config.json`` when it is there; otherwise it looks the
directory's name up here (the published configs' fields that decide shapes; transformers fills the rest); a
missing tiny checkpoint under ``outputs/`` is the preset the trainer would create there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mcore_agentic.utils.errors import ConfigError

KNOWN: dict[str, dict[str, Any]] = {
    "Qwen3-30B-A3B": dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False),
    "Qwen3-8B": dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "Qwen2.5-7B-Instruct": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=3584,
        intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "Qwen2.5-3B-Instruct": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=2048,
        intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
        max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "Qwen2.5-0.5B-Instruct": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=896,
        intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "Llama-3.1-8B-Instruct": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=131072, rope_theta=500_000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}),
}


def resolve_hf_config(model_path: str | Path, field: str = "model.model_path") -> Any:
    """The transformers config of ``model_path``: its ``config.json``, else the published one of a model named like
    the directory (:data:`KNOWN`)."""
    from transformers import AutoConfig

    path = Path(model_path)
    if (path / "config.json").is_file():
        from mcore_agentic.models.hf_io import load_hf_config

        return load_hf_config(path)
    if path.parts and path.parts[0] == "outputs" or "outputs/models/" in path.as_posix():
        from mcore_agentic.models.tiny import preset_for_path, tiny_preset_hf_config

        return tiny_preset_hf_config(preset_for_path(path))  # the tiny checkpoint the trainer would create
    if path.name in KNOWN:
        fields = dict(KNOWN[path.name])
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    raise ConfigError(field, f"{model_path!r} has no config.json and is none of the models the planner knows "
                             f"({', '.join(sorted(KNOWN))}): point it at a checkpoint directory (only config.json "
                             "is read)")
