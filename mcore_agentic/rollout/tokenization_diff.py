"""The tokenization sanity check's token diff (linear: each resync looks a bounded window ahead) and its reports:
the differing regions, whether one differs in whitespace only, and the one-line description of a step's mismatches."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

_SPACE = re.compile(r"\s+")


def _whitespace_only(expected: str, actual: str) -> bool:
    """Whether two differing stretches differ only in whitespace: equal once it is removed, and either
    different as text or blank (the same non-blank text tokenized differently is a real difference)."""
    return _SPACE.sub("", expected) == _SPACE.sub("", actual) and (expected != actual or not expected.strip())


def diff_regions(a: list[int], b: list[int], *, window: int = 256, anchor: int = 8) -> list[tuple[int, int, int, int]]:
    """The regions ``(a0, a1, b0, b1)`` where ``a`` and ``b`` differ, in order.

    After each difference, the next common run is the nearest position pair (within ``window`` tokens
    ahead on each side) where ``anchor`` tokens agree; failing that, the rest is one region. Linear in
    the lengths (plus ``window * anchor`` per region), unlike ``difflib``'s quadratic matcher.
    """
    regions: list[tuple[int, int, int, int]] = []
    i = j = 0
    n, m = len(a), len(b)
    while True:
        while i < n and j < m and a[i] == b[j]:
            i += 1
            j += 1
        if i == n and j == m:
            return regions
        starts: dict[tuple[int, ...], int] = {}
        for dj in range(min(window, m - j) + 1):
            starts.setdefault(tuple(b[j + dj : j + dj + anchor]), dj)
        best: tuple[int, int] | None = None
        for di in range(min(window, n - i) + 1):
            dj = starts.get(tuple(a[i + di : i + di + anchor]))
            if dj is not None and (best is None or di + dj < sum(best)):
                best = (di, dj)
        if best is None:
            regions.append((i, n, j, m))
            return regions
        regions.append((i, i + best[0], j, j + best[1]))
        i, j = i + best[0], j + best[1]


def _runs(mask: list[int]) -> list[tuple[bool, int, int]]:
    """Maximal runs of equal values of a 0/1 mask as ``(is_one, start, end)`` (found by C-level ``index``)."""
    runs: list[tuple[bool, int, int]] = []
    start, n = 0, len(mask)
    while start < n:
        one = bool(mask[start])
        try:
            end = mask.index(0 if one else 1, start)
        except ValueError:
            end = n
        runs.append((one, start, end))
        start = end
    return runs


def describe_diff(d: Mapping[str, Any]) -> str:
    """One sanity-check difference as ``'expected' -> 'actual' at 'context'``; when the two texts are equal (the
    same text as other tokens: a sampled non-canonical split) the token ids say what differs."""
    text = f"{d['expected']!r} -> {d['actual']!r}"
    if d["expected"] == d["actual"] and "expected_ids" in d:
        text += f" (same text, token ids {list(d['expected_ids'])} -> {list(d['actual_ids'])})"
    return f"{text} at {d['context']!r}"


def mismatch_summary(request_id: str, diffs: Sequence[Mapping[str, Any]], mismatched: int, total: int) -> str:
    """The one line of a step's sanity-check mismatches: how many trajectories, and the first one's first diffs."""
    return (
        f"tokenization sanity check: {mismatched} of {total} trajectories differ from a full render of their messages "
        f"(rollout.multi_turn.tokenization_sanity_check_mode); first, request {request_id} (expected -> actual): "
        + "; ".join(describe_diff(d) for d in diffs[:3])
    )


__all__ = ["describe_diff", "diff_regions", "mismatch_summary"]
