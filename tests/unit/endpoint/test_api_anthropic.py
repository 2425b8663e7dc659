"""Anthropic Messages translation: request bodies -> the common form (system, tool_result and thinking blocks
included), every refusal naming its field, and results -> messages and event streams the real ``anthropic``
client's models and its own stream accumulator accept."""

from __future__ import annotations

import json

import anthropic
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from anthropic.types.message_create_params import MessageCreateParamsBase
from pydantic import TypeAdapter

from mcore_agentic.endpoint import anthropic_messages as api
from mcore_agentic.endpoint.turn import ApiError, ToolCallOut, TurnRequest, TurnResult

try:  # anthropic 2.x is built on httpx2 and refuses httpx objects; earlier clients on httpx
    import httpx2 as httpx
except ImportError:
    import httpx

EVENT = TypeAdapter(RawMessageStreamEvent)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _body(**fields):
    return {"model": "claude", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}], **fields}


def _call(call_id, arguments, name="weather"):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# ----------------------------------------------------------------------------------------------------------------
# Requests


def test_parse_conversation_to_the_common_form():
    body = {
        "model": "claude", "max_tokens": 256,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "Use tools."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in"}, {"type": "text", "text": "Paris?"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Need the tool.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "xyz"},
                {"type": "text", "text": "Checking.", "citations": None},
                {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Zürich"}},
                {"type": "tool_use", "id": "toolu_2", "name": "weather", "input": {}},
            ]},
            {"role": "user", "content": [
                {"type": "text", "text": "here you go"},
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny", "cache_control": None},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "no"}, {"type": "text", "text": "city"}]},
            ]},
            {"role": "assistant", "content": "Sunny."},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_3"}]},
            {"role": "user", "content": []},
        ],
        "tools": [{"name": "weather", "description": "Forecast", "input_schema": WEATHER,
                   "cache_control": {"type": "ephemeral"}},
                  {"type": "custom", "name": "time", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stop_sequences": ["###"], "temperature": 0.5, "top_p": 0.9, "stream": True,
        # accepted and ignored
        "top_k": 40, "thinking": {"type": "enabled", "budget_tokens": 1024}, "metadata": {"user_id": "u"},
        "service_tier": "auto", "output_config": {"effort": "low"},
    }
    assert api.parse_request(body) == TurnRequest(
        messages=[
            {"role": "system", "content": "Be brief.\nUse tools."},
            {"role": "user", "content": "Weather in\nParis?"},
            {"role": "assistant", "content": "Checking.", "reasoning_content": "Need the tool.",
             "tool_calls": [_call("toolu_1", '{"city": "Zürich"}'), _call("toolu_2", "{}")]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "no\ncity"},
            {"role": "user", "content": "here you go"},
            {"role": "assistant", "content": "Sunny."},
            {"role": "tool", "tool_call_id": "toolu_3", "content": ""},
            {"role": "user", "content": ""},
        ],
        tools=[{"type": "function", "function": {"name": "weather", "description": "Forecast",
                                                 "parameters": WEATHER}},
               {"type": "function", "function": {"name": "time", "parameters": {"type": "object"}}}],
        tool_choice="required", parallel_tool_calls=False, max_tokens=256, temperature=0.5, top_p=0.9,
        stop=("###",), stream=True, model="claude",
        ignored=("top_k", "thinking", "metadata", "service_tier", "output_config", "cache_control",
                 "tool_result.is_error"),
    )


@pytest.mark.parametrize(("choice", "want"), [
    ({"type": "auto"}, ("auto", True)),
    ({"type": "none"}, ("none", True)),
    ({"type": "tool", "name": "weather"}, ("weather", True)),
    ({"type": "auto", "disable_parallel_tool_use": True}, ("auto", False)),
])
def test_tool_choice(choice, want):
    request = api.parse_request(_body(tool_choice=choice))
    assert (request.tool_choice, request.parallel_tool_calls) == want


def test_string_system_and_no_system():
    assert api.parse_request(_body(system="S")).messages[0] == {"role": "system", "content": "S"}
    assert api.parse_request(_body(system="")).messages == [{"role": "user", "content": "hi"}]


def test_every_client_field_is_known():
    fields = MessageCreateParamsBase.__required_keys__ | MessageCreateParamsBase.__optional_keys__
    assert fields <= api.KNOWN_FIELDS
    assert "stream" in api.KNOWN_FIELDS


def _msgs(*messages):
    return {"model": "claude", "max_tokens": 10, "messages": list(messages)}


_IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}


