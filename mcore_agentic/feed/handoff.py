"""The one hand-off between the feed and the trainer: a replica's rows of the step, typed and tensor-only.

:class:`StepRows` is everything the trainer receives from the rollout side of a step: :class:`ReplicaRows`
(this DP replica's rows, in training order: what crossed the wire, nothing else), the step's count of prompt
groups (the group statistics' size) and the step's rollout metrics, already reduced over the world. Its
``receipt`` is the feed's own (what a dump step needs to bring the trainer's values back to the leaders); the
trainer hands the :class:`StepRows` back to :meth:`~mcore_agentic.feed.feed.Feed.give_back` after the step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from mcore_agentic.data.batch import Batch


@dataclass(frozen=True)
class ReplicaRows:
    """This DP replica's rows of the step, padded to its own longest row (layout in :mod:`mcore_agentic.data.batch`)."""

    prompts: torch.Tensor
    """[B, P] int64, left-padded."""
    responses: torch.Tensor
    """[B, R] int64, right-padded: every turn after the prompt (tool results included)."""
    input_ids: torch.Tensor
    """[B, P+R]"""
    attention_mask: torch.Tensor
    """[B, P+R], 1 on real tokens."""
    position_ids: torch.Tensor
    """[B, P+R]"""
    response_mask: torch.Tensor
    """[B, R], the loss mask: 1 exactly on the tokens the policy sampled."""
    rollout_log_probs: torch.Tensor
    """[B, R] float32, the engine's log-probs of the sampled tokens."""
    seq_scores: torch.Tensor
    """[B] float32, each row's score (rule reward + tool rewards + interaction score + over-long penalty)."""
    group_index: torch.Tensor
    """[B] int64, a step-wide id of the row's prompt group (below the step's group count)."""
    truncated: torch.Tensor
    """[B] int64, 1 where the response budget cut the row."""
    weight_version: torch.Tensor
    """[B] int64, the oldest weight version that sampled the row's tokens (-1: none); older than the trainer's
    under partial rollouts."""
    routed_experts: torch.Tensor | None = None
    """[B, P+R, moe_layers, top_k] int16, the experts the engine chose per token (``actor.moe.routing_replay``)."""

    def __len__(self) -> int:
        return int(self.prompts.shape[0])

    def batch(self) -> Batch:
        """The rows as the workers take them (tensors only)."""
        return Batch(tensors={f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None})

    @classmethod
    def from_batch(cls, batch: Batch) -> ReplicaRows:
        names = {f.name for f in dataclasses.fields(cls)}
        extra = set(batch.tensors) - names
        if extra or batch.meta:
            raise ValueError(f"a replica's rows are the hand-off's tensors only; got {sorted(extra | set(batch.meta))}")
        return cls(**batch.tensors)


@dataclass
class StepRows:
    """What the feed hands the trainer for one step (identical structure on every rank)."""

    rows: ReplicaRows
    num_groups: int
    """The step's prompt groups (``rows.group_index`` is below it)."""
    metrics: dict[str, float]
    """The step's rollout metrics (``reward/*``, ``rollout/*``, the schedule's), reduced over the world."""
    step: int
    receipt: Any = field(default=None, repr=False)
    """The feed's own: the step's plan and the leader's rows, for a dump step's return trip."""
