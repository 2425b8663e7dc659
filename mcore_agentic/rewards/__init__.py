"""Rule-based reward functions selected by ``data_source``, plus custom ones named in config.

Public API::

    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict
    build_reward_fn(RewardConfig) -> RewardFn     # the default dispatch or a custom function
    score_of(result) -> float                     # a float or {"score": ..., ...} -> the float
"""

from mcore_agentic.rewards.config import RewardConfig
from mcore_agentic.rewards.registry import (
    DATA_SOURCES,
    RewardFn,
    build_reward_fn,
    compute_score,
    load_reward_function,
    score_of,
)

__all__ = [
    "DATA_SOURCES",
    "RewardConfig",
    "RewardFn",
    "build_reward_fn",
    "compute_score",
    "load_reward_function",
    "score_of",
]
