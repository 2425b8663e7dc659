"""A step's rounds: a schedule rolls out and scores prompt groups until the step has its groups; one loop for all.

Every schedule answers the same question per round, on each rollout leader: how many *complete, scored* prompt
groups it holds that the step may train (kept), how many it holds that the filter set aside (spare), and how many
sessions are still running (live). :func:`run_rounds` is the one loop, collective over the world:

1. the schedule :meth:`~Schedule.begin`\\ s the step with its prompts (the partial-rollout schedule may draw more to
   keep its buffer full);
2. each round, every leader runs :meth:`~Schedule.round`; one all-reduce of the ``[rollout groups, 3]`` count table
   tells every rank where the step stands;
3. the step has its groups when ``data.train_batch_size`` are kept; while sessions are live another round runs;
   else, while the filter may draw more prompts (``algorithm.filter_groups.max_num_gen_batches``: the batches a
   step draws, 0 for no bound), every rank draws the next batch and the schedule starts it;
4. every rank computes the same allocation (:meth:`Schedule.allocate`): kept groups first; if the rounds ran out,
   spares fill the rest, so the step always trains a full batch. Each leader then :meth:`~Schedule.take`\\ s its
   share.

The schedules (:mod:`.fresh_rounds`: one round, or DAPO's dynamic sampling; :mod:`.partial_rounds`: requests in
flight across steps) differ only in where groups come from and in what survives the step; the filter
(:mod:`.dynamic_sampling`) composes with either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from mcore_agentic.data.batch import Batch
from mcore_agentic.parallel.stats import sum_over

# Rollout seeds: request j of rollout group g (of G) at step k samples with base + (k * G + g) * SEED_STRIDE + j.
SEED_STRIDE = 100_003

Rows = list[dict[str, Any]]


def rollout_seed(base: int, step: int, batch: int, group_index: int, num_groups: int) -> int:
    """Deterministic per step, prompt batch of the step and rollout group, so a resumed run samples what the
    uninterrupted one did. The step's first batch keeps the stride layout; later ones hash."""
    if batch:
        return int(np.random.SeedSequence([base, step, group_index, batch]).generate_state(1)[0])
    return base + (step * num_groups + group_index) * SEED_STRIDE


class Prompts:
    """The training loader's epochs, drawn on every rank (so its checkpointed position counts every prompt drawn)."""

    def __init__(self, loader: Any):
        self.loader = loader
        self._batches: Iterator[Rows] = iter(())

    def start(self) -> None:
        """Begin drawing where the loader stands (after a resume: its restored position)."""
        self._batches = iter(self.loader)

    def next(self) -> Rows:
        """The loader's next batch of prompts (the next epoch's first at an epoch's end), the same on every rank."""
        for _ in range(2):
            rows = next(self._batches, None)
            if rows is not None:
                return rows
            self._batches = iter(self.loader)  # epoch boundary: the loader starts the next epoch
        raise RuntimeError("the training data loader yields no batches")


@dataclass
class Rollout:
    """A step's rollout on this rank, from the schedule's :meth:`~Schedule.take` through the feed's hand-off to a dump
    step's return trip (the one carrier: the feed fills in what each stage adds). Everything but ``group_rows`` and
    ``metrics`` is a leader's own."""

    rows: Batch | None
    """This rollout group's scored rows to train, groups in order; None off its leader, or when it trains none. After
    the hand-off: as they were dealt (group and episode ids tagged, filler rows last)."""
    generated: list[Batch]
    """Every scored batch that left this leader in the step, trained or set aside (the step's rollout statistics)."""
    group_rows: list[int]
    """Rows each rollout group trains (identical on every rank)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The schedule's metrics, then the step's rollout metrics (reduced over the world: identical on every rank)."""
    stall_s: float = 0.0
    """The rollout event loop's longest stall over the step's rounds, on this leader."""
    step: int = 0
    version: int = 0
    """The weight version the engine held for the step's rollout."""
    prefix_cache: Any = None
    """What this leader's engine prefilled and served from its prefix cache during the step (None off the leaders
    and for engines that do not count)."""
    plan: Any = None
    """The hand-off's plan (which replica trains which row): a dump step brings the trainer's values back by it."""
    real_rows: int = 0
    """The leader's rows before any filler rows (they come last and are not dumped)."""
    stats: Any = None
    """The step's rollout statistics where they came computed, with rows scored and tagged (group, episode and version
    ids) where they were generated: streamed from rollout ranks (separate placement; not yet reduced). Else None."""


