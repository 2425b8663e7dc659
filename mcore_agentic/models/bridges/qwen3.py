"""Bridge for ``Qwen3ForCausalLM``: Llama layout plus per-head q/k RMSNorm and an explicit head_dim."""

from __future__ import annotations

from mcore_agentic.models.bridges._dense import DenseDecoderBridge


class Qwen3Bridge(DenseDecoderBridge):
    """Qwen3 (dense): ``q_norm``/``k_norm`` map to Megatron's ``q_layernorm``/``k_layernorm``."""

    architecture = "Qwen3ForCausalLM"
    qkv_bias = False
    qk_layernorm = True
