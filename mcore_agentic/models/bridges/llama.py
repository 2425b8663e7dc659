"""Bridge for ``LlamaForCausalLM`` (Llama 2/3, incl. Llama-3 rope scaling with Megatron's fixed constants)."""

from __future__ import annotations

from mcore_agentic.models.bridges._dense import DenseDecoderBridge


class LlamaBridge(DenseDecoderBridge):
    """Llama: no biases, no q/k norm."""

    architecture = "LlamaForCausalLM"
    qkv_bias = False
    qk_layernorm = False
