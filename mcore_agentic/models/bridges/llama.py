"""Bridge for ``LlamaForCausalLM`` (Llama 2/3, incl. Llama-3 rope scaling with Megatron's fixed constants)."""

from __future__ import annotations

from typing import Any

from mcore_agentic.models.bridge import config_error
from mcore_agentic.models.bridges._dense import DenseDecoderBridge


class LlamaBridge(DenseDecoderBridge):
    """Llama: no biases, no q/k norm."""

    architecture = "LlamaForCausalLM"
    qkv_bias = False
    qk_layernorm = False

    def check_hf_config(self, hf_config: Any) -> None:
        super().check_hf_config(hf_config)
        if hf_config.attention_bias:
            raise config_error("attention_bias", "True is not supported (it adds an o_proj bias): set it to false")
