"""Parsed tool calls, and the safety checks every tool-call parser applies to them.

A parser never raises: whatever it cannot turn into a :class:`ToolCall` becomes a
:class:`ToolCallError` whose ``message`` the model reads as that call's tool result.
Two checks guard the rest of the pipeline against payloads that parse but would
crash later: JSON nested deeper than :data:`MAX_NESTING` levels (recursive code
downstream: schema validation, chat templates) and lone UTF-16 surrogates, which
``json`` accepts (``"\\ud83d"``) but no tokenizer can encode.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

MAX_NESTING = 128
"""Most nested JSON arrays/objects a call payload may hold."""


_IDS = random.Random(os.urandom(16))  # unique, not secret: one urandom read per process, not per call


def new_call_id() -> str:
    """9 alphanumeric characters: the one id shape every chat template accepts (Mistral's insists on it)."""
    return f"{_IDS.getrandbits(36):09x}"


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
Schemas = Mapping[str, dict]
"""Tool name -> the JSON schema of that tool's arguments (``function.parameters``)."""


class ToolCallParser(Protocol):
    format: str

    def parse(self, text: str, *, schemas: Schemas | None = None) -> tuple[str, list[ParsedCall]]:
        """Split ``text`` into (content without the calls, the calls in order of appearance).

        ``schemas`` types the arguments of formats whose values are untyped text (``qwen3_coder``);
        the JSON formats ignore it.
        """
        ...


class BadPayload(ValueError):
    """A call payload that cannot become a call; ``str(exc)`` says why, phrased for the model."""


# One token per match, contiguous from the start position: a whole string literal (escapes
# included), a run of other characters, a run of openers, a run of closers, or a stray quote
# (an unterminated string). Possessive quantifiers keep every match linear.
_JSON_TOKEN = re.compile(r'"(?:[^"\\]++|\\.)*+"|[^"\[\]{}]++|[\[{]++|[\]}]++|"', re.DOTALL)
_JSON_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


def nesting_exceeds(text: str, start: int = 0, limit: int = MAX_NESTING) -> bool:
    """Whether the JSON value at ``text[start]`` nests deeper than ``limit`` (linear scan, no recursion).

    The scan stops where that value closes, so text after it costs nothing.
    """
    depth = 0
    for match in _JSON_TOKEN.finditer(text, start):
        token = match.group()
        if token[0] in "[{":
            depth += len(token)
            if depth > limit:
                return True
        elif token[0] in "]}":
            depth -= len(token)
            if depth <= 0:
                return False
        elif depth == 0:
            return False  # a scalar at the top: nothing nests
    return False


def value_nesting_exceeds(value: Any, limit: int = MAX_NESTING) -> bool:
    """Whether a decoded value nests lists/dicts deeper than ``limit`` (iterative: no recursion limit involved)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, tuple, dict)):
            if depth >= limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return False


def too_deep_message() -> str:
    return f"the tool call nests JSON arrays/objects deeper than the limit of {MAX_NESTING} levels"


def decode_json(text: str, pos: int = 0) -> tuple[Any, int]:
    """The JSON value starting at ``text[pos]`` and the index after it; :class:`BadPayload` if there is none."""
    if nesting_exceeds(text, pos):
        raise BadPayload(too_deep_message())
    try:
        return _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError as exc:
        raise BadPayload(f"the tool call is not valid JSON ({exc.msg} at char {exc.pos - pos})") from None
    except RecursionError:  # the scan above should make this unreachable
        raise BadPayload(too_deep_message()) from None


def loads_json(text: str) -> Any:
    """``json.loads`` semantics (one value, JSON whitespace around it), through :func:`decode_json`."""
    value, end = decode_json(text, _JSON_WS.match(text).end())
    if _JSON_WS.match(text, end).end() != len(text):
        raise BadPayload(f"the tool call is not valid JSON (Extra data at char {end})")
    return value


# ---------------------------------------------------------------------------
# lone surrogates

_SURROGATE = re.compile("[\ud800-\udfff]")


def escape_surrogates(text: str) -> str:
    """``text`` with each surrogate code point written as ``\\uXXXX`` (safe to show and to encode)."""
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _surrogate_in(value: Any) -> tuple[str, str] | None:
    """(dotted path, the surrogate) of the first key or string in ``value`` holding a lone surrogate.

    Iterative, so any depth is safe. (A paired escape such as ``"\\ud83d\\ude00"`` decodes
    to one real character, so every surrogate left in a decoded string is a lone one.)
    """
    stack: list[tuple[tuple[str, ...], Any]] = [((), value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            found = _SURROGATE.search(item)
            if found:
                return ".".join(path), found.group()
        elif isinstance(item, dict):
            for key in reversed(list(item)):
                key_hit = _SURROGATE.search(key) if isinstance(key, str) else None
                if key_hit:
                    return ".".join((*path, key)), key_hit.group()
                stack.append(((*path, str(key)), item[key]))
        elif isinstance(item, list):
            stack.extend(((*path, str(i)), item[i]) for i in reversed(range(len(item))))
    return None


def reject_lone_surrogates(call: ParsedCall) -> ParsedCall:
    """``call``, or a :class:`ToolCallError` if its name or an argument holds a lone UTF-16 surrogate.

    An error's message (which quotes model text) gets its surrogates escaped, so it can be encoded.
    """
    if isinstance(call, ToolCallError):
        call.message = escape_surrogates(call.message)
        call.name = None if call.name is None or _SURROGATE.search(call.name) else call.name
        return call
    if _SURROGATE.search(call.name):
        return ToolCallError(call.raw, "Error: the tool name contains a lone UTF-16 surrogate, which is not valid Unicode.", id=call.id)
    hit = _surrogate_in(call.arguments)
    if hit is None:
        return call
    path, char = hit
    message = (
        f"Error: argument '{escape_surrogates(path)}' of tool '{call.name}' contains a lone UTF-16 surrogate "
        f"(\\u{ord(char):04x}), which is not valid Unicode. Write the character itself, or a complete "
        "surrogate pair such as \\ud83d\\ude00."
    )
    return ToolCallError(call.raw, message, id=call.id, name=call.name)


def finish(calls: list[ParsedCall]) -> list[ParsedCall]:
    """The checks every parser applies to its calls before returning them."""
    return [reject_lone_surrogates(call) for call in calls]


def join_content(pieces: list[str]) -> str:
    """The assistant content around tool calls: the non-blank pieces, each edge-stripped, one per line."""
    return "\n".join(piece.strip() for piece in pieces if piece.strip())


def split_calls(
    text: str, starts: re.Pattern[str], read: Callable[[str, re.Match[str]], tuple[list[ParsedCall], int]]
) -> tuple[str, list[ParsedCall]]:
    """``(content, calls)`` of a text whose calls start where ``starts`` matches: ``read`` turns the block at a
    match into its calls and the index after it; the text between blocks is the content (:func:`join_content`).
    A text with no call is all content, unchanged."""
    pieces: list[str] = []
    calls: list[ParsedCall] = []
    pos = 0
    while (found := starts.search(text, pos)) is not None:
        pieces.append(text[pos : found.start()])
        block, pos = read(text, found)
        calls.extend(block)
    if not calls:
        return text, []
    pieces.append(text[pos:])
    return join_content(pieces), finish(calls)


_TOOL_CALL_BOUNDARY = re.compile(r"</tool_call>|<tool_call>")


def tool_call_block_end(text: str, pos: int) -> int:
    """End of a malformed ``<tool_call>`` block, searching from ``pos``: after the next ``</tool_call>``, at the
    next ``<tool_call>``, or the text's end."""
    found = _TOOL_CALL_BOUNDARY.search(text, pos)
    if found is None:
        return len(text)
    return found.end() if found.group() == "</tool_call>" else found.start()


_SPACE = re.compile(r"\s*")


def skip_space(text: str, pos: int) -> int:
    """The first index at or after ``pos`` that is not whitespace."""
    return _SPACE.match(text, pos).end()


def json_type(value: Any) -> str:
    """The JSON Schema type name of a decoded JSON value."""
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
