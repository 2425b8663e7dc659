"""OpenAI Responses (``POST /v1/responses``): request body -> :class:`~.turn.TurnRequest`, and a
:class:`~.turn.TurnResult` -> the ``response`` object or its typed event stream.

``input`` items become common-form messages in order. An assistant turn arrives as several items: an optional
``reasoning`` item, an optional assistant ``message``, then its ``function_call`` items; they merge back into ONE
assistant message (``reasoning_content``, ``content``, ``tool_calls``): a ``reasoning`` item opens an assistant
message, an assistant ``message`` joins the one a reasoning item just opened (else opens one), and a
``function_call`` joins the assistant message directly before it (else opens one). A ``reasoning`` item followed by
no assistant item becomes an assistant message with empty content. ``function_call_output`` items are tool messages.
``instructions`` stays out of the messages (the session adds it).

The known request fields are the installed ``openai`` client's. Refused, as they would change results in a way
this endpoint cannot honour: ``background: true``, a ``conversation``, a stored ``prompt`` template,
``context_management``, a ``text.format`` other than text, any tool or ``tool_choice`` that is not a function,
``item_reference`` inputs. Accepted and ignored: ``reasoning``, ``store``, ``metadata``, ``truncation`` (the session
never truncates; an input that does not fit is an error either way), ``service_tier``, ``prompt_cache_key``,
``max_tool_calls`` (it bounds built-in tools only), ``include`` values other than
``message.output_text.logprobs`` (which turns log-probs on), and the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from openai.types.responses import response_create_params as _params

from mcore_agentic.endpoint.api_fields import (
    as_dict,
    assistant_message,
    bad,
    body_object,
    check_known,
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
from mcore_agentic.endpoint.turn import ApiError, TurnRequest, TurnResult

KNOWN_FIELDS = client_fields(
    _params.ResponseCreateParamsBase, _params.ResponseCreateParamsStreaming, _params.ResponseCreateParamsNonStreaming,
) | {
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
    "temperature", "top_p", "top_logprobs", "include", "stream", "stream_options", "previous_response_id", "text",
    "background", "conversation", "prompt", "context_management", "reasoning", "store", "metadata", "truncation",
    "service_tier", "prompt_cache_key", "user", "safety_identifier", "max_tool_calls",
}
"""Top-level request fields: the client's ``TypedDict`` keys (read at import) and those handled here by name."""

RESPONSE_PREFIX = "resp_"
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_MESSAGE_TEXT = ("input_text", "output_text", "text")
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def response_id(result: TurnResult) -> str:
    return f"{RESPONSE_PREFIX}{result.id}"


# ----------------------------------------------------------------------------------------------------------------
# Request


def parse_request(body: Any) -> TurnRequest:
    """The common form of a Responses request body; :class:`ApiError` (400, naming the field) if bad."""
    body = body_object(body)
    check_known(body, KNOWN_FIELDS)
    _refuse_unsupported(body)
    include = get_list(body, "include") or []
    for i, value in enumerate(include):
        if not isinstance(value, str):
            raise expected(join_path("include", i), "a string", value)
    return TurnRequest(
        messages=_input(body.get("input")),
        tools=_tools(get_list(body, "tools")),
        tool_choice=_tool_choice(body.get("tool_choice")),
        parallel_tool_calls=get_bool(body, "parallel_tool_calls", default=True),
        max_tokens=get_int(body, "max_output_tokens", minimum=1),
        temperature=get_number(body, "temperature", low=0.0, high=2.0),
        top_p=get_number(body, "top_p", low=0.0, high=1.0, low_open=True),
        logprobs=LOGPROBS_INCLUDE in include,
        top_logprobs=get_int(body, "top_logprobs", minimum=0, maximum=20) or 0,
        stream=get_bool(body, "stream", default=False),
        model=get_str(body, "model", default=""),
        instructions=get_str(body, "instructions"),
        previous_response_id=_previous_response_id(get_str(body, "previous_response_id")),
    )


