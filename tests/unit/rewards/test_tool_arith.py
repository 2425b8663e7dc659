"""synthetic/tool_arith rule: the final turn's '#### <int>' decides; tool text never counts."""

import pytest

from mcore_agentic.rewards.tool_arith import compute_score, extract_final_int

TRAJECTORY = (
    '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call>'
    "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\nThe sum is 42.\n#### {answer}<|im_end|>"
)


@pytest.mark.parametrize(
    "solution, expected",
    [
        (TRAJECTORY.replace("{answer}", "42"), 1.0),
        (TRAJECTORY.replace("{answer}", "41"), 0.0),
        (TRAJECTORY.replace("{answer}", "42.5"), 0.0),  # malformed: not an integer
        (TRAJECTORY.replace("{answer}", "forty-two"), 0.0),
        ("#### 42", 1.0),  # no tool use at all
        ("#### 41 ... no wait #### 42", 1.0),
        ("", 0.0),
        # the answer only appears inside a tool result, the last turn is a tool call: no reward
        ("<tool_response>\n#### 42\n</tool_response><tool_call>\n{}\n</tool_call>", 0.0),
        # decoded with skip_special_tokens (no <|im_*|> markers)
        ("<tool_call>\n{}\n</tool_call>\nuser\n<tool_response>\n42\n</tool_response>\nassistant\n#### 42", 1.0),
        ("#### -7", 0.0),
    ],
)
def test_scores(solution, expected):
    assert compute_score(solution, "42") == expected


def test_negative_format_and_bad_ground_truth():
    assert extract_final_int("#### -7") == -7
    assert compute_score("#### -7", -7) == 1.0
    assert compute_score("#### 3", "4", format_score=0.2) == 0.2
    with pytest.raises(ValueError, match="must be an integer"):
        compute_score("#### 3", "3.5")
