"""``GSM8KInteraction``: a simulated teacher that checks the model's final answer after each turn.

Correct -> "Your response is correct!", turn score 1.0, terminate.
Otherwise -> "Your response is incorrect! ... think again", score 0.0, continue
(until the caller's ``max_user_turns``). ``start_interaction`` takes the
sample's ``interaction_kwargs`` (``ground_truth=...``, as in verl's data).
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Literal

from mcore_agentic.interactions.base import BaseInteraction, last_assistant_content
from mcore_agentic.tools.gsm8k import answers_match, extract_answer
from mcore_agentic.utils.walk import build


@dataclass(frozen=True)
class GSM8KInteractionConfig:
    name: str = "gsm8k"
    max_user_turns: int | None = None
    """Interaction turns per request; None defers to the rollout's own limit. Enforced by the caller."""
    answer_format: Literal["strict", "flexible"] = "flexible"
    """``strict``: only ``#### <number>`` counts as an answer; ``flexible``: else the last number."""
    correct_message: str = "Your response is correct!"
    incorrect_message: str = "Your response is incorrect! You need to reflect on your answer and try again."


@dataclass
class _Instance:
    ground_truth: Decimal | None
    score: float = 0.0
    turns: int = 0


class GSM8KInteraction(BaseInteraction):
    instance_state_attrs = ("_state",)  # per-request answers and scores: kept by paused requests

    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        self.settings: GSM8KInteractionConfig = build(GSM8KInteractionConfig, self.config, path="config")
        self._state: dict[str, _Instance] = {}

    async def start_interaction(self, instance_id: str | None = None, ground_truth: Any = None, **kwargs: Any) -> str:
        instance_id = await super().start_interaction(instance_id, ground_truth=ground_truth, **kwargs)
        truth = extract_answer(str(ground_truth)) if ground_truth is not None else None
        self._state[instance_id] = _Instance(ground_truth=truth)
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        state = self._state.get(instance_id)
        if state is None:
            # A missing start_interaction is the caller's bug, but never the model's crash: end the episode.
            return True, self.settings.incorrect_message, 0.0, {"error": f"no open interaction {instance_id!r}"}
        state.turns += 1
        predicted = extract_answer(last_assistant_content(messages), self.settings.answer_format)
        correct = answers_match(predicted, state.ground_truth)
        state.score = 1.0 if correct else 0.0
        text = self.settings.correct_message if correct else self.settings.incorrect_message
        return correct, text, state.score, {"turn": state.turns}

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        state = self._state.get(instance_id)
        return state.score if state is not None else 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        await super().finalize_interaction(instance_id)
        self._state.pop(instance_id, None)
