"""``Teacher``: the frozen teacher of on-policy distillation — its log-probs of the tokens the student sampled.

Its own Megatron model, built by the bridge from ``teacher.model_path`` (any architecture the bridges load: it may
be wider, deeper or a mixture of experts where the student is dense), with the actor's parallel layout (Megatron's
parallel state is one per process), no DDP wrapper, no optimizer and no gradients. It reads the student's rows as
they are — packed or padded, the same micro-batching as the reference — and normalises over the student's
tokenizer's ids at the student's log-prob temperature, so its numbers compare with the student's token for token.
With ``teacher.param_offload`` its parameters stay off the device between steps.
"""

from __future__ import annotations

from mcore_agentic.data.batch import Batch
from mcore_agentic.models.spec import ModelSpec
from mcore_agentic.parallel.layout import ParallelLayout
from mcore_agentic.workers.config import TeacherConfig
from mcore_agentic.workers.frozen import FrozenScorer


class Teacher(FrozenScorer):
    """Forward-only teacher model (see the module docstring)."""

    def __init__(self, cfg: TeacherConfig, spec: ModelSpec, layout: ParallelLayout) -> None:
        """``spec``: the teacher's model (:func:`mcore_agentic.trainer.build.teacher_spec`: its checkpoint, the
        student's vocabulary, temperature and parallel sizes)."""
        super().__init__(cfg, spec, layout, group="teacher")

    def compute_teacher_log_prob(self, batch: Batch, *, top_k: int = 0) -> Batch:
        """``batch`` plus ``teacher_log_probs`` [B, R] (0 on response padding) and, with ``top_k``
        (``algorithm.distillation.top_k``), the teacher's ``k`` most likely next tokens at every response position,
        ``teacher_top_k_ids`` and ``teacher_top_k_log_probs`` [B, R, k]."""
        out = self.score(batch, "Teacher.compute_teacher_log_prob", top_k=top_k)
        return batch.update({f"teacher_{k}": v for k, v in out.items()})


__all__ = ["Teacher"]
