"""Balanced partitions of weighted items (token counts) into ``k`` bins: Karmarkar–Karp and greedy.

Used twice per step: to deal a mini-batch's rows over the data-parallel replicas (equal row
counts, balanced tokens: :func:`partition`), and to cut a rank's rows into token-budget
micro-batches (:func:`partition` without the equal-size constraint).

Karmarkar–Karp's largest differencing method, k-way: every item starts as a partial solution
of ``k`` subsets (one holding the item); the two partial solutions with the largest spread
(heaviest minus lightest subset) are merged by pairing the heaviest subsets of one with the
lightest of the other, until one solution is left. With ``equal_size`` the items are first
cut, heaviest first, into runs of ``k`` whose members go to different subsets, so every
merge keeps the subset sizes equal (the trick verl's ``get_seqlen_balanced_partitions``
uses). Everything is deterministic: ties break by item index.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["partition", "partition_spread"]


class _Solution:
    """``k`` subsets (item lists) with their sums, kept sorted lightest first."""

    __slots__ = ("items", "sums")

    def __init__(self, items: list[list[int]], sums: list[int]) -> None:
        order = sorted(range(len(sums)), key=lambda i: (sums[i], items[i]))
        self.items = [items[i] for i in order]
        self.sums = [sums[i] for i in order]

    @property
    def spread(self) -> int:
        return self.sums[-1] - self.sums[0]

    def merge(self, other: _Solution) -> _Solution:
        # Heaviest of one with lightest of the other: the spreads cancel as much as they can.
        k = len(self.sums)
        items = [self.items[i] + other.items[k - 1 - i] for i in range(k)]
        sums = [self.sums[i] + other.sums[k - 1 - i] for i in range(k)]
        return _Solution(items, sums)


def partition(weights: Sequence[int], k: int, *, equal_size: bool = False) -> list[list[int]]:
    """Indices of ``weights`` split into ``k`` bins with sums as equal as KK makes them.

    Each bin's indices are sorted. ``equal_size`` needs ``len(weights) % k == 0`` and gives
    every bin ``len(weights) // k`` items. Bins may be empty when there are fewer items than bins.
    """
    n = len(weights)
    if k < 1:
        raise ValueError(f"k={k} bins: need at least one")
    if equal_size and n % k:
        raise ValueError(f"{n} items do not split into {k} bins of equal size")
    w = [int(x) for x in weights]
    if any(x < 0 for x in w):
        raise ValueError("weights must be >= 0")
    order = sorted(range(n), key=lambda i: (-w[i], i))
    seeds: list[_Solution] = []
    if equal_size:
        for start in range(0, n, k):
            run = order[start : start + k]
            seeds.append(_Solution([[i] for i in run], [w[i] for i in run]))
    else:
        for i in order:
            seeds.append(_Solution([[i]] + [[] for _ in range(k - 1)], [w[i]] + [0] * (k - 1)))
    if not seeds:
        return [[] for _ in range(k)]
    heap = [(-s.spread, tie, s) for tie, s in enumerate(seeds)]
    heapq.heapify(heap)
    tie = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = a.merge(b)
        heapq.heappush(heap, (-merged.spread, tie, merged))
        tie += 1
    bins = [sorted(items) for items in heap[0][2].items]
    # Heaviest bin first, then by first index: a stable, readable order.
    return sorted(bins, key=lambda b: (-sum(w[i] for i in b), b[:1]))


def partition_spread(weights: Sequence[int], bins: Sequence[Sequence[int]]) -> int:
    """Heaviest bin's sum minus the lightest's."""
    sums = [sum(int(weights[i]) for i in b) for b in bins]
    return max(sums) - min(sums) if sums else 0
