"""Where the rollout engines live: groups of ``rollout.tensor_model_parallel_size`` consecutive ranks.

The rollout's data parallelism is decided here, independently of the training layout:
``world_size / rollout_tp`` groups of consecutive ranks, each with one engine on its first
rank (the *leader*), which generates — and runs the tools of — the group's contiguous share
of a step's prompts. Other ranks hold no engine; they join the weight export (a collective)
and receive the rollout through the trainer's all-gather.

So training TP/PP/CP replicas never generate the same prompts twice (a TP=8 actor on
8 GPUs with rollout TP=1 runs 8 engines over 8 disjoint shares), and an SGLang engine of
TP=k spans the k GPUs of its group, launched by the leader from GPU ``LOCAL_RANK``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class RolloutPlacement:
    """This rank's place among the rollout groups."""

    world_size: int
    rank: int
    tensor_parallel_size: int
    """Ranks per rollout engine (``rollout.tensor_model_parallel_size``)."""

    def __post_init__(self) -> None:
        # The config's rule (config.rules.check_rollout_groups) names the key; this guards direct use.
        if self.tensor_parallel_size < 1 or self.world_size % self.tensor_parallel_size:
            raise ValueError(f"rollout groups of {self.tensor_parallel_size} ranks do not tile a world of {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a world of {self.world_size}")

    @property
    def num_groups(self) -> int:
        """Rollout engines in the run (the rollout's data-parallel size)."""
        return self.world_size // self.tensor_parallel_size

    @property
    def group_index(self) -> int:
        """Which group this rank belongs to (0-based, in rank order)."""
        return self.rank // self.tensor_parallel_size

    @property
    def leader_rank(self) -> int:
        """Global rank of this group's first rank, the one holding the engine."""
        return self.group_index * self.tensor_parallel_size

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader_rank

    def split_rows(self, rows: Sequence[T]) -> list[T]:
        """This group's contiguous share of a step's prompts (they must split evenly over the groups)."""
        if len(rows) % self.num_groups:
            raise ValueError(f"{len(rows)} prompts do not split over {self.num_groups} rollout engines")
        k = len(rows) // self.num_groups
        return list(rows[self.group_index * k : (self.group_index + 1) * k])

    def strided_rows(self, rows: Sequence[T]) -> list[T]:
        """This group's share of rows that need not split evenly (validation): every ``num_groups``-th row."""
        return list(rows[self.group_index :: self.num_groups])


__all__ = ["RolloutPlacement"]
