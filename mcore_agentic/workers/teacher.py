"""``Teacher``: the frozen teacher of on-policy distillation — its log-probs of the tokens the student sampled.

Its own Megatron model, built by the bridge from ``teacher.model_path`` (any architecture the bridges load: it may
be wider, deeper or a mixture of experts where the student is dense), with the actor's parallel layout (Megatron's
parallel state is one per process), no DDP wrapper, no optimizer and no gradients. It reads the student's rows as
they are — packed or padded, the same micro-batching as the reference — and normalises over the student's
tokenizer's ids at the student's log-prob temperature, so its numbers compare with the student's token for token.
With ``teacher.param_offload`` its parameters stay off the device between steps.
"""

from __future__ import annotations

import torch

from mcore_agentic.data.batch import Batch
from mcore_agentic.models.spec import ModelSpec
from mcore_agentic.parallel.layout import ParallelLayout
from mcore_agentic.workers.config import TeacherConfig
from mcore_agentic.workers.engine import MegatronEngine, MicroBatching
from mcore_agentic.workers.passes import MODEL_KEYS, log_prob_head, require_keys


class Teacher:
    """Forward-only teacher model (see the module docstring)."""

    def __init__(self, cfg: TeacherConfig, spec: ModelSpec, layout: ParallelLayout) -> None:
        """``spec``: the teacher's model (:func:`mcore_agentic.trainer.build.teacher_spec`: its checkpoint, the
        student's vocabulary, temperature and parallel sizes)."""
        self.cfg = cfg
        self.temperature = spec.temperature
        self.engine = MegatronEngine(spec, layout, optim=None)
        self.batching = MicroBatching(
            micro_batch_size=cfg.log_prob_micro_batch_size_per_gpu,
            use_dynamic_bsz=cfg.use_dynamic_bsz,
            max_token_len=cfg.log_prob_max_token_len_per_gpu,
            field="teacher.log_prob_max_token_len_per_gpu",
            pack=spec.use_remove_padding,
        )
        if cfg.param_offload:
            self.engine.offload(params=True)

    def compute_teacher_log_prob(self, batch: Batch) -> Batch:
        """``batch`` plus ``teacher_log_probs`` [B, R] (0 on response padding)."""
        require_keys(batch, MODEL_KEYS, "Teacher.compute_teacher_log_prob")
        if self.cfg.param_offload:
            self.engine.reload()
        try:
            out = self.engine.forward_only(
                batch, log_prob_head(self.engine, self.temperature, with_entropy=False), self.batching
            )
        finally:
            if self.cfg.param_offload:
                self.engine.offload(params=True)
        log_probs: torch.Tensor = out["log_probs"]
        return batch.update({"teacher_log_probs": log_probs})


__all__ = ["Teacher"]
