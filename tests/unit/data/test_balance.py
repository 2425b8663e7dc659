"""Karmarkar–Karp k-way partitions: coverage, equal sizes, spread against a brute-force optimum, determinism, errors."""

from __future__ import annotations

import itertools
import random

import pytest

from mcore_agentic.data.balance import partition, partition_spread


def _optimum(weights: list[int], k: int, equal_size: bool) -> int:
    """Smallest spread over every assignment of the items to ``k`` bins (bin 0 holds item 0: symmetry)."""
    n, best = len(weights), None
    for assign in itertools.product(range(k), repeat=n):
        if n and assign[0]:
            continue
        if equal_size and any(assign.count(j) != n // k for j in range(k)):
            continue
        sums = [0] * k
        for i, j in enumerate(assign):
            sums[j] += weights[i]
        spread = max(sums) - min(sums)
        best = spread if best is None else min(best, spread)
    return best


def _check_cover(bins: list[list[int]], n: int, k: int) -> None:
    assert len(bins) == k
    assert sorted(i for b in bins for i in b) == list(range(n))
    assert all(b == sorted(b) for b in bins)


def test_every_index_exactly_once():
    rng = random.Random(0)
    for _ in range(100):
        n, k = rng.randint(0, 40), rng.randint(1, 9)
        weights = [rng.randint(0, 1000) for _ in range(n)]
        _check_cover(partition(weights, k), n, k)


def test_equal_size_gives_equal_counts():
    rng = random.Random(1)
    for _ in range(100):
        k = rng.randint(1, 8)
        n = k * rng.randint(0, 6)
        weights = [rng.randint(0, 1000) for _ in range(n)]
        bins = partition(weights, k, equal_size=True)
        _check_cover(bins, n, k)
        assert {len(b) for b in bins} == {n // k}


def test_bins_come_heaviest_first():
    weights = [9, 1, 1, 1, 8, 2, 7, 3]
    bins = partition(weights, 3)
    sums = [sum(weights[i] for i in b) for b in bins]
    assert sums == sorted(sums, reverse=True)


def test_classic_karmarkar_karp_example():
    # Differencing 8,7,6,5,4: (8,7)->1, (6,5)->1, (4,1)->3, (3,1)->2; the optimum (8+7 | 6+5+4) is 0.
    weights = [8, 7, 6, 5, 4]
    bins = partition(weights, 2)
    assert partition_spread(weights, bins) == 2
    assert _optimum(weights, 2, False) == 0


def test_perfect_splits_are_found():
    assert partition_spread([5, 5, 5, 5], partition([5, 5, 5, 5], 4)) == 0
    weights = [10, 10, 10, 1, 1, 1]
    bins = partition(weights, 3, equal_size=True)
    assert sorted(sorted(weights[i] for i in b) for b in bins) == [[1, 10]] * 3


@pytest.mark.parametrize("equal_size", [False, True])
def test_spread_is_close_to_the_optimum(equal_size):
    rng = random.Random(2 + equal_size)
    exact = 0
    trials = 80
    for _ in range(trials):
        k = rng.choice([2, 3])
        n = k * rng.randint(1, 7 // k) if equal_size else rng.randint(1, 7)
        weights = [rng.randint(0, 50) for _ in range(n)]
        bins = partition(weights, k, equal_size=equal_size)
        got, best = partition_spread(weights, bins), _optimum(weights, k, equal_size)
        assert best <= got <= best + max(weights), (weights, k, bins)
        exact += got == best
    assert exact >= trials // 2  # KK is usually optimal on instances this small


def test_balance_beats_a_contiguous_split_on_skewed_lengths():
    rng = random.Random(3)
    weights = [int(rng.lognormvariate(6, 1)) for _ in range(64)]
    kk = partition_spread(weights, partition(weights, 8, equal_size=True))
    contiguous = partition_spread(weights, [list(range(i, i + 8)) for i in range(0, 64, 8)])
    assert kk * 20 < contiguous
    assert kk <= max(weights)


def test_deterministic():
    rng = random.Random(4)
    weights = [rng.randint(0, 5) for _ in range(30)]  # many ties
    for k, eq in [(4, False), (5, True), (3, True)]:
        first = partition(weights, k, equal_size=eq)
        assert all(partition(list(weights), k, equal_size=eq) == first for _ in range(3))
        assert partition(tuple(weights), k, equal_size=eq) == first


def test_fewer_items_than_bins_leaves_bins_empty():
    bins = partition([5, 3], 4)
    _check_cover(bins, 2, 4)
    assert bins[:2] == [[0], [1]] and bins[2:] == [[], []]
    assert partition([], 3) == [[], [], []]
    assert partition([], 3, equal_size=True) == [[], [], []]
    # Positive weights and at least k items: no bin is left empty.
    assert all(partition([1, 1, 100, 1, 1], 5))


def test_one_bin_takes_everything():
    assert partition([3, 1, 2], 1) == [[0, 1, 2]]
    assert partition([3, 1, 2], 1, equal_size=True) == [[0, 1, 2]]


def test_errors():
    with pytest.raises(ValueError, match="at least one"):
        partition([1, 2], 0)
    with pytest.raises(ValueError, match="at least one"):
        partition([1, 2], -1)
    with pytest.raises(ValueError, match="5 items do not split into 2 bins"):
        partition([1, 2, 3, 4, 5], 2, equal_size=True)
    with pytest.raises(ValueError, match=">= 0"):
        partition([1, -2], 2)


def test_partition_spread():
    assert partition_spread([5, 2, 2], [[0], [1, 2]]) == 1
    assert partition_spread([5, 2, 2], [[0, 1, 2], []]) == 9
    assert partition_spread([1], []) == 0
