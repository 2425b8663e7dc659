"""Tool-call parsing from generated text, and argument validation against a tool's JSON schema.

Formats (``rollout.multi_turn.format``):

* ``hermes`` (alias ``qwen2_5``, ``qwen``): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number per turn. A final block missing its ``</tool_call>`` (the engine
  stopped on it and trimmed the stop string) is still parsed.
* ``llama3_json``: Llama-3.x JSON calls ``{"name": ..., "parameters" | "arguments": {...}}``,
  optionally after ``<|python_tag|>``, several separated by ``;``. Text that
  neither starts with ``{`` nor holds ``<|python_tag|>`` is plain content.
* ``mistral``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` and the
  newer ``[TOOL_CALLS]name[ARGS]{...}``.

``<|python_tag|>`` and ``[TOOL_CALLS]`` are special tokens: decode the
generated ids with ``skip_special_tokens=False`` before parsing those formats.

A malformed call never raises: it comes back as :class:`ToolCallError` whose
``message`` the model reads as that call's tool result, so it can fix it.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from mcore_agentic.config.errors import ConfigError

if TYPE_CHECKING:
    from mcore_agentic.tools.base import ToolProtocol


def new_call_id() -> str:
    """9 alphanumeric characters: the one id shape every chat template accepts (Mistral's insists on it)."""
    return uuid.uuid4().hex[:9]


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    raw: str
    """The exact text of this call as generated (for logs; the tokens themselves are kept by the rollout)."""
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        """The ``tool_calls`` entry of an assistant message, as chat templates expect it."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallError:
    raw: str
    message: str
    """What the model will read as the tool result for this call."""
    id: str = field(default_factory=new_call_id)
    name: str | None = None
    """The tool name when it could be read, else ``None``."""


ParsedCall = ToolCall | ToolCallError


class ToolCallParser(Protocol):
    format: str

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        """Split ``text`` into (content without the calls, the calls in order of appearance)."""
        ...


_DECODER = json.JSONDecoder()


def _call_from_object(obj: Any, raw: str, args_keys: tuple[str, ...], hint: str) -> ParsedCall:
    """Turn one decoded JSON value into a ToolCall, or say what is wrong with it."""
    if not isinstance(obj, dict):
        return ToolCallError(raw, f"Error: a tool call must be a JSON object, got {_json_type(obj)}. {hint}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError(raw, f'Error: the tool call has no "name" string. {hint}')
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):
        # OpenAI-style: arguments as a JSON-encoded string.
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolCallError(raw, f"Error: the arguments of '{name}' are not valid JSON ({exc.msg}). {hint}", name=name)
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCallError(raw, f"Error: the arguments of '{name}' must be a JSON object, got {_json_type(args)}. {hint}", name=name)
    call_id = obj.get("id")
    if isinstance(call_id, str) and call_id:
        return ToolCall(name=name, arguments=args, raw=raw, id=call_id)
    return ToolCall(name=name, arguments=args, raw=raw)


def _decode_error(raw: str, exc: json.JSONDecodeError, hint: str) -> ToolCallError:
    m = re.search(r'"name"\s*:\s*"([^"]+)"', raw)
    return ToolCallError(raw, f"Error: the tool call is not valid JSON ({exc.msg} at char {exc.pos}). {hint}", name=m.group(1) if m else None)


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks (Hermes / Qwen2.5 / Qwen3 chat templates)."""

    format = "hermes"
    # An unclosed block ends at the next <tool_call> or the end of the text.
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|(?=<tool_call>)|\Z)", re.DOTALL)
    HINT = 'Write each call as <tool_call>{"name": "<tool name>", "arguments": {<arguments>}}</tool_call>.'

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        calls: list[ParsedCall] = []
        for match in self._BLOCK.finditer(text):
            raw, body = match.group(0), match.group(1).strip()
            if not body:
                calls.append(ToolCallError(raw, f"Error: empty tool call. {self.HINT}"))
                continue
            try:
                obj, end = _DECODER.raw_decode(body)
            except json.JSONDecodeError as exc:
                calls.append(_decode_error(raw, exc, self.HINT))
                continue
            if body[end:].strip():
                calls.append(ToolCallError(raw, f"Error: unexpected text after the JSON object in a tool call. {self.HINT}"))
                continue
            calls.append(_call_from_object(obj, raw, ("arguments", "parameters"), self.HINT))
        content = self._BLOCK.sub("", text).strip() if calls else text.strip()
        return content, calls


