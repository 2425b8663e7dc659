"""GSM8K reward: the final answer (``#### <n>``, else ``\\boxed{n}``, else the last number in
flexible mode) compared numerically with the ground truth."""

from __future__ import annotations

from typing import Literal

from mcore_agentic.rewards.extract import last_boxed, last_hash_answer, last_number, to_number


def extract_gsm8k_answer(solution_str: str, method: Literal["strict", "flexible"] = "strict") -> str | None:
    """The answer string the response commits to, or None.

    ``strict``: the last ``#### <number>``, else the last ``\\boxed{}``. ``flexible``: falls back
    further to the last number anywhere in the text.
    """
    answer = last_hash_answer(solution_str)
    if answer is None:
        answer = last_boxed(solution_str)
    if answer is None and method == "flexible":
        answer = last_number(solution_str)
    return answer


def ground_truth_number(ground_truth: str | int | float):
    """The gold number from ``"72"``, ``72`` or a full GSM8K solution ending in ``#### 72``."""
    text = str(ground_truth)
    return to_number(last_hash_answer(text) or text)


def compute_score(
    solution_str: str,
    ground_truth: str | int | float,
    method: Literal["strict", "flexible"] = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` if the extracted answer equals the ground truth, ``format_score`` if an answer was
    found but is wrong (or not a number), 0.0 if none was found."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    gold = ground_truth_number(ground_truth)
    if gold is None:
        raise ValueError(f"gsm8k ground_truth {ground_truth!r} is not a number (nor ends in '#### <number>')")
    answer = extract_gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    return score if to_number(answer) == gold else format_score
