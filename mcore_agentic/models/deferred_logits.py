"""Defer a ``GPTModel``'s output layer: the model returns the layer's prepared input, never the logits.

megatron-core's ``GPTModel`` ends with ``ColumnParallelLinear`` (``output_layer``): it gathers the sequence-parallel
hidden states over TP (or copies them into the tensor-parallel region, whose backward all-reduces), multiplies by
this rank's ``[V / TP, h]`` weight (the tied embedding's when ``share_embeddings_and_output_weights``) and returns
the logits, which the model transposes to ``[b, s, V / TP]``. :func:`defer_output_layer` replaces that layer's
forward on one model chunk (its instance attribute; the class, the parameters and their names are untouched, so
checkpoints, the weight export and DDP see the same model) with the input preparation alone. The caller then makes
the logits in chunks of tokens (:class:`mcore_agentic.parallel.chunked_logits.HiddenStates`) with
:func:`output_weight`, the weight the matmul would have used.
"""

from __future__ import annotations

import types
from typing import Any

import torch


def _deferred_forward(self: Any, input_: torch.Tensor, weight: torch.Tensor | None = None,
                      runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
    """``ColumnParallelLinear.forward`` without its matmul: the input as the matmul would have read it."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    if self.sequence_parallel:
        return gather_from_sequence_parallel_region(input_, group=self.tp_group), None
    if self.tp_group is not None and self.tp_group.size() > 1:
        return copy_to_tensor_model_parallel_region(input_, group=self.tp_group), None
    return input_, None


def defer_output_layer(model: Any) -> bool:
    """Defer ``model``'s (an unwrapped ``GPTModel`` chunk) output layer; False when the chunk has none (not the last
    pipeline stage) or it is not megatron-core's ``ColumnParallelLinear`` (a value head)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    layer = getattr(model, "output_layer", None)
    if not getattr(model, "post_process", False) or type(layer) is not ColumnParallelLinear:
        return False
    layer.forward = types.MethodType(_deferred_forward, layer)
    return True


def output_weight(model: Any) -> torch.Tensor:
    """The ``[V / TP, h]`` weight ``model``'s (a last-stage ``GPTModel`` chunk) output layer multiplies by: the tied
    embedding's when they share, as ``GPTModel`` passes it, else the layer's own."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


__all__ = ["defer_output_layer", "output_weight"]