class Schedule(Protocol):
    """Where a step's complete, scored prompt groups come from (one object per rank; only leaders hold groups)."""

    def begin(self, rows: Rows, step: int, draw: Callable[[], Rows]) -> int:
        """Start the step with its prompts; ``draw`` gives more (every rank calls it alike). Returns batches drawn."""

    def start(self, rows: Rows, step: int, batch: int) -> None:
        """Start the step's ``batch``-th batch of prompts (every rank calls it)."""

    def round(self, step: int) -> tuple[int, int, int]:
        """Run one round; (kept, spare, live) after it on this leader, zeros elsewhere."""

    def allocate(self, available: Sequence[int], wanted: int) -> list[int]:
        """How many of each rollout group's ``available`` groups the step takes, ``wanted`` in all (every rank)."""

    def take(self, kept: int, spare: int, rounds: int) -> Rollout:
        """This leader's share: its first ``kept`` kept groups then ``spare`` spares (``rows``, ``generated``), and
        the schedule's metrics (collective: every rank calls it); ``rounds``: the step's."""

    def round_metrics(self, result: RoundsResult, batch_size: int) -> dict[str, float]:
        """What the step's rounds say under a filter (every rank alike); ``batch_size``: prompts a batch holds."""

    def checkpoint_parts(self) -> tuple[dict[str, Callable[[Any], None]], dict[str, Callable[[Any], None]]]:
        """Checkpoint writers and readers of what the schedule carries across steps."""

    def close(self) -> None:
        """Release what the schedule holds in flight."""


@dataclass
class RoundsResult:
    """The count table after the last round, and how the step got there."""

    table: torch.Tensor
    """``[rollout groups, 3]``: kept, spare, live."""
    rounds: int
    batches: int
    """Prompt batches the step drew (its own included)."""


def _world_sum() -> Callable[[torch.Tensor], torch.Tensor]:
    return sum_over(dist.group.WORLD if dist.is_initialized() else None)


def run_rounds(
    schedule: Schedule, rows: Rows, step: int, *, wanted: int, group_index: int | None, num_groups: int,
    draw: Callable[[], Rows], max_batches: int | None,
) -> RoundsResult:
    """The step's rounds (collective; see the module docstring). ``group_index``: this rank's rollout group when it
    leads one, else None. ``max_batches``: the prompt batches a step may draw (0: no bound; None: none beyond what
    :meth:`Schedule.begin` draws)."""
    world = _world_sum()
    batches = schedule.begin(rows, step, draw)
    rounds = 0
    while True:
        mine = torch.zeros(num_groups, 3, dtype=torch.long)
        counts = schedule.round(step)
        if group_index is not None:
            mine[group_index] = torch.tensor(counts)
        rounds += 1
        table = world(mine)
        if int(table[:, 0].sum()) >= wanted:
            break
        if int(table[:, 2].sum()):
            continue
        if max_batches is None or (max_batches and batches >= max_batches):
            break
        schedule.start(draw(), step, batches)
        batches += 1
    return RoundsResult(table, rounds, batches)


def allocate(available: Sequence[int], wanted: int) -> list[int]:
    """How many of each rollout group's ``available`` groups to take, in rollout-group order, ``wanted`` in all."""
    out, left = [], wanted
    for n in available:
        take = min(int(n), left)
        out.append(take)
        left -= take
    if left:
        raise ValueError(f"{wanted} groups wanted but only {sum(available)} available")
    return out


def allocate_even(available: Sequence[int], wanted: int) -> list[int]:
    """``wanted`` groups taken as evenly as ``available`` allows over the rollout groups (water-filling; the
    remainder goes to the first ones): no leader's groups wait while another's train (partial rollouts)."""
    take = [0] * len(available)
    left = wanted
    while left:
        open_ = [g for g, n in enumerate(available) if take[g] < n]
        if not open_:
            raise ValueError(f"{wanted} groups wanted but only {sum(available)} available")
        share = max(1, left // len(open_))
        for g in open_:
            add = min(share, int(available[g]) - take[g], left)
            take[g] += add
            left -= add
            if not left:
                break
    return take


def allocation(schedule: Schedule, table: torch.Tensor, wanted: int) -> tuple[list[int], list[int]]:
    """(kept, spare) groups each rollout group contributes: kept ones first, spares fill what is missing."""
    kept = table[:, 0].tolist()
    take = schedule.allocate(kept, min(sum(kept), wanted))
    fill = schedule.allocate(table[:, 1].tolist(), wanted - sum(take))
    return take, fill
