"""The one loader of YAML plug-ins (tools, interactions): a list of entries, each naming a class by import path.

A kind of plug-in is a :class:`PluginKind`: its YAML key (``tools:``, ``interaction:``), the keys an entry may
hold, how its classes are checked, how an entry's name is found and how an instance is built. The loader does
the rest, the same way for every kind, in two passes:

- :func:`read_plugins` reads the list (a YAML file, with the file's own directory put on the import path, or an
  already-loaded list), and checks every entry without constructing anything: a mapping with known keys, a
  class path that imports, a class of the kind, a ``config:`` mapping, the kind's own checks and its name, and
  names unique;
- :func:`build_plugins` constructs them, by name in config order, each checked against the kind's protocol.

Every problem raises one one-line :class:`ConfigError` naming the file, the entry and the key, e.g.
``tools.yaml: tools[1].class_name: cannot import module 'my_tools' (...); check the class path``.
A ``ConfigError`` raised by a constructor is reported under the entry (``tools[0].config.<key>``).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mcore_agentic.utils.errors import ConfigError, first_line


def plain(value: Any) -> Any:
    """Plain dicts/lists from OmegaConf containers or any Mapping/Sequence (no omegaconf import needed)."""
    if isinstance(value, Mapping) or hasattr(value, "items") and callable(value.items):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes) or type(value).__name__ == "ListConfig":
        return [plain(v) for v in value]
    return value


def read_yaml_list(config_file: str | Path, key: str) -> list[Any]:
    """The list under ``key`` in a YAML file, with errors naming the file and the key."""
    path = Path(config_file)
    if not path.is_file():
        raise ConfigError(str(config_file), f"file not found; point the config at an existing YAML file with a '{key}:' list")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:  # PyYAML's own message spans lines (it quotes the source): one line, the place first
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(str(config_file), f"not valid YAML{at}: {getattr(exc, 'problem', None) or first_line(exc)}") from None
    if not isinstance(data, dict) or key not in data:
        raise ConfigError(f"{config_file}: {key}", f"missing; the file must hold a top-level '{key}:' list")
    entries = data[key]
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise ConfigError(f"{config_file}: {key}", f"must be a list of entries, got {type(entries).__name__}")
    return entries


def import_path_of(config_file: str | Path) -> None:
    """Put the directory of a plug-in YAML on ``sys.path``, so a ``class_name`` such as ``my_tools.CounterTool``
    imports from a ``my_tools.py`` beside the YAML without setting ``PYTHONPATH``."""
    directory = str(Path(config_file).resolve().parent)
    if directory not in sys.path:
        sys.path.insert(0, directory)


def resolve_class(class_name: Any, field: str, example: str = "package.module.ClassName") -> type:
    """Import ``pkg.module.Class`` once, naming ``field`` in any error (``example`` shows a good class path)."""
    if not isinstance(class_name, str) or "." not in class_name:
        raise ConfigError(field, f"must be a class path like {example!r}, got {class_name!r}")
    module_name, _, attr = class_name.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(field, f"cannot import module {module_name!r} ({exc}); check the class path") from None
    except Exception as exc:  # the module itself fails (a SyntaxError, a NameError at import): name it, one line
        raise ConfigError(field, f"module {module_name!r} fails to import: {type(exc).__name__}: {exc}") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise ConfigError(field, f"module {module_name!r} has no attribute {attr!r}; check the class name")
    if not inspect.isclass(cls):
        raise ConfigError(field, f"{class_name!r} is not a class")
    return cls


@dataclass(frozen=True)
class PluginEntry:
    """One checked entry: ``field`` names it in errors (``<file>: tools[0]``), ``extra`` is what the kind's
    ``describe`` returned besides the name (a tool's checked schema)."""

    field: str
    name: str
    cls: type
    config: dict[str, Any]
    extra: Any = None


@dataclass(frozen=True)
class PluginKind:
    """What is particular to one kind of plug-in; everything else is the loader's."""

    key: str  # the YAML's top-level list, and the root of every field an error names: "tools", "interaction"
    noun: str  # in messages: "tool", "interaction"
    keys: tuple[str, ...]  # the keys an entry may hold, in the order messages list them
    example: str  # a class path of this kind, shown when class_name is not one
    check_class: Callable[[type, str], None]  # (cls, field of class_name): raise ConfigError if not of this kind
    # (entry, cls, config, field of the entry) -> (name, extra): the kind's own checks of the entry, and its name
    describe: Callable[[Mapping[str, Any], type, dict[str, Any], str], tuple[str, Any]]
    name_key: str  # where the name stands in an entry, for the duplicate-name error: "name", "tool_schema.function.name"
    construct: Callable[[PluginEntry], Any]
    protocol: type  # a runtime-checkable protocol every instance must satisfy

    @property
    def article(self) -> str:
        return "an" if self.noun[:1] in "aeiou" else "a"


def read_plugins(source: str | Path | Sequence[Mapping[str, Any]] | None, kind: PluginKind) -> list[PluginEntry]:
    """Every entry of ``source`` (a YAML file holding a ``kind.key:`` list, or an already-loaded list; None: none)
    checked, nothing constructed. A YAML file's own directory goes on the import path (:func:`import_path_of`)."""
    if isinstance(source, str | Path):
        entries, where = read_yaml_list(source, kind.key), f"{source}: {kind.key}"
        import_path_of(source)
    else:
        entries, where = plain(source or []), kind.key
        if not isinstance(entries, list):
            raise ConfigError(where, f"must be a list of {kind.noun} entries, got {type(entries).__name__}")
    listed = ", ".join(kind.keys)
    checked: list[PluginEntry] = []
    first_index: dict[str, int] = {}
    for i, entry in enumerate(entries):
        field = f"{where}[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(field, f"each {kind.noun} entry must be a mapping with {listed}")
        unknown = set(entry) - set(kind.keys)
        if unknown:
            raise ConfigError(f"{field}.{sorted(unknown)[0]}", f"unknown key; {kind.article} {kind.noun} entry holds {listed}")
        cls = resolve_class(entry.get("class_name"), f"{field}.class_name", kind.example)
        kind.check_class(cls, f"{field}.class_name")
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ConfigError(f"{field}.config", f"must be a mapping, got {type(config).__name__}")
        name, extra = kind.describe(entry, cls, config, field)
        if name in first_index:
            raise ConfigError(f"{field}.{kind.name_key}", f"duplicate {kind.noun} name {name!r} (also {where}[{first_index[name]}]); names must be unique")
        first_index[name] = i
        checked.append(PluginEntry(field=field, name=name, cls=cls, config=config, extra=extra))
    return checked


def build_plugins(entries: Sequence[PluginEntry], kind: PluginKind) -> dict[str, Any]:
    """The instances of checked entries, by name in config order; a constructor's ``ConfigError`` is reported
    under its entry, and an instance that does not satisfy ``kind.protocol`` is refused."""
    built: dict[str, Any] = {}
    for entry in entries:
        try:
            instance = kind.construct(entry)
        except ConfigError as exc:
            raise ConfigError(f"{entry.field}.{exc.field}", str(exc).split(": ", 1)[-1]) from None
        if not isinstance(instance, kind.protocol):
            raise ConfigError(f"{entry.field}.class_name", f"{entry.cls.__qualname__} instances do not satisfy the {kind.noun} interface")
        built[entry.name] = instance
    return built
