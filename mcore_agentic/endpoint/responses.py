"""OpenAI Responses (``POST /v1/responses``): request body -> :class:`~.turn.TurnRequest`, and a
:class:`~.turn.TurnResult` -> the ``response`` object or its typed event stream (those two in
:mod:`.responses_output`; this module parses requests and builds the :class:`~.api.ChatApi`).

``input`` items become common-form messages in order. An assistant turn arrives as several items: an optional
``reasoning`` item, an optional assistant ``message``, then its ``function_call`` items; they merge back into ONE
assistant message (``reasoning_content``, ``content``, ``tool_calls``): a ``reasoning`` item opens an assistant
message, an assistant ``message`` joins the one a reasoning item just opened (else opens one), and a
``function_call`` joins the assistant message directly before it (else opens one). A ``reasoning`` item followed by
no assistant item becomes an assistant message with empty content. ``function_call_output`` items are tool messages.
``instructions`` stays out of the messages (the session adds it).

**Custom (freeform) tools** (``{"type": "custom", "name", "description", "format"}``, Codex CLI's ``apply_patch``)
take a string, not JSON: the template is offered a function of one string argument ``input`` (the tool's grammar,
when it has one, in that argument's description: the model is not constrained, it learns the format), and a call
the model makes to it is returned as a ``custom_tool_call`` item with that string. ``custom_tool_call`` and
``custom_tool_call_output`` input items come back as a call with arguments ``{"input": ...}`` and a tool message.

**Reasoning round trip**: a client that keeps no server state (``store: false``, Codex CLI) asks for
``include: ["reasoning.encrypted_content"]`` and sends each reasoning item back with only its
``encrypted_content``: here that holds the reasoning text (``mcore:`` + base64), read back as the reasoning, so
the request extends the sample instead of forking it as ``thinking_dropped``.

Fields follow :mod:`.field_policy`: those read here are checked; every other field, known to the installed
``openai`` client or not (``client_metadata``, ``store``, ``include`` values other than the two above,
``prompt_cache_key``, ``reasoning``, ``text.verbosity``, ``truncation``, ``parallel_tool_calls``, ``metadata``,
``service_tier``, ``context_management``...), is accepted, ignored and named in
:attr:`~.turn.TurnRequest.ignored`. Hosted tools (web search, file search, computer use, code interpreter, MCP:
Codex CLI offers web search by default) are not offered to the model and counted (``hosted_tools``): the model
works without them. Refused, as they would change results in a way this endpoint cannot honour: ``background:
true``, a ``conversation``, a stored ``prompt`` template, a ``tool_choice`` naming a hosted tool, ``item_reference``
inputs. Structured output (a ``text.format`` other than text) is accepted and counted (``structured_output``):
sampling is not constrained, the text is the model's as sampled.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from openai.types.responses import response_create_params as _params

from mcore_agentic.endpoint.api import ChatApi
from mcore_agentic.endpoint.api_fields import (
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
    refuse_unless_null,
    tool_call,
)
from mcore_agentic.endpoint.field_policy import ignored_top_level
from mcore_agentic.endpoint.responses_output import (
    FREEFORM_ARGUMENT,
    REASONING_PASSBACK,
    RESPONSE_PREFIX,
    response_body,
    stream_events,
)
from mcore_agentic.endpoint.turn import ApiError, TurnRequest

KNOWN_FIELDS = client_fields(
    _params.ResponseCreateParamsBase, _params.ResponseCreateParamsStreaming, _params.ResponseCreateParamsNonStreaming,
) | {
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
    "temperature", "top_p", "top_logprobs", "include", "stream", "stream_options", "previous_response_id", "text",
    "background", "conversation", "prompt", "context_management", "reasoning", "store", "metadata", "truncation",
    "service_tier", "prompt_cache_key", "user", "safety_identifier", "max_tool_calls",
}
"""Top-level request fields: the client's ``TypedDict`` keys (read at import) and those handled here by name."""

HONOURED = frozenset({"model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature",
                      "top_p", "top_logprobs", "stream", "previous_response_id", "background", "conversation",
                      "prompt"})
"""The top-level fields read here (``include`` and ``text`` are read for what they honour and counted otherwise);
any other is accepted and ignored (:mod:`.field_policy`)."""

LOGPROBS_INCLUDE = "message.output_text.logprobs"
REASONING_INCLUDE = "reasoning.encrypted_content"
_MESSAGE_TEXT = ("input_text", "output_text", "text")
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


# ----------------------------------------------------------------------------------------------------------------
# Request


def parse_request(body: Any) -> TurnRequest:
    """The common form of a Responses request body; :class:`ApiError` (400, naming the field) if bad."""
    body = body_object(body)
    ignored = [k for k in ignored_top_level(body, HONOURED) if k not in ("include", "text")]
    _refuse_unsupported(body)
    include = get_list(body, "include") or []
    for i, value in enumerate(include):
        if not isinstance(value, str):
            raise expected(join_path("include", i), "a string", value)
    if set(include) - {LOGPROBS_INCLUDE, REASONING_INCLUDE}:
        ignored.append("include")
    text = get_dict(body, "text") or {}
    if text.get("verbosity") is not None:
        ignored.append("text.verbosity")
    if (text.get("format") or {}).get("type") not in (None, "text"):
        ignored.append("structured_output")
    hosted: list[str] = []
    tools, freeform = _tools(get_list(body, "tools"), hosted)
    if hosted:
        ignored.append("hosted_tools")
    return TurnRequest(
        messages=_input(body.get("input")),
        tools=tools,
        freeform_tools=freeform,
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
        reasoning_passback=REASONING_INCLUDE in include,
        ignored=tuple(ignored),
    )


