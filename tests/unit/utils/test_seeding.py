"""set_seed makes python, numpy and torch draws repeat."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from mcore_agentic.utils.seeding import set_seed


def _draw():
    return random.random(), float(np.random.rand()), torch.rand(2).tolist()


def test_same_seed_same_draws_offsets_differ():
    set_seed(7)
    a = _draw()
    set_seed(7)
    assert _draw() == a
    assert set_seed(7, rank_offset=1) == 8
    assert _draw() != a
    with pytest.raises(ValueError):
        set_seed(-1)
