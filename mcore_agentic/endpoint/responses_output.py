"""OpenAI Responses output: a :class:`~.turn.TurnResult` as the ``response`` object (:func:`response_body`) or its
typed event stream (:func:`stream_events`); with the ids and encodings a later request sends back, which
:mod:`.responses` (the API: request parsing) reads.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from typing import Any

from mcore_agentic.endpoint.api_fields import pieces, sse
from mcore_agentic.endpoint.turn import TurnRequest, TurnResult

RESPONSE_PREFIX = "resp_"
REASONING_PASSBACK = "mcore:"
"""The prefix of the ``encrypted_content`` this endpoint returns: the reasoning text, base64-encoded."""
FREEFORM_ARGUMENT = "input"
"""The one string argument a custom (freeform) tool is offered with."""


def response_id(result: TurnResult) -> str:
    return f"{RESPONSE_PREFIX}{result.id}"


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
        item = {"id": reasoning_id, "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": result.reasoning}], "status": "completed"}
        if request.reasoning_passback:
            item["encrypted_content"] = REASONING_PASSBACK + base64.b64encode(result.reasoning.encode()).decode()
        items.append(item)
    if result.content:
        items.append({"id": message_id, "type": "message", "role": "assistant",
                      "status": "incomplete" if result.finish_reason == "length" else "completed",
                      "content": [_text_part(result, request, result.content)]})
    for call, call_id in zip(result.tool_calls, call_ids):
        if call.name in request.freeform_tools:
            items.append({"id": f"c{call_id}", "type": "custom_tool_call", "call_id": call.id, "name": call.name,
                          "input": _freeform_input(call.arguments), "status": "completed"})
        else:
            items.append({"id": call_id, "type": "function_call", "call_id": call.id, "name": call.name,
                          "arguments": call.arguments, "status": "completed"})
    return items


def _freeform_input(arguments: str) -> str:
    """A custom tool call's string: its ``input`` argument (the parser checked the call against the one-string
    schema, so it is there)."""
    value = json.loads(arguments)
    return value[FREEFORM_ARGUMENT] if isinstance(value, dict) and isinstance(value.get(FREEFORM_ARGUMENT), str) \
        else arguments


def _usage(result: TurnResult) -> dict[str, Any]:
    return {"input_tokens": result.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": result.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.prompt_tokens + result.completion_tokens}


def _tool_choice_out(choice: str) -> str | dict[str, str]:
    return choice if choice in ("auto", "none", "required") else {"type": "function", "name": choice}


def _tools_out(request: TurnRequest) -> list[dict[str, Any]]:
    out = []
    for t in request.tools or []:
        f = t["function"]
        if f["name"] in request.freeform_tools:
            out.append({"type": "custom", "name": f["name"], "description": f.get("description")})
        else:
            out.append({"type": "function", "name": f["name"], "description": f.get("description"),
                        "parameters": f.get("parameters"), "strict": None})
    return out


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
        elif item["type"] == "custom_tool_call":
            for piece in pieces(item["input"]):
                yield event("response.custom_tool_call_input.delta", item_id=item["id"], output_index=index,
                            delta=piece)
            yield event("response.custom_tool_call_input.done", item_id=item["id"], output_index=index,
                        input=item["input"])
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
    elif item["type"] == "custom_tool_call":
        started["input"] = ""
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
