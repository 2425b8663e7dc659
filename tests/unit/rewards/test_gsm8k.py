"""GSM8K rule: extraction order, numeric comparison, format score, bad ground truth."""

import pytest

from mcore_agentic.rewards.gsm8k import compute_score, extract_gsm8k_answer


@pytest.mark.parametrize(
    "solution, expected",
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", 1.0),
        ("#### 7.0", 1.0),  # numeric, not string, comparison
        ("First guess #### 5, corrected: #### 7", 1.0),  # the last marker counts
        ("The answer is $\\boxed{7}$.", 1.0),
        ("#### $1,000", 0.0),  # wrong (gold is 7)
        ("She has 7 apples.", 0.0),  # strict: a bare number is not an answer
        ("", 0.0),
        ("#### seven", 0.0),  # malformed: no number after the marker
    ],
)
def test_strict(solution, expected):
    assert compute_score(solution, "7") == expected


def test_flexible_takes_last_number_and_ground_truth_formats():
    assert compute_score("3 + 4 = 7 so she has 7 apples", "7", method="flexible") == 1.0
    assert compute_score("she has 8 apples, not 7", "7", method="flexible") == 1.0
    assert compute_score("no digits here", "7", method="flexible") == 0.0
    full_solution = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
    assert compute_score("#### 72", full_solution) == 1.0
    assert compute_score("#### 1,234.50", 1234.5) == 1.0
    assert compute_score("#### -3", "-3") == 1.0


def test_format_score_only_for_a_wrong_but_present_answer():
    assert compute_score("#### 8", "7", format_score=0.1) == 0.1
    assert compute_score("no answer", "7", format_score=0.1) == 0.0
    assert compute_score("#### 7", "7", format_score=0.1, score=2.0) == 2.0


def test_extraction_and_errors():
    assert extract_gsm8k_answer("\\boxed{\\frac{1}{2}} then #### 3") == "3"
    assert extract_gsm8k_answer("\\boxed{12") is None  # unclosed box
    with pytest.raises(ValueError, match="ground_truth"):
        compute_score("#### 1", "not a number")
    with pytest.raises(ValueError, match="method"):
        compute_score("#### 1", "1", method="loose")