class Llama3JsonParser:
    """Llama-3.x JSON tool calls (``{"name", "parameters"}``), optionally after ``<|python_tag|>``, ``;``-separated."""

    format = "llama3_json"
    BOT = "<|python_tag|>"
    HINT = 'Write a call as {"name": "<tool name>", "parameters": {<arguments>}}; separate several calls with ";".'

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        tag = text.find(self.BOT)
        if tag >= 0:
            content, body, forced = text[:tag], text[tag + len(self.BOT) :], True
        else:
            stripped = text.lstrip()
            if not stripped.startswith("{"):
                return text.strip(), []
            content, body, forced = "", stripped, False
        calls: list[ParsedCall] = []
        trailing = ""
        pos = 0
        while True:
            while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
                pos += 1
            if pos >= len(body):
                break
            if body[pos] != "{":
                trailing = body[pos:]
                break
            try:
                obj, end = _DECODER.raw_decode(body, pos)
            except json.JSONDecodeError as exc:
                if not forced and not calls and not re.match(r'\{\s*"name"', body[pos:]):
                    return text.strip(), []  # an answer that merely starts with "{"
                calls.append(_decode_error(body[pos:], exc, self.HINT))
                break
            raw = body[pos:end]
            if not forced and not calls and not (isinstance(obj, dict) and "name" in obj):
                return text.strip(), []  # a JSON answer, not a call
            calls.append(_call_from_object(obj, raw, ("parameters", "arguments"), self.HINT))
            pos = end
        content = "\n".join(s for s in (content.strip(), trailing.strip()) if s)
        return content, calls


class MistralParser:
    """``[TOOL_CALLS] [{...}, ...]`` (Mistral v3 tokenizers) and ``[TOOL_CALLS]name[ARGS]{...}`` (v11+)."""

    format = "mistral"
    BOT = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    HINT = 'Write calls as [TOOL_CALLS] [{"name": "<tool name>", "arguments": {<arguments>}}].'
    _NAME = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*\[ARGS\]")

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        first = text.find(self.BOT)
        if first < 0:
            return text.strip(), []
        pieces = [text[:first]]
        calls: list[ParsedCall] = []
        for segment in text[first + len(self.BOT) :].split(self.BOT):
            calls_part, rest = self._parse_segment(segment)
            calls.extend(calls_part)
            pieces.append(rest)
        return "\n".join(p.strip() for p in pieces if p.strip()), calls

    def _parse_segment(self, seg: str) -> tuple[list[ParsedCall], str]:
        named = self._NAME.match(seg)
        start = len(seg) - len(seg.lstrip())
        if named:  # v11: name[ARGS]{json}
            try:
                args, end = _DECODER.raw_decode(seg, named.end())
            except json.JSONDecodeError as exc:
                return [_decode_error(seg.strip(), exc, self.HINT)], ""
            call = {"name": named.group(1), "arguments": args}
            return [_call_from_object(call, seg[start:end], ("arguments",), self.HINT)], seg[end:]
        if seg.startswith("[", start):
            return self._parse_list(seg, start)
        try:
            obj, end = _DECODER.raw_decode(seg, start)
        except json.JSONDecodeError as exc:
            return [_decode_error(seg.strip(), exc, self.HINT)], ""
        return [_call_from_object(obj, seg[start:end], ("arguments", "parameters"), self.HINT)], seg[end:]

    def _parse_list(self, seg: str, start: int) -> tuple[list[ParsedCall], str]:
        """``[{...}, {...}]`` item by item, so each call's ``raw`` is its exact text."""
        calls: list[ParsedCall] = []
        pos = start + 1
        while True:
            while pos < len(seg) and (seg[pos].isspace() or seg[pos] == ","):
                pos += 1
            if seg.startswith("]", pos) or (pos >= len(seg) and calls):
                break  # a missing final "]" (trimmed stop string) loses nothing
            try:
                obj, end = _DECODER.raw_decode(seg, pos)
            except json.JSONDecodeError as exc:
                calls.append(_decode_error(seg[pos:].strip() or seg[start:].strip(), exc, self.HINT))
                return calls, ""
            calls.append(_call_from_object(obj, seg[pos:end], ("arguments", "parameters"), self.HINT))
            pos = end
        if not calls:
            return [ToolCallError(seg[start : pos + 1], f"Error: empty tool call list. {self.HINT}")], seg[pos + 1 :]
        return calls, seg[pos + 1 :]


_PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    "hermes": HermesParser,
    "qwen2_5": HermesParser,
    "qwen": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def get_tool_parser(fmt: str) -> ToolCallParser:
    """The parser for ``rollout.multi_turn.format``."""
    try:
        return _PARSERS[fmt]()
    except KeyError:
        raise ConfigError("rollout.multi_turn.format", f"unknown format {fmt!r}: use one of {sorted(_PARSERS)}") from None


# ---------------------------------------------------------------------------
# validation against the tool's schema


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _short(value: Any, limit: int = 40) -> str:
    s = json.dumps(value, ensure_ascii=False, default=str)
    return s if len(s) <= limit else s[: limit - 3] + "..."


@functools.lru_cache(maxsize=256)
def _validator(schema_json: str) -> Any:
    import jsonschema

    schema = json.loads(schema_json)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema)


def parameters_schema(tool: ToolProtocol) -> dict[str, Any]:
    """The JSON schema of a tool's arguments (an empty object schema when the tool declares none)."""
    function = tool.get_openai_tool_schema().get("function", {})
    params = function.get("parameters")
    return params if isinstance(params, dict) else {"type": "object", "properties": {}}


def _describe(error: Any, schema: dict[str, Any]) -> str:
    path = ".".join(str(p) for p in error.absolute_path)
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
        return f"{where} must be of type {expected}, got {_json_type(error.instance)} {_short(error.instance)}"
    if kind == "enum":
        return f"{where} must be one of {_short(error.validator_value, 120)}, got {_short(error.instance)}"
    if kind == "additionalProperties":
        allowed = sorted((error.schema.get("properties") or {}).keys())
        extra = sorted(set(error.instance) - set(allowed)) if isinstance(error.instance, dict) else []
        return f"unexpected argument{'s' if len(extra) > 1 else ''} " + ", ".join(f"'{e}'" for e in extra) + f" (allowed: {', '.join(allowed) or 'none'})"
    return f"{where}: {error.message}"


def _signature(schema: dict[str, Any]) -> str:
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    parts = []
    for key, spec in props.items():
        typ = spec.get("type", "any") if isinstance(spec, dict) else "any"
        typ = "|".join(typ) if isinstance(typ, list) else typ
        parts.append(f"{key}: {typ}{'' if key in required else ', optional'}")
    return "; ".join(parts) or "no arguments"


def validate_tool_call(call: ToolCall, tools: Mapping[str, ToolProtocol], max_errors: int = 3) -> ToolCallError | None:
    """``None`` when ``call`` names a known tool with schema-valid arguments, else the error the model reads."""
    tool = tools.get(call.name)
    if tool is None:
        known = ", ".join(sorted(tools)) or "(none)"
        return ToolCallError(call.raw, f"Error: unknown tool '{call.name}'. Available tools: {known}.", id=call.id, name=call.name)
    schema = parameters_schema(tool)
    validator = _validator(json.dumps(schema, sort_keys=True))
    errors = sorted(validator.iter_errors(call.arguments), key=lambda e: (list(map(str, e.absolute_path)), e.validator))
    if not errors:
        return None
    problems = [_describe(e, schema) for e in errors[:max_errors]]
    more = f" (and {len(errors) - max_errors} more)" if len(errors) > max_errors else ""
    message = f"Error: invalid arguments for tool '{call.name}': {'; '.join(problems)}{more}. Expected arguments: {_signature(schema)}."
    return ToolCallError(call.raw, message, id=call.id, name=call.name)
