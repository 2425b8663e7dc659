"""OpenAI Chat Completions (``POST /v1/chat/completions``): request body -> :class:`~.turn.TurnRequest`, and a
:class:`~.turn.TurnResult` -> the ``chat.completion`` body or its ``chat.completion.chunk`` event stream.

Fields follow :mod:`.field_policy`. Those that would change what is sampled in a way this endpoint cannot honour
are refused (``n`` other than 1, ``audio``, a modality other than text, the deprecated ``functions`` /
``function_call``, ``web_search_options``); structured output (``response_format`` json_object / json_schema) is
accepted and counted (``structured_output``): sampling is not constrained, the text is the model's as sampled; every
field not read here, known
to the installed ``openai`` client or not (``seed``, penalties, ``logit_bias``, ``metadata``, ``store``, ``user``,
``reasoning_effort``, ``stream_options`` beyond ``include_usage``, vLLM's and other servers' extensions...), is
accepted, ignored and named in :attr:`~.turn.TurnRequest.ignored`. ``top_logprobs`` is accepted, but every
``top_logprobs`` list returned is empty.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from openai.types.chat import completion_create_params as _params

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
    pieces,
    refuse_unless_null,
    sse,
    tool_call,
)
from mcore_agentic.endpoint.field_policy import ignored_top_level
from mcore_agentic.endpoint.turn import ApiError, TurnRequest, TurnResult

KNOWN_FIELDS = client_fields(
    _params.CompletionCreateParamsBase, _params.CompletionCreateParamsStreaming,
    _params.CompletionCreateParamsNonStreaming,
) | {
    "model", "messages", "tools", "tool_choice", "parallel_tool_calls", "max_tokens", "max_completion_tokens",
    "temperature", "top_p", "stop", "logprobs", "top_logprobs", "stream", "stream_options", "n", "response_format",
    "audio", "modalities", "functions", "function_call", "web_search_options", "metadata", "store", "user", "seed",
    "service_tier", "prompt_cache_key", "reasoning_effort", "frequency_penalty", "presence_penalty", "logit_bias",
    "safety_identifier", "verbosity", "prediction",
}
"""Top-level request fields: the client's ``TypedDict`` keys (read at import, so a newer client's are known) and
the ones this module reads or ignores by name."""

HONOURED = frozenset({"model", "messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens",
                      "temperature", "top_p", "stop", "logprobs", "top_logprobs", "stream", "stream_options", "n",
                      "response_format", "audio", "modalities", "functions", "function_call", "web_search_options"})
"""The fields read here (``stream_options`` for ``include_usage``; any other option in it is counted); any other
field is accepted and ignored (:mod:`.field_policy`)."""

MAX_STOP = 4
_TEXT = ("text",)
_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "stop_sequence": "stop"}


def completion_id(result: TurnResult) -> str:
    return f"chatcmpl-{result.id}"


# ----------------------------------------------------------------------------------------------------------------
# Request


def parse_request(body: Any) -> TurnRequest:
    """The common form of a Chat Completions request body; :class:`ApiError` (400, naming the field) if bad."""
    body = body_object(body)
    ignored = ignored_top_level(body, HONOURED)
    _refuse_unsupported(body)
    messages = get_list(body, "messages", required=True)
    if not messages:
        raise bad("messages", "must not be empty")
    max_tokens = get_int(body, "max_completion_tokens", minimum=1)
    legacy_max = get_int(body, "max_tokens", minimum=1)
    stream_options = get_dict(body, "stream_options") or {}
    response_format = get_dict(body, "response_format")
    if response_format is not None and get_str(response_format, "type", "response_format", required=True) != "text":
        ignored.append("structured_output")
    if set(stream_options) - {"include_usage"}:
        ignored.append("stream_options")
    return TurnRequest(
        messages=[_message(m, join_path("messages", i)) for i, m in enumerate(messages)],
        tools=_tools(get_list(body, "tools")),
        tool_choice=_tool_choice(body.get("tool_choice")),
        parallel_tool_calls=get_bool(body, "parallel_tool_calls", default=True),
        max_tokens=max_tokens if max_tokens is not None else legacy_max,
        temperature=get_number(body, "temperature", low=0.0, high=2.0),
        top_p=get_number(body, "top_p", low=0.0, high=1.0, low_open=True),
        stop=_stop(body.get("stop")),
        logprobs=get_bool(body, "logprobs", default=False),
        top_logprobs=get_int(body, "top_logprobs", minimum=0, maximum=20) or 0,
        stream=get_bool(body, "stream", default=False),
        include_usage=get_bool(stream_options, "include_usage", "stream_options", default=False),
        model=get_str(body, "model", default=""),
        ignored=tuple(ignored),
    )


def _refuse_unsupported(body: dict[str, Any]) -> None:
    n = get_int(body, "n")
    if n is not None and n != 1:
        raise bad("n", f"only n=1 is supported, got {n} (send n requests instead)")
    refuse_unless_null(body, "audio", "audio output is not supported")
    modalities = get_list(body, "modalities") or []
    for i, modality in enumerate(modalities):
        if modality != "text":
            raise bad(join_path("modalities", i), f"only the 'text' modality is supported, got {modality!r}")
    refuse_unless_null(body, "functions", "the deprecated 'functions' is not supported; send 'tools'")
    refuse_unless_null(body, "function_call", "the deprecated 'function_call' is not supported; send 'tool_choice'")
    refuse_unless_null(body, "web_search_options", "web search is not supported")


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise expected("stop", "a string or an array of strings", value)
    if len(value) > MAX_STOP:
        raise bad("stop", f"at most {MAX_STOP} stop strings, got {len(value)}")
    for i, s in enumerate(value):
        if not isinstance(s, str):
            raise expected(join_path("stop", i), "a string", s)
        if not s:
            raise bad(join_path("stop", i), "a stop string must not be empty")
    return tuple(value)


def _message(message: Any, path: str) -> dict[str, Any]:
    message = as_dict(message, path, "a message object")
    role = get_str(message, "role", path, required=True)
    content_path = join_path(path, "content")
    if role in ("system", "developer", "user"):
        content = join_text_parts(message.get("content"), content_path, text_types=_TEXT)
        return {"role": "user" if role == "user" else "system", "content": content}
    if role == "assistant":
        content = join_text_parts(message.get("content"), content_path, text_types=_TEXT, drop_types=("refusal",))
        reasoning = get_str(message, "reasoning_content", path)
        if reasoning is None:
            reasoning = get_str(message, "reasoning", path)
        calls = get_list(message, "tool_calls", path) or []
        tool_calls = [_tool_call(c, join_path(join_path(path, "tool_calls"), i)) for i, c in enumerate(calls)]
        return assistant_message(content, tool_calls, reasoning)
    if role == "tool":
        return {"role": "tool", "tool_call_id": get_str(message, "tool_call_id", path, required=True),
                "content": join_text_parts(message.get("content"), content_path, text_types=_TEXT)}
    if role == "function":
        raise bad(join_path(path, "role"), "the deprecated 'function' role is not supported; send 'tool' messages")
    raise bad(join_path(path, "role"), f"unknown role {role!r} (system, developer, user, assistant or tool)")


def _tool_call(call: Any, path: str) -> dict[str, Any]:
    call = as_dict(call, path, "a tool call object")
    kind = get_str(call, "type", path, default="function")
    if kind != "function":
        raise bad(join_path(path, "type"), f"only 'function' tool calls are supported, got {kind!r}")
    function = get_dict(call, "function", path, required=True)
    where = join_path(path, "function")
    return tool_call(get_str(call, "id", path, required=True), get_str(function, "name", where, required=True),
                     get_str(function, "arguments", where, required=True))


def _tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    out = []
    for i, tool in enumerate(tools or []):
        path = join_path("tools", i)
        tool = as_dict(tool, path, "a tool object")
        kind = get_str(tool, "type", path, required=True)
        if kind != "function":
            raise bad(join_path(path, "type"), f"only 'function' tools are supported, got {kind!r}")
        function = get_dict(tool, "function", path, required=True)
        where = join_path(path, "function")
        get_bool(function, "strict", where, default=False)
        out.append(function_tool(get_str(function, "name", where, required=True),
                                 get_str(function, "description", where), get_dict(function, "parameters", where)))
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
    function = get_dict(choice, "function", "tool_choice", required=True)
    return get_str(function, "name", "tool_choice.function", required=True)


# ----------------------------------------------------------------------------------------------------------------
# Response


def _logprobs(result: TurnResult) -> list[dict[str, Any]]:
    return [{"token": lp.token, "logprob": lp.logprob, "bytes": lp.bytes, "top_logprobs": []}
            for lp in result.logprobs or []]


def _usage(result: TurnResult) -> dict[str, int]:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens}


def response_body(result: TurnResult, request: TurnRequest) -> dict[str, Any]:
    """The ``chat.completion`` object of ``result``."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": None if not result.content and result.tool_calls else result.content,
        "refusal": None,
    }
    if result.tool_calls:
        message["tool_calls"] = [tool_call(c.id, c.name, c.arguments) for c in result.tool_calls]
    if result.reasoning is not None:
        message["reasoning_content"] = result.reasoning
    return {
        "id": completion_id(result),
        "object": "chat.completion",
        "created": result.created,
        "model": result.model,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": {"content": _logprobs(result), "refusal": None} if request.logprobs else None,
            "finish_reason": _FINISH[result.finish_reason],
        }],
        "usage": _usage(result),
    }


