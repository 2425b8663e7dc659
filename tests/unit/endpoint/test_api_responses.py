"""Responses translation: input items -> the common form (merging an assistant turn's items back into one
message), every refusal naming its field, and results -> ``response`` objects and event streams the real ``openai``
client's models and its own stream accumulator accept."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from openai.types.responses.response_create_params import ResponseCreateParamsBase
from pydantic import TypeAdapter

from mcore_agentic.endpoint import responses as api
from mcore_agentic.endpoint.turn import ApiError, TokenLogprob, ToolCallOut, TurnRequest, TurnResult

EVENT = TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _body(**fields):
    return {"model": "m", "input": "hi", **fields}


def _call(call_id, name="weather", arguments='{"city": "Paris"}'):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# ----------------------------------------------------------------------------------------------------------------
# Requests


def test_parse_string_input():
    request = api.parse_request({"model": "gpt", "input": "Hello", "instructions": "Be brief.",
                                 "max_output_tokens": 32})
    assert request == TurnRequest(messages=[{"role": "user", "content": "Hello"}], max_tokens=32, model="gpt",
                                  instructions="Be brief.")


def test_parse_items_merge_an_assistant_turn():
    body = {
        "model": "m",
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in"},
                                         {"type": "input_text", "text": "Paris and Rome?"}]},
            # one assistant turn: reasoning, message, two calls
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "short"}],
             "content": [{"type": "reasoning_text", "text": "Need both."}], "encrypted_content": None},
            {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []},
                         {"type": "refusal", "refusal": "no"}]},
            {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "weather",
             "arguments": '{"city": "Paris"}', "status": "completed"},
            {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city": "Rome"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2",
             "output": [{"type": "input_text", "text": "rain"}]},
            # calls with no message before them; reasoning (summary only) before a call
            {"type": "function_call", "call_id": "c3", "name": "weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c3", "output": "?"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "a"},
                                              {"type": "summary_text", "text": "b"}]},
            {"type": "function_call", "call_id": "c4", "name": "weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c4", "output": "!"},
            # a reasoning item with nothing after it in its turn; then two plain assistant messages
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
            {"role": "user", "content": "go on"},
            {"role": "assistant", "content": "One."},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Two."}]},
        ],
        "tools": [{"type": "function", "name": "weather", "description": "Forecast", "parameters": WEATHER,
                   "strict": False}],
        "tool_choice": {"type": "function", "name": "weather"}, "parallel_tool_calls": False,
        "temperature": 0.5, "top_p": 1, "include": ["message.output_text.logprobs", "reasoning.encrypted_content"],
        "top_logprobs": 2, "stream": True, "previous_response_id": "resp_abc123",
        # accepted and ignored
        "reasoning": {"effort": "low", "summary": "auto"}, "store": False, "metadata": {"a": "b"},
        "truncation": "disabled", "service_tier": "auto", "prompt_cache_key": "k", "user": "u",
        "safety_identifier": "s", "text": {"format": {"type": "text"}, "verbosity": "low"}, "background": False,
        "stream_options": {"include_obfuscation": False}, "max_tool_calls": 3,
    }
    assert api.parse_request(body) == TurnRequest(
        messages=[
            {"role": "system", "content": "Use tools."},
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in\nParis and Rome?"},
            {"role": "assistant", "content": "Checking.", "reasoning_content": "Need both.",
             "tool_calls": [_call("c1"), _call("c2", arguments='{"city": "Rome"}')]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "c2", "content": "rain"},
            {"role": "assistant", "content": "", "tool_calls": [_call("c3", arguments="{}")]},
            {"role": "tool", "tool_call_id": "c3", "content": "?"},
            {"role": "assistant", "content": "", "reasoning_content": "a\nb",
             "tool_calls": [_call("c4", arguments="{}")]},
            {"role": "tool", "tool_call_id": "c4", "content": "!"},
            {"role": "assistant", "content": "", "reasoning_content": "hmm"},
            {"role": "user", "content": "go on"},
            {"role": "assistant", "content": "One."},
            {"role": "assistant", "content": "Two."},
        ],
        tools=[{"type": "function", "function": {"name": "weather", "description": "Forecast",
                                                 "parameters": WEATHER}}],
        tool_choice="weather", parallel_tool_calls=False, temperature=0.5, top_p=1.0, logprobs=True,
        top_logprobs=2, stream=True, model="m", previous_response_id="abc123", reasoning_passback=True,
        ignored=("parallel_tool_calls", "reasoning", "store", "metadata", "truncation", "service_tier",
                 "prompt_cache_key", "user", "safety_identifier", "stream_options", "max_tool_calls",
                 "text.verbosity"),
    )


def test_every_client_field_is_known():
    fields = ResponseCreateParamsBase.__required_keys__ | ResponseCreateParamsBase.__optional_keys__
    assert fields <= api.KNOWN_FIELDS
    assert "stream" in api.KNOWN_FIELDS


def _input(*items):
    return {"model": "m", "input": list(items)}


@pytest.mark.parametrize(("body", "param", "words"), [
    ("hi", None, "JSON object"),
    ({"model": "m"}, "input", "required"),
    (_body(input=""), "input", "empty"),
    (_input(), "input", "empty"),
    (_body(input=3), "input", "expected a string or an array of input items, got integer"),
    (_body(previous_response_id="abc123"), "previous_response_id", "resp_"),
    (_body(previous_response_id="resp_"), "previous_response_id", ""),
    (_input({"type": "item_reference", "id": "msg_1"}), "input[0].type", "not supported"),
    (_input({"type": "web_search_call", "id": "ws", "status": "completed"}), "input[0].type", "web_search_call"),
    (_input({"type": "message", "content": "x"}), "input[0].role", "required"),
    (_input({"role": "tool", "content": "x"}), "input[0].role", "unknown role"),
    (_input({"role": "user", "content": None}), "input[0].content", "got null"),
    (_input({"role": "user", "content": [{"type": "input_text", "text": "a"},
                                         {"type": "input_image", "image_url": "http://x"}]}),
     "input[0].content[1]", "only text content is supported"),
    (_input({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}), "input[0].content[0]",
     "only text"),
    (_input({"type": "function_call", "name": "f", "arguments": "{}"}), "input[0].call_id", "required"),
    (_input({"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}), "input[0].arguments",
     "string"),
    (_input({"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}),
     "input[0].output[0]", "only text"),
    (_input({"type": "function_call_output", "output": "x"}), "input[0].call_id", "required"),
    (_input({"type": "reasoning", "summary": [], "content": [{"type": "text", "text": "x"}]}),
     "input[0].content[0]", "only text"),
    (_body(tools=[{"type": "custom", "name": "p", "format": {"type": "regex"}}]), "tools[0].format.type",
     "grammar"),
    (_body(tools=[{"type": "custom", "name": "p", "format": {"type": "grammar"}}]), "tools[0].format.definition",
     "required"),
    (_body(tools=[{"type": "function", "parameters": {}}]), "tools[0].name", "required"),
    (_body(tool_choice="any"), "tool_choice", "auto"),
    (_body(tool_choice={"type": "web_search_preview"}), "tool_choice.type", "function"),
    (_body(background=True), "background", "not supported"),
    (_body(conversation="conv_1"), "conversation", "previous_response_id"),
    (_body(prompt={"id": "pmpt_1"}), "prompt", "templates"),
    (_body(text={"format": {"name": "x"}}), "text.format.type", "required"),
    (_body(truncation="sometimes"), "truncation", "disabled"),
    (_body(max_output_tokens=0), "max_output_tokens", ">= 1"),
    (_body(max_output_tokens=False), "max_output_tokens", "boolean"),
    (_body(temperature=3), "temperature", "[0, 2]"),
    (_body(top_p=0.0), "top_p", "(0, 1]"),
    (_body(instructions=["x"]), "instructions", "string"),
    (_body(include=[1]), "include[0]", "string"),
    (_body(model=None, stream=1), "stream", "boolean"),
])
def test_refusals_name_the_field(body, param, words):
    with pytest.raises(ApiError) as err:
        api.parse_request(body)
    assert err.value.status == 400
    assert err.value.param == param
    assert words in err.value.message


# ----------------------------------------------------------------------------------------------------------------
# Responses

CALLS = [ToolCallOut("call_a", "weather", '{"city": "Zürich", "days": [1, 2, 3], "units": {"t": "C"}}'),
         ToolCallOut("call_b", "time", "{}")]
RESULTS = {
    "text": TurnResult(content="Hello there, this is a longer answer.\nSecond line: é 漢字 🙂", reasoning=None,
                       tool_calls=[], finish_reason="stop", prompt_tokens=10, completion_tokens=12, model="m"),
    "think_text_calls": TurnResult(content="Let me check.", reasoning="The user wants weather; call both tools.",
                                   tool_calls=CALLS, finish_reason="tool_calls", prompt_tokens=20,
                                   completion_tokens=40, model="m"),
    "calls_only": TurnResult(content="", reasoning="", tool_calls=CALLS[:1], finish_reason="tool_calls",
                             prompt_tokens=5, completion_tokens=9, model="m"),
    "length": TurnResult(content="Truncated answ", reasoning="thought", tool_calls=[], finish_reason="length",
                         prompt_tokens=5, completion_tokens=4, model="m"),
    "length_in_reasoning": TurnResult(content="", reasoning="still thinki", tool_calls=[], finish_reason="length",
                                      prompt_tokens=5, completion_tokens=4, model="m"),
    "stop_sequence": TurnResult(content="Up to", reasoning=None, tool_calls=[], finish_reason="stop_sequence",
                                prompt_tokens=5, completion_tokens=2, model="m", stop_sequence="###"),
    "logprobs": TurnResult(content="Hi!", reasoning=None, tool_calls=[], finish_reason="stop", prompt_tokens=3,
                           completion_tokens=2, model="m",
                           logprobs=[TokenLogprob("Hi", -0.25, [72, 105]), TokenLogprob("!", -1.5, [33])]),
}
REQUESTS = {
    "plain": TurnRequest(messages=[{"role": "user", "content": "hi"}]),
    "full": TurnRequest(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2, stream=True,
                        instructions="Be brief.", previous_response_id="abc", max_tokens=100, temperature=0.3,
                        top_p=0.9, tool_choice="weather", parallel_tool_calls=False,
                        tools=[{"type": "function", "function": {"name": "weather", "description": "Forecast",
                                                                 "parameters": WEATHER}},
                               {"type": "function", "function": {"name": "time"}}]),
}
CASES = [(r, q) for r in RESULTS for q in REQUESTS]


def _check_output(response: Response, result: TurnResult, request: TurnRequest) -> None:
    kinds = [item.type for item in response.output]
    assert kinds == (["reasoning"] if result.reasoning is not None else []) + (
        ["message"] if result.content else []) + ["function_call"] * len(result.tool_calls)
    for item in response.output:
        if item.type == "reasoning":
            assert item.id.startswith("rs_") and item.summary == []
            assert [c.text for c in item.content] == [result.reasoning]
        elif item.type == "message":
            assert item.id.startswith("msg_") and item.role == "assistant"
            (part,) = item.content
            assert part.type == "output_text" and part.text == result.content
            want = [(lp.token, lp.logprob, lp.bytes) for lp in result.logprobs or []] if request.logprobs else []
            assert [(lp.token, lp.logprob, lp.bytes) for lp in part.logprobs] == want
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.call_id, c.name, c.arguments, c.status) for c in calls] == [
        (c.id, c.name, c.arguments, "completed") for c in result.tool_calls]
    assert all(c.id.startswith("fc_") for c in calls) and len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize(("result_name", "request_name"), CASES)
def test_response_body_is_a_client_response(result_name, request_name):
    result, request = RESULTS[result_name], REQUESTS[request_name]
    response = Response.model_validate(api.response_body(result, request))
    assert response.id == f"resp_{result.id}"
    _check_output(response, result, request)
    if result.finish_reason == "length":
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed" and response.incomplete_details is None
    assert response.usage.input_tokens == result.prompt_tokens
    assert response.usage.total_tokens == result.prompt_tokens + result.completion_tokens
    assert response.instructions == request.instructions
    if request.previous_response_id is not None:
        assert response.previous_response_id == f"resp_{request.previous_response_id}"
    assert [t.name for t in response.tools] == [t["function"]["name"] for t in request.tools or []]
    if request.tool_choice == "weather":
        assert response.tool_choice.type == "function" and response.tool_choice.name == "weather"


def _events(result: TurnResult, request: TurnRequest) -> list:
    events = []
    for frame in api.stream_events(result, request):
        head, data, tail = frame.split("\n", 2)
        assert head.startswith("event: ") and data.startswith("data: ") and tail == "\n"
        event = EVENT.validate_python(json.loads(data[len("data: "):]))
        assert event.type == head[len("event: "):]
        events.append(event)
    return events


@pytest.mark.parametrize(("result_name", "request_name"), CASES)
def test_stream_events_accumulate_to_the_body(result_name, request_name):
    result, request = RESULTS[result_name], REQUESTS[request_name]
    events = _events(result, request)
    body = Response.model_validate(api.response_body(result, request))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    last = events[-1]
    assert last.type == ("response.incomplete" if result.finish_reason == "length" else "response.completed")
    assert last.response == body.model_copy(update={"id": last.response.id})
    assert {e.response.id for e in events if hasattr(e, "response")} == {body.id}
    # accumulate by hand, as a client reading only deltas would
    texts: dict[tuple[int, str], str] = {}
    added, done = [], []
    for event in events:
        if event.type == "response.output_item.added":
            added.append(event.item)
            assert event.item.status == "in_progress" and event.output_index == len(added) - 1
        elif event.type == "response.output_item.done":
            done.append(event.item)
        elif event.type in ("response.output_text.delta", "response.reasoning_text.delta",
                            "response.function_call_arguments.delta"):
            key = (event.output_index, event.type)
            texts[key] = texts.get(key, "") + event.delta
        elif event.type in ("response.output_text.done", "response.reasoning_text.done"):
            assert texts.get((event.output_index, event.type.replace("done", "delta")), "") == event.text
        elif event.type == "response.function_call_arguments.done":
            assert texts.get((event.output_index, "response.function_call_arguments.delta"), "") == event.arguments
    assert [i.id for i in added] == [i.id for i in done] == [i.id for i in body.output]
    assert done == body.output
    if result.content:
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        assert len(deltas) == -(-len(result.content) // 16)
        assert [lp.token for d in deltas for lp in d.logprobs] == (
            [lp.token for lp in result.logprobs or []] if request.logprobs else [])


# ----------------------------------------------------------------------------------------------------------------
# Through the real client (in-process transport: the client builds the request and parses the SSE itself)


def _client(responses: list[bytes], sent: list[dict]) -> openai.OpenAI:
    def handle(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        data = responses.pop(0)
        kind = "text/event-stream" if data.startswith(b"event:") else "application/json"
        return httpx.Response(200, content=data, headers={"content-type": kind})

    return openai.OpenAI(api_key="k", base_url="http://endpoint/v1", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(handle)))


def _unparsed(value):
    """A dump of the stream helper's ``Parsed*`` objects without the keys they add (``parsed``...)."""
    if isinstance(value, dict):
        return {k: _unparsed(v) for k, v in value.items() if k not in ("parsed", "parsed_arguments")}
    if isinstance(value, list):
        return [_unparsed(v) for v in value]
    return value


