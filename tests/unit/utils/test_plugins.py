"""The shared plug-in loader (utils/plugins.py) with a toy kind: YAML reading, class paths imported with the YAML's
directory on the import path, one-line errors naming file, entry and key, and checking before constructing."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import pytest

from mcore_agentic.utils.errors import ConfigError
from mcore_agentic.utils.plugins import PluginKind, build_plugins, plain, read_plugins, resolve_class

BUILT: list[str] = []


@runtime_checkable
class GreeterProtocol(Protocol):
    def greet(self) -> str: ...


class Greeter:
    def __init__(self, config: dict[str, Any]):
        if "volume" in config and not isinstance(config["volume"], int):
            raise ConfigError("config.volume", "must be an integer")
        self.config = config
        BUILT.append(config.get("word", "hello"))

    def greet(self) -> str:
        return self.config.get("word", "hello")


class Mute:  # passes the class check, but its instances have no greet()
    def __init__(self, config: dict[str, Any]):
        pass


class NotAGreeter:
    pass


def _check_class(cls: type, field: str) -> None:
    if cls is NotAGreeter:
        raise ConfigError(field, f"{cls.__qualname__} cannot greet")


def _describe(entry: Mapping[str, Any], cls: type, config: dict[str, Any], field: str) -> tuple[str, Any]:
    name = entry.get("name")
    if not isinstance(name, str):
        raise ConfigError(f"{field}.name", f"must be a string, got {name!r}")
    return name, len(name)


GREETERS = PluginKind(
    key="greeters", noun="greeter", keys=("name", "class_name", "config"), example="pkg.greeters.Greeter",
    check_class=_check_class, describe=_describe, name_key="name",
    construct=lambda entry: entry.cls(entry.config), protocol=GreeterProtocol,
)
HERE = __name__


def _load(source: Any) -> dict[str, Any]:
    return build_plugins(read_plugins(source, GREETERS), GREETERS)


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the loader puts YAML directories on it
    BUILT.clear()


def test_inline_list_builds_by_name_in_order_with_what_describe_returned():
    entries = read_plugins([{"name": "b", "class_name": f"{HERE}.Greeter", "config": {"word": "hi"}},
                            {"name": "a", "class_name": f"{HERE}.Greeter"}], GREETERS)
    assert [(e.name, e.field, e.extra, e.config) for e in entries] == [("b", "greeters[0]", 1, {"word": "hi"}),
                                                                       ("a", "greeters[1]", 1, {})]
    assert BUILT == []  # reading checks, never constructs
    built = build_plugins(entries, GREETERS)
    assert list(built) == ["b", "a"] and built["b"].greet() == "hi"
    assert read_plugins(None, GREETERS) == [] and read_plugins([], GREETERS) == []


def test_omegaconf_containers_are_plain():
    from omegaconf import OmegaConf

    assert plain(OmegaConf.create({"a": [1, {"b": 2}]})) == {"a": [1, {"b": 2}]}
    assert list(_load(OmegaConf.create([{"name": "x", "class_name": f"{HERE}.Greeter"}]))) == ["x"]


def test_a_class_beside_the_yaml_imports_and_errors_name_the_file(tmp_path):
    (tmp_path / "neighbour_greeters_mod.py").write_text(
        "class Loud:\n    def __init__(self, config):\n        self.config = config\n\n"
        "    def greet(self):\n        return 'HELLO'\n")
    good = tmp_path / "greeters.yaml"
    good.write_text("greeters:\n  - name: loud\n    class_name: neighbour_greeters_mod.Loud\n")
    try:
        assert _load(good)["loud"].greet() == "HELLO"
        assert sys.path[0] == str(tmp_path)
        _load(str(good))
        assert sys.path.count(str(tmp_path)) == 1  # once, however often it loads
    finally:
        sys.modules.pop("neighbour_greeters_mod", None)
    bad = tmp_path / "bad.yaml"
    bad.write_text("greeters:\n  - name: x\n    class_name: neighbour_greeters_mod.Quiet\n")
    with pytest.raises(ConfigError) as info:
        _load(bad)
    assert info.value.field == f"{bad}: greeters[0].class_name" and "has no attribute 'Quiet'" in str(info.value)


@pytest.mark.parametrize(
    "text, field, message",
    [
        (None, "{file}", "file not found; point the config at an existing YAML file with a 'greeters:' list"),
        ("greeters: [\n", "{file}", "not valid YAML at line 2, column 1: expected the node content, but found '<stream end>'"),
        ("greeter: []\n", "{file}: greeters", "missing; the file must hold a top-level 'greeters:' list"),
        ("- 1\n", "{file}: greeters", "missing"),
        ("greeters: {a: 1}\n", "{file}: greeters", "must be a list of entries, got dict"),
        ("greeters:\n  - 3\n", "{file}: greeters[0]", "each greeter entry must be a mapping with name, class_name, config"),
    ],
)
def test_bad_files(tmp_path, text, field, message):
    path = tmp_path / "g.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as info:
        _load(path)
    assert info.value.field == field.format(file=path)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_an_empty_list_in_a_file_is_no_plugins(tmp_path):
    (tmp_path / "g.yaml").write_text("greeters:\n")
    assert _load(tmp_path / "g.yaml") == {}


def _entry(**fields: Any) -> dict[str, Any]:
    return {"name": "g", "class_name": f"{HERE}.Greeter", **fields}


@pytest.mark.parametrize(
    "entries, field, message",
    [
        ({"name": "g"}, "greeters", "must be a list of greeter entries, got dict"),
        ([_entry(kwargs={})], "greeters[0].kwargs", "unknown key; a greeter entry holds name, class_name, config"),
        ([_entry(class_name="Greeter")], "greeters[0].class_name", "must be a class path like 'pkg.greeters.Greeter', got 'Greeter'"),
        ([_entry(class_name=None)], "greeters[0].class_name", "class path"),
        ([_entry(class_name="no_such_pkg_xyz.Greeter")], "greeters[0].class_name", "cannot import module 'no_such_pkg_xyz'"),
        ([_entry(class_name=f"{HERE}.Nope")], "greeters[0].class_name", f"module {HERE!r} has no attribute 'Nope'"),
        ([_entry(class_name=f"{HERE}.HERE")], "greeters[0].class_name", "is not a class"),
        ([_entry(class_name=f"{HERE}.NotAGreeter")], "greeters[0].class_name", "NotAGreeter cannot greet"),
        ([_entry(config=[1])], "greeters[0].config", "must be a mapping, got list"),
        ([_entry(name=3)], "greeters[0].name", "must be a string, got 3"),
        ([_entry(), _entry()], "greeters[1].name", "duplicate greeter name 'g' (also greeters[0]); names must be unique"),
        ([_entry(config={"volume": "x"})], "greeters[0].config.volume", "must be an integer"),
        ([_entry(class_name=f"{HERE}.Mute")], "greeters[0].class_name", "Mute instances do not satisfy the greeter interface"),
    ],
)
def test_bad_entries_name_the_key_in_one_line(entries, field, message):
    with pytest.raises(ConfigError) as info:
        _load(entries)
    assert info.value.field == field, str(info.value)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_module_that_fails_at_import_is_one_line(tmp_path):
    (tmp_path / "broken_greeters_mod.py").write_text("def f(:\n")
    (tmp_path / "g.yaml").write_text("greeters:\n  - name: g\n    class_name: broken_greeters_mod.G\n")
    with pytest.raises(ConfigError, match=r"g.yaml: greeters\[0\].class_name: module 'broken_greeters_mod' fails to import: SyntaxError"):
        _load(tmp_path / "g.yaml")


def test_every_entry_is_checked_before_any_is_built():
    with pytest.raises(ConfigError, match=r"greeters\[1\].class_name"):
        _load([_entry(), _entry(name="h", class_name="Greeter")])
    assert BUILT == []


def test_resolve_class_alone():
    assert resolve_class(f"{HERE}.Greeter", "f") is Greeter
    with pytest.raises(ConfigError, match="f: must be a class path like 'package.module.ClassName'"):
        resolve_class("Greeter", "f")

