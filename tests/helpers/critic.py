"""Test helper: a critic's weights as full HF tensors plus its value head, for comparisons across layouts."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_agentic.models.bridge import unwrap_model


def critic_weights(critic) -> dict[str, torch.Tensor]:
    """Full HF tensors of the body plus ``value_head.weight`` [1, H] (collective, same on every rank)."""
    model = critic.model
    weights = model.export_hf_weights()
    layout = model.layout
    if layout.is_pipeline_last_stage:
        head = unwrap_model(model.chunks[-1]).output_layer.weight.detach().clone()
    else:
        head = torch.empty(1, model.tcfg.hidden_size, dtype=model.dtype)
    if layout.pipeline_model_parallel_size > 1:
        dist.broadcast(head, group=layout.pp_group(), group_src=layout.pipeline_model_parallel_size - 1)
    weights["value_head.weight"] = head
    return weights
