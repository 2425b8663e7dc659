"""Patch ``transformer_devices``: transformer blocks, GPTModel and RoPE allocate on CPU.

Targets (module-global ``torch`` rebound to the CPU view, see ``_cpu_torch``):
``megatron.core.transformer.{module,attention,dot_product_attention,transformer_layer,
transformer_block,utils}``, ``megatron.core.models.gpt.gpt_model``,
``megatron.core.models.common.embeddings.rotary_pos_embedding``,
``megatron.core.models.common.embeddings.language_model_embedding``, e.g.
``RotaryEmbedding.__init__`` (``inv_freq`` on ``torch.cuda.current_device()``),
``DotProductAttention`` (mask buffers), ``transformer.utils.get_default_causal_mask``
(``device="cuda"``), ``megatron.core.utils.GlobalMemoryBuffer.get_tensor`` (the
attention score buffer, on ``torch.cuda.current_device()``).

(``LanguageModule.setup_embeddings_and_output_layer``'s ``.cuda()`` is the separate
``tied_embedding_sync`` patch.)

Reason: CUDA hard-coded on the forward path. No numerical change.

Versions: megatron-core 0.16.x - 0.19.x (run and tested on 0.16.1 only; missing targets are skipped). Remove when megatron-core allocates on the
input's device on these paths.
"""

from __future__ import annotations

from megatron_patches._base import Patch, PatchContext
from megatron_patches._cpu_torch import rebind_torch

MODULES = (
    "megatron.core.transformer.module",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.mlp",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.language_model_embedding",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.utils",
)


def _install(ctx: PatchContext) -> None:
    rebind_torch(ctx, MODULES)


PATCH = Patch(
    name="transformer_devices",
    reason="GPTModel/attention/RoPE allocate on torch.cuda.current_device() or device='cuda'",
    install=_install,
)
