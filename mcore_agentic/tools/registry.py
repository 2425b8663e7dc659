"""Build tools from YAML (verl's format): each entry names a class path, its config and its OpenAI schema.

.. code-block:: yaml

    tools:
      - class_name: mcore_agentic.tools.gsm8k.GSM8KTool
        config: {type: native}
        tool_schema:
          type: function
          function:
            name: calc_gsm8k_reward
            description: ...
            parameters: {type: object, properties: {answer: {type: string}}, required: [answer]}

Classes are resolved once here and checked against ``ToolProtocol``; every
problem raises :class:`ConfigError` naming ``tools[i].<field>``.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from mcore_agentic.tools.base import BaseTool, ToolProtocol
from mcore_agentic.tools.schema import drop_null_keywords
from mcore_agentic.utils.errors import ConfigError

if TYPE_CHECKING:
    from mcore_agentic.tools.executor import ToolExecutor

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_LIFECYCLE = ("create", "execute", "calc_reward", "release")


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
    except yaml.YAMLError as exc:
        raise ConfigError(str(config_file), f"not valid YAML: {exc}") from None
    if not isinstance(data, dict) or key not in data:
        raise ConfigError(f"{config_file}: {key}", f"missing; the file must hold a top-level '{key}:' list")
    entries = data[key]
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise ConfigError(f"{config_file}: {key}", f"must be a list of entries, got {type(entries).__name__}")
    return entries


def resolve_class(class_name: Any, field: str) -> type:
    """Import ``pkg.module.Class`` once, naming ``field`` in any error."""
    if not isinstance(class_name, str) or "." not in class_name:
        raise ConfigError(field, f"must be a class path like 'mcore_agentic.tools.gsm8k.GSM8KTool', got {class_name!r}")
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


def check_tool_class(cls: type, field: str) -> None:
    """The class must provide the tool lifecycle as coroutines (``BaseTool`` subclasses do)."""
    if issubclass(cls, BaseTool):
        return
    for method in ("get_openai_tool_schema", *_LIFECYCLE):
        fn = getattr(cls, method, None)
        if fn is None:
            raise ConfigError(field, f"{cls.__qualname__} lacks {method}(); subclass mcore_agentic.tools.base.BaseTool")
        if method in _LIFECYCLE and not inspect.iscoroutinefunction(fn):
            raise ConfigError(field, f"{cls.__qualname__}.{method} must be 'async def'")


def check_tool_schema(schema: Any, field: str) -> dict[str, Any]:
    """Validate an OpenAI function schema; returns it as a plain dict, null-valued keywords dropped.

    verl's dumps write ``"enum": null`` and the like; those keys are dropped (see
    :mod:`~mcore_agentic.tools.schema`), so they never reach the argument validator.
    """
    if not isinstance(schema, dict):
        raise ConfigError(field, "missing or not a mapping; give {type: function, function: {name, description, parameters}}")
    schema = drop_null_keywords(schema)
    if schema.get("type", "function") != "function":
        raise ConfigError(f"{field}.type", f"must be 'function', got {schema.get('type')!r}")
    function = schema.get("function")
    if not isinstance(function, dict):
        raise ConfigError(f"{field}.function", "missing; give {name, description, parameters}")
    name = function.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.match(name):
        raise ConfigError(f"{field}.function.name", f"must be 1-64 letters, digits, '_' or '-', got {name!r}")
    if "description" in function and not isinstance(function["description"], str):
        raise ConfigError(f"{field}.function.description", "must be a string")
    params = function.get("parameters")
    if params is not None:
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ConfigError(f"{field}.function.parameters", "must be a JSON schema of type 'object'")
        import jsonschema

        try:
            jsonschema.validators.validator_for(params, default=jsonschema.Draft202012Validator).check_schema(params)
        except jsonschema.SchemaError as exc:
            raise ConfigError(f"{field}.function.parameters", f"not a valid JSON schema: {exc.message}") from None
        for req in params.get("required", []) or []:
            if req not in (params.get("properties") or {}):
                raise ConfigError(f"{field}.function.parameters.required", f"names {req!r}, which is not in properties")
    return {"type": "function", **schema}


def import_path_of(config_file: str | Path) -> None:
    """Put the directory of a tools or interactions YAML on ``sys.path``, so a ``class_name`` such as
    ``my_tools.CounterTool`` imports from a ``my_tools.py`` beside the YAML without setting ``PYTHONPATH``."""
    directory = str(Path(config_file).resolve().parent)
    if directory not in sys.path:
        sys.path.insert(0, directory)


def load_tools(
    config_file: str | Path | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    executor: ToolExecutor | None = None,
    *,
    instantiate: bool = True,
) -> dict[str, Any]:
    """Tools by name, in config order, from a YAML file (``tools:`` list) or an already-loaded list.

    ``executor`` (optional) is bound to every tool that has ``bind_executor``,
    so blocking tool work runs where the rollout says (local pool or Ray). ``instantiate=False`` checks
    everything but the constructors and returns each tool's checked schema by name (the launcher's pre-flight).
    A class path is imported with the YAML's own directory on the import path (:func:`import_path_of`).
    """
    if config_file is not None and tools is not None:
        raise ConfigError("rollout.multi_turn.tool_config_path", "give either a tools YAML file or an inline tools list, not both")
    if config_file is not None:
        entries, where = read_yaml_list(config_file, "tools"), f"{config_file}: tools"
        import_path_of(config_file)
    else:
        entries, where = plain(tools or []), "tools"
        if not isinstance(entries, list):
            raise ConfigError("tools", f"must be a list of tool entries, got {type(entries).__name__}")
    built: dict[str, BaseTool] = {}
    first_index: dict[str, int] = {}
    for i, entry in enumerate(entries):
        field = f"{where}[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(field, "each tool entry must be a mapping with class_name, config, tool_schema")
        unknown = set(entry) - {"class_name", "config", "tool_schema"}
        if unknown:
            raise ConfigError(f"{field}.{sorted(unknown)[0]}", "unknown key; a tool entry holds class_name, config, tool_schema")
        cls = resolve_class(entry.get("class_name"), f"{field}.class_name")
        check_tool_class(cls, f"{field}.class_name")
        schema = check_tool_schema(entry.get("tool_schema"), f"{field}.tool_schema")
        name = schema["function"]["name"]
        if name in first_index:
            raise ConfigError(f"{field}.tool_schema.function.name", f"duplicate tool name {name!r} (also {where}[{first_index[name]}]); names must be unique")
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ConfigError(f"{field}.config", f"must be a mapping, got {type(config).__name__}")
        if not instantiate:
            first_index[name] = i
            built[name] = schema
            continue
        try:
            tool = cls(config=config, tool_schema=schema)
        except ConfigError as exc:
            raise ConfigError(f"{field}.{exc.field}", str(exc).split(": ", 1)[-1]) from None
        if not isinstance(tool, ToolProtocol):
            raise ConfigError(f"{field}.class_name", f"{cls.__qualname__} instances do not satisfy the tool interface")
        if executor is not None and hasattr(tool, "bind_executor"):
            tool.bind_executor(executor)
        first_index[name] = i
        built[name] = tool
    return built
