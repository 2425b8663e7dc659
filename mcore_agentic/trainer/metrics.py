"""Metric names the plots and the progress bar read, and the numeric view of a step's metrics.

The step's own metrics are computed where their data is: the experience batch's in :mod:`.experience`, the
rollout's in :mod:`mcore_agentic.feed.scoring`.

Metric names follow verl where one exists (``critic/score/mean``,
``response_length/mean``, ``timing_s/<phase>``, ``perf/throughput``) so dashboards
carry over. :data:`REWARD_KEY` and :data:`RESPONSE_LENGTH_KEY` are what the
end-of-run plots draw.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

REWARD_KEY = "critic/score/mean"
RESPONSE_LENGTH_KEY = "response_length/mean"
VAL_REWARD_PREFIX = "val/"


def scalar(value: Any) -> float | None:
    """A plain float from a python/numpy/torch scalar, or None for anything else (strings, tensors with >1 item)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float, np.integer, np.floating)):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if isinstance(value, np.ndarray) and value.size == 1:
        return float(value.reshape(-1)[0])
    return None


def numeric_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numeric entries of ``metrics`` as floats (NaN/inf kept: hiding them hides divergence)."""
    out = {}
    for k, v in metrics.items():
        f = scalar(v)
        if f is not None:
            out[k] = f
    return out
