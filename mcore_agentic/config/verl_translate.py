"""verl's key translation: verl's keys in YAML trees and on the command line, moved to the native keys.

The table (what each verl key means here) is :mod:`mcore_agentic.config.verl_keys`; this module applies it, and
:mod:`mcore_agentic.config.load` calls in here and nowhere else for verl:

* command-line overrides, before Hydra composes (its struct mode refuses keys the base config lacks):
  :func:`translate_overrides` rewrites ``actor_rollout_ref.actor.optim.lr=1e-6`` to ``actor.optim.lr=1e-6`` and
  drops keys not needed here, returning one line per key used for the caller to print; :func:`plan_overrides`
  says what each override becomes and what is wrong with it (for ``check_overrides``);
* YAML trees (a verl-style YAML, ``actor_rollout_ref: {actor: {...}}``): :func:`translate_config` moves each
  value to its native key, returning one log line per key and the problems.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from mcore_agentic.config import verl_keys, verl_lookup
from mcore_agentic.config.key_hints import suggest_key
from mcore_agentic.config.paths import CONFIG_DIR
from mcore_agentic.config.schema import RLConfig, native_groups, native_leaves
from mcore_agentic.config.verl_entry import fmt, same_value
from mcore_agentic.config.verl_keys import DIFFERS, IGNORED, KEEP_DEFAULT, VerlKey
from mcore_agentic.utils.errors import ConfigError
from mcore_agentic.utils.walk import get_dotted, set_dotted, to_dict

__all__ = ["plan_overrides", "translate_config", "translate_overrides"]

_REWARD_PAIR = ("custom_reward_function.path", "custom_reward_function.name")
"""verl's two keys of one native key, ``reward.custom_reward_function=<path>:<name>``."""

# ------------------------------------------------------------------------------------------------ YAML trees
@cache
def _defaults() -> dict[str, Any]:
    from mcore_agentic.config.reference import default_instance

    out: dict[str, Any] = {}

    def flat(node: Any, path: str) -> None:
        if isinstance(node, Mapping) and path not in native_leaves():
            for k, v in node.items():
                flat(v, f"{path}.{k}" if path else k)
        else:
            out[path] = node

    flat(to_dict(default_instance(RLConfig)), "")
    return out


@cache
def _shipped_values() -> dict[str, list[Any]]:
    """Every value the shipped run configs and model presets (``configs/*.yaml``, ``configs/model/*.yaml``) give
    each native key: a native key holding one of them was not set by the user's own YAML."""
    import yaml

    out: dict[str, list[Any]] = {}

    def flat(node: Any, path: str) -> None:
        if isinstance(node, Mapping) and path not in native_leaves():
            for k, v in node.items():
                if k != "defaults":
                    flat(v, f"{path}.{k}" if path else str(k))
        else:
            out.setdefault(path, []).append(node)

    for path in sorted(CONFIG_DIR.glob("*.yaml")) + sorted(CONFIG_DIR.glob("model/*.yaml")):
        try:
            text = path.read_text()
            tree = yaml.safe_load(text)
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(tree, Mapping):
            package = "" if path.parent == CONFIG_DIR or "@package _global_" in text else path.parent.name
            flat(tree, package)
    return out


def _baseline(key: str, value: Any, data: Mapping[str, Any]) -> bool:
    """Whether native ``key`` holding ``value`` was left as this project ships it (its default, the key its
    base-YAML interpolation follows, or a shipped config's or preset's value), not set by the user."""
    from mcore_agentic.config.reference import YAML_INTERPOLATIONS

    if key in YAML_INTERPOLATIONS and same_value(value, get_dotted(data, YAML_INTERPOLATIONS[key][2:-1], _MISSING)):
        return True
    candidates = [_defaults().get(key, _MISSING), *_shipped_values().get(key, [])]
    return any(same_value(value, c) for c in candidates)


_MISSING = object()


def _delete(tree: dict[str, Any], dotted: str) -> None:
    *parents, last = dotted.split(".")
    node: Any = tree
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(last, None)


