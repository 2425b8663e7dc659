"""Small builders of the run: the LR schedule's horizon honours ``<worker>.optim.total_training_steps``."""

from __future__ import annotations

from mcore_agentic.workers.config import OptimConfig
from mcore_agentic.workers.engine import decay_horizon


def test_decay_horizon_is_the_configured_one_or_the_runs():
    assert decay_horizon(OptimConfig(), 120) == 120  # -1: the trainer's count
    assert decay_horizon(OptimConfig(total_training_steps=500), 120) == 500  # set in YAML: honoured
