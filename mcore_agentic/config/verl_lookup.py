"""Reading verl's key table (:mod:`.verl_keys`): an entry by key, its log lines, and hints for a mistyped key.

Standard library only: :mod:`.verl_translate` applies the table, :mod:`.key_hints` asks here what to write instead
of an unknown key.
"""

from __future__ import annotations

import difflib
from typing import Any

from mcore_agentic.config.verl_entry import ALIAS, DOC, IGNORED, KEEP_DEFAULT, VerlKey, fmt
from mcore_agentic.config.verl_keys import TABLE, TARGET, VERL_GROUPS, VERL_ROOTS

_EXACT: dict[str, VerlKey] = {e.verl: e for e in TABLE if not e.wildcard}
_WILDCARDS: dict[str, VerlKey] = {e.prefix: e for e in TABLE if e.wildcard}
_PREFIXES: frozenset[str] = frozenset(
    ".".join(e.prefix.split(".")[:i]) for e in TABLE for i in range(1, e.prefix.count(".") + 1)
)


def lookup(key: str) -> VerlKey | None:
    """The entry for verl key ``key``: exact, else the deepest ``.*`` entry above it, else ``None``."""
    if key in _EXACT:
        return _EXACT[key]
    if key.rsplit(".", 1)[-1] == "_target_":
        return TARGET
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        entry = _WILDCARDS.get(".".join(parts[:i]))
        if entry is not None:
            return entry
    return None


def has_entries_below(key: str) -> bool:
    """Whether table entries sit below ``key`` (a mapping there is walked into rather than taken whole)."""
    return key in _PREFIXES


def is_verl_root(key: str) -> bool:
    return key.split(".", 1)[0] in VERL_ROOTS


def alias_line(key: str, entry: VerlKey, targets: tuple[str, ...] | None = None, detail: str = "") -> str:
    """The log line of an alias used: ``verl key A -> B``."""
    line = f"verl key {key} -> {', '.join(targets or entry.native)}"
    if detail:
        line += f" ({detail})"
    elif entry.explain and entry.note:
        line += f" ({entry.note})"
    return line


def ignored_line(key: str, entry: VerlKey, value: Any = None, accepted: bool = False) -> str:
    """The log line of a key not needed here (or a refused key given the value that changes nothing)."""
    if accepted:
        return f"{key}={fmt(value)}: not needed here: {entry.note}"
    return f"{key}: not needed here: {entry.note}"


def convert(entry: VerlKey, value: Any) -> Any:
    """An alias's value in native terms (:data:`KEEP_DEFAULT`: nothing to set); ``ValueError`` if it has none."""
    if entry.convert is None:
        return value
    return entry.convert(value)


def reward_function_spec(path: Any, name: Any) -> Any:
    """``reward.custom_reward_function`` of verl's ``custom_reward_function.path`` and ``.name``."""
    if path is None or path == "":
        return KEEP_DEFAULT
    return f"{path}:{name or 'compute_score'}"


def native_of(key: str) -> str | None:
    """The verl spelling of a native-looking key (``actor.fsdp_config.param_offload`` ->
    ``actor_rollout_ref.actor.fsdp_config.param_offload``) when verl nests its group, else ``None``."""
    group = key.split(".", 1)[0]
    for verl_group, native_group in VERL_GROUPS.items():
        if group == native_group:
            return verl_group + key[len(native_group):]
    return None


def hint(key: str) -> str | None:
    """What to write instead of ``key``, from the table; ``None`` when the table says nothing about it.

    ``key`` is a verl key met where the table was not applied (a mapping given straight to ``build``), or a
    native-looking key with verl's name under it (``rollout.multi_turn.max_turns``, ``actor.fsdp_config.param_offload``).
    """
    entry = lookup(key)
    if entry is not None:
        return _entry_hint(key, entry, mixed=False)
    if is_verl_root(key) and has_entries_below(key):
        return f"verl's {key} group: the launcher and load_config translate its keys (see {DOC})"
    verl_key = native_of(key)
    if verl_key:
        entry = lookup(verl_key)
        if entry is not None and entry is not TARGET:
            return _entry_hint(verl_key, entry, mixed=True)
    return None


def close_key(key: str, native_leaves: frozenset[str] | set[str] = frozenset()) -> str | None:
    """A likely meant key for a misspelt verl key: a verl key of the same parent (with its native name), else
    the native key of the group verl's parent became; ``None`` when ``key`` is not under a verl group."""
    parent, _, last = key.rpartition(".")
    if not (is_verl_root(key) or parent in VERL_GROUPS or has_entries_below(parent)):
        return None
    siblings = {e.verl.rpartition(".")[2]: e for e in TABLE if not e.wildcard and e.verl.rpartition(".")[0] == parent}
    close = difflib.get_close_matches(last, list(siblings), n=1, cutoff=0.75)
    if close:
        e = siblings[close[0]]
        here = f" (here {' and '.join(e.native)})" if e.kind == ALIAS else ""
        return f"did you mean {parent}.{close[0]}{here}?"
    native_group = VERL_GROUPS.get(parent)
    if native_group:
        known = [leaf.rpartition(".")[2] for leaf in native_leaves if leaf.rpartition(".")[0] == native_group]
        close = difflib.get_close_matches(last, known, n=1, cutoff=0.75)
        if close:
            return f"did you mean {native_group}.{close[0]}?"
    if is_verl_root(key):
        return f"not a verl key this project knows; see {DOC} for verl's keys and their names here"
    return None


def _entry_hint(key: str, entry: VerlKey, mixed: bool) -> str:
    """``mixed``: ``key`` is verl's name of a native-looking key the user wrote (their key is not accepted)."""
    if entry.kind == ALIAS:
        targets = " and ".join(entry.native)
        if mixed:
            return f"did you mean {targets}?" + (f" ({entry.note})" if entry.explain and entry.note else "")
        return f"verl's name of {targets}: write {targets}"
    if entry.kind == IGNORED:
        return (f"verl's {key} is not needed here: {entry.note}; drop the key" if mixed
                else f"verl's key, not needed here: {entry.note}")
    return f"verl's {key}: {entry.error()}" if mixed else entry.error()

