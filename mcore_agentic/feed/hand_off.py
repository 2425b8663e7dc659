"""The hand-off: what the feed gives the trainer for one step (:class:`StepRows`), with this DP replica's rows as
tensors only (:class:`ReplicaRows`: the layout and the fields of :mod:`.fields`' table).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from mcore_agentic.data.batch import LAYOUT_KEYS, Batch
from mcore_agentic.feed.fields import always_fields, field_names, select


@dataclass(frozen=True)
class ReplicaRows:
    """This DP replica's rows of the step, padded to its own longest row (layout in :mod:`mcore_agentic.data.batch`):
    the layout and the run's fields of the seam's table (:mod:`.fields`), tensors only."""

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
    fields: Mapping[str, torch.Tensor]
    """The table's fields the run sends (:data:`.fields.FIELDS`: every run's, and each optional one whose setting is
    on), by name, in the table's order."""

    def __getattr__(self, name: str) -> torch.Tensor | None:
        """A field of the table by name (``rows.turn_rewards``); None when this run does not send it."""
        if name != "fields" and name in field_names():
            return self.fields.get(name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __len__(self) -> int:
        return int(self.prompts.shape[0])

    def batch(self) -> Batch:
        """The rows as the workers take them (tensors only)."""
        return Batch(tensors={**{k: getattr(self, k) for k in LAYOUT_KEYS}, **self.fields})

    @classmethod
    def from_batch(cls, batch: Batch) -> ReplicaRows:
        """The hand-off of an exchanged batch: the layout and the table's fields, in their dtypes; any other tensor,
        any per-row object, a missing layout key or a missing field of every run is refused."""
        extra = set(batch.tensors) - set(LAYOUT_KEYS) - field_names()
        if extra or batch.meta:
            raise ValueError(f"a replica's rows are the hand-off's tensors only; got {sorted(extra | set(batch.meta))}")
        missing = (set(LAYOUT_KEYS) | always_fields()) - set(batch.tensors)
        if missing:
            raise ValueError(f"a replica's rows lack {sorted(missing)}")
        wrong = [f"{f.name} is {batch[f.name].dtype}, not {f.dtype}" for f in select(set(batch.tensors) - set(LAYOUT_KEYS))
                 if batch[f.name].dtype != f.dtype]
        if wrong:
            raise ValueError(f"a replica's rows hold fields of other dtypes than the table's: {'; '.join(wrong)}")
        fields = {f.name: batch.tensors[f.name] for f in select(set(batch.tensors) - set(LAYOUT_KEYS))}
        return cls(**{k: batch.tensors[k] for k in LAYOUT_KEYS}, fields=fields)


@dataclass
class StepRows:
    """What the feed hands the trainer for one step (identical structure on every rank)."""

    rows: ReplicaRows
    num_rows: int
    """The step's rows over every replica: ``sequences_per_step``, or more when agent episodes trained several
    samples (then a multiple of every mini-batch count times DP, filler rows included). Also the bound on the
    step's group and episode ids (``rows.group_index``, ``rows.episode_index``)."""
    metrics: dict[str, float]
    """The step's rollout metrics (``reward/*``, ``rollout/*``, the schedule's), reduced over the world."""
    step: int
    receipt: Any = field(default=None, repr=False)
    """The feed's own: the step's :class:`~.rounds.Rollout` (its plan and the leader's rows), for a dump step's return
    trip."""
