"""Chat Completions translation: request bodies -> the common form (and every refusal naming its field), and
results -> bodies and chunk streams the real ``openai`` client's own models and stream accumulator accept."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.chat.completion_create_params import CompletionCreateParamsBase

from mcore_agentic.endpoint import openai_chat as api
from mcore_agentic.endpoint.turn import ApiError, TokenLogprob, ToolCallOut, TurnRequest, TurnResult

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _body(**fields):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def _refusal(body) -> ApiError:
    with pytest.raises(ApiError) as err:
        api.parse_request(body)
    assert err.value.status == 400
    return err.value


# ----------------------------------------------------------------------------------------------------------------
# Requests


def test_parse_conversation_to_the_common_form():
    body = {
        "model": "qwen",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
            {"role": "user", "content": [{"type": "text", "text": "Weather in"}, {"type": "text", "text": "Paris?"}],
             "name": "alice"},
            {"role": "assistant", "content": None, "reasoning_content": "Need the tool.", "refusal": None,
             "annotations": [], "audio": None,
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
            {"role": "assistant", "content": "Sunny.", "reasoning": "Done."},
            {"role": "user", "content": "Thanks"},
        ],
        "tools": [{"type": "function", "function": {"name": "weather", "description": "Forecast",
                                                    "parameters": WEATHER, "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "weather"}},
        "parallel_tool_calls": False, "max_completion_tokens": 64, "temperature": 0.7, "top_p": 0.9, "stop": "END",
        "logprobs": True, "top_logprobs": 3, "stream": True, "stream_options": {"include_usage": True},
        # accepted and ignored
        "seed": 1, "metadata": {"k": "v"}, "store": False, "user": "u", "service_tier": "auto", "n": 1,
        "reasoning_effort": "low", "frequency_penalty": 0.5, "presence_penalty": 0.1, "logit_bias": {"5": 1},
        "response_format": {"type": "text"}, "modalities": ["text"], "prompt_cache_key": "p", "verbosity": "low",
    }
    assert api.parse_request(body) == TurnRequest(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Weather in\nParis?"},
            {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "assistant", "content": "Sunny.", "reasoning_content": "Done."},
            {"role": "user", "content": "Thanks"},
        ],
        tools=[{"type": "function", "function": {"name": "weather", "description": "Forecast",
                                                 "parameters": WEATHER}}],
        tool_choice="weather", parallel_tool_calls=False, max_tokens=64, temperature=0.7, top_p=0.9, stop=("END",),
        logprobs=True, top_logprobs=3, stream=True, include_usage=True, model="qwen",
        ignored=("parallel_tool_calls", "seed", "metadata", "store", "user", "service_tier", "reasoning_effort",
                 "frequency_penalty", "presence_penalty", "logit_bias", "prompt_cache_key", "verbosity"),
    )


def test_parse_defaults_and_legacy_max_tokens():
    request = api.parse_request({"messages": [{"role": "user", "content": None}], "max_tokens": 5,
                                 "stop": ["a", "b"], "tools": []})
    assert request == TurnRequest(messages=[{"role": "user", "content": ""}], max_tokens=5, stop=("a", "b"))


def test_every_client_field_is_known():
    fields = CompletionCreateParamsBase.__required_keys__ | CompletionCreateParamsBase.__optional_keys__
    assert fields <= api.KNOWN_FIELDS
    assert "stream" in api.KNOWN_FIELDS


def _msgs(*messages):
    return {"model": "m", "messages": list(messages)}


_CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(("body", "param", "words"), [
    ([1, 2], None, "JSON object"),
    (_body(n=2), "n", "n=1"),
    (_body(response_format={"json_schema": {"name": "x"}}), "response_format.type", "required"),
    (_body(audio={"voice": "alloy", "format": "mp3"}), "audio", "audio"),
    (_body(modalities=["text", "audio"]), "modalities[1]", "text"),
    (_body(functions=[{"name": "f"}]), "functions", "tools"),
    (_body(function_call="auto"), "function_call", "tool_choice"),
    (_body(web_search_options={}), "web_search_options", "web search"),
    ({"model": "m"}, "messages", "required"),
    (_msgs(), "messages", "empty"),
    (_body(messages="hi"), "messages", "expected an array, got string"),
    (_msgs({"content": "x"}), "messages[0].role", "required"),
    (_msgs({"role": 1, "content": "x"}), "messages[0].role", "expected a string, got integer"),
    (_msgs({"role": "function", "name": "f", "content": "x"}), "messages[0].role", "tool"),
    (_msgs({"role": "robot", "content": "x"}), "messages[0].role", "unknown role"),
    (_msgs("hi"), "messages[0]", "expected a message object, got string"),
    (_msgs({"role": "user", "content": 5}), "messages[0].content",
     "expected a string or a list of content parts, got integer"),
    (_msgs({"role": "user", "content": [{"type": "text", "text": "a"},
                                        {"type": "image_url", "image_url": {"url": "http://x"}}]}),
     "messages[0].content[1]", "only text content is supported"),
    (_msgs({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}), "messages[0].content[0]",
     "only text"),
    (_msgs({"role": "user", "content": [{"type": "file", "file": {}}]}), "messages[0].content[0]", "only text"),
    (_msgs({"role": "user", "content": [{"type": "text", "text": 3}]}), "messages[0].content[0].text", "string"),
    (_msgs({"role": "user", "content": "x"}, {"role": "tool", "content": "r"}), "messages[1].tool_call_id",
     "required"),
    (_msgs({"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{**_CALL, "type": "custom"}]}),
     "messages[1].tool_calls[0].type", "function"),
    (_msgs({"role": "user", "content": "x"},
           {"role": "assistant", "tool_calls": [{**_CALL, "function": {"name": "f", "arguments": {}}}]}),
     "messages[1].tool_calls[0].function.arguments", "expected a string, got object"),
    (_msgs({"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"type": "function"}]}),
     "messages[1].tool_calls[0].function", "required"),
    (_msgs({"role": "user", "content": "x"}, {"role": "assistant", "content": "a", "reasoning_content": 1}),
     "messages[1].reasoning_content", "string"),
    (_body(temperature=2.5), "temperature", "[0, 2]"),
    (_body(temperature=-0.1), "temperature", ""),
    (_body(temperature="1"), "temperature", "expected a number, got string"),
    (_body(temperature=True), "temperature", "got boolean"),
    (_body(top_p=0), "top_p", "(0, 1]"),
    (_body(top_p=1.5), "top_p", ""),
    (_body(max_tokens=0), "max_tokens", ">= 1"),
    (_body(max_tokens=True), "max_tokens", "expected an integer, got boolean"),
    (_body(max_tokens=1.5), "max_tokens", "got number"),
    (_body(max_completion_tokens=0), "max_completion_tokens", ">= 1"),
    (_body(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4"),
    (_body(stop=[1]), "stop[0]", "string"),
    (_body(stop=["a", ""]), "stop[1]", "empty"),
    (_body(stop=5), "stop", "a string or an array of strings"),
    (_body(model=3), "model", "string"),
    (_body(tools=[{"type": "custom", "custom": {"name": "x"}}]), "tools[0].type", "function"),
    (_body(tools=[{"type": "function", "function": {"description": "d"}}]), "tools[0].function.name", "required"),
    (_body(tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}]),
     "tools[0].function.parameters", "object"),
    (_body(tool_choice="maybe"), "tool_choice", "auto"),
    (_body(tool_choice={"type": "allowed_tools", "allowed_tools": {}}), "tool_choice.type", "function"),
    (_body(stream="yes"), "stream", "boolean"),
    (_body(logprobs=1), "logprobs", "boolean"),
    (_body(top_logprobs=21), "top_logprobs", "<= 20"),
    (_body(stream_options={"include_usage": "x"}), "stream_options.include_usage", "boolean"),
    (_body(parallel_tool_calls="no"), "parallel_tool_calls", "boolean"),
])
def test_refusals_name_the_field(body, param, words):
    error = _refusal(body)
    assert error.param == param
    assert words in error.message
    if param is not None:
        assert error.message.startswith(f"{param}: ") or error.message == f"unknown field '{param}'"


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
    "length": TurnResult(content="Truncated answ", reasoning=None, tool_calls=[], finish_reason="length",
                         prompt_tokens=5, completion_tokens=4, model="m"),
    "stop_sequence": TurnResult(content="Up to", reasoning=None, tool_calls=[], finish_reason="stop_sequence",
                                prompt_tokens=5, completion_tokens=2, model="m", stop_sequence="###"),
    "empty": TurnResult(content="", reasoning=None, tool_calls=[], finish_reason="stop", prompt_tokens=5,
                        completion_tokens=1, model="m"),
    "logprobs": TurnResult(content="Hi!", reasoning=None, tool_calls=[], finish_reason="stop", prompt_tokens=3,
                           completion_tokens=2, model="m",
                           logprobs=[TokenLogprob("Hi", -0.25, [72, 105]), TokenLogprob("!", -1.5, [33])]),
}
REQUESTS = {
    "plain": TurnRequest(messages=[{"role": "user", "content": "hi"}]),
    "logprobs_usage": TurnRequest(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2,
                                  stream=True, include_usage=True),
}
CASES = [(r, q) for r in RESULTS for q in REQUESTS]


@pytest.mark.parametrize(("result_name", "request_name"), CASES)
def test_response_body_is_a_client_chat_completion(result_name, request_name):
    result, request = RESULTS[result_name], REQUESTS[request_name]
    completion = ChatCompletion.model_validate(api.response_body(result, request))
    assert completion.id == f"chatcmpl-{result.id}"
    choice = completion.choices[0]
    expected_finish = {"stop_sequence": "stop"}.get(result.finish_reason, result.finish_reason)
    assert choice.finish_reason == expected_finish
    if result.tool_calls and not result.content:
        assert choice.message.content is None
    else:
        assert choice.message.content == result.content
    assert [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []] == [
        (c.id, c.name, c.arguments) for c in result.tool_calls]
    assert getattr(choice.message, "reasoning_content", None) == result.reasoning
    if request.logprobs:
        assert [(lp.token, lp.logprob, lp.bytes, lp.top_logprobs) for lp in choice.logprobs.content] == [
            (lp.token, lp.logprob, lp.bytes, []) for lp in result.logprobs or []]
    else:
        assert choice.logprobs is None
    assert completion.usage.total_tokens == result.prompt_tokens + result.completion_tokens


def _chunks(frames: list[str]) -> list[ChatCompletionChunk]:
    assert frames[-1] == "data: [DONE]\n\n"
    chunks = []
    for frame in frames[:-1]:
        assert frame.startswith("data: ") and frame.endswith("\n\n") and "\n" not in frame[:-2]
        chunks.append(ChatCompletionChunk.model_validate(json.loads(frame[len("data: "):])))
    return chunks


@pytest.mark.parametrize(("result_name", "request_name"), CASES)
def test_stream_accumulates_to_the_body(result_name, request_name):
    result, request = RESULTS[result_name], REQUESTS[request_name]
    chunks = _chunks(list(api.stream_events(result, request)))
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    streamed = state.current_completion_snapshot  # get_final_completion() refuses length-cut turns (it parses)
    body = ChatCompletion.model_validate(api.response_body(result, request))
    got, want = streamed.choices[0], body.choices[0]
    assert got.finish_reason == want.finish_reason
    assert (got.message.content or "") == (want.message.content or "")
    assert [(c.id, c.type, c.function.name, c.function.arguments) for c in got.message.tool_calls or []] == [
        (c.id, c.type, c.function.name, c.function.arguments) for c in want.message.tool_calls or []]
    assert getattr(got.message, "reasoning_content", None) == getattr(want.message, "reasoning_content", None)
    assert (got.logprobs and got.logprobs.content) == (want.logprobs and want.logprobs.content)
    assert streamed.id == body.id and {c.id for c in chunks} == {body.id}
    # pieces, not one blob: the client's delta accumulation is exercised
    content_deltas = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_deltas) == -(-len(result.content) // 16)
    usage = [c for c in chunks if c.usage is not None]
    if request.include_usage:
        assert len(usage) == 1 and usage[0] is chunks[-1] and usage[0].choices == []
        assert usage[0].usage == body.usage
    else:
        assert usage == []


# ----------------------------------------------------------------------------------------------------------------
# Through the real client (in-process transport: the client builds the request and parses the SSE itself)


def _client(responses: list[bytes], sent: list[dict]) -> openai.OpenAI:
    def handle(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        data = responses.pop(0)
        kind = "text/event-stream" if data.startswith(b"data:") else "application/json"
        return httpx.Response(200, content=data, headers={"content-type": kind})

    return openai.OpenAI(api_key="k", base_url="http://endpoint/v1", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(handle)))


def test_client_round_trip_and_echoed_history():
    result = RESULTS["think_text_calls"]
    sent: list[dict] = []
    first = api.parse_request(_body(tools=[{"type": "function", "function": {"name": "weather",
                                                                              "parameters": WEATHER}}]))
    body = api.response_body(result, first)
    stream = "".join(api.stream_events(result, first)).encode()
    client = _client([json.dumps(body).encode(), stream], sent)
    completion = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                tools=[{"type": "function", "function": {"name": "weather",
                                                                                         "parameters": WEATHER}}])
    assert api.parse_request(sent[0]).tools == first.tools
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                stream=True):
        state.handle_chunk(chunk)
    assert state.get_final_completion().choices[0].message.content == completion.choices[0].message.content

    # the assistant message as the client holds it (a pydantic model) and as plain JSON, fed back as history
    echoed = {"role": "assistant", "content": result.content, "reasoning_content": result.reasoning,
              "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in result.tool_calls]}
    tool_results = [{"role": "tool", "tool_call_id": c.id, "content": "ok"} for c in result.tool_calls]
    for history in (completion.choices[0].message, body["choices"][0]["message"]):
        client = _client([json.dumps(body).encode()], sent)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}, history,
                                                            *tool_results])
        assert api.parse_request(sent[-1]).messages == [{"role": "user", "content": "hi"}, echoed, *tool_results]


def test_echo_of_a_calls_only_turn_keeps_empty_content():
    result = RESULTS["calls_only"]
    message = api.response_body(result, REQUESTS["plain"])["choices"][0]["message"]
    parsed = api.parse_request(_msgs({"role": "user", "content": "hi"}, message)).messages[1]
    assert parsed == {"role": "assistant", "content": "", "reasoning_content": "",
                      "tool_calls": [{"id": "call_a", "type": "function",
                                      "function": {"name": "weather", "arguments": CALLS[0].arguments}}]}


def test_error_body():
    error = ApiError(400, "temperature: must be in [0, 2], got 3", param="temperature")
    assert api.error_body(error) == {"error": {"message": error.message, "type": "invalid_request_error",
                                               "param": "temperature", "code": None}}
