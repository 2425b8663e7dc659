"""Fresh rounds: each round rolls out a new batch of prompts to the end; nothing survives the step.

Without a filter this is the plain step: one round of the step's prompts, every group trained. With
``algorithm.filter_groups`` (DAPO's dynamic sampling) the rounds go on with fresh batches until the step has
``data.train_batch_size`` informative groups; groups are taken in rollout-group then round order
(:func:`~mcore_agentic.feed.dynamic_sampling.allocate`), and the groups not taken are discarded with the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mcore_agentic.data.batch import Batch, concat_rollouts
from mcore_agentic.feed.dynamic_sampling import group_rows, informative
from mcore_agentic.feed.rounds import Rollout, RoundsResult, Rows, allocate


@dataclass
class GroupPool:
    """A rollout leader's scored groups over one step's rounds: informative ones and spares, in round order.
    ``metric`` None: no filter, every group is kept."""

    metric: str | None
    kept: list[Batch] = field(default_factory=list)
    spare: list[Batch] = field(default_factory=list)
    kept_groups: int = 0
    spare_groups: int = 0

    def add(self, batch: Batch) -> tuple[int, int]:
        """Sort ``batch``'s groups into the pool; returns (informative, spare) group counts of this round."""
        if self.metric is None:  # no filter: the whole batch is kept as it came
            n = len(dict.fromkeys(batch["uid"]))
            self.kept.append(batch)
            self.kept_groups += n
            return n, 0
        groups = group_rows(batch)
        flags = informative(batch, self.metric)
        keep = [i for rows, ok in zip(groups, flags) if ok for i in rows]
        drop = [i for rows, ok in zip(groups, flags) if not ok for i in rows]
        if keep:
            self.kept.append(batch.index(keep))
        if drop:
            self.spare.append(batch.index(drop))
        self.kept_groups += sum(flags)
        self.spare_groups += len(flags) - sum(flags)
        return sum(flags), len(flags) - sum(flags)

    def take(self, kept: int, spare: int, pad_token_id: int) -> Batch | None:
        """The first ``kept`` informative groups then the first ``spare`` spares, as one batch (None if none)."""
        if kept == self.kept_groups and not spare:  # every kept group (the step without a filter)
            parts = list(self.kept)
        else:
            parts = _first_groups(self.kept, kept) + _first_groups(self.spare, spare)
        return concat_rollouts(parts, pad_token_id) if parts else None


def _first_groups(batches: list[Batch], count: int) -> list[Batch]:
    out = []
    for b in batches:
        if count <= 0:
            break
        groups = group_rows(b)[:count]
        out.append(b.index([i for rows in groups for i in rows]))
        count -= len(groups)
    return out


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
        r.between_rounds()  # separate placement: new weights load here, between two rounds
        local_rows = r.placement.split_rows(rows)
        cfg = r.sampling(step, batch)
        rolled = r.roll(local_rows, cfg)
        self.stall_s = max(self.stall_s, float(rolled.info.get("rollout/event_loop_max_stall_s", 0.0)))
        extra_infos = rolled.meta.get("extra_info") or [row.get("extra_info") or {} for row in local_rows
                                                          for _ in range(cfg.n)]
        scored = r.score(rolled, extra_infos)
        self.generated.append(scored)
        self.pool.add(scored)
        return self.pool.kept_groups, self.pool.spare_groups, 0

    def allocate(self, available: Sequence[int], wanted: int) -> list[int]:
        return allocate(available, wanted)

    def take(self, kept: int, spare: int, rounds: int) -> Rollout:
        del rounds
        rows = self.pool.take(kept, spare, self.pad_id) if self.roller.leads else None
        generated, self.generated, self.pool = self.generated, [], GroupPool(self.metric)
        return Rollout(rows=rows, generated=generated, group_rows=[], stall_s=self.stall_s)

    def round_metrics(self, result: RoundsResult, batch_size: int) -> dict[str, float]:
        return {"rollout/sampling_rounds": float(result.rounds),  # a round is a prompt batch
                "rollout/prompts_consumed": float(result.batches * batch_size)}

    def checkpoint_parts(self) -> tuple[dict[str, Callable[[Any], None]], dict[str, Callable[[Any], None]]]:
        return {}, {}  # nothing survives the step

    def close(self) -> None:
        pass
