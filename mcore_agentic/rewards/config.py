"""``RewardConfig``: which reward function scores finished responses (the ``reward`` group).

Light imports only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from mcore_agentic.utils.errors import require


@dataclass(frozen=True)
class OverlongBufferConfig:
    """DAPO's soft over-long punishment (verl's ``reward_model.overlong_buffer``): a response whose length
    (every token after the prompt, tool results included) enters the last ``len`` tokens of
    ``data.max_response_length`` loses ``penalty_factor * (length - (max - len)) / len`` of reward, reaching
    ``penalty_factor`` at the limit. When to use: many responses hit the budget (``rollout/truncated``) and a
    hard zero for a cut answer is too sharp a signal."""

    enable: bool = False
    """Add the penalty to each sequence's score (before groups are compared)."""
    len: int = 16
    """Tokens before the response budget where the penalty starts; must be below ``data.max_response_length``."""
    penalty_factor: float = 1.0
    """The penalty at the budget itself."""

    def __post_init__(self) -> None:
        require(self.len > 0, "reward.overlong_buffer.len", f"must be positive, got {self.len}")
        require(self.penalty_factor >= 0, "reward.overlong_buffer.penalty_factor",
                f"must be >= 0, got {self.penalty_factor}")


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
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """Soft over-long punishment (``reward.overlong_buffer.*``)."""

    def __post_init__(self) -> None:
        if isinstance(self.overlong_buffer, Mapping):
            known = {f.name for f in fields(OverlongBufferConfig)}
            unknown = sorted(set(self.overlong_buffer) - known)
            require(not unknown, f"reward.overlong_buffer.{unknown[0]}" if unknown else "reward.overlong_buffer",
                    f"unknown key; allowed: {', '.join(sorted(known))}")
            object.__setattr__(self, "overlong_buffer", OverlongBufferConfig(**dict(self.overlong_buffer)))
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
