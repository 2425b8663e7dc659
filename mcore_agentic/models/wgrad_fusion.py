"""``gradient_accumulation_fusion`` without apex: TE's linears fuse, megatron's own output layer does not.

megatron-core hands ``config.gradient_accumulation_fusion`` to every TransformerEngine linear as
``fuse_wgrad_accumulation``: TE's GEMM accumulates the weight gradient straight into Megatron's fp32 ``main_grad``,
with TE's own kernel. Its own ``ColumnParallelLinear`` — ``GPTModel``'s output layer, under the TE spec too — takes
the same flag only with apex's ``fused_weight_gradient_mlp_cuda`` and refuses to be built without it
(``tensor_parallel/layers.py``). ``GPTModel`` builds the output layer and its transformer layers from the one config
it is given, so without apex :func:`split_wgrad_fusion` gives the model a copy of the config with the flag off (the
output layer's plain path: its weight gradient lands in ``.grad``, which Megatron's DDP adds into ``main_grad``) and
every transformer layer the run's config, through :class:`OwnConfigLayer`. The output layer stays megatron-core's
``ColumnParallelLinear``, so :mod:`mcore_agentic.models.deferred_logits` defers it as before.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from mcore_agentic.models.transformer_impl import wgrad_fusion_kernel_available


class OwnConfigLayer(TransformerLayer):
    """A ``TransformerLayer`` built with the config its spec names (``layer_config``), not its block's."""

    def __init__(self, config: Any, submodules: Any, *, layer_config: Any, **kwargs: Any) -> None:
        super().__init__(config=layer_config, submodules=submodules, **kwargs)


def split_wgrad_fusion(tcfg: Any, layer_spec: ModuleSpec) -> tuple[Any, ModuleSpec]:
    """``(the config to build the GPTModel with, its layer spec)`` for ``tcfg`` and a ``TransformerLayer`` spec.

    Unchanged unless ``tcfg.gradient_accumulation_fusion`` is on and apex's kernel is missing: then the model's
    config is a copy of ``tcfg`` with the flag off (its output layer is built unfused) and the layers are
    :class:`OwnConfigLayer` built with ``tcfg`` itself (every TE linear in them fuses)."""
    if not tcfg.gradient_accumulation_fusion or wgrad_fusion_kernel_available():
        return tcfg, layer_spec
    if layer_spec.module is not TransformerLayer:
        raise TypeError(f"split_wgrad_fusion takes a TransformerLayer spec, not {layer_spec.module!r}")
    model_config = copy.copy(tcfg)  # a shallow copy: __post_init__ has run on tcfg already
    model_config.gradient_accumulation_fusion = False
    layers = dataclasses.replace(layer_spec, module=OwnConfigLayer, params={**layer_spec.params, "layer_config": tcfg})
    return model_config, layers


__all__ = ["OwnConfigLayer", "split_wgrad_fusion"]
