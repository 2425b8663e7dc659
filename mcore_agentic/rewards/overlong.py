"""DAPO's soft over-long punishment: a linear reward penalty over the last tokens of the response budget."""

from __future__ import annotations


def overlong_penalty(length: int, max_length: int, buffer_len: int, penalty_factor: float) -> float:
    """The (non-positive) reward added to a response of ``length`` tokens with a budget of ``max_length``.

    Zero up to ``max_length - buffer_len`` tokens, then falling linearly to ``-penalty_factor`` at
    ``max_length`` (Yu et al. 2025, DAPO eq. 13).
    """
    if buffer_len <= 0 or buffer_len > max_length:
        raise ValueError(f"buffer_len={buffer_len} must be in 1..max_length={max_length}")
    start = max_length - buffer_len
    return min(0.0, -(length - start) / buffer_len * penalty_factor)