def _refuse_unsupported(body: dict[str, Any]) -> None:
    if get_bool(body, "background", default=False):
        raise bad("background", "background responses are not supported; send background: false")
    refuse_unless_null(body, "conversation", "conversations are not supported; send previous_response_id or the "
                                             "whole input")
    refuse_unless_null(body, "prompt", "stored prompt templates are not supported; send instructions and input")
    if body.get("context_management"):
        raise bad("context_management", "server-side context management is not supported")
    text = get_dict(body, "text") or {}
    text_format = get_dict(text, "format", "text")
    if text_format is not None:
        kind = get_str(text_format, "type", "text.format", required=True)
        if kind != "text":
            raise bad("text.format.type", f"'{kind}' is not supported: sampling is not constrained here; ask for "
                                          "JSON in the prompt and parse the text")
    truncation = get_str(body, "truncation")
    if truncation not in (None, "auto", "disabled"):
        raise bad("truncation", f"expected 'auto' or 'disabled', got {truncation!r}")


def _previous_response_id(value: str | None) -> str | None:
    if value is None:
        return None
    if not value.startswith(RESPONSE_PREFIX) or len(value) == len(RESPONSE_PREFIX):
        raise bad("previous_response_id", f"expected an id this endpoint returned ('{RESPONSE_PREFIX}...'), "
                                          f"got {value!r}")
    return value[len(RESPONSE_PREFIX):]


