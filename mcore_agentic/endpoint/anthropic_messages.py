"""Anthropic Messages (``POST /v1/messages``): request body -> :class:`~.turn.TurnRequest`, and a
:class:`~.turn.TurnResult` -> the ``message`` object or its event stream.

``system`` (a string or text blocks) becomes a first system message (none when its text is empty). A user message's
blocks become, in this order: one tool message per ``tool_result`` block (in block order), then one user message
with the text blocks joined, if there are any text blocks (a user message with no block at all stays an empty user
message). An assistant message's ``text`` blocks are its content, its ``thinking`` blocks its ``reasoning_content``
(``redacted_thinking`` is dropped: its text is not readable), its ``tool_use`` blocks its ``tool_calls`` (arguments:
``input`` as compact JSON). Consecutive messages of one role stay separate messages.

Fields follow :mod:`.field_policy`: those read here are checked; every other field, known to the installed
``anthropic`` client or not (``context_management``, ``cache_control`` on any block, ``thinking``, ``top_k``,
``metadata``, ``service_tier``, ``container``, ``output_config.effort``, Claude Code's newer fields), is accepted,
ignored and named in :attr:`~.turn.TurnRequest.ignored`. Server tools (any tool ``type`` but ``custom``: web search,
code execution, the schema-less bash and editor tools) are not offered to the model and counted
(``hosted_tools``); a ``tool_choice`` naming one is refused. A ``system`` message inside ``messages`` (Claude Code's
mid-conversation system beta) is a system message at that place. Structured output (``output_config.format``:
Claude Code's title call asks for a JSON schema) is accepted and counted (``structured_output``): sampling is not
constrained, the text is the model's as sampled. Refused: image / document / other non-text blocks,
``mcp_servers`` (tools the API would connect). ``tool_result.is_error`` is read but not
kept (the common form has no slot; counted as ignored). :func:`parse_count_request` reads a
``/v1/messages/count_tokens`` body (no ``max_tokens``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from anthropic.types import message_create_params as _params

from mcore_agentic.endpoint.api import ChatApi
from mcore_agentic.endpoint.api_fields import (
    TEXT_JOIN,
    as_dict,
    assistant_message,
    bad,
    body_object,
    client_fields,
    expected,
    function_tool,
    get_bool,
    get_dict,
    get_int,
    get_list,
    get_number,
    get_str,
    join_path,
    join_text_parts,
    pieces,
    refuse_unless_null,
    sse,
    tool_call,
)
from mcore_agentic.endpoint.field_policy import has_key, ignored_top_level
from mcore_agentic.endpoint.turn import ApiError, TurnRequest, TurnResult

KNOWN_FIELDS = client_fields(
    _params.MessageCreateParamsBase, _params.MessageCreateParamsStreaming, _params.MessageCreateParamsNonStreaming,
) | {
    "model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p", "top_k", "tools",
    "tool_choice", "thinking", "metadata", "stream", "output_config", "service_tier", "container",
}
"""Top-level request fields: the client's ``TypedDict`` keys (read at import) and those handled here by name."""

HONOURED = frozenset({"model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p", "tools",
                      "tool_choice", "stream", "mcp_servers"})
"""The fields read here; any other is accepted and ignored (:mod:`.field_policy`)."""

ERROR_TYPES = frozenset({
    "invalid_request_error", "authentication_error", "billing_error", "permission_error", "not_found_error",
    "request_too_large", "rate_limit_error", "timeout_error", "api_error", "overloaded_error",
})
_STATUS_ERROR = {401: "authentication_error", 402: "billing_error", 403: "permission_error", 404: "not_found_error",
                 413: "request_too_large", 429: "rate_limit_error", 504: "timeout_error", 529: "overloaded_error"}
_STOP_REASON = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "stop_sequence": "stop_sequence"}
_TEXT = ("text",)


def message_id(result: TurnResult) -> str:
    return f"msg_{result.id}"


