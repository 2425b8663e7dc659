"""The one round loop every schedule runs (one process: the count table is this leader's), the allocation after it,
and the typed hand-off's contract."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from mcore_agentic.data.batch import Batch
from mcore_agentic.feed import ReplicaRows
from mcore_agentic.feed.rounds import Rollout, allocate, allocate_even, allocation, run_rounds
from tests.helpers.batches import hand_off_tensors


class _Scripted:
    """A schedule whose rounds report scripted (kept, spare, live) counts; records what it was asked."""

    def __init__(self, counts: list[tuple[int, int, int]], *, even: bool = False):
        self.counts = counts
        self.even = even
        self.started: list[int] = []
        self.rounds = 0

    def begin(self, rows: list, step: int, draw: Callable[[], list]) -> int:
        self.started.append(0)
        return 1

    def start(self, rows: list, step: int, batch: int) -> None:
        self.started.append(batch)

    def round(self, step: int) -> tuple[int, int, int]:
        self.rounds += 1
        return self.counts[self.rounds - 1]

    def allocate(self, available: Sequence[int], wanted: int) -> list[int]:
        return (allocate_even if self.even else allocate)(available, wanted)

    def take(self, kept: int, spare: int, rounds: int) -> Rollout:
        return Rollout(rows=None, generated=[], group_rows=[])


def _run(schedule: _Scripted, *, wanted: int = 4, max_batches: int | None) -> tuple:
    draws = []

    def draw() -> list:
        draws.append(1)
        return [{}] * wanted

    result = run_rounds(schedule, [{}] * wanted, 1, wanted=wanted, group_index=0, num_groups=1, draw=draw,
                        max_batches=max_batches)
    return result, len(draws)


def test_one_round_when_the_step_has_its_groups():
    result, draws = _run(_Scripted([(4, 0, 0)]), max_batches=None)
    assert (result.rounds, result.batches, draws) == (1, 1, 0)


def test_live_sessions_get_more_rounds_before_any_new_prompts():
    s = _Scripted([(1, 0, 6), (3, 1, 2), (4, 1, 0)])
    result, draws = _run(s, max_batches=10)
    assert (result.rounds, result.batches, draws) == (3, 1, 0)


def test_the_filter_draws_batches_until_the_step_is_full_or_the_bound():
    s = _Scripted([(1, 3, 0), (3, 5, 0), (5, 7, 0)])
    result, draws = _run(s, max_batches=10)
    assert (result.rounds, result.batches, draws) == (3, 3, 2) and s.started == [0, 1, 2]
    s = _Scripted([(1, 3, 0), (2, 6, 0), (3, 9, 0)])
    result, draws = _run(s, max_batches=2)  # the bound: two batches drawn by the step, its own included
    assert (result.rounds, result.batches, draws) == (2, 2, 1)
    take, fill = allocation(s, result.table, 4)
    assert (take, fill) == ([2], [2])  # two informative groups, two spares fill the step


def test_without_a_filter_the_loop_never_draws():
    s = _Scripted([(2, 0, 0)])  # cannot happen with the partial schedule's top-up; the loop stops, never spins
    result, draws = _run(s, max_batches=None)
    assert (result.rounds, draws) == (1, 0)


def test_allocation_takes_kept_groups_first():
    table = torch.tensor([[3, 2, 0], [1, 4, 0]])
    assert allocation(_Scripted([]), table, 4) == ([3, 1], [0, 0])
    assert allocation(_Scripted([], even=True), table, 4) == ([3, 1], [0, 0])
    assert allocation(_Scripted([], even=True), torch.tensor([[1, 2, 0], [1, 4, 0]]), 4) == ([1, 1], [1, 1])


def _rows(**extra) -> Batch:
    return Batch(tensors={**hand_off_tensors(), **extra})


def test_the_hand_off_is_typed_and_tensor_only():
    rows = ReplicaRows.from_batch(_rows())
    assert len(rows) == 2 and rows.routed_experts is None
    assert set(rows.batch().tensors) == set(_rows().tensors)  # what the workers take: no None fields, no meta
    with pytest.raises(ValueError, match="tensors only"):
        ReplicaRows.from_batch(_rows().update(meta={"messages": [[], []]}))
    with pytest.raises(ValueError, match="uid"):
        ReplicaRows.from_batch(_rows(uid=torch.zeros(2)))
