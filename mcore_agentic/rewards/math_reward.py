"""Math reward via HuggingFace's ``math-verify``: parse the gold answer and the response
(LaTeX and plain expressions, ``\\boxed{}`` preferred) and check equivalence symbolically."""

from __future__ import annotations

import threading

from mcore_agentic.rewards.extract import last_boxed

_TIMEOUT_S = 5


def _timeout() -> int | None:
    # math-verify's timeout uses signal.alarm, which only works on the main thread;
    # elsewhere (executor threads) it must be off or every call raises.
    return _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _as_latex(answer: str) -> str:
    """Wrap a bare gold answer (``\\frac{1}{2}``, ``3``) so math-verify's LaTeX extractor sees it."""
    text = answer.strip()
    if "$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text:
        return text
    return f"${text}$"


def compute_score(solution_str: str, ground_truth: str, format_score: float = 0.0, score: float = 1.0) -> float:
    """``score`` if the response's final answer is mathematically equal to ``ground_truth``,
    ``format_score`` if it gave a ``\\boxed{}`` answer that is wrong, else 0.0."""
    from math_verify import parse, verify

    timeout = _timeout()
    gold = parse(_as_latex(str(ground_truth)), parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math ground_truth {ground_truth!r} could not be parsed by math-verify")
    boxed = last_boxed(solution_str)
    # Prefer the committed \boxed{} answer; otherwise let math-verify find the last expression.
    pred = parse(_as_latex(boxed) if boxed is not None else solution_str, parsing_timeout=timeout)
    if pred and verify(gold, pred, timeout_seconds=timeout):
        return score
    return format_score if boxed is not None else 0.0
