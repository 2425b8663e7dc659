"""Walk config dataclasses: build them from plain mappings, list their keys, turn them back into dicts.

The dataclasses are the schema: their fields, type hints and defaults say what
a key may hold. This module only walks them:

* an unknown key raises :class:`ConfigError` naming the full dotted key and the
  nearest known key ("did you mean actor.ppo_mini_batch_size?");
* a value of the wrong type raises naming the key, the expected type and the
  value given (``int`` never silently becomes ``bool``; ``1`` is accepted where
  a ``float`` is expected);
* a ``Literal`` field rejects values outside its choices;
* a field with ``metadata={"flatten": True}`` is a sub-dataclass whose keys sit
  directly in the parent mapping (``actor.tensor_model_parallel_size`` filling
  ``actor.parallel``), so two packages can own fields of one YAML group;
* errors raised by a group's own ``__post_init__`` are re-raised with the
  group's dotted path in front of the field they name.

No defaults live here: a key that is absent takes the dataclass default.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar, Union

from mcore_agentic.config.errors import ConfigError

T = TypeVar("T")

FLATTEN = "flatten"  # dataclass field metadata key: sub-group keys live in the parent mapping


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


RETIRED_KEYS: dict[str, str] = {
    "sharding.offload_actor_params": "use actor.param_offload (verl's key, the one switch)",
    "sharding.offload_actor_grads": "use actor.grad_offload (verl's key, the one switch)",
    "sharding.offload_actor_optimizer": "use actor.optimizer_offload (verl's key, the one switch)",
    "sharding.flat_gather": "removed: the per-tensor gather was as fast or faster at every bucket size; drop the key",
}
"""Keys an earlier version accepted, with what to write instead."""


def suggest_key(key: str, path: str, known: Sequence[str], root_leaves: Sequence[str]) -> str:
    if _join(path, key) in RETIRED_KEYS:
        return RETIRED_KEYS[_join(path, key)]
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    if close:
        return f"did you mean {_join(path, close[0])}?"
    # The same name in another group is the common slip (``actor.n`` for ``rollout.n``).
    elsewhere = [p for p in root_leaves if p.rsplit(".", 1)[-1] == key]
    if elsewhere:
        return f"did you mean {' or '.join(elsewhere[:3])}?"
    return f"known keys here: {', '.join(sorted(known))}"


def convert(tp: Any, value: Any, path: str, root_leaves: Sequence[str] = ()) -> Any:
    """``value`` checked (and lightly coerced) against type hint ``tp``; errors name ``path``."""
    if tp is Any or tp is object:
        return value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)

    if origin in (Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(path, f"must not be null (expected {_type_name(tp)})")
        errors = []
        for arm in args:
            if arm is type(None):
                continue
            try:
                return convert(arm, value, path, root_leaves)
            except ConfigError as e:
                errors.append(e)
        # A mapping aimed at a dataclass arm gives the most useful message.
        if isinstance(value, Mapping):
            for e in errors:
                if e.field != path:
                    raise e
        raise ConfigError(path, f"expected {_type_name(tp)}, got {value!r}")

    if value is None:
        raise ConfigError(path, f"must not be null (expected {_type_name(tp)}); set a value or remove the key")

    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(path, f"got {value!r}; choose one of {', '.join(repr(a) for a in args)}")
        return value

    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"expected a mapping of {tp.__name__} keys, got {value!r}")
        return build(tp, value, path, root_leaves)

    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise ConfigError(path, f"expected a list, got {value!r}")
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise ConfigError(path, f"expected {len(args)} items, got {len(value)}")
            return tuple(convert(a, v, f"{path}[{i}]", root_leaves) for i, (a, v) in enumerate(zip(args, value)))
        item_tp = args[0] if args else Any
        items = [convert(item_tp, v, f"{path}[{i}]", root_leaves) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple or tp is tuple else items

    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"expected a mapping, got {value!r}")
        key_tp, val_tp = args if args else (Any, Any)
        return {
            convert(key_tp, k, f"{path}.{k}", root_leaves): convert(val_tp, v, f"{path}.{k}", root_leaves)
            for k, v in value.items()
        }

    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        # Command lines turn ``experiment_name=2024`` into an int; a name is still meant.
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {value!r}")
        return value
    if isinstance(tp, type):
        if not isinstance(value, tp):
            raise ConfigError(path, f"expected {tp.__name__}, got {value!r}")
        return value
    raise TypeError(f"config schema at {path} uses an unsupported type hint {tp!r}")


def build(cls: type[T], data: Mapping[str, Any], path: str = "", root_leaves: Sequence[str] = ()) -> T:
    """An instance of dataclass ``cls`` from ``data``; every error names its full dotted key."""
    if not root_leaves:
        root_leaves = leaf_paths(cls, path)
    hints = _hints(cls)
    accepted = accepted_keys(cls)
    for key in data:
        if not isinstance(key, str) or key not in accepted:
            raise ConfigError(_join(path, str(key)), f"unknown key; {suggest_key(str(key), path, list(accepted), root_leaves)}")

    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if is_flattened(f):
            sub_cls = hints[f.name]
            sub_keys = accepted_keys(sub_cls)
            kwargs[f.name] = build(sub_cls, {k: v for k, v in data.items() if k in sub_keys}, path, root_leaves)
            continue
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(_join(path, f.name), "is required; set it in the YAML or on the command line")
            continue
        kwargs[f.name] = convert(hints[f.name], data[f.name], _join(path, f.name), root_leaves)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        # Groups may name their fields relative ("gamma") or absolute ("algorithm.gamma"); give the full key.
        if path and not _names_group(e.field, path):
            raise ConfigError(_join(path, e.field), str(e)[len(e.field) + 2 :]) from None
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(path or cls.__name__, str(e)) from None


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

