"""``Reference``: the frozen initial policy — reference log-probs for the KL terms.

Its own Megatron model, built by the bridge from the same HF checkpoint as the
actor (so it never changes when the actor trains), with no DDP wrapper, no
optimizer and no gradients. With ``ref.param_offload`` its parameters stay off
the device between calls and come back only for :meth:`compute_ref_log_prob`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mcore_agentic.data.batch import Batch
from mcore_agentic.models.spec import ModelSpec
from mcore_agentic.parallel.layout import ParallelLayout
from mcore_agentic.workers.config import RefConfig
from mcore_agentic.workers.frozen import FrozenScorer


class Reference(FrozenScorer):
    """Forward-only copy of the initial policy."""

    def __init__(self, cfg: RefConfig, spec: ModelSpec, layout: ParallelLayout) -> None:
        """``spec``: the run's model (the actor's checkpoint; log-probs at its ``temperature``)."""
        super().__init__(cfg, spec, layout, group="ref")

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """``batch`` plus ``ref_log_probs`` [B, R] (0 on response padding)."""
        return batch.update({"ref_log_probs": self.response_log_probs(batch, "Reference.compute_ref_log_prob")})

    def load_hf_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Make ``weights`` (HF names, full tensors) the new KL anchor, e.g. the policy after an SFT warm start.

        Offloaded parameters are brought back for the copy and offloaded again after it.
        """
        if self.cfg.param_offload:
            self.model.reload()
        try:
            self.model.bridge.load_hf_weights(self.model.chunks, weights)
        finally:
            if self.cfg.param_offload:
                self.model.offload(params=True)


__all__ = ["Reference"]
