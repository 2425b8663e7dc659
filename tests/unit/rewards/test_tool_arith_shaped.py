"""The default job's shaped reward (``configs/rewards/tool_arith_shaped.py``), loaded as the trainer loads it."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore_agentic.rewards.registry import load_reward_function

SPEC = str(Path(__file__).resolve().parents[3] / "configs/rewards/tool_arith_shaped.py") + ":compute_score"
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+30"}}\n</tool_call><|im_end|>\n'
REPLY = "<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    ("response", "score"),
    [
        (CALL + REPLY.format(result="42") + "#### 42<|im_end|>", 1.0),  # exact sum
        (CALL + REPLY.format(result="42") + "#### 41<|im_end|>", 0.5),  # protocol completed, wrong copy
        (CALL + REPLY.format(result="42") + "#### 41 and then more and more", 0.0),  # never ended its turn
        (CALL + REPLY.format(result="42") + "#### 41<|im_end|> trailing", 0.0),
        (CALL + REPLY.format(result="error: bad expression") + "#### 41<|im_end|>", 0.0),  # the tool failed
        ("#### 41<|im_end|>", 0.0),  # no tool call
    ],
)
def test_protocol_credit_needs_a_successful_call_and_an_ended_answer(response: str, score: float) -> None:
    fn = load_reward_function(SPEC)
    result = fn("synthetic/tool_arith", response, "42", None)
    assert result["score"] == score and result["acc"] == float(score == 1.0)
