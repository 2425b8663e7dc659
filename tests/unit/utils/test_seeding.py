"""RngState: a captured python/numpy/torch RNG state draws the same numbers again once restored."""

from __future__ import annotations

import random

import numpy as np
import torch

from mcore_agentic.utils.seeding import RngState


def _draw():
    return random.random(), float(np.random.rand()), torch.rand(2).tolist()


def test_capture_restore_and_seeded_streams():
    state = RngState.capture()
    a = _draw()
    state.restore()
    assert _draw() == a
    RngState.seeded(7).restore()
    b = _draw()
    RngState.seeded(7).restore()
    assert _draw() == b
    RngState.seeded(8).restore()
    assert _draw() != b
