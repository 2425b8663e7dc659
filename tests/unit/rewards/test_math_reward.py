"""Math rule via math-verify: equivalent forms, wrong, malformed, missing, threads."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from mcore_agentic.rewards.math_reward import compute_score


@pytest.mark.parametrize(
    "solution, gold, expected",
    [
        ("So the result is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", 1.0),
        ("The answer is \\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("We get \\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
        ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", 1.0),
        ("Final: $\\boxed{3}$", "4", 0.0),
        ("The answer is 4.", "4", 1.0),  # no box: math-verify finds the final expression
        ("I do not know.", "4", 0.0),
        ("\\boxed{", "4", 0.0),  # malformed
        ("", "4", 0.0),
    ],
)
def test_scores(solution, gold, expected):
    assert compute_score(solution, gold) == expected


def test_format_score_and_bad_gold():
    assert compute_score("\\boxed{3}", "4", format_score=0.1) == 0.1
    assert compute_score("no answer", "4", format_score=0.1) == 0.0
    with pytest.raises(ValueError, match="ground_truth"):
        compute_score("\\boxed{1}", "")


def test_works_off_the_main_thread():
    # math-verify's signal-based timeout only works on the main thread; we switch it off elsewhere.
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda s: compute_score(s, "\\frac{1}{2}"), ["\\boxed{0.5}", "\\boxed{2}"]))
    assert results == [1.0, 0.0]
