"""``RewardConfig``: which reward function scores finished responses (the ``reward`` group).

Light imports only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mcore_agentic.config.errors import require


@dataclass(frozen=True)
class RewardConfig:
    """The ``reward`` group."""

    custom_reward_function: str | None = None
    """A function or class replacing the built-in ``data_source`` dispatch, as ``pkg.module:name``,
    ``pkg.module.name`` or ``path/to/file.py:name``. It is called like
    ``fn(data_source, solution_str, ground_truth, extra_info)`` and returns a float or a dict with a
    ``score`` key. A class is instantiated once with ``reward_kwargs``. None: built-in rules."""
    reward_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Extra keyword arguments: bound to the custom function (or its class's constructor), or passed
    to the built-in rule of every data source (e.g. ``{format_score: 0.1}`` for gsm8k)."""

    def __post_init__(self) -> None:
        spec = self.custom_reward_function
        require(
            spec is None or (isinstance(spec, str) and spec.strip() != ""),
            "reward.custom_reward_function",
            f"must be null or a non-empty 'module:function' string, got {spec!r}",
        )
        require(
            isinstance(self.reward_kwargs, Mapping),
            "reward.reward_kwargs",
            f"must be a mapping of keyword arguments, got {type(self.reward_kwargs).__name__}",
        )
