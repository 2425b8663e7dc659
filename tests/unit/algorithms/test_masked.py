"""Tests for masked statistics: hand-computed values, masked positions ignored (even NaN)."""

from __future__ import annotations

import math
import statistics

import torch

from mcore_agentic.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten

VALUES = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0], [1, 0, 1]])
KEPT = [1.0, 2.0, 4.0, 6.0]


def test_sum_and_mean_ignore_masked_nan_and_inf():
    assert masked_sum(VALUES, MASK).item() == 13.0
    assert masked_mean(VALUES, MASK).item() == 13.0 / 4
    assert masked_mean(VALUES, MASK, dim=-1).tolist() == [1.5, 5.0]


def test_all_masked_row_gives_zero_not_nan():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert masked_mean(VALUES, mask, dim=-1).tolist() == [1.5, 0.0]
    assert masked_mean(VALUES, torch.zeros_like(mask)).item() == 0.0


def test_var_matches_statistics_module():
    assert math.isclose(masked_var(VALUES, MASK).item(), statistics.variance(KEPT))
    assert math.isclose(masked_var(VALUES, MASK, unbiased=False).item(), statistics.pvariance(KEPT))
    one = torch.tensor([[3.0, 7.0]])
    assert masked_var(one, torch.tensor([[1, 0]])).item() == 0.0  # one token: no Bessel division by zero


def test_whiten_by_hand():
    mean, std = statistics.mean(KEPT), statistics.stdev(KEPT)
    out = masked_whiten(VALUES, MASK)
    kept = out[MASK.bool()].tolist()
    expected = [(v - mean) / math.sqrt(std**2 + 1e-8) for v in KEPT]
    assert all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(kept, expected))
    scale_only = masked_whiten(VALUES, MASK, shift_mean=False)[MASK.bool()]
    assert torch.allclose(scale_only, torch.tensor(expected, dtype=torch.float64) + mean)