@pytest.mark.parametrize("result_name", ["think_text_calls", "length", "logprobs"])
def test_client_stream_helper_accumulates_to_the_body(result_name):
    result, sent = RESULTS[result_name], []
    tools = [{"type": "function", "name": "weather", "description": "Forecast", "parameters": WEATHER,
              "strict": False}]
    client = _client(["".join(api.stream_events(result, REQUESTS["full"])).encode()], sent)
    with client.responses.stream(model="m", input="hi", instructions="Be brief.", tools=tools,
                                 include=["message.output_text.logprobs"]) as stream:
        events = list(stream)
        # the helper's get_final_response() waits for response.completed; a length-cut turn ends (as OpenAI's
        # do) with response.incomplete, whose response the helper hands over with the finished items
        final = events[-1].response if result.finish_reason == "length" else stream.get_final_response()
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    request = api.parse_request(sent[0])
    assert request.stream and request.logprobs and request.instructions == "Be brief."
    assert request.tools == [{"type": "function", "function": {"name": "weather", "description": "Forecast",
                                                               "parameters": WEATHER}}]
    assert text == result.content
    body = Response.model_validate(api.response_body(result, REQUESTS["full"]))
    assert [_unparsed(i.model_dump()) for i in final.output] == [i.model_dump() for i in body.output]
    assert final.status == body.status