class _Messages:
    """The common-form messages of an ``input`` list, built item by item (merging rules: module docstring)."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        """The assistant message a following ``function_call`` joins (the previous item made or joined it)."""
        self.opened_by_reasoning = False
        """``open`` holds only a reasoning item's text so far: an assistant ``message`` joins it."""

    def add(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        self.open, self.opened_by_reasoning = None, False

    def reasoning(self, text: str) -> None:
        self.add(assistant_message("", [], text))
        self.open, self.opened_by_reasoning = self.messages[-1], True

    def assistant(self, content: str) -> None:
        if self.open is not None and self.opened_by_reasoning:
            self.open["content"] = content
        else:
            self.add(assistant_message(content, [], None))
            self.open = self.messages[-1]
        self.opened_by_reasoning = False

    def function_call(self, call: dict[str, Any]) -> None:
        if self.open is None:
            self.add(assistant_message("", [], None))
            self.open = self.messages[-1]
        self.open.setdefault("tool_calls", []).append(call)
        self.opened_by_reasoning = False


def _input(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        if not value:
            raise bad("input", "must not be empty")
        return [{"role": "user", "content": value}]
    if value is None:
        raise bad("input", "is required")
    if not isinstance(value, list):
        raise expected("input", "a string or an array of input items", value)
    if not value:
        raise bad("input", "must not be empty")
    out = _Messages()
    for i, item in enumerate(value):
        _item(out, item, join_path("input", i))
    return out.messages


def _item(out: _Messages, item: Any, path: str) -> None:
    item = as_dict(item, path, "an input item object")
    kind = get_str(item, "type", path, default="message")
    if kind == "message":
        role = get_str(item, "role", path, required=True)
        if role not in _ROLES:
            raise bad(join_path(path, "role"), f"unknown role {role!r} (user, system, developer or assistant)")
        content = join_text_parts(item.get("content"), join_path(path, "content"), text_types=_MESSAGE_TEXT,
                                  drop_types=("refusal",), allow_null=False)
        if role == "assistant":
            out.assistant(content)
        else:
            out.add({"role": _ROLES[role], "content": content})
    elif kind == "function_call":
        out.function_call(tool_call(get_str(item, "call_id", path, required=True),
                                    get_str(item, "name", path, required=True),
                                    get_str(item, "arguments", path, required=True)))
    elif kind == "function_call_output":
        output = join_text_parts(item.get("output"), join_path(path, "output"), text_types=_MESSAGE_TEXT,
                                 what="a string or a list of text parts", allow_null=False)
        out.add({"role": "tool", "tool_call_id": get_str(item, "call_id", path, required=True), "content": output})
    elif kind == "reasoning":
        content = get_list(item, "content", path)
        if content:
            text = join_text_parts(content, join_path(path, "content"), text_types=("reasoning_text",))
        else:
            text = join_text_parts(get_list(item, "summary", path) or [], join_path(path, "summary"),
                                   text_types=("summary_text",))
        out.reasoning(text)
    elif kind == "item_reference":
        raise bad(join_path(path, "type"), "item references are not supported; send the items themselves or "
                                           "previous_response_id")
    else:
        raise bad(join_path(path, "type"), f"input items of type {kind!r} are not supported (message, "
                                           "function_call, function_call_output, reasoning)")


def _tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    out = []
    for i, tool in enumerate(tools or []):
        path = join_path("tools", i)
        tool = as_dict(tool, path, "a tool object")
        kind = get_str(tool, "type", path, required=True)
        if kind != "function":
            raise bad(join_path(path, "type"), f"only 'function' tools are supported, got {kind!r}")
        get_bool(tool, "strict", path, default=False)
        out.append(function_tool(get_str(tool, "name", path, required=True), get_str(tool, "description", path),
                                 get_dict(tool, "parameters", path)))
    return out or None


def _tool_choice(value: Any) -> str:
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise bad("tool_choice", f"expected 'auto', 'none', 'required' or a function object, got {value!r}")
        return value
    choice = as_dict(value, "tool_choice", "a string or an object")
    kind = get_str(choice, "type", "tool_choice", required=True)
    if kind != "function":
        raise bad("tool_choice.type", f"only 'function' is supported, got {kind!r}")
    return get_str(choice, "name", "tool_choice", required=True)


# ----------------------------------------------------------------------------------------------------------------
# Response


def _item_ids(result: TurnResult) -> tuple[str, str, list[str]]:
    """The ids of the reasoning item, the message item and each function_call item."""
    return f"rs_{result.id}", f"msg_{result.id}", [f"fc_{result.id}_{i}" for i in range(len(result.tool_calls))]


def _logprobs(result: TurnResult, *, with_bytes: bool) -> list[dict[str, Any]]:
    out = []
    for lp in result.logprobs or []:
        entry: dict[str, Any] = {"token": lp.token, "logprob": lp.logprob, "top_logprobs": []}
        if with_bytes:
            entry["bytes"] = lp.bytes
        out.append(entry)
    return out


def _text_part(result: TurnResult, request: TurnRequest, text: str) -> dict[str, Any]:
    logprobs = _logprobs(result, with_bytes=True) if request.logprobs else []
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _output(result: TurnResult, request: TurnRequest) -> list[dict[str, Any]]:
    """The output items: reasoning (when the turn has any), the message (when its text is not empty), the calls."""
    reasoning_id, message_id, call_ids = _item_ids(result)
    items: list[dict[str, Any]] = []
    if result.reasoning is not None:
        items.append({"id": reasoning_id, "type": "reasoning", "summary": [],
                      "content": [{"type": "reasoning_text", "text": result.reasoning}], "status": "completed"})
    if result.content:
        items.append({"id": message_id, "type": "message", "role": "assistant",
                      "status": "incomplete" if result.finish_reason == "length" else "completed",
                      "content": [_text_part(result, request, result.content)]})
    for call, call_id in zip(result.tool_calls, call_ids):
        items.append({"id": call_id, "type": "function_call", "call_id": call.id, "name": call.name,
                      "arguments": call.arguments, "status": "completed"})
    return items


def _usage(result: TurnResult) -> dict[str, Any]:
    return {"input_tokens": result.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": result.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.prompt_tokens + result.completion_tokens}


def _tool_choice_out(choice: str) -> str | dict[str, str]:
    return choice if choice in ("auto", "none", "required") else {"type": "function", "name": choice}


def _tools_out(request: TurnRequest) -> list[dict[str, Any]]:
    return [{"type": "function", "name": t["function"]["name"], "description": t["function"].get("description"),
             "parameters": t["function"].get("parameters"), "strict": None} for t in request.tools or []]


def _response(result: TurnResult, request: TurnRequest, *, final: bool) -> dict[str, Any]:
    """The ``response`` object: finished (``final``), or as it stands before any output (stream's first events)."""
    incomplete = final and result.finish_reason == "length"
    previous = request.previous_response_id
    return {
        "id": response_id(result),
        "object": "response",
        "created_at": result.created,
        "status": ("incomplete" if incomplete else "completed") if final else "in_progress",
        "completed_at": result.created if final and not incomplete else None,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_tokens,
        "metadata": {},
        "model": result.model,
        "output": _output(result, request) if final else [],
        "parallel_tool_calls": request.parallel_tool_calls,
        "previous_response_id": f"{RESPONSE_PREFIX}{previous}" if previous is not None else None,
        "reasoning": {"effort": None, "summary": None},
        "temperature": request.temperature,
        "text": {"format": {"type": "text"}},
        "tool_choice": _tool_choice_out(request.tool_choice),
        "tools": _tools_out(request),
        "top_logprobs": request.top_logprobs,
        "top_p": request.top_p,
        "truncation": "disabled",
        "usage": _usage(result) if final else None,
    }


def response_body(result: TurnResult, request: TurnRequest) -> dict[str, Any]:
    """The ``response`` object of ``result``: ``completed``, or ``incomplete`` (``max_output_tokens``) on length."""
    return _response(result, request, final=True)


def stream_events(result: TurnResult, request: TurnRequest) -> Iterator[str]:
    """The Responses event stream of ``result`` (``event: <type>`` frames numbered by ``sequence_number``):
    ``response.created``, ``response.in_progress``, each output item added, its content streamed in pieces and
    done, then ``response.completed`` (``response.incomplete`` on length). The log-probs of every sampled token, when
    asked for, ride on the first text delta and on the done events."""
    sequence = 0

    def event(kind: str, **data: Any) -> str:
        nonlocal sequence
        frame = sse({"type": kind, "sequence_number": sequence, **data}, event=kind)
        sequence += 1
        return frame

    yield event("response.created", response=_response(result, request, final=False))
    yield event("response.in_progress", response=_response(result, request, final=False))
    for index, item in enumerate(_output(result, request)):
        yield event("response.output_item.added", output_index=index, item=_started(item))
        if item["type"] == "reasoning":
            yield from _part_events(event, index, item, [])
        elif item["type"] == "message":
            logprobs = _logprobs(result, with_bytes=False) if request.logprobs else []
            yield from _part_events(event, index, item, logprobs)
        else:
            for piece in pieces(item["arguments"]):
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=piece)
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        name=item["name"], arguments=item["arguments"])
        yield event("response.output_item.done", output_index=index, item=item)
    final = _response(result, request, final=True)
    yield event("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)


def _started(item: dict[str, Any]) -> dict[str, Any]:
    """``item`` as ``response.output_item.added`` shows it: in progress, no content or arguments yet."""
    started = {**item, "status": "in_progress"}
    if item["type"] == "function_call":
        started["arguments"] = ""
    else:
        started["content"] = []
    return started


def _part_events(event: Callable[..., str], index: int, item: dict[str, Any],
                 logprobs: list[dict[str, Any]]) -> Iterator[str]:
    """The events of an item's one content part (``output_text`` or ``reasoning_text``): added, text deltas, text
    done, part done. Only ``output_text`` events carry ``logprobs``: all of them on the first delta and on done."""
    where = {"item_id": item["id"], "output_index": index, "content_index": 0}
    part = item["content"][0]
    part_type, text = part["type"], part["text"]
    is_output = part_type == "output_text"
    empty = {**part, "text": ""}
    if is_output:
        empty["logprobs"] = []
    yield event("response.content_part.added", **where, part=empty)
    for n, piece in enumerate(pieces(text)):
        extra = {"logprobs": logprobs if n == 0 else []} if is_output else {}
        yield event(f"response.{part_type}.delta", **where, delta=piece, **extra)
    yield event(f"response.{part_type}.done", **where, text=text, **({"logprobs": logprobs} if is_output else {}))
    yield event("response.content_part.done", **where, part=part)


def error_body(error: ApiError) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}
