"""Bridge for ``Qwen2ForCausalLM`` (Qwen2 / Qwen2.5): Llama layout plus q/k/v biases."""

from __future__ import annotations

from mcore_agentic.models.bridges._dense import DenseDecoderBridge


class Qwen2Bridge(DenseDecoderBridge):
    """Qwen2: biases on q_proj/k_proj/v_proj (Megatron ``add_qkv_bias``), none elsewhere."""

    architecture = "Qwen2ForCausalLM"
    qkv_bias = True
    qk_layernorm = False
