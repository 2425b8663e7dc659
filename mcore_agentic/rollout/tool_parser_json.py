"""The JSON tool-call formats: ``hermes``, ``llama3_json`` and ``mistral``.

Each payload is decoded JSON-aware: the JSON value is decoded from the call's start and
only then is the closing delimiter expected, so a delimiter inside a JSON string is just
text. Splitting at the next delimiter is the fallback that bounds a payload that is not
valid JSON, for its error observation.
"""

from __future__ import annotations

import re
from typing import Any

from mcore_agentic.rollout.tool_call import (
    BadPayload,
    ParsedCall,
    Schemas,
    ToolCall,
    ToolCallError,
    decode_json,
    finish,
    join_content,
    json_type,
    loads_json,
    skip_space,
    split_calls,
    tool_call_block_end,
)

_NAME_IN_RAW = re.compile(r'"name"\s*:\s*"([^"]+)"')
_MODEL_ID = re.compile(r"[A-Za-z0-9_\-]{1,64}")


def payload_error(raw: str, exc: BadPayload, hint: str) -> ToolCallError:
    """The error observation for a payload that did not decode (naming the tool when the text shows it)."""
    found = _NAME_IN_RAW.search(raw)
    return ToolCallError(raw, f"Error: {exc}. {hint}", name=found.group(1) if found else None)


def _arguments(obj: dict[str, Any]) -> Any:
    """SGLang's rule: ``parameters`` when present and non-empty, else ``arguments`` (default ``{}``)."""
    return obj.get("parameters") or obj.get("arguments", {})