def stream_events(result: TurnResult, request: TurnRequest) -> Iterator[str]:
    """The ``chat.completion.chunk`` frames of ``result``, then ``data: [DONE]``: the role, the reasoning and the
    content in pieces, each tool call (id and name first, then its arguments in pieces), the finish reason (with the
    log-probs of every sampled token when asked for), and the usage when ``stream_options.include_usage``."""
    head = {"id": completion_id(result), "object": "chat.completion.chunk", "created": result.created,
            "model": result.model}
    if request.include_usage:
        head["usage"] = None

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse({**head, "choices": [choice]})

    first: dict[str, Any] = {"role": "assistant", "content": ""}
    if result.reasoning is not None:
        first["reasoning_content"] = ""  # so an empty thinking block still arrives as "", not as none at all
    yield chunk(first)
    for piece in pieces(result.reasoning or ""):
        yield chunk({"reasoning_content": piece})
    for piece in pieces(result.content):
        yield chunk({"content": piece})
    for index, call in enumerate(result.tool_calls):
        yield chunk({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                     "function": {"name": call.name, "arguments": ""}}]})
        for piece in pieces(call.arguments):
            yield chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
    logprobs = {"content": _logprobs(result), "refusal": None} if request.logprobs else None
    yield chunk({}, _FINISH[result.finish_reason], logprobs)
    if request.include_usage:
        yield sse({**head, "choices": [], "usage": _usage(result)})
    yield "data: [DONE]\n\n"


def error_body(error: ApiError) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}


API = ChatApi(
    name="openai_chat", path="/v1/chat/completions", known_fields=KNOWN_FIELDS, parse_request=parse_request,
    response_body=response_body, stream_events=stream_events, error_body=error_body,
)
"""This API as :mod:`.server` serves it (:class:`~.api.ChatApi`)."""