# ----------------------------------------------------------------------------------------------------------------
# Request


def parse_request(body: Any) -> TurnRequest:
    """The common form of a Messages request body; :class:`ApiError` (400, naming the field) if bad."""
    return _parse(body, count_only=False)


def parse_count_request(body: Any) -> TurnRequest:
    """The common form of a ``/v1/messages/count_tokens`` body: a Messages request without ``max_tokens``."""
    return _parse(body, count_only=True)


def _parse(body: Any, *, count_only: bool) -> TurnRequest:
    body = body_object(body)
    ignored = ignored_top_level(body, HONOURED)
    max_tokens = get_int(body, "max_tokens", required=not count_only, minimum=1)
    if has_key(body.get("system"), "cache_control") or has_key(body.get("messages"), "cache_control") or has_key(
            body.get("tools"), "cache_control"):
        ignored.append("cache_control")
    refuse_unless_null(body, "mcp_servers", "remote MCP servers are not supported: run the MCP client in the agent "
                                            "program and send its tools as client tools")
    messages = get_list(body, "messages", required=True)
    if not messages:
        raise bad("messages", "must not be empty")
    get_int(body, "top_k", minimum=0)
    get_dict(body, "thinking")
    get_dict(body, "metadata")
    output_config = get_dict(body, "output_config") or {}
    if output_config.get("format") is not None:  # Claude Code's title call asks for a JSON schema
        ignored.append("structured_output")
    system = _system(body.get("system"))
    tool_choice, parallel = _tool_choice(get_dict(body, "tool_choice"))
    hosted: list[str] = []
    tools = _tools(get_list(body, "tools"), hosted)
    if hosted:
        ignored.append("hosted_tools")
        if tool_choice in hosted:
            raise bad("tool_choice.name", f"{tool_choice!r} is a server tool, which the endpoint does not run: "
                                          "choose a client tool")
    converted = []
    for i, message in enumerate(messages):
        converted += _message(message, join_path("messages", i))
    if any(_tool_error(m) for m in messages):
        ignored.append("tool_result.is_error")
    return TurnRequest(
        messages=system + converted,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        max_tokens=max_tokens,
        temperature=get_number(body, "temperature", low=0.0, high=1.0),
        top_p=get_number(body, "top_p", low=0.0, high=1.0, low_open=True),
        stop=_stop_sequences(get_list(body, "stop_sequences")),
        stream=get_bool(body, "stream", default=False),
        model=get_str(body, "model", default=""),
        ignored=tuple(ignored),
    )


def _tool_error(message: Any) -> bool:
    """Whether a (parsed, valid) message holds a ``tool_result`` block with ``is_error: true``."""
    content = message.get("content")
    return isinstance(content, list) and any(
        b.get("type") == "tool_result" and b.get("is_error") is True for b in content)


def _system(value: Any) -> list[dict[str, Any]]:
    text = join_text_parts(value, "system", text_types=_TEXT, what="a string or a list of text blocks")
    return [{"role": "system", "content": text}] if text else []


def _stop_sequences(value: list[Any] | None) -> tuple[str, ...]:
    for i, s in enumerate(value or []):
        if not isinstance(s, str):
            raise expected(join_path("stop_sequences", i), "a string", s)
        if not s:
            raise bad(join_path("stop_sequences", i), "a stop sequence must not be empty")
    return tuple(value or ())


