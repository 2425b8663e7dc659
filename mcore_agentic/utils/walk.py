"""Walk config dataclasses: build them from plain mappings, list their keys, turn them back into dicts.

The dataclasses are the schema: their fields, type hints and defaults say what
a key may hold. This module only walks them:

* an unknown key is an error naming the full dotted key and the nearest known key
  ("did you mean actor.ppo_mini_batch_size?"); the root dataclass may add what it knows
  (``unknown_key_hint``: the run's config names verl's keys, :mod:`mcore_agentic.config.key_hints`);
  the hint is never empty or another group's key of another meaning;
* a value of the wrong type raises naming the key, the expected type and the
  value given (``int`` never silently becomes ``bool``; ``1`` is accepted where
  a ``float`` is expected);
* a ``Literal`` field rejects values outside its choices;
* a field with ``metadata={"flatten": True}`` is a sub-dataclass whose keys sit
  directly in the parent mapping (``actor.tensor_model_parallel_size`` filling
  ``actor.parallel``), so two packages can own fields of one YAML group;
* errors raised by a group's own ``__post_init__`` are re-raised with the
  group's dotted path in front of the field they name.

:func:`build` collects every problem of the tree before it raises: one problem
raises that :class:`ConfigError` as it always did, several raise one
:class:`~mcore_agentic.utils.errors.ConfigErrors` (a ``ConfigError`` too) with a
line each. A group whose own fields failed skips its ``__post_init__``.

No defaults live here: a key that is absent takes the dataclass default.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from typing import Any, TypeVar, Union

from mcore_agentic.utils.errors import ConfigError, raise_errors

T = TypeVar("T")

FLATTEN = "flatten"  # dataclass field metadata key: sub-group keys live in the parent mapping

_HINT: ContextVar[Any] = ContextVar("unknown_key_hint", default=None)
"""The hint function of the tree being built (its root's ``unknown_key_hint``, else :func:`plain_hint`)."""


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def is_flattened(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get(FLATTEN, False))


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def accepted_keys(cls: type) -> dict[str, tuple[str, ...]]:
    """Every key a mapping for ``cls`` may hold -> the attribute path it fills (flattened groups expanded)."""
    keys: dict[str, tuple[str, ...]] = {}
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if is_flattened(f):
            for sub, route in accepted_keys(hints[f.name]).items():
                keys[sub] = (f.name, *route)
        else:
            keys[f.name] = (f.name,)
    return keys


def leaf_paths(cls: type, path: str = "") -> list[str]:
    """All dotted keys of a config tree (used for cross-group "did you mean" hints and docs)."""
    out: list[str] = []
    hints = _hints(cls)
    for key, route in accepted_keys(cls).items():
        tp = hints[route[0]]
        for name in route[1:]:
            tp = _hints(tp)[name]
        inner = _dataclass_in(tp)
        if inner is not None:
            out.extend(leaf_paths(inner, _join(path, key)))
        else:
            out.append(_join(path, key))
    return out


def _dataclass_in(tp: Any) -> type | None:
    """The dataclass in ``tp`` (``X`` or ``X | None``), if any."""
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return tp
    if typing.get_origin(tp) in (Union, types.UnionType):
        for arm in typing.get_args(tp):
            if dataclasses.is_dataclass(arm) and isinstance(arm, type):
                return arm
    return None


LIST_KNOWN_MAX = 12
"""A group with at most this many keys is listed in full when nothing better is known."""

CONFIG_DOC = "docs/configuration.md"

GENERIC_NAMES = frozenset({
    "name", "path", "enable", "type", "mode", "format", "seed", "shuffle", "len", "metric", "task", "device",
    "dtype", "strategy", "config", "kwargs", "model", "optim", "model_path",
})
"""Key names too common to suggest from another group (``custom_reward_function.name`` is not ``rollout.name``)."""

KeyHint = Callable[[str, str, Sequence[str], Sequence[str]], str]
"""``(key, group path, the group's keys, every leaf path of the tree) -> hint`` for an unknown key."""


def plain_hint(key: str, path: str, known: Sequence[str], root_leaves: Sequence[str]) -> str:
    """The hint after "unknown key; " from the schema alone: the key under a misspelt group, a close name in the
    same group, the same distinctive name in another group, the group's keys (a small group) or the doc. A root
    dataclass with an ``unknown_key_hint`` (a :data:`KeyHint`) adds what it knows (the run's config: verl's names)."""
    return missing_group_hint(key, path, root_leaves) or close_in_group(key, path, known) or elsewhere_hint(
        key, path, known, root_leaves)


def close_in_group(key: str, path: str, known: Sequence[str]) -> str | None:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f"did you mean {_join(path, close[0])}?" if close else None


def elsewhere_hint(key: str, path: str, known: Sequence[str], root_leaves: Sequence[str]) -> str:
    """The same name in another group (the common slip: ``actor.n`` for ``rollout.n``), when the name means one
    thing; else the group's keys or the reference doc."""
    if key not in GENERIC_NAMES:
        elsewhere = [p for p in root_leaves if p.rsplit(".", 1)[-1] == key]
        if elsewhere:
            return f"did you mean {' or '.join(elsewhere[:3])}?"
    if known and len(known) <= LIST_KNOWN_MAX:
        return f"known keys here: {', '.join(sorted(known))}"
    return f"see {CONFIG_DOC} for {path or 'the top level'}'s keys"


def missing_group_hint(key: str, path: str, root_leaves: Sequence[str]) -> str | None:
    """For a key under a group that does not exist (``rollout.multi_turns.enable``): the key with that group's
    name corrected, when that is a real key, else what the nearest existing group holds."""
    groups = {".".join(p.split(".")[:i]) for p in root_leaves for i in range(1, p.count(".") + 1)}
    if not path or path in groups or not root_leaves:
        return None
    parts = path.split(".")
    depth = max((i for i in range(len(parts)) if i == 0 or ".".join(parts[:i]) in groups), default=0)
    ancestor, missing, rest = ".".join(parts[:depth]), parts[depth], [*parts[depth + 1 :], key]
    under = [p[len(ancestor) + 1 :] if ancestor else p for p in root_leaves if not ancestor or p.startswith(ancestor + ".")]
    children = sorted({p.split(".")[0] for p in under})
    close = difflib.get_close_matches(missing, children, n=1, cutoff=0.6)
    if close and _join(ancestor, ".".join([close[0], *rest])) in root_leaves:
        return f"did you mean {_join(ancestor, '.'.join([close[0], *rest]))}?"
    where = ancestor or "the top level"
    if len(children) <= LIST_KNOWN_MAX:
        return f"{_join(ancestor, missing)} is not a group; {where} holds: {', '.join(children)}"
    return f"{_join(ancestor, missing)} is not a group; see {CONFIG_DOC} for {where}'s keys"


class _Failed:
    """A value that could not be converted (its errors are in the walk's list)."""

    def __repr__(self) -> str:
        return "<failed>"


FAILED = _Failed()


def convert(tp: Any, value: Any, path: str, root_leaves: Sequence[str] = ()) -> Any:
    """``value`` checked (and lightly coerced) against type hint ``tp``; errors name ``path``.

    Raises every problem found (a single :class:`ConfigError`, or :class:`ConfigErrors` for several).
    """
    errors: list[ConfigError] = []
    out = _convert(tp, value, path, root_leaves, errors)
    raise_errors(errors)
    return out


def _convert(tp: Any, value: Any, path: str, root_leaves: Sequence[str], errors: list[ConfigError]) -> Any:
    """``value`` converted, or :data:`FAILED` with its problems appended to ``errors``."""
    if tp is Any or tp is object:
        return value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return _convert_union(tp, args, value, path, root_leaves, errors)

    if value is None:
        return _fail(errors, path, f"must not be null (expected {_type_name(tp)}); set a value or remove the key")

    if origin is typing.Literal:
        if value not in args:
            return _fail(errors, path, f"got {value!r}; choose one of {', '.join(repr(a) for a in args)}")
        return value

    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, Mapping):
            return _fail(errors, path, f"expected a mapping of {tp.__name__} keys, got {value!r}")
        return _build(tp, value, path, root_leaves, errors)

    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        return _convert_sequence(tp, origin, args, value, path, root_leaves, errors)

    if origin in (dict, Mapping) or tp is dict:
        return _convert_mapping(args, value, path, root_leaves, errors)

    return _convert_scalar(tp, value, path, errors)