@pytest.mark.parametrize(("body", "param", "words"), [
    (None, None, "JSON object"),
    ({"model": "c", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens", "required"),
    (_body(max_tokens=0), "max_tokens", ">= 1"),
    (_body(max_tokens="5"), "max_tokens", "integer"),
    (_body(messages=[]), "messages", "empty"),
    (_msgs({"content": "x"}), "messages[0].role", "required"),
    (_msgs({"role": "user"}), "messages[0].content", "required"),
    (_msgs({"role": "user", "content": 3}), "messages[0].content",
     "expected a string or a list of content blocks, got integer"),
    (_msgs({"role": "user", "content": [_IMAGE]}), "messages[0].content[0]", "only text content is supported"),
    (_msgs({"role": "user", "content": [{"type": "document", "source": {}}]}), "messages[0].content[0]",
     "only text"),
    (_msgs({"role": "user", "content": [{"text": "x"}]}), "messages[0].content[0].type", "required"),
    (_msgs({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [_IMAGE]}]}),
     "messages[0].content[0].content[0]", "only text"),
    (_msgs({"role": "user", "content": [{"type": "tool_result", "content": "x"}]}),
     "messages[0].content[0].tool_use_id", "required"),
    (_msgs({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}]}),
     "messages[0].content[0].is_error", "boolean"),
    (_msgs({"role": "user", "content": "x"},
           {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}),
     "messages[1].content[0].input", "expected an object, got string"),
    (_msgs({"role": "user", "content": "x"},
           {"role": "assistant", "content": [{"type": "server_tool_use", "id": "t", "name": "web_search",
                                              "input": {}}]}),
     "messages[1].content[0]", "server_tool_use"),
    (_msgs({"role": "user", "content": "x"}, {"role": "assistant", "content": [{"type": "thinking"}]}),
     "messages[1].content[0].thinking", "required"),
    (_body(system=[_IMAGE]), "system[0]", "only text"),
    (_body(system=5), "system", "a string or a list of text blocks"),
    (_body(tools=[{"name": "f"}]), "tools[0].input_schema", "required"),
    (_body(tools=[{"input_schema": {}}]), "tools[0].name", "required"),
    (_body(tools=[{"type": "web_search_20250305", "name": "web_search"}],
           tool_choice={"type": "tool", "name": "web_search"}), "tool_choice.name", "server tool"),
    (_msgs({"role": "system", "content": 5}), "messages[0].content", "expected"),
    (_body(tool_choice={"type": "bogus"}), "tool_choice.type", "auto"),
    (_body(tool_choice="auto"), "tool_choice", "object"),
    (_body(tool_choice={"type": "tool"}), "tool_choice.name", "required"),
    (_body(temperature=1.5), "temperature", "[0, 1]"),
    (_body(top_p=0), "top_p", "(0, 1]"),
    (_body(top_k=-1), "top_k", ">= 0"),
    (_body(stop_sequences="###"), "stop_sequences", "array"),
    (_body(stop_sequences=[1]), "stop_sequences[0]", "string"),
    (_body(thinking="on"), "thinking", "object"),
    (_body(model=1), "model", "string"),
])
def test_refusals_name_the_field(body, param, words):
    with pytest.raises(ApiError) as err:
        api.parse_request(body)
    assert err.value.status == 400
    assert err.value.param == param
    assert words in err.value.message


# ----------------------------------------------------------------------------------------------------------------
# Responses

CALLS = [ToolCallOut("toolu_a", "weather", '{"city": "Zürich", "days": [1, 2, 3], "units": {"t": "C"}}'),
         ToolCallOut("toolu_b", "time", "{}")]