def test_echoed_output_items_parse_to_the_same_assistant_message():
    result = RESULTS["think_text_calls"]
    body = api.response_body(result, REQUESTS["plain"])
    echoed = {"role": "assistant", "content": result.content, "reasoning_content": result.reasoning,
              "tool_calls": [_call(c.id, c.name, c.arguments) for c in result.tool_calls]}
    outputs = [{"type": "function_call_output", "call_id": c.id, "output": "ok"} for c in result.tool_calls]
    tool_messages = [{"role": "tool", "tool_call_id": c.id, "content": "ok"} for c in result.tool_calls]
    want = [{"role": "user", "content": "hi"}, echoed, *tool_messages]
    # as plain JSON items
    request = api.parse_request({"model": "m", "input": [{"role": "user", "content": "hi"}, *body["output"],
                                                         *outputs], "previous_response_id": None})
    assert request.messages == want
    # as the client's own output objects, serialised by the client
    sent: list[dict] = []
    client = _client([json.dumps(body).encode(), json.dumps(body).encode()], sent)
    response = client.responses.create(model="m", input="hi")
    client.responses.create(model="m", input=[{"role": "user", "content": "hi"}, *response.output, *outputs])
    assert api.parse_request(sent[-1]).messages == want
    # with previous_response_id, only the new items
    client = _client([json.dumps(body).encode()], sent)
    client.responses.create(model="m", previous_response_id=response.id, input=outputs)
    assert api.parse_request(sent[-1]).previous_response_id == result.id


def test_echo_of_a_reasoning_only_turn():
    result = RESULTS["length_in_reasoning"]
    body = api.response_body(result, REQUESTS["plain"])
    request = api.parse_request(_input({"role": "user", "content": "hi"}, *body["output"],
                                       {"role": "user", "content": "continue"}))
    assert request.messages[1] == {"role": "assistant", "content": "", "reasoning_content": "still thinki"}


def test_error_body():
    error = ApiError(400, "unknown field 'foo'", param="foo")
    assert api.error_body(error) == {"error": {"message": error.message, "type": "invalid_request_error",
                                               "param": "foo", "code": None}}