def _leaves(key: str, value: Any) -> list[tuple[str, Any]]:
    """``(dotted key, value)`` of every leaf under ``key`` (an empty mapping is a leaf)."""
    if isinstance(value, Mapping) and value:
        return [leaf for k, v in value.items() for leaf in _leaves(f"{key}.{k}", v)]
    return [(key, value)]


def _override_keys(overrides: Sequence[str]) -> set[str]:
    return {item.split("=", 1)[0].lstrip("+~") for item in overrides}


@dataclass
class _Source:
    key: str
    value: Any
    entry: VerlKey
    detail: str = ""


class _Lines:
    """Log lines, each once, ordered by the position of the key they speak of (then as added)."""

    def __init__(self) -> None:
        self._lines: dict[str, int] = {}

    def add(self, line: str, position: int = 0) -> None:
        self._lines.setdefault(line, position)

    def __iter__(self):
        return iter(sorted(self._lines, key=self._lines.__getitem__))


def translate_config(
    data: dict[str, Any], overrides: Sequence[str] = ()
) -> tuple[dict[str, Any], list[str], list[ConfigError]]:
    """``data`` (a plain config tree, changed in place) with verl's keys moved to the native ones.

    Returns the tree, one log line per verl key used (``verl key A -> B``; ``K: not needed here: why``) and the
    problems: refused keys (:data:`~mcore_agentic.config.verl_keys.DIFFERS`), unknown keys under verl's own groups,
    values that cannot be translated, and values set under both names that disagree. A native key holding its
    default (or set to the same value) yields to the verl key; ``overrides`` (the command line) decides between a
    native key given there and a verl key in a YAML file.
    """
    lines = _Lines()
    errors: list[ConfigError] = []
    items = _take_verl_keys(data, errors)
    sources = _sources(items, lines, errors)
    given = _override_keys(overrides)
    applied: dict[str, tuple[VerlKey, list[str], str]] = {}
    for target, srcs in sources.items():
        _resolve(target, srcs, data, given, applied, errors)
    position = {full: pos for pos, (full, _, _) in enumerate(items)}
    for key, (entry, targets, detail) in applied.items():
        lines.add(verl_lookup.alias_line(key, entry, tuple(targets), detail=detail), position.get(key, 0))
    _translate_values(data, lines)
    return data, list(lines), errors


def _take_verl_keys(data: dict[str, Any], errors: list[ConfigError]) -> list[tuple[str, VerlKey, Any]]:
    """Remove verl's keys from ``data`` (in tree order) with their table entries; an unknown key under a node only
    verl has is removed too, as a problem in ``errors``."""
    items: list[tuple[str, VerlKey, Any]] = []
    leaves, groups = native_leaves(), native_groups()

    def walk(node: dict[str, Any], path: str) -> None:
        for key in list(node):
            if not isinstance(key, str):
                continue
            full = f"{path}.{key}" if path else key
            value = node[key]
            if full in leaves:
                continue
            if isinstance(value, Mapping) and (full in groups or verl_lookup.has_entries_below(full)):
                walk(value, full)  # type: ignore[arg-type]
                if not value and full not in groups:
                    del node[key]
                continue
            entry = verl_lookup.lookup(full)
            if entry is not None:
                items.append((full, entry, value))
                del node[key]
            elif verl_lookup.is_verl_root(full) or (path and path not in groups):  # under a node only verl has
                parent, _, last = full.rpartition(".")
                errors.append(ConfigError(full, f"unknown key; {suggest_key(last, parent, [], sorted(leaves))}"))
                del node[key]

    walk(data, "")
    return items


