"""Shaped reward for the ``synthetic/tool_arith`` task (``data.synthetic.task=tool_arith``): credit for completing the tool protocol.

The built-in ``synthetic/tool_arith`` rule pays only for the exact sum. A random tiny model
first has to learn to copy digits (operands into the call, the result into the answer),
which takes longer than a few-minute CPU run; with no correct sample GRPO has nothing to
compare. This rule keeps the exact-sum reward and adds ``protocol_score`` for a response
that went through the calculator *successfully* (its last tool response is a number) and
then stated an integer answer ``#### <int>`` and ended its turn (``<|im_end|>`` right after
the answer) — the multi-turn behaviour the job teaches. Answering without calling the tool
earns nothing, so the shaping cannot be won by skipping it; nor by rambling on after the
answer until the length limit (an unfinished turn earns nothing).

Use it in any run with ``reward.custom_reward_function=configs/rewards/tool_arith_shaped.py:compute_score``.
"""

from __future__ import annotations

import re
from typing import Any

from mcore_agentic.rewards import compute_score as builtin_score
from mcore_agentic.rewards import score_of
from mcore_agentic.rewards.tool_arith import extract_final_int

_TOOL_RESPONSE = re.compile(r"<tool_response>\s*(.*?)\s*</tool_response>", re.DOTALL)
_NUMBER = re.compile(r"[-+]?\d+(\.\d+)?")
_ENDED_ANSWER = re.compile(r"####\s*[-+]?\d+\s*<\|im_end\|>\s*$")


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None,
    protocol_score: float = 0.5,
) -> dict[str, float]:
    """``{"score", "acc"}``: 1.0 for the right sum; ``protocol_score`` for a successful calculator call followed
    by an integer answer that ends the turn; else 0. Other data sources use the built-in rules unchanged."""
    if data_source != "synthetic/tool_arith":
        result = builtin_score(data_source, solution_str, ground_truth, extra_info)
        return {"score": score_of(result), "acc": float(score_of(result) >= 1.0)}
    exact = score_of(builtin_score(data_source, solution_str, ground_truth, extra_info))
    if exact >= 1.0:
        return {"score": 1.0, "acc": 1.0}
    responses = _TOOL_RESPONSE.findall(solution_str)
    tool_ok = bool(responses) and _NUMBER.fullmatch(responses[-1]) is not None
    answered = extract_final_int(solution_str) is not None and _ENDED_ANSWER.search(solution_str) is not None
    return {"score": protocol_score if tool_ok and answered else 0.0, "acc": 0.0}
