"""The one error type for bad configuration or bad input data.

Its message is a single line naming the offending field and the fix, e.g.
``actor.tensor_model_parallel_size=3 does not divide world size 2: use 1 or 2``.
Entry points catch it and exit with that line, no traceback.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """Bad config or input: ``field`` names the key, the message says how to fix it."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


def require(condition: bool, field: str, message: str) -> None:
    """Raise :class:`ConfigError` for ``field`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(field, message)


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first non-empty line of ``exc``'s message (its type name if none), at most ``limit`` characters.

    For one-line errors that quote a library's failure without its traceback-sized message.
    """
    line = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    return line[:limit]
