"""Bridge for ``Qwen3ForCausalLM``: Llama layout plus per-head q/k RMSNorm and an explicit head_dim."""

from __future__ import annotations

from typing import Any

from mcore_agentic.models.bridge import config_error
from mcore_agentic.models.bridges._dense import DenseDecoderBridge


class Qwen3Bridge(DenseDecoderBridge):
    """Qwen3 (dense): ``q_norm``/``k_norm`` map to Megatron's ``q_layernorm``/``k_layernorm``."""

    architecture = "Qwen3ForCausalLM"
    qkv_bias = False
    qk_layernorm = True

    def check_hf_config(self, hf_config: Any) -> None:
        super().check_hf_config(hf_config)
        if hf_config.attention_bias:
            raise config_error("attention_bias", "True is not supported (it adds an o_proj bias): set it to false")