def _sources(items: list[tuple[str, VerlKey, Any]], lines: _Lines,
             errors: list[ConfigError]) -> dict[str, list[_Source]]:
    """The verl keys that set each native key: keys not needed (and refused keys given an accepted value) are
    only logged, refused keys and values that cannot be translated become problems, and verl's two reward keys
    join into one."""
    sources: dict[str, list[_Source]] = {}
    pair: dict[str, tuple[Any, VerlKey]] = {}
    for pos, (full, entry, value) in enumerate(items):
        if entry.kind == IGNORED:
            lines.add(verl_lookup.ignored_line(full, entry), pos)
        elif entry.kind == DIFFERS:
            bad = [(k, v) for k, v in _leaves(full, value) if not entry.accepts(v)] if entry.wildcard else (
                [] if entry.accepts(value) else [(full, value)])
            if bad:
                errors += [ConfigError(k, entry.error()) for k, _ in bad]
            else:
                lines.add(verl_lookup.ignored_line(full, entry, value, accepted=not entry.wildcard), pos)
        elif full in _REWARD_PAIR:
            pair[full] = (value, entry)
        else:
            try:
                native = verl_lookup.convert(entry, value)
            except ValueError as e:
                errors.append(ConfigError(full, str(e)))
                continue
            if native is KEEP_DEFAULT:
                lines.add(verl_lookup.alias_line(full, entry, detail="null: keeps its value"), pos)
                continue
            for target in entry.native:
                sources.setdefault(target, []).append(_Source(full, native, entry))
    if pair:
        _reward_source(pair, sources)
    return sources


def _reward_source(pair: dict[str, tuple[Any, VerlKey]], sources: dict[str, list[_Source]]) -> None:
    """``reward.custom_reward_function`` from verl's ``custom_reward_function.path`` and ``.name``."""
    path = pair.get(_REWARD_PAIR[0], (None, None))[0]
    name = pair.get(_REWARD_PAIR[1], (None, None))[0]
    spec = verl_lookup.reward_function_spec(path, name)
    if spec is not KEEP_DEFAULT:
        used = [k for k in _REWARD_PAIR if k in pair]
        sources.setdefault("reward.custom_reward_function", []).append(
            _Source(used[0], spec, pair[used[0]][1], detail=" + ".join(used[1:])))


def _resolve(target: str, srcs: list[_Source], data: dict[str, Any], given: set[str],
             applied: dict[str, tuple[VerlKey, list[str], str]], errors: list[ConfigError]) -> None:
    """Set native key ``target`` from the verl keys in ``srcs`` (recorded in ``applied``), or say why not."""
    main = [s for s in srcs if not s.entry.fallback]
    chosen = main or srcs
    first = chosen[0]
    for other in chosen[1:]:
        if not same_value(other.value, first.value):
            errors.append(ConfigError(other.key, f"{fmt(other.value)} disagrees with {first.key}={fmt(first.value)} "
                                      f"(both set {target}): keep one"))
            return
    current = get_dotted(data, target, _MISSING)
    from_command_line = any(s.key in given for s in chosen)
    unset = current is _MISSING or same_value(current, first.value) or _baseline(target, current, data)
    if not main and not unset:
        return  # a fallback (verl's clip_ratio) yields to the specific key
    detail = ""
    if target in given and not from_command_line:
        if not same_value(current, first.value):
            detail = f"the command line's {target}={fmt(current)} wins"
    elif not unset and not from_command_line:
        errors.append(ConfigError(first.key, f"{fmt(first.value)} disagrees with {target}={fmt(current)}: "
                                  "set one of the two"))
        return
    if not detail:
        if current is not _MISSING and not same_value(current, first.value) and \
                not same_value(current, _defaults().get(target, _MISSING)):
            detail = f"instead of {fmt(current)}"
        set_dotted(data, target, first.value)
    for s in chosen:
        entry, targets, _ = applied.setdefault(s.key, (s.entry, [], ""))
        targets.append(target)
        applied[s.key] = (entry, targets, detail or (f"with {s.detail}" if s.detail else ""))


def _translate_values(data: dict[str, Any], lines: _Lines) -> None:
    """verl's spellings of shared keys' values (``trainer.logger: console`` ...)."""
    for key, translate in verl_keys.VALUE_TRANSLATIONS.items():
        value = get_dotted(data, key, _MISSING)
        if value is _MISSING:
            continue
        new = translate(value)
        if new is KEEP_DEFAULT:
            _delete(data, key)
            lines.add(f"verl value {key}={fmt(value)} -> the default", 1 << 30)
        elif not (same_value(new, value) and type(new) is type(value)):
            set_dotted(data, key, new)
            lines.add(f"verl value {key}={fmt(value)} -> {fmt(new)}", 1 << 30)


