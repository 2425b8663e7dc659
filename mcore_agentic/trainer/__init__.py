"""The PPO/GRPO step loop, metrics, logging and checkpoints.

Entry point: :func:`~.runner.run` (called by ``launch/pretrain_rl.py`` on every rank); :mod:`.build` builds the run,
:mod:`.loop` steps it.
"""

from mcore_agentic.trainer.runner import RunSummary, current_layout, run

__all__ = ["RunSummary", "current_layout", "run"]
