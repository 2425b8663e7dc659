"""The ``qwen3_coder`` tool-call format (Qwen3-Coder, Qwen3.5): XML-like blocks, values typed by schema.

::

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

A value is the raw text between ``<parameter=ARG>`` and ``</parameter>`` less one leading and
one trailing newline. It is typed as SGLang's ``Qwen3CoderDetector`` types it, from the
tool's JSON schema (:func:`convert_value`). Whatever does not have exactly this structure
(after whitespace between tags) is a :class:`ToolCallError`, one per block.
"""

from __future__ import annotations

import ast
import json
import re
import threading
import warnings
from collections.abc import Mapping
from typing import Any

from mcore_agentic.rollout.tool_call import (
    MAX_NESTING,
    BadPayload,
    ParsedCall,
    Schemas,
    ToolCall,
    ToolCallError,
    loads_json,
    nesting_exceeds,
    skip_space,
    split_calls,
    tool_call_block_end,
)

# ---------------------------------------------------------------------------
# value typing, as SGLang's Qwen3CoderDetector does it

_STRING_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})
_INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_FLOAT_PREFIXES = ("num", "float")
_BOOL_TYPES = frozenset({"boolean", "bool", "binary"})
_JSON_TYPES = frozenset({"object", "array", "arr"})
_JSON_PREFIXES = ("dict", "list")


def argument_properties(schema: Any) -> Mapping[str, Any]:
    """Parameter name -> its schema, for a tool's ``parameters`` schema (SGLang's lookup rule).

    The top-level ``properties``, else those of its ``anyOf``/``oneOf``/``allOf`` branches
    (first one wins); a schema with neither is used as the mapping itself.
    """
    if not isinstance(schema, dict):
        return {}
    try:
        properties = _schema_properties(schema)
    except RecursionError:  # a cyclic schema: treat the values as text
        return {}
    return properties if properties or "properties" in schema else schema


def _schema_properties(schema: Any) -> dict[str, Any]:
    if not isinstance(schema, dict):
        return {}
    properties = schema.get("properties")
    if isinstance(properties, dict):
        return properties
    merged: dict[str, Any] = {}
    for keyword in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(keyword)
        for branch in branches if isinstance(branches, list) else []:
            for key, value in _schema_properties(branch).items():
                merged.setdefault(key, value)
    return merged


_ENUM_TYPES: tuple[tuple[type, str], ...] = (
    (bool, "boolean"),
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
)


def _enum_value_type(value: Any) -> str | None:
    if value is None:
        return "null"
    return next((name for kind, name in _ENUM_TYPES if isinstance(value, kind)), None)


def _infer_type(schema: Any) -> Any:
    """The primary type of a parameter schema, or None (same precedence as SGLang's inference)."""
    if not isinstance(schema, dict):
        return None
    declared = schema.get("type")
    if isinstance(declared, str):
        return declared
    if isinstance(declared, list) and declared:
        return next((t for t in declared if t != "null"), "string")
    branches = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(branches, list):
        found = _union_type([t for t in map(_infer_type, branches) if t])
        if found is not None:
            return found
    if isinstance(schema.get("enum"), list):
        kinds = {_enum_value_type(v) for v in schema["enum"]} - {None}
        return kinds.pop() if len(kinds) == 1 else "string"
    if isinstance(schema.get("allOf"), list):
        return next((t for t in map(_infer_type, schema["allOf"]) if t and t != "string"), "string")
    if "properties" in schema:
        return "object"
    if "items" in schema:
        return "array"
    return None


def _union_type(types: list[Any]) -> Any:
    if not types:
        return None
    distinct = list(dict.fromkeys(map(str, types)))
    if len(distinct) == 1:
        return types[0]
    if len(distinct) == 2 and "null" in distinct:
        return next(t for t in types if t != "null")
    return "string" if "string" in distinct else types[0]


def parameter_type(schema: Any) -> str:
    """The conversion type of one parameter: the inferred type, lower-cased; ``string`` if none."""
    try:
        inferred = _infer_type(schema)
    except (TypeError, ValueError, RecursionError):  # a malformed tool schema: treat its values as text
        inferred = None
    return "string" if inferred is None else str(inferred).strip().lower()


_LITERAL_LOCK = threading.Lock()


