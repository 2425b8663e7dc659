"""The one error type for bad configuration or bad input data.

Its message is a single line naming the offending field and the fix, e.g.
``actor.tensor_model_parallel_size=3 does not divide world size 2: use 1 or 2``.
Entry points catch it and exit with that line, no traceback. Several problems found
in one pass travel together as :class:`ConfigErrors` (a ``ConfigError`` too), one
line each; every ``ConfigError`` lists its problems in ``.errors``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


class ConfigError(ValueError):
    """Bad config or input: ``field`` names the key, the message says how to fix it."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")

    @property
    def errors(self) -> list[ConfigError]:
        """The problems this error reports, one per line: just itself (see :class:`ConfigErrors`)."""
        return [self]

    def __reduce__(self):  # picklable: the arguments are (field, message), not the joined message
        return (type(self), (self.field, str(self)[len(self.field) + 2 :]))


class ConfigErrors(ConfigError):
    """Several config problems found in one pass: ``errors`` holds each, ``str()`` is one ``field: message``
    line per problem, and ``field`` is the first problem's field (so code that handles one error still works)."""

    def __init__(self, errors: Iterable[ConfigError]):
        flat = [e for error in errors for e in error.errors]
        if not flat:
            raise ValueError("ConfigErrors needs at least one error")
        self._errors = flat
        self.field = flat[0].field
        ValueError.__init__(self, "\n".join(str(e) for e in flat))

    @property
    def errors(self) -> list[ConfigError]:
        return list(self._errors)

    def __reduce__(self):  # picklable (ConfigError's arguments are not its message)
        return (ConfigErrors, (self._errors,))


def raise_errors(errors: Iterable[ConfigError]) -> None:
    """Raise the problems in ``errors``, if any: a single one as itself (its message exactly as when raised
    alone), several as one :class:`ConfigErrors`."""
    flat = [e for error in errors for e in error.errors]
    if len(flat) == 1:
        raise flat[0]
    if flat:
        raise ConfigErrors(flat)


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


def collect(problems: list[ConfigError], check: Callable[[], Any], field: str = "config") -> Any:
    """Run ``check``; its config problems join ``problems`` (several at once from a ``ConfigErrors``). Any other
    exception (a user's module that does not import, a checkpoint without tokenizer files) becomes one line
    naming ``field``, never a traceback. What ``check`` returned, or None when it failed."""
    try:
        return check()
    except ConfigError as exc:
        problems.extend(getattr(exc, "errors", None) or [exc])
    except Exception as exc:  # noqa: BLE001 -- a pre-flight's promise: one line per problem
        problems.append(ConfigError(field, f"{type(exc).__name__}: {first_line(exc)}"))
    return None