# ------------------------------------------------------------------------------------------------ command line
_UNPARSED = object()


@dataclass
class _Override:
    index: int
    item: str
    prefix: str
    key: str
    text: str | None
    value: Any = _UNPARSED
    entry: VerlKey | None = None


@dataclass
class OverridePlan:
    """What :func:`plan_overrides` makes of a command line."""

    out: dict[int, list[str]] = field(default_factory=dict)
    """What each override (by position) becomes: itself, nothing, or its native item(s)."""
    lines: _Lines = field(default_factory=_Lines)
    errors: list[ConfigError] = field(default_factory=list)
    unknown: list[_Override] = field(default_factory=list)
    applied: dict[int, list[str]] = field(default_factory=dict)
    """Alias overrides (by position) -> their rewritten items (empty: consumed without an item)."""
    kept: set[int] = field(default_factory=set)
    """Alias overrides left as they are (a problem names them)."""


def _split(index: int, item: str) -> _Override:
    prefix = "++" if item.startswith("++") else item[0] if item[:1] in ("+", "~") else ""
    rest = item[len(prefix):]
    key, eq, text = rest.partition("=")
    return _Override(index, item, prefix, key, text if eq else None)


def _parse_value(item: str) -> Any:
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        override = OverridesParser.create().parse_override(item)
        if override.is_sweep_override():
            return _UNPARSED
        return override.value()
    except Exception:  # noqa: BLE001 -- Hydra will say what is wrong with it
        return _UNPARSED