def _blocks(content: Any, path: str) -> list[dict[str, Any]]:
    """``content`` as a list of blocks (a string is one text block), each with a string ``type``."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise expected(path, "a string or a list of content blocks", content)
    for i, block in enumerate(content):
        get_str(as_dict(block, join_path(path, i), "a content block object"), "type", join_path(path, i),
                required=True)
    return content


def _message(message: Any, path: str) -> list[dict[str, Any]]:
    message = as_dict(message, path, "a message object")
    role = get_str(message, "role", path, required=True)
    content_path = join_path(path, "content")
    if "content" not in message:
        raise bad(content_path, "is required")
    blocks = _blocks(message["content"], content_path)
    if role == "user":
        return _user(blocks, content_path)
    if role == "assistant":
        return [_assistant(blocks, content_path)]
    if role == "system":  # a mid-conversation system message (Claude Code's mid-conversation-system beta)
        return [{"role": "system", "content": join_text_parts(blocks, content_path, text_types=_TEXT,
                                                              what="a string or a list of text blocks")}]
    raise bad(join_path(path, "role"), f"unknown role {role!r} (user, assistant, or system for a mid-conversation "
                                       "system message)")


def _not_text(block: dict[str, Any], path: str) -> ApiError:
    return bad(path, f"only text content is supported, got a '{block['type']}' block")


def _user(blocks: list[dict[str, Any]], path: str) -> list[dict[str, Any]]:
    tool_messages, texts = [], []
    for i, block in enumerate(blocks):
        where = join_path(path, i)
        if block["type"] == "text":
            texts.append(get_str(block, "text", where, required=True))
        elif block["type"] == "tool_result":
            get_bool(block, "is_error", where, default=False)
            content = join_text_parts(block.get("content"), join_path(where, "content"), text_types=_TEXT,
                                      what="a string or a list of text blocks")
            tool_messages.append({"role": "tool", "tool_call_id": get_str(block, "tool_use_id", where, required=True),
                                  "content": content})
        else:
            raise _not_text(block, where)
    if texts or not tool_messages:
        tool_messages.append({"role": "user", "content": TEXT_JOIN.join(texts)})
    return tool_messages


def _assistant(blocks: list[dict[str, Any]], path: str) -> dict[str, Any]:
    texts, thoughts, calls = [], [], []
    for i, block in enumerate(blocks):
        where = join_path(path, i)
        if block["type"] == "text":
            texts.append(get_str(block, "text", where, required=True))
        elif block["type"] == "thinking":
            thoughts.append(get_str(block, "thinking", where, required=True))
        elif block["type"] == "redacted_thinking":
            continue
        elif block["type"] == "tool_use":
            arguments = json.dumps(get_dict(block, "input", where, required=True), ensure_ascii=False)
            calls.append(tool_call(get_str(block, "id", where, required=True),
                                   get_str(block, "name", where, required=True), arguments))
        else:
            raise _not_text(block, where)
    return assistant_message(TEXT_JOIN.join(texts), calls, TEXT_JOIN.join(thoughts) if thoughts else None)


def _tools(tools: list[Any] | None, hosted: list[str]) -> list[dict[str, Any]] | None:
    """The client tools in the common form; the names of server tools (web search, code execution, Anthropic's
    schema-less bash and editor tools), which the model is not offered, appended to ``hosted``."""
    out = []
    for i, tool in enumerate(tools or []):
        path = join_path("tools", i)
        tool = as_dict(tool, path, "a tool object")
        kind = get_str(tool, "type", path, default="custom")
        if kind != "custom":
            hosted.append(get_str(tool, "name", path, default=kind) or kind)
            continue
        out.append(function_tool(get_str(tool, "name", path, required=True), get_str(tool, "description", path),
                                 get_dict(tool, "input_schema", path, required=True)))
    return out or None


def _tool_choice(choice: dict[str, Any] | None) -> tuple[str, bool]:
    """(the common ``tool_choice``, ``parallel_tool_calls``)."""
    if choice is None:
        return "auto", True
    kind = get_str(choice, "type", "tool_choice", required=True)
    parallel = not get_bool(choice, "disable_parallel_tool_use", "tool_choice", default=False)
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        return get_str(choice, "name", "tool_choice", required=True), parallel
    raise bad("tool_choice.type", f"expected 'auto', 'any', 'tool' or 'none', got {kind!r}")


# ----------------------------------------------------------------------------------------------------------------
# Response


def _content(result: TurnResult) -> list[dict[str, Any]]:
    """The content blocks: thinking (when the turn has reasoning), text (when not empty), one tool_use per call."""
    blocks: list[dict[str, Any]] = []
    if result.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": result.reasoning, "signature": ""})
    if result.content:
        blocks.append({"type": "text", "text": result.content})
    for call in result.tool_calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments)})
    return blocks


def _stop(result: TurnResult) -> dict[str, Any]:
    sequence = result.stop_sequence if result.finish_reason == "stop_sequence" else None
    return {"stop_reason": _STOP_REASON[result.finish_reason], "stop_sequence": sequence}


def _usage(result: TurnResult, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": result.prompt_tokens, "output_tokens": output_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0}


def response_body(result: TurnResult, request: TurnRequest) -> dict[str, Any]:
    """The ``message`` object of ``result``."""
    return {"id": message_id(result), "type": "message", "role": "assistant", "model": result.model,
            "content": _content(result), **_stop(result), "usage": _usage(result, result.completion_tokens)}


def stream_events(result: TurnResult, request: TurnRequest) -> Iterator[str]:
    """The Messages event stream of ``result``: ``message_start`` (no content yet), each block started, streamed in
    pieces (thinking then an empty signature, text, the tool input's JSON text) and stopped, ``message_delta`` (stop
    reason, usage), ``message_stop``."""

    def event(kind: str, **data: Any) -> str:
        return sse({"type": kind, **data}, event=kind)

    yield event("message_start", message={"id": message_id(result), "type": "message", "role": "assistant",
                                          "model": result.model, "content": [], "stop_reason": None,
                                          "stop_sequence": None, "usage": _usage(result, 0)})
    calls = iter(result.tool_calls)
    for index, block in enumerate(_content(result)):
        if block["type"] == "thinking":
            yield event("content_block_start", index=index, content_block={**block, "thinking": ""})
            for piece in pieces(block["thinking"]):
                yield event("content_block_delta", index=index, delta={"type": "thinking_delta", "thinking": piece})
            yield event("content_block_delta", index=index, delta={"type": "signature_delta", "signature": ""})
        elif block["type"] == "text":
            yield event("content_block_start", index=index, content_block={**block, "text": ""})
            for piece in pieces(block["text"]):
                yield event("content_block_delta", index=index, delta={"type": "text_delta", "text": piece})
        else:
            yield event("content_block_start", index=index, content_block={**block, "input": {}})
            for piece in pieces(next(calls).arguments):  # the JSON text as sampled
                yield event("content_block_delta", index=index,
                            delta={"type": "input_json_delta", "partial_json": piece})
        yield event("content_block_stop", index=index)
    yield event("message_delta", delta=_stop(result), usage={"input_tokens": result.prompt_tokens,
                                                               "output_tokens": result.completion_tokens})
    yield event("message_stop")


def error_type(error: ApiError) -> str:
    """Anthropic's error ``type`` for ``error``: its own type when that is one of Anthropic's (other than the default
    ``invalid_request_error``), else the type of its HTTP status."""
    if error.type in ERROR_TYPES and error.type != "invalid_request_error":
        return error.type
    if error.status in _STATUS_ERROR:
        return _STATUS_ERROR[error.status]
    return "api_error" if error.status >= 500 else "invalid_request_error"


def error_body(error: ApiError) -> dict[str, Any]:
    """Anthropic's error object."""
    return {"type": "error", "error": {"type": error_type(error), "message": error.message}}


API = ChatApi(
    name="anthropic_messages", path="/v1/messages", known_fields=KNOWN_FIELDS, parse_request=parse_request,
    response_body=response_body, stream_events=stream_events, error_body=error_body,
    count_tokens_path="/v1/messages/count_tokens", parse_count_request=parse_count_request,
    ignored_headers=("anthropic-beta",),
)
"""This API as :mod:`.server` serves it (:class:`~.api.ChatApi`)."""
