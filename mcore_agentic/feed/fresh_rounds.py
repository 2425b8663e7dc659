"""Fresh rounds: each round rolls out a new batch of prompts to the end; nothing survives the step.

Without a filter this is the plain step: one round of the step's prompts, every group trained. With
``algorithm.filter_groups`` (DAPO's dynamic sampling) the rounds go on with fresh batches until the step has
``data.train_batch_size`` informative groups; groups are taken in rollout-group then round order
(:func:`~mcore_agentic.feed.dynamic_sampling.allocate`), and the groups not taken are discarded with the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mcore_agentic.data.batch import Batch
from mcore_agentic.feed.dynamic_sampling import GroupPool, allocate
from mcore_agentic.feed.rounds import Collected, Rows
from mcore_agentic.rollout.driver import generate_sequences_sync


class FreshRounds:
    """The :class:`~mcore_agentic.feed.rounds.Schedule` of fresh rounds (see the module docstring)."""

    def __init__(self, roller: Any, metric: str | None, pad_id: int):
        self.roller = roller
        """The leader's rollout (:class:`~mcore_agentic.feed.feed.Roller`); its ``engine`` is None off a leader."""
        self.metric = metric
        self.pad_id = pad_id
        self.pool = GroupPool(metric)
        self.generated: list[Batch] = []
        self.pending: tuple[Rows, int] | None = None
        self.stall_s = 0.0

    def begin(self, rows: Rows, step: int, draw: Callable[[], Rows]) -> int:
        del draw
        self.pool = GroupPool(self.metric)
        self.generated, self.stall_s = [], 0.0
        self.start(rows, step, 0)
        return 1

    def start(self, rows: Rows, step: int, batch: int) -> None:
        self.pending = (rows, batch)

    def round(self, step: int) -> tuple[int, int, int]:
        assert self.pending is not None
        rows, batch = self.pending
        self.pending = None
        r = self.roller
        if not r.leads:
            return 0, 0, 0
        local_rows = r.placement.split_rows(rows)
        cfg = r.sampling(step, batch)
        rolled = generate_sequences_sync(local_rows, r.engine, r.tools, r.interactions, cfg, r.chat, r.executor)
        self.stall_s = max(self.stall_s, float(rolled.info.get("rollout/event_loop_max_stall_s", 0.0)))
        scored = r.score(rolled, [row.get("extra_info") or {} for row in local_rows for _ in range(cfg.n)])
        self.generated.append(scored)
        self.pool.add(scored)
        return self.pool.kept_groups, self.pool.spare_groups, 0

    def allocate(self, available: Sequence[int], wanted: int) -> list[int]:
        return allocate(available, wanted)

    def take(self, kept: int, spare: int, rounds: int) -> Collected:
        del rounds
        rows = self.pool.take(kept, spare, self.pad_id) if self.roller.leads else None
        generated, self.generated, self.pool = self.generated, [], GroupPool(self.metric)
        return Collected(rows=rows, generated=generated, group_rows=[], stall_s=self.stall_s)