RESULTS = {
    "text": TurnResult(content="Hello there, this is a longer answer.\nSecond line: é 漢字 🙂", reasoning=None,
                       tool_calls=[], finish_reason="stop", prompt_tokens=10, completion_tokens=12, model="claude"),
    "think_text_calls": TurnResult(content="Let me check.", reasoning="The user wants weather; call both tools.",
                                   tool_calls=CALLS, finish_reason="tool_calls", prompt_tokens=20,
                                   completion_tokens=40, model="claude"),
    "calls_only": TurnResult(content="", reasoning="", tool_calls=CALLS[:1], finish_reason="tool_calls",
                             prompt_tokens=5, completion_tokens=9, model="claude"),
    "length": TurnResult(content="Truncated answ", reasoning=None, tool_calls=[], finish_reason="length",
                         prompt_tokens=5, completion_tokens=4, model="claude"),
    "stop_sequence": TurnResult(content="Up to", reasoning=None, tool_calls=[], finish_reason="stop_sequence",
                                prompt_tokens=5, completion_tokens=2, model="claude", stop_sequence="###"),
    "empty": TurnResult(content="", reasoning=None, tool_calls=[], finish_reason="stop", prompt_tokens=5,
                        completion_tokens=1, model="claude"),
}
REQUEST = TurnRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=100)
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "stop_sequence": "stop_sequence"}


@pytest.mark.parametrize("name", RESULTS)
def test_response_body_is_a_client_message(name):
    result = RESULTS[name]
    message = Message.model_validate(api.response_body(result, REQUEST))
    assert message.id == f"msg_{result.id}"
    kinds = [b.type for b in message.content]
    assert kinds == (["thinking"] if result.reasoning is not None else []) + (
        ["text"] if result.content else []) + ["tool_use"] * len(result.tool_calls)
    for block in message.content:
        if block.type == "thinking":
            assert block.thinking == result.reasoning and block.signature == ""
        elif block.type == "text":
            assert block.text == result.content
    assert [(b.id, b.name, b.input) for b in message.content if b.type == "tool_use"] == [
        (c.id, c.name, json.loads(c.arguments)) for c in result.tool_calls]
    assert message.stop_reason == STOP_REASONS[result.finish_reason]
    assert message.stop_sequence == result.stop_sequence
    assert (message.usage.input_tokens, message.usage.output_tokens) == (result.prompt_tokens,
                                                                          result.completion_tokens)


def _events(result: TurnResult) -> list:
    events = []
    for frame in api.stream_events(result, REQUEST):
        head, data, tail = frame.split("\n", 2)
        assert head.startswith("event: ") and data.startswith("data: ") and tail == "\n"
        event = EVENT.validate_python(json.loads(data[len("data: "):]))
        assert event.type == head[len("event: "):]
        events.append(event)
    return events


