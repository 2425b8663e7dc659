"""``FrozenScorer``: a forward-only Megatron model that scores a batch's response tokens — what the reference and the
distillation teacher share.

No DDP wrapper, no optimizer, no gradients; the reference's micro-batching keys (``<group>.log_prob_*``) and,
with ``<group>.param_offload``, parameters off the device between calls.
"""

from __future__ import annotations

from typing import Protocol

import torch

from mcore_agentic.data.batch import Batch
from mcore_agentic.models.spec import ModelSpec
from mcore_agentic.parallel.layout import ParallelLayout
from mcore_agentic.workers.megatron_model import MegatronModel, MicroBatching
from mcore_agentic.workers.passes import MODEL_KEYS, log_prob_head, require_keys


class FrozenConfig(Protocol):
    log_prob_micro_batch_size_per_gpu: int
    use_dynamic_bsz: bool
    log_prob_max_token_len_per_gpu: int
    param_offload: bool


class FrozenScorer:
    """Log-probs of the response tokens under a frozen model (``spec``: its checkpoint, at ``spec.temperature``)."""

    def __init__(self, cfg: FrozenConfig, spec: ModelSpec, layout: ParallelLayout, *, group: str) -> None:
        """``group``: the config group (``ref``, ``teacher``) that error messages name."""
        self.cfg = cfg
        self.temperature = spec.temperature
        self.model = MegatronModel(spec, layout, optim=None)
        self.batching = MicroBatching(
            micro_batch_size=cfg.log_prob_micro_batch_size_per_gpu,
            use_dynamic_bsz=cfg.use_dynamic_bsz,
            max_token_len=cfg.log_prob_max_token_len_per_gpu,
            field=f"{group}.log_prob_max_token_len_per_gpu",
            pack=spec.use_remove_padding,
        )
        if cfg.param_offload:
            self.model.offload(params=True)

    def response_log_probs(self, batch: Batch, caller: str) -> torch.Tensor:
        """``[B, R]`` log-probs of ``batch``'s response tokens (0 on response padding)."""
        log_probs: torch.Tensor = self.score(batch, caller)["log_probs"]
        return log_probs

    def score(self, batch: Batch, caller: str, *, top_k: int = 0) -> dict[str, torch.Tensor]:
        """``log_probs`` ``[B, R]`` of ``batch``'s response tokens and, with ``top_k``, the model's ``k`` most likely
        tokens at each response position (``top_k_log_probs``, ``top_k_ids`` ``[B, R, k]``); 0 on padding."""
        require_keys(batch, MODEL_KEYS, caller)
        if self.cfg.param_offload:
            self.model.reload()
        try:
            return self.model.forward_only(
                batch, log_prob_head(self.model, self.temperature, with_entropy=False, top_k=top_k), self.batching
            )
        finally:
            if self.cfg.param_offload:
                self.model.offload(params=True)


__all__ = ["FrozenScorer"]
