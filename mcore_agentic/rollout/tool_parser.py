"""Tool-call parsing from generated text, and argument validation against a tool's JSON schema.

Formats (``rollout.multi_turn.format``):

* ``hermes`` (alias ``qwen2_5``, ``qwen``): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number per turn. A final block missing its ``</tool_call>`` (the engine stopped on it
  and trimmed the stop string) is still parsed, and so is a block cut by the next ``<tool_call>``.
* ``llama3_json``: Llama-3.x JSON calls ``{"name": ..., "parameters" | "arguments": {...}}``,
  after ``<|python_tag|>`` or bare, several separated by ``;``. Text starting with a JSON
  object that holds ``"name"`` is a bare call; any other JSON answer is content. After the
  tag the first payload must be a call object (anything else is an error observation);
  text after the calls that does not start with ``{`` is content.
* ``mistral``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` and the newer
  ``[TOOL_CALLS]name[ARGS]{...}``.
* ``qwen3_coder`` (Qwen3-Coder, Qwen3.5): ``<tool_call><function=NAME><parameter=ARG>VALUE
  </parameter></function></tool_call>``, each tag on its own line, values typed by the tool's
  schema (pass ``schemas`` to ``parse``); see :mod:`~mcore_agentic.rollout.tool_parser_qwen3_coder`.

``<|python_tag|>`` and ``[TOOL_CALLS]`` are special tokens: decode the generated ids with
``skip_special_tokens=False`` before parsing those formats. For the JSON formats a call's
arguments are ``parameters`` when present and non-empty, else ``arguments`` (SGLang's rule);
arguments given as a JSON-encoded string are decoded.

Content (the assistant message's text): with no call in the text, the text exactly as
generated. With calls, the text outside the calls' ``raw`` spans, each piece edge-stripped,
non-blank pieces joined by a newline. When text appears only before the first call this
is SGLang's ``normal_text`` (edge-stripped), and it re-renders exactly through the Qwen
templates, which write ``content | trim`` before the calls. Text after or between calls
cannot be re-rendered in place by any of these templates; it is kept (SGLang drops it).

Never raises: a malformed call comes back as :class:`ToolCallError` whose ``message`` the
model reads as that call's tool result, so it can fix it. Payloads nested deeper than
:data:`~mcore_agentic.rollout.tool_call.MAX_NESTING` levels, and names or arguments with a
lone UTF-16 surrogate (which no tokenizer can encode), are errors too.

Agreement with SGLang's parsers (``sglang.srt.function_call``: ``HermesDetector``,
``Qwen25Detector``, ``Llama32Detector``, ``MistralDetector``, ``Qwen3CoderDetector``): the
same calls (names and arguments) on every output the chat templates render, checked by
``tests/unit/rollout/test_tool_parser_sglang_parity.py``. Deliberate differences, all on
malformed or unusual output:

* where SGLang drops a call silently (invalid JSON, a non-object payload, a JSON answer
  without a tag, a truncated value, an unknown tool), or drops every call of the turn
  (``HermesDetector`` and ``Qwen3CoderDetector`` on any exception), we return one error
  observation per bad call and keep the good ones; unknown tools are left to
  :func:`validate_tool_call`;
* a closing delimiter inside a JSON string does not end a call (``HermesDetector`` cuts it);
* ``<tool_call>{...}</tool_call>`` without the newlines ``Qwen25Detector`` requires, a
  Mistral ``[TOOL_CALLS][...]`` without the space, a single object after ``[TOOL_CALLS]``,
  several ``[TOOL_CALLS]`` lists, and a leading space before a bare Llama-3 call are parsed;
* a JSON list of calls inside one ``<tool_call>`` block, several ``<function=...>`` in one
  block, Python-dict payloads (``Llama32Detector``'s fallback), and ``qwen3_coder`` blocks
  with a missing ``</parameter>`` or ``</function>``, an empty parameter name, or text
  between the tags are error observations (SGLang accepts them);
* a Llama-3 call after ``"; "`` keeps surrogate-pair escapes as the real character
  (``Llama32Detector`` decodes it with ``literal_eval``, which makes two lone surrogates);
* a ``qwen3_coder`` value containing ``</parameter>``, ``<parameter=``, ``</function>`` or
  ``</tool_call>`` is an error observation (SGLang cuts the value there); a value that
  Python's ``literal_eval`` turns into a set, bytes or complex number is an error
  observation (SGLang then drops every call of the turn);
* a final ``qwen3_coder`` block without ``</tool_call>`` after complete blocks is parsed
  (SGLang drops it);
* JSON nested more than 128 levels deep is an error observation (SGLang accepts up to
  Python's recursion limit).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from mcore_agentic.rollout.tool_call import (
    MAX_NESTING,
    ParsedCall,
    Schemas,
    ToolCall,
    ToolCallError,
    ToolCallParser,
    escape_surrogates,
    json_type,
    new_call_id,
    value_nesting_exceeds,
)
from mcore_agentic.rollout.tool_parser_json import HermesParser, Llama3JsonParser, MistralParser
from mcore_agentic.rollout.tool_parser_qwen3_coder import Qwen3CoderParser
from mcore_agentic.tools.schema import drop_null_keywords
from mcore_agentic.utils.errors import ConfigError

if TYPE_CHECKING:
    from mcore_agentic.tools.base import ToolProtocol

__all__ = [
    "MAX_NESTING",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "ParsedCall",
    "Qwen3CoderParser",
    "Schemas",
    "ToolCall",
    "ToolCallError",
    "ToolCallParser",
    "get_tool_parser",
    "new_call_id",
    "parameters_schema",
    "validate_tool_call",
]

_PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    "hermes": HermesParser,
    "qwen2_5": HermesParser,
    "qwen": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "qwen3_coder": Qwen3CoderParser,
}


def get_tool_parser(fmt: str) -> ToolCallParser:
    """The parser for ``rollout.multi_turn.format``."""
    try:
        return _PARSERS[fmt]()
    except KeyError:
        raise ConfigError("rollout.multi_turn.format", f"unknown format {fmt!r}: use one of {sorted(_PARSERS)}") from None


# ---------------------------------------------------------------------------
# validation against the tool's schema


def _short(value: Any, limit: int = 40) -> str:
    try:
        s = json.dumps(value, ensure_ascii=False, default=str)
    except (ValueError, RecursionError):
        s = repr(type(value).__name__)
    s = escape_surrogates(s)
    return s if len(s) <= limit else s[: limit - 3] + "..."


@functools.lru_cache(maxsize=256)
def _validator(schema_json: str) -> Any:
    import jsonschema

    schema = json.loads(schema_json)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema)


def parameters_schema(tool: ToolProtocol) -> dict[str, Any]:
    """The JSON schema of a tool's arguments (an empty object schema when the tool declares none), cleaned once per
    schema object the tool returns (see :func:`_schema_and_validator`); read-only, shared by every request.

    Null-valued keywords (``"enum": null`` in verl's dumps) are dropped: registry-loaded and
    ``BaseTool`` schemas already are, this covers any other tool class.
    """
    return _schema_and_validator(tool)[0]


def _clean_parameters_schema(tool: ToolProtocol) -> dict[str, Any]:
    function = tool.get_openai_tool_schema().get("function", {})
    params = function.get("parameters")
    return drop_null_keywords(params) if isinstance(params, dict) else {"type": "object", "properties": {}}


def _describe(error: Any) -> str:
    path = escape_surrogates(".".join(str(p) for p in error.absolute_path))
    where = f"argument '{path}'" if path else "the arguments"
    kind = error.validator
    if kind == "required":
        present = error.instance if isinstance(error.instance, dict) else {}
        missing = [k for k in error.validator_value if k not in present]
        prefix = f"'{path}' is " if path else ""
        return f"{prefix}missing required argument{'s' if len(missing) > 1 else ''} " + ", ".join(f"'{m}'" for m in missing)
    if kind == "type":
        expected = error.validator_value
        expected = " or ".join(expected) if isinstance(expected, list) else expected
        return f"{where} must be of type {expected}, got {json_type(error.instance)} {_short(error.instance)}"
    if kind == "enum":
        return f"{where} must be one of {_short(error.validator_value, 120)}, got {_short(error.instance)}"
    if kind == "additionalProperties":
        allowed = sorted((error.schema.get("properties") or {}).keys())
        extra = sorted(set(error.instance) - set(allowed)) if isinstance(error.instance, dict) else []
        extra = [escape_surrogates(e) for e in extra]
        return f"unexpected argument{'s' if len(extra) > 1 else ''} " + ", ".join(f"'{e}'" for e in extra) + f" (allowed: {', '.join(allowed) or 'none'})"
    return f"{where}: {escape_surrogates(error.message)}"


def _signature(schema: dict[str, Any]) -> str:
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    parts = []
    for key, spec in props.items():
        typ = spec.get("type", "any") if isinstance(spec, dict) else "any"
        typ = "|".join(typ) if isinstance(typ, list) else typ
        parts.append(f"{key}: {typ}{'' if key in required else ', optional'}")
    return "; ".join(parts) or "no arguments"


_VALIDATION_NESTING = MAX_NESTING + 2


def validate_tool_call(call: ToolCall, tools: Mapping[str, ToolProtocol], max_errors: int = 3) -> ToolCallError | None:
    """``None`` when ``call`` names a known tool with schema-valid arguments, else the error the model reads.

    Never raises: a schema that cannot be applied, or arguments too deep for the validator,
    give an error observation too.
    """
    name = escape_surrogates(call.name)
    tool = tools.get(call.name)
    if tool is None:
        known = ", ".join(sorted(tools)) or "(none)"
        return ToolCallError(call.raw, f"Error: unknown tool '{name}'. Available tools: {known}.", id=call.id, name=call.name)
    # Deeper than any parser lets through (a payload within MAX_NESTING holds arguments two levels less deep, plus
    # margin): refused the same way whatever the interpreter's recursion limit, which the validator recurses into.
    if value_nesting_exceeds(call.arguments, _VALIDATION_NESTING):
        message = (
            f"Error: the arguments for tool '{name}' could not be checked: they nest arrays/objects deeper than "
            f"{_VALIDATION_NESTING} levels."
        )
        return ToolCallError(call.raw, message, id=call.id, name=call.name)
    try:
        return _schema_problems(call, tool, max_errors)
    except Exception as exc:  # noqa: BLE001 -- a bad schema or a pathological payload must not fail the request
        message = f"Error: the arguments for tool '{name}' could not be checked ({type(exc).__name__})."
        return ToolCallError(call.raw, message, id=call.id, name=call.name)


_BY_SCHEMA_OBJECT: dict[int, tuple[Any, dict[str, Any], Any]] = {}


def _schema_and_validator(tool: ToolProtocol) -> tuple[dict[str, Any], Any]:
    """The tool's argument schema and its validator, looked up by the schema object the tool returns.

    Tools return the same schema object every call, so the schema is cleaned and serialised (for the
    validator cache) once per object, not once per call. The entry holds that object, so its id stays
    unique while cached.
    """
    raw = tool.get_openai_tool_schema()
    hit = _BY_SCHEMA_OBJECT.get(id(raw))
    if hit is not None and hit[0] is raw:
        return hit[1], hit[2]
    schema = _clean_parameters_schema(tool)
    validator = _validator(json.dumps(schema, sort_keys=True))
    if len(_BY_SCHEMA_OBJECT) >= 1024:
        _BY_SCHEMA_OBJECT.clear()
    _BY_SCHEMA_OBJECT[id(raw)] = (raw, schema, validator)
    return schema, validator


def _schema_problems(call: ToolCall, tool: ToolProtocol, max_errors: int) -> ToolCallError | None:
    schema, validator = _schema_and_validator(tool)
    errors = sorted(validator.iter_errors(call.arguments), key=lambda e: (list(map(str, e.absolute_path)), e.validator))
    if not errors:
        return None
    problems = [_describe(e) for e in errors[:max_errors]]
    more = f" (and {len(errors) - max_errors} more)" if len(errors) > max_errors else ""
    name = escape_surrogates(call.name)
    message = f"Error: invalid arguments for tool '{name}': {'; '.join(problems)}{more}. Expected arguments: {_signature(schema)}."
    return ToolCallError(call.raw, message, id=call.id, name=call.name)
