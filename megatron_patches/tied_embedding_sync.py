"""Patch ``tied_embedding_sync``: tied input/output embeddings under pipeline parallelism on CPU.

Target: ``megatron.core.models.common.language_module.language_module.LanguageModule
.setup_embeddings_and_output_layer``.

Reason: with PP > 1 and ``share_embeddings_and_output_weights`` the first stage owns
the word embedding and the last stage a copy used as output layer; the method makes
them equal at construction with ``weight.data = weight.data.cuda()`` followed by an
all-reduce over the embedding group. ``.cuda()`` raises without CUDA. The method now
runs with ``Tensor.cuda`` as the identity (``_cpu_torch.tensor_cuda_is_identity``) so
the all-reduce runs on the CPU tensor (gloo): identical result. Construction-time only.

Versions: megatron-core 0.16.x - 0.19.x (run and tested on 0.16.1 only; missing targets are skipped). Remove when the method stops moving the
weight (it is already on the model's device).
"""

from __future__ import annotations

from megatron_patches._base import Patch, PatchContext
from megatron_patches._cpu_torch import wrap_cuda_calls


def _install(ctx: PatchContext) -> None:
    wrap_cuda_calls(
        ctx,
        (
            (
                "megatron.core.models.common.language_module.language_module",
                "LanguageModule",
                "setup_embeddings_and_output_layer",
            ),
        ),
    )


PATCH = Patch(
    name="tied_embedding_sync",
    reason="tied embeddings at PP>1 are synchronised after weight.data.cuda()",
    install=_install,
)