def call_from_object(obj: Any, raw: str, hint: str) -> ParsedCall:
    """Turn one decoded JSON value into a ToolCall, or say what is wrong with it."""
    if not isinstance(obj, dict):
        return ToolCallError(raw, f"Error: a tool call must be a JSON object, got {json_type(obj)}. {hint}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError(raw, f'Error: the tool call has no "name" string. {hint}')
    args = _arguments(obj)
    if isinstance(args, str):  # OpenAI-style: arguments as a JSON-encoded string
        try:
            args = loads_json(args) if args.strip() else {}
        except BadPayload as exc:
            return ToolCallError(raw, f"Error: the arguments of '{name}' are a string that is not valid JSON ({exc}). {hint}", name=name)
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCallError(raw, f"Error: the arguments of '{name}' must be a JSON object, got {json_type(args)}. {hint}", name=name)
    call_id = obj.get("id")
    if isinstance(call_id, str) and _MODEL_ID.fullmatch(call_id):
        return ToolCall(name=name, arguments=args, raw=raw, id=call_id)
    return ToolCall(name=name, arguments=args, raw=raw)


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks (Hermes / Qwen2.5 / Qwen3 chat templates)."""

    format = "hermes"
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    HINT = 'Write each call as <tool_call>{"name": "<tool name>", "arguments": {<arguments>}}</tool_call>.'
    _START = re.compile(re.escape(OPEN))

    def parse(self, text: str, *, schemas: Schemas | None = None) -> tuple[str, list[ParsedCall]]:
        return split_calls(text, self._START, self._read)

    def _read(self, text: str, found: re.Match[str]) -> tuple[list[ParsedCall], int]:
        call, end = self._block(text, found.start())
        return [call], end

    def _block(self, text: str, start: int) -> tuple[ParsedCall, int]:
        """The call whose ``<tool_call>`` is at ``start``, and the index after its block."""
        body = skip_space(text, start + len(self.OPEN))
        if body == len(text) or text.startswith((self.CLOSE, self.OPEN), body):
            end = tool_call_block_end(text, body)
            return ToolCallError(text[start:end], f"Error: empty tool call. {self.HINT}"), end
        try:
            obj, stop = decode_json(text, body)
        except BadPayload as exc:
            end = tool_call_block_end(text, body)
            return payload_error(text[start:end], exc, self.HINT), end
        after = skip_space(text, stop)
        if text.startswith(self.CLOSE, after):
            end = after + len(self.CLOSE)
        elif after == len(text) or text.startswith(self.OPEN, after):
            end = after  # unclosed: the engine trimmed its stop string, or the next call starts
        else:
            end = tool_call_block_end(text, stop)
            message = f"Error: unexpected text after the JSON object in a tool call. {self.HINT}"
            return ToolCallError(text[start:end], message, name=_name_of(obj)), end
        return call_from_object(obj, text[start:end], self.HINT), end


def _name_of(obj: Any) -> str | None:
    name = obj.get("name") if isinstance(obj, dict) else None
    return name if isinstance(name, str) and name else None


class Llama3JsonParser:
    """Llama-3.x JSON tool calls (``{"name", "parameters"}``), optionally after ``<|python_tag|>``, ``;``-separated."""

    format = "llama3_json"
    BOT = "<|python_tag|>"
    HINT = 'Write a call as {"name": "<tool name>", "parameters": {<arguments>}}; separate several calls with ";".'
    _LOOKS_LIKE_CALL = re.compile(r'\{\s*"name"')
    _SEPARATORS = re.compile(r"(?:\s|;|<\|python_tag\|>)*")

    def parse(self, text: str, *, schemas: Schemas | None = None) -> tuple[str, list[ParsedCall]]:
        start = skip_space(text, 0)
        if text.startswith("{", start):  # a bare call, or an answer that happens to be JSON
            try:
                obj, _ = decode_json(text, start)
            except BadPayload as exc:
                if self._LOOKS_LIKE_CALL.match(text, start):
                    return join_content([text[:start]]), [payload_error(text[start:], exc, self.HINT)]
            else:
                if isinstance(obj, dict) and "name" in obj:
                    return self._calls(text, start, text[:start])
        tag = text.find(self.BOT)  # a JSON answer is content, but a tag anywhere starts a call
        if tag < 0:
            return text, []
        if self._SEPARATORS.match(text, tag).end() == len(text):
            return join_content([text[:tag]]), [ToolCallError(text[tag:], f"Error: empty tool call after {self.BOT}. {self.HINT}")]
        return self._calls(text, tag + len(self.BOT), text[:tag])

    def _calls(self, text: str, pos: int, before: str) -> tuple[str, list[ParsedCall]]:
        """Calls from ``pos`` on: the first payload must be a call; after one, text not starting with ``{`` is content."""
        calls: list[ParsedCall] = []
        trailing = ""
        while (pos := self._SEPARATORS.match(text, pos).end()) < len(text):
            if calls and text[pos] != "{":
                trailing = text[pos:]
                break
            try:
                obj, end = decode_json(text, pos)
            except BadPayload as exc:
                calls.append(payload_error(text[pos:], exc, self.HINT))
                break
            calls.append(call_from_object(obj, text[pos:end], self.HINT))
            pos = end
        return join_content([before, trailing]), finish(calls)


class MistralParser:
    """``[TOOL_CALLS] [{...}, ...]`` (Mistral v3 tokenizers) and ``[TOOL_CALLS]name[ARGS]{...}`` (v11+)."""

    format = "mistral"
    BOT = "[TOOL_CALLS]"
    HINT = 'Write calls as [TOOL_CALLS] [{"name": "<tool name>", "arguments": {<arguments>}}].'
    _NAME = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*\[ARGS\]\s*")
    _ITEM_SEPARATORS = re.compile(r"[\s,]*")
    _START = re.compile(re.escape(BOT))

    def parse(self, text: str, *, schemas: Schemas | None = None) -> tuple[str, list[ParsedCall]]:
        return split_calls(text, self._START, lambda text, found: self._payload(text, found.end()))

    def _fallback_end(self, text: str, pos: int) -> int:
        """End of a payload that is not valid JSON: the next ``[TOOL_CALLS]`` or the end of the text."""
        found = text.find(self.BOT, pos)
        return len(text) if found < 0 else found

    def _payload(self, text: str, pos: int) -> tuple[list[ParsedCall], int]:
        """The calls after the ``[TOOL_CALLS]`` that ends at ``pos``, and the index after them."""
        named = self._NAME.match(text, pos)
        if named:  # v11: name[ARGS]{json}
            return self._named(text, pos, named)
        start = skip_space(text, pos)
        if text.startswith("[", start):
            return self._list(text, start)
        try:
            obj, end = decode_json(text, start)
        except BadPayload as exc:
            end = self._fallback_end(text, start)
            return [payload_error(text[start:end].strip() or self.BOT, exc, self.HINT)], end
        return [call_from_object(obj, text[start:end], self.HINT)], end

    def _named(self, text: str, pos: int, named: re.Match[str]) -> tuple[list[ParsedCall], int]:
        start = skip_space(text, pos)
        try:
            args, end = decode_json(text, named.end())
        except BadPayload as exc:
            end = self._fallback_end(text, named.end())
            return [ToolCallError(text[start:end], f"Error: {exc}. {self.HINT}", name=named.group(1))], end
        obj = {"name": named.group(1), "arguments": args}
        return [call_from_object(obj, text[start:end], self.HINT)], end

    def _list(self, text: str, start: int) -> tuple[list[ParsedCall], int]:
        """``[{...}, {...}]`` item by item, so each call's ``raw`` is its exact text."""
        calls: list[ParsedCall] = []
        pos = start + 1
        while True:
            pos = self._ITEM_SEPARATORS.match(text, pos).end()
            if text.startswith("]", pos):
                pos += 1
                break
            if calls and (pos == len(text) or text.startswith(self.BOT, pos)):
                break  # a missing final "]" (trimmed stop string) loses nothing
            try:
                obj, end = decode_json(text, pos)
            except BadPayload as exc:
                end = self._fallback_end(text, pos)
                calls.append(payload_error(text[pos:end].strip() or text[start:end].strip(), exc, self.HINT))
                return calls, end
            calls.append(call_from_object(obj, text[pos:end], self.HINT))
            pos = end
        if not calls:
            return [ToolCallError(text[start:pos], f"Error: empty tool call list. {self.HINT}")], pos
        return calls, pos