def _literal(value: str) -> Any:
    """``ast.literal_eval`` without SyntaxWarnings for invalid escapes (warning filters are process-global)."""
    with _LITERAL_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ast.literal_eval(value)


def _as_int(value: str) -> Any:
    try:
        return int(value)
    except (TypeError, ValueError):
        return value  # not an integer: kept as text


def _as_number(value: str) -> Any:
    integral = "." not in value and "e" not in value.lower()
    try:
        number = float(value)
    except (TypeError, ValueError):
        return value  # not a number: kept as text
    return int(number) if integral and number.is_integer() else number


def _as_structure(value: str, json_first: bool) -> Any:
    """JSON (for object/array types), else a Python literal, else the text itself."""
    if nesting_exceeds(value, skip_space(value, 0)):
        raise BadPayload(f"nested deeper than the limit of {MAX_NESTING} levels of JSON arrays/objects")
    if json_first:
        try:
            return loads_json(value)
        except BadPayload:
            pass
    try:
        return _plain_json(_literal(value))
    except BadPayload:
        raise
    except Exception:  # noqa: BLE001 -- literal_eval raises SyntaxError, ValueError, MemoryError, RecursionError...
        return value


def _plain_json(value: Any) -> Any:
    """A literal_eval result as the JSON it serialises to (tuples become lists, non-str keys strings)."""
    try:
        return json.loads(json.dumps(value, ensure_ascii=False))
    except (TypeError, ValueError):
        raise BadPayload(f"a Python {type(value).__name__} literal, which JSON cannot represent") from None


def convert_value(value: str, name: str, properties: Mapping[str, Any]) -> Any:
    """Type one raw parameter value by its schema, exactly as SGLang's Qwen3CoderDetector does.

    ``null`` (any case) is None whatever the type; a parameter the schema does not declare
    stays text; integers/numbers that do not parse stay text; a boolean is true only for
    ``true`` (any case), anything else is false; objects/arrays are JSON, else a Python
    literal, else text; other declared types try a Python literal, else text.
    :class:`BadPayload` for a value nested too deeply or not representable in JSON.
    """
    if value.lower() == "null":
        return None
    if name not in properties:
        return value
    kind = parameter_type(properties[name])
    if kind in _STRING_TYPES:
        return value
    if kind.startswith(_INT_PREFIXES):
        return _as_int(value)
    if kind.startswith(_FLOAT_PREFIXES):
        return _as_number(value)
    if kind in _BOOL_TYPES:
        return value.lower() == "true"
    return _as_structure(value, json_first=kind in _JSON_TYPES or kind.startswith(_JSON_PREFIXES))


# ---------------------------------------------------------------------------
# the parser


class _Malformed(Exception):
    """A block that is not well formed: why, where that showed, and the tool name if it was read."""

    def __init__(self, reason: str, at: int):
        super().__init__(reason)
        self.reason = reason
        self.at = at
        self.name: str | None = None


