"""``Teacher``: the frozen teacher of on-policy distillation — its log-probs of the tokens the student sampled.

Its own Megatron model, built by the bridge from ``teacher.model_path`` (any architecture the bridges load: it may
be wider, deeper or a mixture of experts where the student is dense), no DDP wrapper, no optimizer and no
gradients. It is split as the actor is (Megatron's parallel state, one per process), or with
``teacher.tensor_model_parallel_size`` over tensor-parallel groups of its own
(:mod:`mcore_agentic.parallel.own_layout`): each block of its ranks gathers the rows of the actor replicas among
them, scores them in one pass and hands each rank its own back. It reads the student's rows as
they are — packed or padded, the same micro-batching as the reference — and normalises over the student's
tokenizer's ids at the student's log-prob temperature, so its numbers compare with the student's token for token.
With ``teacher.param_offload`` its parameters stay off the device between steps.
"""

from __future__ import annotations

import dataclasses

import torch

from mcore_agentic.data.batch import Batch, repad_rollout_layout
from mcore_agentic.models.spec import ModelSpec
from mcore_agentic.parallel import comm
from mcore_agentic.parallel.layout import ParallelLayout
from mcore_agentic.parallel.own_layout import OwnLayout, own_tp_layout, own_tp_split
from mcore_agentic.workers.config import TeacherConfig
from mcore_agentic.workers.frozen import FrozenScorer
from mcore_agentic.workers.passes import MODEL_KEYS, require_keys


class Teacher(FrozenScorer):
    """Forward-only teacher model (see the module docstring)."""

    def __init__(self, cfg: TeacherConfig, spec: ModelSpec, layout: ParallelLayout) -> None:
        """``spec``: the teacher's model (:func:`mcore_agentic.trainer.build.teacher_spec`: its checkpoint, the
        student's vocabulary, temperature and parallel sizes); ``layout``: the actor's. With
        ``cfg.tensor_model_parallel_size`` the teacher's own groups are made here (collective over the world)."""
        self.own: OwnLayout | None = None
        if cfg.tensor_model_parallel_size is not None:
            self.own = own_tp_layout(cfg.tensor_model_parallel_size, layout)
            layout = self.own
            spec = dataclasses.replace(spec, parallel=own_tp_split(spec.parallel, cfg.tensor_model_parallel_size))
        super().__init__(cfg, spec, layout, group="teacher")

    def compute_teacher_log_prob(self, batch: Batch, *, top_k: int = 0) -> Batch:
        """``batch`` plus ``teacher_log_probs`` [B, R] (0 on response padding) and, with ``top_k``
        (``algorithm.distillation.top_k``), the teacher's ``k`` most likely next tokens at every response position,
        ``teacher_top_k_ids`` and ``teacher_top_k_log_probs`` [B, R, k]."""
        caller = "Teacher.compute_teacher_log_prob"
        if self.own is None:
            out = self.score(batch, caller, top_k=top_k)
        else:
            require_keys(batch, MODEL_KEYS, caller)
            rows, offsets, mine = _gather_block_rows(batch, self.own, MODEL_KEYS)
            out = _own_rows(self.score(rows, caller, top_k=top_k), offsets, mine, batch["responses"].shape[1])
        return batch.update({f"teacher_{k}": v for k, v in out.items()})


def _gather_block_rows(batch: Batch, layout: OwnLayout, keys: tuple[str, ...]) -> tuple[Batch, list[int], int]:
    """The rows of every student replica in this rank's TP block, each replica's once, in replica order, widened
    to common prompt and response widths: ``(rows, offsets, mine)`` — ``rows[offsets[i]:offsets[i + 1]]`` are the
    ``i``-th replica's, ``mine`` is this rank's replica's index.

    Tensors only (host calls over the block: the rows are host data): one all-gather of each member's
    ``(replica, rows, prompt width, response width)``, then one per key of the rows padded to the block's widest."""
    if layout.tensor_model_parallel_size == 1:
        return Batch(tensors={k: batch[k] for k in keys}), [0, len(batch)], 0
    group = layout.tp_group()
    prompt_len, response_len = batch["prompts"].shape[1], batch["responses"].shape[1]
    shapes = comm.all_gather_host(comm.to_host([layout.student_dp_rank, len(batch), prompt_len, response_len],
                                               torch.long), group=group)
    members = [tuple(int(x) for x in t.tolist()) for t in shapes]
    most_rows = max(m[1] for m in members)
    prompt, response = max(m[2] for m in members), max(m[3] for m in members)
    mine = repad_rollout_layout({k: batch[k] for k in keys}, pad_token_id=0, prompt_width=prompt,
                                response_width=response)  # pads sit where the attention mask is 0: any id does
    gathered: dict[str, list[torch.Tensor]] = {}
    for k in keys:
        t = mine[k]
        padded = torch.cat([t, t.new_zeros((most_rows - len(t), *t.shape[1:]))]) if len(t) < most_rows else t
        gathered[k] = comm.all_gather_host(comm.as_host(padded.contiguous()), group=group)
    first = {}  # each replica's rows from the first member holding them
    for i, (dp_rank, rows, _, _) in enumerate(members):
        first.setdefault(dp_rank, (i, rows))
    order = sorted(first)
    parts = [Batch(tensors={k: gathered[k][first[d][0]][: first[d][1]] for k in keys}) for d in order]
    offsets = [0]
    for part in parts:
        offsets.append(offsets[-1] + len(part))
    return Batch.concat(parts), offsets, order.index(layout.student_dp_rank)


def _own_rows(outputs: dict[str, torch.Tensor], offsets: list[int], mine: int, response_len: int) -> dict[str, torch.Tensor]:
    """This rank's replica's rows of the block's per-response-token ``outputs`` ``[B, R', ...]``, cut to its own
    response width ``response_len``."""
    lo, hi = offsets[mine], offsets[mine + 1]
    return {k: v[lo:hi, :response_len].contiguous() for k, v in outputs.items()}


__all__ = ["Teacher"]
