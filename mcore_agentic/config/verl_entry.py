"""One verl key of :data:`mcore_agentic.config.verl_keys.TABLE`: its kind, what it means here, and how values compare.

Standard library only; :mod:`.verl_keys` re-exports every name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

ALIAS = "alias"
DIFFERS = "differs"
IGNORED = "not needed"

KEEP_DEFAULT = object()
"""A value translation's answer for "nothing to set": the native key keeps its value (verl's ``null`` = unset)."""

DOC = "docs/verl_migration.md"


@dataclass(frozen=True)
class VerlKey:
    """One verl key and what it means here."""

    verl: str
    """verl's dotted key path; ``prefix.*`` covers the node ``prefix`` and every key under it."""
    kind: str
    """:data:`ALIAS`, :data:`DIFFERS` or :data:`IGNORED`."""
    native: tuple[str, ...] = ()
    """Alias: the native key(s) the value goes to."""
    note: str = ""
    """Alias: what to know about the translation; differs: what differs; not needed: why."""
    fix: str = ""
    """Differs: what to write instead."""
    accept: tuple[Any, ...] = ()
    """Differs: values that ask for what happens here anyway (accepted and ignored, with one line)."""
    convert: Callable[[Any], Any] | None = None
    """Alias: translates verl's value (:data:`KEEP_DEFAULT`: nothing to set); raises ``ValueError(message)``."""
    fallback: bool = False
    """Alias: fills only targets no other key sets (verl's ``clip_ratio`` under ``clip_ratio_low``/``_high``)."""
    explain: bool = False
    """Alias: the log line carries the note (a renamed key whose old name misleads)."""

    @property
    def wildcard(self) -> bool:
        return self.verl.endswith(".*")

    @property
    def prefix(self) -> str:
        return self.verl[:-2] if self.wildcard else self.verl

    def accepts(self, value: Any) -> bool:
        return any(same_value(value, a) for a in self.accept)

    def error(self) -> str:
        """The one-line message of a refused (differs) key."""
        return f"{self.note}: {self.fix}" if self.fix else self.note


def same_value(a: Any, b: Any) -> bool:
    """``a == b`` without Python's ``True == 1`` and ``"1" != 1`` surprises: numbers compare as numbers."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return isinstance(a, str) == isinstance(b, str) and a == b


def alias(verl: str, *native: str, note: str = "", convert: Callable[[Any], Any] | None = None,
          fallback: bool = False, explain: bool = False) -> VerlKey:
    return VerlKey(verl, ALIAS, tuple(native), note, convert=convert, fallback=fallback, explain=explain)


def ignored(verl: str, note: str) -> VerlKey:
    return VerlKey(verl, IGNORED, note=note)


def differs(verl: str, note: str, fix: str = "drop the key", accept: tuple[Any, ...] = ()) -> VerlKey:
    return VerlKey(verl, DIFFERS, note=note, fix=fix, accept=accept)


def fmt(value: Any) -> str:
    """A value as it would be written on a command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(fmt(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{fmt(v)}" for k, v in value.items()) + "}"
    return str(value)