class Qwen3CoderParser:
    """``<tool_call><function=NAME><parameter=ARG>VALUE</parameter>...</function></tool_call>`` blocks."""

    format = "qwen3_coder"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    FUNCTION, FUNCTION_END = "<function=", "</function>"
    PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
    HINT = (
        "Write each call as\n<tool_call>\n<function=TOOL_NAME>\n<parameter=ARGUMENT_NAME>\nvalue\n</parameter>\n"
        "</function>\n</tool_call>\nwith one <function=...> per <tool_call>."
    )
    _START = re.compile(r"<tool_call>|<function=")
    _TAG_NAME = re.compile(r"([^<>\n]+)>")
    # A value ends where SGLang ends it; anything but </parameter> there means it is unclosed.
    _VALUE_END = re.compile(r"</parameter>|<parameter=|</function>|</tool_call>")
    _STRAY_END = re.compile(r"</function>|<tool_call>")

    def parse(self, text: str, *, schemas: Schemas | None = None) -> tuple[str, list[ParsedCall]]:
        def read(text: str, found: re.Match[str]) -> tuple[list[ParsedCall], int]:
            if found.group() == self.OPEN:
                call, end = self._block(text, found.start(), schemas or {})
            else:
                call, end = self._stray(text, found.start())
            return [call], end

        return split_calls(text, self._START, read)

    def _block(self, text: str, start: int, schemas: Schemas) -> tuple[ParsedCall, int]:
        """The call whose ``<tool_call>`` is at ``start``, and the index after its block."""
        try:
            name, values, end = self._structure(text, start)
        except _Malformed as bad:
            end = tool_call_block_end(text, bad.at)
            return ToolCallError(text[start:end], f"Error: malformed tool call: {bad.reason}. {self.HINT}", name=bad.name), end
        try:
            arguments = self._typed(name, values, schemas)
        except BadPayload as exc:
            return ToolCallError(text[start:end], f"Error: in the call of '{name}': {exc}. {self.HINT}", name=name), end
        return ToolCall(name=name, arguments=arguments, raw=text[start:end]), end

    def _structure(self, text: str, start: int) -> tuple[str, list[tuple[str, str]], int]:
        """(function name, [(parameter, raw value)], end of block); :class:`_Malformed` if not well formed."""
        pos = skip_space(text, start + len(self.OPEN))
        if not text.startswith(self.FUNCTION, pos):
            raise _Malformed("<tool_call> must be followed by <function=TOOL_NAME>", pos)
        name, pos = self._tag_name(text, pos + len(self.FUNCTION), "function")
        try:
            values, pos = self._parameters(text, pos, name)
            return name, values, self._block_end(text, pos + len(self.FUNCTION_END))
        except _Malformed as bad:
            bad.name = name
            raise

    def _parameters(self, text: str, pos: int, name: str) -> tuple[list[tuple[str, str]], int]:
        """The (parameter, raw value) pairs from ``pos`` on, and the index of ``</function>``."""
        values: list[tuple[str, str]] = []
        while not text.startswith(self.FUNCTION_END, pos := skip_space(text, pos)):
            if not text.startswith(self.PARAMETER, pos):
                raise _Malformed(f"expected <parameter=ARGUMENT_NAME> or </function> inside <function={name}>", pos)
            key, pos = self._tag_name(text, pos + len(self.PARAMETER), "parameter")
            value, pos = self._value(text, pos, key)
            values.append((key, value))
        return values, pos

    def _tag_name(self, text: str, pos: int, tag: str) -> tuple[str, int]:
        found = self._TAG_NAME.match(text, pos)
        if found is None:
            raise _Malformed(f"<{tag}=...> needs a name and a closing '>' on the same line", pos)
        return found.group(1), found.end()

    def _value(self, text: str, pos: int, key: str) -> tuple[str, int]:
        """The raw value starting at ``pos`` (one edge newline each side removed) and the index after ``</parameter>``."""
        end = self._VALUE_END.search(text, pos)
        if end is None or end.group() != self.PARAMETER_END:
            raise _Malformed(f"parameter '{key}' is not closed by </parameter>", len(text) if end is None else end.start())
        value = text[pos : end.start()]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        return value, end.end()

    def _block_end(self, text: str, pos: int) -> int:
        """The index after ``</tool_call>``; also accepts a block cut at the end of the text or before the next call."""
        pos = skip_space(text, pos)
        if text.startswith(self.CLOSE, pos):
            return pos + len(self.CLOSE)
        if pos == len(text) or text.startswith(self.OPEN, pos):
            return pos  # the engine stopped on </tool_call> and trimmed it, or the next call starts
        raise _Malformed("expected </tool_call> after </function> (one <function=...> per <tool_call>)", pos)

    def _stray(self, text: str, start: int) -> tuple[ToolCallError, int]:
        """A ``<function=`` outside any ``<tool_call>`` block: an error up to its ``</function>``."""
        found = self._STRAY_END.search(text, start + len(self.FUNCTION))
        end = len(text) if found is None else found.end() if found.group() == self.FUNCTION_END else found.start()
        named = self._TAG_NAME.match(text, start + len(self.FUNCTION))
        message = f"Error: a <function=...> call must be nested within <tool_call></tool_call> tags. {self.HINT}"
        return ToolCallError(text[start:end], message, name=named.group(1) if named else None), end

    @staticmethod
    def _typed(name: str, values: list[tuple[str, str]], schemas: Schemas) -> dict[str, Any]:
        """The arguments, each value typed by the tool's schema (a repeated parameter: the last wins)."""
        properties = argument_properties(schemas.get(name))
        arguments: dict[str, Any] = {}
        for key, value in values:
            try:
                arguments[key] = convert_value(value, key, properties)
            except BadPayload as exc:
                raise BadPayload(f"argument '{key}' is {exc}") from None
        return arguments
