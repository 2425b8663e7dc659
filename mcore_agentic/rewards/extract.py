"""Answer extraction shared by the rule-based rewards: ``#### <answer>``, ``\\boxed{...}``, numbers."""

from __future__ import annotations

import re
from fractions import Fraction

# A number as people write it: sign, thousands separators, decimals, optional currency/percent.
_NUMBER = r"[-+]?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?%?|[-+]?\$?\s?\.\d+%?"
NUMBER_RE = re.compile(_NUMBER)
HASH_ANSWER_RE = re.compile(r"####\s*(" + _NUMBER + r")")
_BOXED_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_hash_answer(text: str) -> str | None:
    """The number after the last ``####`` marker, or None."""
    matches = HASH_ANSWER_RE.findall(text)
    return matches[-1] if matches else None


def last_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` (balanced braces), or None if absent or unclosed."""
    starts = [m.end() for m in _BOXED_OPEN.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


def last_number(text: str) -> str | None:
    """The last number in ``text``, or None."""
    matches = NUMBER_RE.findall(text)
    return matches[-1] if matches else None


def to_number(text: str | None) -> Fraction | None:
    """``"1,234.50"``, ``"$12"``, ``"-3"``, ``"50%"`` (-> 50) as an exact Fraction; None if not a number."""
    if text is None:
        return None
    cleaned = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip("%").rstrip(".")
    if cleaned.startswith("\\text{") and cleaned.endswith("}"):
        cleaned = cleaned[6:-1]
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None