def _fail(errors: list[ConfigError], path: str, message: str) -> Any:
    errors.append(ConfigError(path, message))
    return FAILED


def _convert_union(tp: Any, args: tuple[Any, ...], value: Any, path: str, root_leaves: Sequence[str],
                   errors: list[ConfigError]) -> Any:
    """The first arm of ``tp`` that takes ``value`` (``None`` for an optional)."""
    if value is None:
        if type(None) in args:
            return None
        return _fail(errors, path, f"must not be null (expected {_type_name(tp)})")
    tries: list[list[ConfigError]] = []
    for arm in args:
        if arm is type(None):
            continue
        arm_errors: list[ConfigError] = []
        out = _convert(arm, value, path, root_leaves, arm_errors)
        if not arm_errors:
            return out
        tries.append(arm_errors)
    # A mapping aimed at a dataclass arm gives the most useful messages.
    if isinstance(value, Mapping):
        for arm_errors in tries:
            if any(e.field != path for e in arm_errors):
                errors.extend(arm_errors)
                return FAILED
    return _fail(errors, path, f"expected {_type_name(tp)}, got {value!r}")


def _convert_sequence(tp: Any, origin: Any, args: tuple[Any, ...], value: Any, path: str, root_leaves: Sequence[str],
                      errors: list[ConfigError]) -> Any:
    """A list or tuple (fixed-length or ``tuple[X, ...]``), item by item."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return _fail(errors, path, f"expected a list, got {value!r}")
    if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        if len(value) != len(args):
            return _fail(errors, path, f"expected {len(args)} items, got {len(value)}")
        items = [_convert(a, v, f"{path}[{i}]", root_leaves, errors) for i, (a, v) in enumerate(zip(args, value))]
        return FAILED if any(i is FAILED for i in items) else tuple(items)
    item_tp = args[0] if args else Any
    items = [_convert(item_tp, v, f"{path}[{i}]", root_leaves, errors) for i, v in enumerate(value)]
    if any(i is FAILED for i in items):
        return FAILED
    return tuple(items) if origin is tuple or tp is tuple else items


def _convert_mapping(args: tuple[Any, ...], value: Any, path: str, root_leaves: Sequence[str],
                     errors: list[ConfigError]) -> Any:
    """A dict, key by key and value by value."""
    if not isinstance(value, Mapping):
        return _fail(errors, path, f"expected a mapping, got {value!r}")
    key_tp, val_tp = args if args else (Any, Any)
    out: dict[Any, Any] = {}
    failed = False
    for k, v in value.items():
        ck = _convert(key_tp, k, f"{path}.{k}", root_leaves, errors)
        cv = _convert(val_tp, v, f"{path}.{k}", root_leaves, errors)
        failed = failed or ck is FAILED or cv is FAILED
        out[ck] = cv
    return FAILED if failed else out


def _convert_scalar(tp: Any, value: Any, path: str, errors: list[ConfigError]) -> Any:
    """A bool, int, float, str or other plain class."""
    if tp is bool:
        if not isinstance(value, bool):
            return _fail(errors, path, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            return _fail(errors, path, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return _fail(errors, path, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        # Command lines turn ``experiment_name=2024`` into an int; a name is still meant.
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        if not isinstance(value, str):
            return _fail(errors, path, f"expected a string, got {value!r}")
        return value
    if isinstance(tp, type):
        if not isinstance(value, tp):
            return _fail(errors, path, f"expected {tp.__name__}, got {value!r}")
        return value
    raise TypeError(f"config schema at {path} uses an unsupported type hint {tp!r}")


def build(cls: type[T], data: Mapping[str, Any], path: str = "", root_leaves: Sequence[str] = ()) -> T:
    """An instance of dataclass ``cls`` from ``data``; every error names its full dotted key.

    Every problem is collected: unknown keys, wrong types, ``Literal`` choices, required keys, and the
    ``__post_init__`` errors of each group whose own fields all converted. One problem raises that
    :class:`ConfigError` exactly as alone; several raise one :class:`ConfigErrors` (one line each).
    """
    if not root_leaves:
        root_leaves = leaf_paths(cls, path)
    errors: list[ConfigError] = []
    token = _HINT.set(getattr(cls, "unknown_key_hint", None) or plain_hint)
    try:
        out = _build(cls, data, path, root_leaves, errors)
    finally:
        _HINT.reset(token)
    raise_errors(errors)
    return out


def _build(cls: type[T], data: Mapping[str, Any], path: str, root_leaves: Sequence[str], errors: list[ConfigError]) -> Any:
    hints = _hints(cls)
    accepted = accepted_keys(cls)
    for key in data:
        if not isinstance(key, str) or key not in accepted:
            errors.append(
                ConfigError(_join(path, str(key)), f"unknown key; {(_HINT.get() or plain_hint)(str(key), path, list(accepted), root_leaves)}")
            )

    kwargs: dict[str, Any] = {}
    failed = False
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if is_flattened(f):
            sub_cls = hints[f.name]
            sub_keys = accepted_keys(sub_cls)
            value = _build(sub_cls, {k: v for k, v in data.items() if k in sub_keys}, path, root_leaves, errors)
        elif f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                errors.append(ConfigError(_join(path, f.name), "is required; set it in the YAML or on the command line"))
                failed = True
            continue
        else:
            value = _convert(hints[f.name], data[f.name], _join(path, f.name), root_leaves, errors)
        if value is FAILED:
            failed = True
        kwargs[f.name] = value
    if failed:  # a group whose fields failed cannot check itself
        return FAILED
    try:
        return cls(**kwargs)
    except ConfigError as e:
        # Groups may name their fields relative ("gamma") or absolute ("algorithm.gamma"); give the full key.
        errors.extend(_prefixed(one, path) for one in e.errors)
    except (ValueError, TypeError) as e:
        errors.append(ConfigError(path or cls.__name__, str(e)))
    return FAILED


def _prefixed(e: ConfigError, path: str) -> ConfigError:
    if path and not _names_group(e.field, path):
        return ConfigError(_join(path, e.field), str(e)[len(e.field) + 2 :])
    return e


def _names_group(field_name: str, path: str) -> bool:
    """True when ``field_name`` already starts with the top-level group of ``path``."""
    return field_name.split(".", 1)[0] == path.split(".", 1)[0]


def to_dict(obj: Any) -> Any:
    """Plain, YAML-ready containers from a config tree (flattened groups merged back into their parent)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(obj):
            value = to_dict(getattr(obj, f.name))
            if is_flattened(f):
                out.update(value)
            else:
                out[f.name] = value
        return out
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj



def get_dotted(tree: Mapping[str, Any], dotted: str, default: Any = None) -> Any:
    """The value at ``a.b.c`` in nested mappings, or ``default`` when any level is missing."""
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``a.b.c`` in nested dicts, creating (or replacing non-dict) levels on the way."""
    *parents, last = dotted.split(".")
    node = tree
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value