def _refuse_unsupported(body: dict[str, Any]) -> None:
    if get_bool(body, "background", default=False):
        raise bad("background", "background responses are not supported; send background: false")
    refuse_unless_null(body, "conversation", "conversations are not supported; send previous_response_id or the "
                                             "whole input")
    refuse_unless_null(body, "prompt", "stored prompt templates are not supported; send instructions and input")
    text = get_dict(body, "text") or {}
    text_format = get_dict(text, "format", "text")
    if text_format is not None:
        get_str(text_format, "type", "text.format", required=True)
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
    elif kind == "custom_tool_call":
        arguments = json.dumps({FREEFORM_ARGUMENT: get_str(item, "input", path, required=True)}, ensure_ascii=False)
        out.function_call(tool_call(get_str(item, "call_id", path, required=True),
                                    get_str(item, "name", path, required=True), arguments))
    elif kind in ("function_call_output", "custom_tool_call_output"):
        output = join_text_parts(item.get("output"), join_path(path, "output"), text_types=_MESSAGE_TEXT,
                                 what="a string or a list of text parts", allow_null=False)
        out.add({"role": "tool", "tool_call_id": get_str(item, "call_id", path, required=True), "content": output})
    elif kind == "reasoning":
        content = get_list(item, "content", path)
        passback = _passed_back(get_str(item, "encrypted_content", path))
        if content:
            text = join_text_parts(content, join_path(path, "content"), text_types=("reasoning_text",))
        elif passback is not None:
            text = passback
        else:
            text = join_text_parts(get_list(item, "summary", path) or [], join_path(path, "summary"),
                                   text_types=("summary_text",))
        out.reasoning(text)
    elif kind == "item_reference":
        raise bad(join_path(path, "type"), "item references are not supported; send the items themselves or "
                                           "previous_response_id")
    else:
        raise bad(join_path(path, "type"), f"input items of type {kind!r} are not supported (message, "
                                           "function_call, function_call_output, custom_tool_call, "
                                           "custom_tool_call_output, reasoning)")


def _passed_back(encrypted: str | None) -> str | None:
    """The reasoning text this endpoint put in an ``encrypted_content`` (None for anyone else's)."""
    if encrypted is None or not encrypted.startswith(REASONING_PASSBACK):
        return None
    try:
        return base64.b64decode(encrypted[len(REASONING_PASSBACK):], validate=True).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return None


def _tools(tools: list[Any] | None, hosted: list[str]) -> tuple[list[dict[str, Any]] | None, frozenset[str]]:
    """The function and custom tools in the common form, and the names of the custom (freeform) ones among them;
    the types of hosted tools (web search, file search, computer use, a tool ``namespace`` such as Codex's sub-agent
    group...), which the model is not offered, appended to ``hosted``."""
    out, freeform = [], set()
    for i, tool in enumerate(tools or []):
        path = join_path("tools", i)
        tool = as_dict(tool, path, "a tool object")
        kind = get_str(tool, "type", path, required=True)
        if kind not in ("function", "custom"):
            hosted.append(kind)
            continue
        name = get_str(tool, "name", path, required=True)
        if kind == "function":
            get_bool(tool, "strict", path, default=False)
            out.append(function_tool(name, get_str(tool, "description", path), get_dict(tool, "parameters", path)))
        else:
            out.append(function_tool(name, get_str(tool, "description", path),
                                     _freeform_parameters(get_dict(tool, "format", path), join_path(path, "format"))))
            freeform.add(name)
    return out or None, frozenset(freeform)


def _freeform_parameters(fmt: dict[str, Any] | None, path: str) -> dict[str, Any]:
    """The JSON schema a custom tool is offered with: one string ``input``, described by its grammar if any."""
    description = "The tool's whole input, as free text."
    if fmt is not None:
        kind = get_str(fmt, "type", path, required=True)
        if kind == "grammar":
            syntax = get_str(fmt, "syntax", path, default="lark")
            definition = get_str(fmt, "definition", path, required=True)
            description = f"The tool's whole input, as free text in this {syntax} grammar:\n{definition}"
        elif kind != "text":
            raise bad(join_path(path, "type"), f"expected 'text' or 'grammar', got {kind!r}")
    return {"type": "object", "properties": {FREEFORM_ARGUMENT: {"type": "string", "description": description}},
            "required": [FREEFORM_ARGUMENT]}


def _tool_choice(value: Any) -> str:
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise bad("tool_choice", f"expected 'auto', 'none', 'required' or a function object, got {value!r}")
        return value
    choice = as_dict(value, "tool_choice", "a string or an object")
    kind = get_str(choice, "type", "tool_choice", required=True)
    if kind == "allowed_tools":  # a subset the model may call: never constrained here, so the mode is what counts
        mode = get_str(choice, "mode", "tool_choice", default="auto")
        if mode not in ("auto", "required"):
            raise bad("tool_choice.mode", f"expected 'auto' or 'required', got {mode!r}")
        return mode
    if kind not in ("function", "custom"):
        raise bad("tool_choice.type", f"{kind!r} is a hosted tool, which the endpoint does not run: choose 'auto', "
                                      "'none', 'required', a function, a custom tool or 'allowed_tools'")
    return get_str(choice, "name", "tool_choice", required=True)


# ----------------------------------------------------------------------------------------------------------------
# Response: its object and event stream are :mod:`.responses_output`'s; the error object


def error_body(error: ApiError) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}


API = ChatApi(
    name="responses", path="/v1/responses", known_fields=KNOWN_FIELDS, parse_request=parse_request,
    response_body=response_body, stream_events=stream_events, error_body=error_body,
)
"""This API as :mod:`.server` serves it (:class:`~.api.ChatApi`)."""