def _hydra_text(value: Any) -> str:
    """``value`` in Hydra's override grammar."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_hydra_text(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{_hydra_text(v)}" for k, v in value.items()) + "}"
    return str(value)


def _is_native(key: str) -> bool:
    leaves = native_leaves()
    return key in leaves or key in native_groups() or any(key.startswith(leaf + ".") for leaf in leaves)


def _config_groups() -> set[str]:
    return {p.name for p in CONFIG_DIR.iterdir() if p.is_dir()} if CONFIG_DIR.is_dir() else set()


def plan_overrides(overrides: Sequence[str]) -> OverridePlan:
    """What each override becomes: the rewritten items (by position), the log lines and the problems."""
    plan = OverridePlan()
    groups = _config_groups()
    native: dict[str, _Override] = {}
    sources: dict[str, list[tuple[_Override, Any]]] = {}
    aliases: list[_Override] = []
    for i, item in enumerate(overrides):
        o = _split(i, item)
        plan.out[i] = [item]
        if (o.text is None and o.prefix != "~") or o.key in groups or o.key.startswith("hydra.") or _is_native(o.key):
            native[o.key] = o  # the last one given is Hydra's
            continue
        o.entry = verl_lookup.lookup(o.key)
        if o.entry is None:
            plan.unknown.append(o)
            continue
        o.value = _parse_value(item) if o.text is not None else None
        entry = o.entry
        if entry.kind == IGNORED:
            plan.out[i] = []
            plan.lines.add(verl_lookup.ignored_line(o.key, entry), i)
        elif entry.kind == DIFFERS:
            values = [v for _, v in _leaves(o.key, o.value)] if entry.wildcard else [o.value]
            if o.prefix != "~" and (o.value is _UNPARSED or not all(entry.accepts(v) for v in values)):
                plan.errors.append(ConfigError(o.key, entry.error()))
            else:
                plan.out[i] = []
                plan.lines.add(verl_lookup.ignored_line(o.key, entry, o.value, accepted=o.prefix != "~"), i)
        elif o.key in _REWARD_PAIR:
            # Joined with its partner, which may sit in a YAML file: into the tree under verl's name.
            plan.out[i] = [f"~{o.key}" if o.prefix == "~" else f"++{o.key}={o.text}"]
        elif o.prefix == "~":
            plan.out[i] = [f"~{t}" for t in entry.native]
            plan.lines.add(verl_lookup.alias_line(o.key, entry), i)
        else:
            value = o.value
            if entry.convert is not None:
                try:
                    if value is _UNPARSED:
                        raise ValueError(f"cannot translate {o.text!r}: give a plain value")
                    value = verl_lookup.convert(entry, value)
                except ValueError as e:
                    plan.errors.append(ConfigError(o.key, str(e)))
                    continue
                if value is KEEP_DEFAULT:
                    plan.out[i] = []
                    plan.lines.add(verl_lookup.alias_line(o.key, entry, detail="null: keeps its value"), i)
                    continue
            aliases.append(o)
            plan.applied[i] = []
            for target in entry.native:
                sources.setdefault(target, []).append((o, value))
    for target, srcs in sources.items():
        _plan_target(plan, target, srcs, native.get(target))
    for o in aliases:
        if o.index in plan.kept:
            continue
        plan.out[o.index] = plan.applied[o.index]
        targets = tuple(t.split("=", 1)[0].lstrip("+") for t in plan.applied[o.index])
        detail = "the specific keys are set" if not targets and o.entry.fallback else ""  # type: ignore[union-attr]
        plan.lines.add(verl_lookup.alias_line(o.key, o.entry, targets or None, detail=detail), o.index)  # type: ignore[arg-type]
    return plan


def _plan_target(plan: OverridePlan, target: str, srcs: list[tuple[_Override, Any]], native: _Override | None) -> None:
    """Rewrite the verl overrides that set native key ``target``, or name the conflict."""
    main = [(o, v) for o, v in srcs if not o.entry.fallback]  # type: ignore[union-attr]
    chosen = main or srcs  # a fallback (verl's clip_ratio) yields to the specific key
    o0, v0 = chosen[0]
    agreeing = [(o0, v0)]
    for o, v in chosen[1:]:
        if v is _UNPARSED or v0 is _UNPARSED or not same_value(v, v0):
            plan.errors.append(ConfigError(o.key, f"{o.text} disagrees with {o0.key}={o0.text} (both set {target}): "
                                           "keep one"))
            plan.kept.add(o.index)
        else:
            agreeing.append((o, v))
    if native is not None:
        nv = _parse_value(native.item) if native.text is not None else _UNPARSED
        for o, v in agreeing:
            if o.entry.fallback or (v is not _UNPARSED and nv is not _UNPARSED and same_value(v, nv)):  # type: ignore[union-attr]
                continue  # the native item says it (a fallback yields to it); the verl one is consumed
            plan.errors.append(ConfigError(o.key, f"{o.text} disagrees with {target}={native.text} on the command "
                                           "line: keep one"))
            plan.kept.add(o.index)
        return
    o, v = agreeing[0]
    text = o.text if o.entry.convert is None else _hydra_text(v)  # type: ignore[union-attr]
    plus = "++" if o.prefix in ("+", "++") else ""
    plan.applied[o.index].append(f"{plus}{target}={text}")


def translate_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Command-line overrides with verl's keys rewritten to the native ones, before Hydra composes.

    Returns ``(overrides, lines)``: an alias becomes its native key (``actor_rollout_ref.actor.optim.lr=1e-6`` ->
    ``actor.optim.lr=1e-6``, verl's value spellings translated), a key not needed here is dropped, and ``lines``
    says so, one line per key (``verl key A -> B``, ``K: not needed here: why``) for the caller to print once.
    ``custom_reward_function.path``/``.name`` go into the tree as ``++`` overrides (joined there, with a partner in
    a YAML file). Everything else stays as it was, problems included: :func:`check_overrides` reports them.
    Anything that is not ``key=value`` (launcher flags, ``--config-name``) passes through untouched.
    """
    plan = plan_overrides(argv)
    out = [item for i in range(len(argv)) for item in plan.out[i]]
    return out, list(plan.lines)


