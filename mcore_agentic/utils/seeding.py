"""Seed every random number generator a run uses from one number."""

from __future__ import annotations

import random

import numpy as np
import torch


def set_seed(seed: int, rank_offset: int = 0) -> int:
    """Seed python, numpy and torch (CPU and CUDA) with ``seed + rank_offset``; return that value.

    Give ranks that must draw different numbers (e.g. dropout on different data) distinct
    offsets; ranks that must agree (data order, tool calls of one rollout group) share one.
    Megatron's tensor-parallel RNG tracker is seeded separately by the parallel setup.
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    value = seed + rank_offset
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)  # also seeds every CUDA device
    return value