@pytest.mark.parametrize("name", RESULTS)
def test_stream_events_accumulate_to_the_body(name):
    result = RESULTS[name]
    events = _events(result)
    body = Message.model_validate(api.response_body(result, REQUEST))
    assert events[0].type == "message_start" and events[0].message.content == []
    assert events[0].message.stop_reason is None
    assert [e.type for e in events[-2:]] == ["message_delta", "message_stop"]
    # accumulate by hand, as a client reading the raw events would
    blocks: list[dict] = []
    partial: dict[int, str] = {}
    calls = iter(result.tool_calls)
    for event in events[1:-2]:
        if event.type == "content_block_start":
            assert event.index == len(blocks)
            blocks.append(event.content_block.model_dump(exclude_none=True))
        elif event.type == "content_block_delta":
            block, delta = blocks[event.index], event.delta
            if delta.type == "text_delta":
                block["text"] += delta.text
            elif delta.type == "thinking_delta":
                block["thinking"] += delta.thinking
            elif delta.type == "signature_delta":
                block["signature"] += delta.signature
            else:
                partial[event.index] = partial.get(event.index, "") + delta.partial_json
        else:
            assert event.type == "content_block_stop" and event.index == len(blocks) - 1
            if blocks[-1]["type"] == "tool_use":
                blocks[-1]["input"] = json.loads(partial.get(event.index) or "{}")
                # the streamed JSON is the arguments text as sampled
                assert partial.get(event.index, "") == next(calls).arguments
    assert blocks == [b.model_dump(exclude_none=True) for b in body.content]
    assert events[-2].delta.stop_reason == body.stop_reason
    assert events[-2].delta.stop_sequence == body.stop_sequence
    assert events[-2].usage.output_tokens == body.usage.output_tokens
    if result.content:
        deltas = [e for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"]
        assert len(deltas) == -(-len(result.content) // 16)


# ----------------------------------------------------------------------------------------------------------------
# Through the real client (in-process transport: the client builds the request and parses the SSE itself)


def _client(responses: list[bytes], sent: list[dict]) -> anthropic.Anthropic:
    def handle(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        data = responses.pop(0)
        kind = "text/event-stream" if data.startswith(b"event:") else "application/json"
        return httpx.Response(200, content=data, headers={"content-type": kind})

    return anthropic.Anthropic(api_key="k", base_url="http://endpoint", max_retries=0,
                               http_client=httpx.Client(transport=httpx.MockTransport(handle)))


@pytest.mark.parametrize("name", ["think_text_calls", "calls_only", "stop_sequence"])
def test_client_stream_helper_accumulates_to_the_body(name):
    result, sent = RESULTS[name], []
    client = _client(["".join(api.stream_events(result, REQUEST)).encode()], sent)
    tools = [{"name": "weather", "description": "Forecast", "input_schema": WEATHER}]
    with client.messages.stream(model="claude", max_tokens=100, system="Be brief.", tools=tools,
                                messages=[{"role": "user", "content": "hi"}], stop_sequences=["###"]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    request = api.parse_request(sent[0])
    assert request.stream and request.stop == ("###",) and request.messages[0] == {"role": "system",
                                                                                  "content": "Be brief."}
    assert text == result.content
    body = Message.model_validate(api.response_body(result, REQUEST))
    assert [b.model_dump(exclude_none=True) for b in final.content] == [
        b.model_dump(exclude_none=True) for b in body.content]
    assert (final.stop_reason, final.stop_sequence, final.usage.output_tokens) == (
        body.stop_reason, body.stop_sequence, body.usage.output_tokens)


def test_echoed_content_blocks_parse_to_the_same_assistant_message():
    result = RESULTS["think_text_calls"]
    body = api.response_body(result, REQUEST)
    results = [{"type": "tool_result", "tool_use_id": c.id, "content": "ok"} for c in result.tool_calls]
    want_tools = [{"role": "tool", "tool_call_id": c.id, "content": "ok"} for c in result.tool_calls]
    sent: list[dict] = []
    client = _client([json.dumps(body).encode(), json.dumps(body).encode()], sent)
    message = client.messages.create(model="claude", max_tokens=100, messages=[{"role": "user", "content": "hi"}])
    # the client's own content objects (serialised by the client), and the plain JSON blocks
    client.messages.create(model="claude", max_tokens=100, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": message.content},
        {"role": "user", "content": results}])
    plain = _msgs({"role": "user", "content": "hi"}, {"role": "assistant", "content": body["content"]},
                  {"role": "user", "content": results})
    for request_body in (sent[-1], plain):
        user, assistant, *tools = api.parse_request(request_body).messages
        assert tools == want_tools
        calls = assistant.pop("tool_calls")
        assert assistant == {"role": "assistant", "content": result.content, "reasoning_content": result.reasoning}
        # the session compares the arguments as parsed JSON: the text may differ from what was sampled
        assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            (c.id, c.name, json.loads(c.arguments)) for c in result.tool_calls]


@pytest.mark.parametrize(("error", "kind"), [
    (ApiError(400, "bad"), "invalid_request_error"),
    (ApiError(401, "no key"), "authentication_error"),
    (ApiError(404, "no such response"), "not_found_error"),
    (ApiError(413, "too long"), "request_too_large"),
    (ApiError(429, "busy"), "rate_limit_error"),
    (ApiError(500, "boom", type="server_error"), "api_error"),
    (ApiError(503, "down"), "api_error"),
    (ApiError(529, "busy", type="overloaded_error"), "overloaded_error"),
    (ApiError(400, "x", type="permission_error"), "permission_error"),
])
def test_error_body(error, kind):
    assert api.error_body(error) == {"type": "error", "error": {"type": kind, "message": error.message}}
