"""Reward of the synthetic tool tasks (``synthetic/meter_reading``, the embedded default's, and ``synthetic/tool_arith``).

The response (all assistant turns, tool calls and tool results of one request, decoded)
must state ``#### <integer>`` in its final assistant turn (the last such marker counts);
reward 1.0 when that integer equals the ground truth. Text up to the last tool result or
tool call never counts, so the model is not rewarded for a number a tool printed.
"""

from __future__ import annotations

import re

# "#### 12" counts; "#### 12.5" or "#### 1,2" are malformed (group 2 matches); "#### x" finds nothing.
_FINAL_ANSWER = re.compile(r"####\s*([-+]?\d+)([.,]\d)?")
_LAST_TOOL_MARK = re.compile(r"</tool_response>|</tool_call>")


def final_turn(solution_str: str) -> str:
    """The text after the last ``</tool_response>`` or ``</tool_call>`` (all of it if none)."""
    marks = list(_LAST_TOOL_MARK.finditer(solution_str))
    return solution_str[marks[-1].end() :] if marks else solution_str


def extract_final_int(solution_str: str) -> int | None:
    """The integer of the last ``#### <int>`` in the final assistant turn, or None (missing/malformed)."""
    matches = list(_FINAL_ANSWER.finditer(final_turn(solution_str)))
    if not matches or matches[-1].group(2):
        return None
    return int(matches[-1].group(1))


def compute_score(solution_str: str, ground_truth: str | int, format_score: float = 0.0, score: float = 1.0) -> float:
    """``score`` if the final ``#### <int>`` equals ``ground_truth``, ``format_score`` if present
    but wrong, 0.0 if missing or malformed."""
    try:
        gold = int(str(ground_truth).strip())
    except ValueError:
        raise ValueError(f"synthetic/tool_arith ground_truth must be an integer, got {ground_truth!r}") from None
    answer = extract_final_int(solution_str)
    if answer is None:
        return 0.0
    return score if answer == gold else format_score
