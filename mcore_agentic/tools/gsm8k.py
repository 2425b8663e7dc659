"""``GSM8KTool``: the model submits its final answer; the tool scores it against the sample's ground truth.

verl's ``calc_gsm8k_reward`` tool, re-done: ``create(ground_truth=...)`` stores
the answer per request, each ``execute({"answer": ...})`` reports the parsed
number and its reward, and ``calc_reward`` is 1.0 when the *latest* submitted
answer equals the ground truth numerically ("1,000" == "1000.0").

Also home to the small GSM8K answer helpers the interaction reuses.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

from mcore_agentic.tools.base import BaseTool, ToolResponse, error_response
from mcore_agentic.utils.walk import build

# A number as people write it: optional sign, digits with thousands commas, decimals.
_NUMBER = r"-?\$?\s*(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+"
_STRICT = re.compile(r"####\s*(" + _NUMBER + r")")
_ANY = re.compile(_NUMBER)


def _to_decimal(text: str) -> Decimal | None:
    cleaned = text.replace(",", "").replace("$", "").replace(" ", "")
    try:
        return Decimal(cleaned)
    except InvalidOperation:
        return None


def extract_answer(text: str, method: Literal["strict", "flexible"] = "flexible") -> Decimal | None:
    """The answer number in ``text``.

    ``strict``: only a GSM8K-style ``#### <number>`` (the last one) counts.
    ``flexible``: the ``####`` form if present, else the last number in the text.
    """
    if not isinstance(text, str):
        return None
    found = _STRICT.findall(text)
    if found:
        return _to_decimal(found[-1])
    if method == "strict":
        return None
    numbers = _ANY.findall(text)
    return _to_decimal(numbers[-1]) if numbers else None


def answers_match(predicted: Decimal | None, truth: Decimal | None) -> bool:
    """Numeric equality (GSM8K answers are integers; decimals compare exactly)."""
    return predicted is not None and truth is not None and predicted == truth


def format_number(value: Decimal | None) -> str:
    if value is None:
        return "None"
    return format(value.normalize(), "f") if value == value.to_integral_value() else str(value)


@dataclass(frozen=True)
class GSM8KToolConfig:
    no_improvement_penalty: float = 0.0
    """Step reward is ``-no_improvement_penalty`` when a call does not raise the best reward so far
    (verl uses 0.05), else 0.0: it discourages resubmitting without changing the answer."""

    def __post_init__(self) -> None:
        from mcore_agentic.utils.errors import require

        require(self.no_improvement_penalty >= 0, "no_improvement_penalty", f"must be >= 0, got {self.no_improvement_penalty}")


@dataclass
class _Instance:
    ground_truth: Decimal | None
    last_answer: Decimal | None = None
    best_reward: float = 0.0
    calls: int = 0


class GSM8KTool(BaseTool):
    """Parameters ``{"answer": str}``; ``create(instance_id, ground_truth="#### 72" | "72" | 72)``."""

    instance_state_attrs = ("_state",)  # per-request answers and scores: kept by paused requests

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any]):
        super().__init__(config, tool_schema)
        self.settings: GSM8KToolConfig = build(GSM8KToolConfig, self.config, path="config")
        self._state: dict[str, _Instance] = {}

    async def create(self, instance_id: str | None = None, ground_truth: Any = None, **create_kwargs: Any) -> str:
        instance_id = await super().create(instance_id, ground_truth=ground_truth, **create_kwargs)
        truth = extract_answer(str(ground_truth)) if ground_truth is not None else None
        self._state[instance_id] = _Instance(ground_truth=truth)
        return instance_id

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResponse:
        state = self._state.get(instance_id)
        if state is None:
            return error_response(f"Error: tool '{self.name}' has no open instance {instance_id!r}.", bad_call=1)
        answer = parameters.get("answer") if isinstance(parameters, dict) else None
        if isinstance(answer, int | float) and not isinstance(answer, bool):
            answer = str(answer)  # tolerate a bare number
        if not isinstance(answer, str):
            return error_response(f"Error: tool '{self.name}' needs a string argument 'answer'.", bad_call=1)
        state.calls += 1
        parsed = extract_answer(answer)
        state.last_answer = parsed
        reward = 1.0 if answers_match(parsed, state.ground_truth) else 0.0
        step_reward = 0.0 if reward > state.best_reward else -self.settings.no_improvement_penalty
        state.best_reward = max(state.best_reward, reward)
        text = f"Current parsed answer={format_number(parsed)} reward={reward:.1f}"
        if parsed is None:
            text += " (no number found in the answer)"
        return ToolResponse(text=text, reward=step_reward, metrics={"correct": reward})

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        state = self._state.get(instance_id)
        if state is None:
            return 0.0
        return 1.0 if answers_match(state.last_answer, state.ground_truth) else 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        await super().release(instance_id)
        self._state.pop(instance_id, None)
