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

The YAML, the class paths and the one-line errors naming ``tools[i].<field>`` are the shared plug-in loader's
(:mod:`mcore_agentic.utils.plugins`); what is a tool's is here: its class checked against ``ToolProtocol``, its
schema (:func:`check_tool_schema`), the executor it is bound to, and the pre-flight's ``instantiate=False``.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mcore_agentic.tools.base import BaseTool, ToolProtocol
from mcore_agentic.tools.schema import drop_null_keywords
from mcore_agentic.utils.errors import ConfigError
from mcore_agentic.utils.plugins import PluginKind, build_plugins, read_plugins

if TYPE_CHECKING:
    from mcore_agentic.tools.executor import ToolExecutor

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_LIFECYCLE = ("create", "execute", "calc_reward", "release")


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


def _schema_and_name(entry: Mapping[str, Any], cls: type, config: dict[str, Any], field: str) -> tuple[str, dict[str, Any]]:
    schema = check_tool_schema(entry.get("tool_schema"), f"{field}.tool_schema")
    return schema["function"]["name"], schema


# What a tool is; the YAML, class paths, config mappings, unique names and one-line errors are the loader's.
TOOLS = PluginKind(
    key="tools", noun="tool", keys=("class_name", "config", "tool_schema"), example="mcore_agentic.tools.gsm8k.GSM8KTool",
    check_class=check_tool_class, describe=_schema_and_name, name_key="tool_schema.function.name",
    construct=lambda entry: entry.cls(config=entry.config, tool_schema=entry.extra), protocol=ToolProtocol,
)


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
    A class path is imported with the YAML's own directory on the import path
    (:func:`~mcore_agentic.utils.plugins.import_path_of`). Every entry is checked before any tool is built.
    """
    if config_file is not None and tools is not None:
        raise ConfigError("rollout.multi_turn.tool_config_path", "give either a tools YAML file or an inline tools list, not both")
    entries = read_plugins(config_file if config_file is not None else tools, TOOLS)
    if not instantiate:
        return {entry.name: entry.extra for entry in entries}
    built = build_plugins(entries, TOOLS)
    if executor is not None:
        for tool in built.values():
            if hasattr(tool, "bind_executor"):
                tool.bind_executor(executor)
    return built
