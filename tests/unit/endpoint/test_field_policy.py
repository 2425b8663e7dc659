"""The field policy (``endpoint/field_policy.py``) and what the harnesses need beside it: fields that change nothing
are accepted and counted in every API, never refused; Responses custom (freeform) tools and the reasoning
pass-back round-trip; Anthropic's token count is the render's; a harness's side calls open threads of their own and
never fork the episode's."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest

from mcore_agentic.endpoint import anthropic_messages, field_policy, openai_chat, responses
from mcore_agentic.endpoint.samples import SessionSettings
from mcore_agentic.endpoint.session import Session
from mcore_agentic.endpoint.turn import ApiError, TurnRequest
from mcore_agentic.models.tokenizer import load_qwen_tokenizer
from mcore_agentic.rollout.tokenization import ChatTokenizer
from mcore_agentic.rollout.tool_parser import get_tool_parser
from tests.unit.rollout.scripted import ScriptedEngine, call

SHELL = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
PATCH_GRAMMAR = 'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF'


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_qwen_tokenizer("qwen2_5", vocab_size=4096)


# ----------------------------------------------------------------------------------------------------------------
# Accepted, ignored, counted


@pytest.mark.parametrize(("api", "body", "fields"), [
    (anthropic_messages, {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                          "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
                          "brand_new_field": {"x": 1}, "metadata": {"user_id": "u"}},
     ["context_management", "brand_new_field", "metadata"]),
    (responses, {"model": "m", "input": "hi", "client_metadata": {"x": "y"}, "store": False,
                 "include": ["reasoning.encrypted_content", "web_search_call.action.sources"],
                 "prompt_cache_key": "k", "context_management": [{"type": "compaction"}]},
     ["client_metadata", "store", "prompt_cache_key", "context_management", "include"]),
    (openai_chat, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream_options":
                   {"include_usage": True, "include_obfuscation": False}, "user": "u", "seed": 3,
                   "chat_template_kwargs": {"enable_thinking": False}, "top_k": 20},
     ["user", "seed", "chat_template_kwargs", "top_k", "stream_options"]),
])
def test_fields_that_change_nothing_are_accepted_and_named(api, body, fields):
    request = api.parse_request(body)
    assert sorted(request.ignored) == sorted(fields)


def test_metric_names_are_a_fixed_set():
    assert field_policy.metric_name("client_metadata") == "client_metadata"
    assert field_policy.metric_name("anything-a-client-makes-up") == field_policy.OTHER
    assert set(field_policy.IGNORED_METRICS) == {*field_policy.IGNORED, field_policy.OTHER}


def test_one_log_line_per_new_name(caplog):
    with caplog.at_level(logging.INFO, logger="mcore_agentic.endpoint.field_policy"):
        field_policy.log_new(["a_field_for_this_test", "a_field_for_this_test"], "chat")
        field_policy.log_new(["a_field_for_this_test"], "responses")
        field_policy.log_new(["store"], "chat", openai_chat.KNOWN_FIELDS)
    lines = [r for r in caplog.records if "a_field_for_this_test" in r.getMessage()]
    assert len(lines) == 1 and "agent/ignored_fields/other" in lines[0].getMessage()
    assert "no installed client defines" in lines[0].getMessage()
    known = [r.getMessage() for r in caplog.records if "'store'" in r.getMessage()]
    assert all("a field of the installed client" in m for m in known)


@pytest.mark.parametrize(("api", "body", "param"), [
    (anthropic_messages, {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                          "mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
    (responses, {"model": "m", "input": "hi", "tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
    (openai_chat, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "web_search_options": {}},
     "web_search_options"),
])
def test_capabilities_the_model_lacks_are_refused_in_one_line(api, body, param):
    """Only a request that *needs* what the endpoint cannot do is refused: forcing a hosted tool, web search options,
    remote MCP servers. (Images and structured output: each API's own refusal tests.)"""
    with pytest.raises(ApiError) as err:
        api.parse_request(body)
    assert err.value.status == 400 and err.value.param == param
    assert "\n" not in err.value.message


@pytest.mark.parametrize(("api", "body"), [
    (anthropic_messages, {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "title?"}],
                          "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}),
    (responses, {"model": "m", "input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}),
    (openai_chat, {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                   "response_format": {"type": "json_object"}}),
])
def test_structured_output_is_accepted_unconstrained_and_counted(api, body):
    """Claude Code's title call asks for a JSON schema on every run: a refusal would be an API error per episode."""
    assert "structured_output" in api.parse_request(body).ignored


@pytest.mark.parametrize(("api", "body"), [
    (responses, {"model": "m", "input": "hi", "tools": [
        {"type": "web_search"}, {"type": "file_search", "vector_store_ids": []}, {"type": "computer_use_preview"},
        {"type": "function", "name": "exec_command", "parameters": SHELL}]}),
    (anthropic_messages, {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "web_search_20250305", "name": "web_search"}, {"type": "bash_20250124", "name": "bash"},
        {"name": "Bash", "input_schema": SHELL}]}),
])
def test_hosted_tools_merely_offered_are_left_out_and_counted(api, body):
    """Codex CLI offers web search on every request: the model is offered only the tools the client runs."""
    request = api.parse_request(body)
    assert [t["function"]["name"] for t in request.tools] in (["exec_command"], ["Bash"])
    assert "hosted_tools" in request.ignored


def test_a_mid_conversation_system_message_stays_in_place():
    """Claude Code's mid-conversation-system beta sends ``role: system`` inside ``messages``."""
    request = anthropic_messages.parse_request({"model": "m", "max_tokens": 8, "system": "S", "messages": [
        {"role": "user", "content": "task"},
        {"role": "system", "content": [{"type": "text", "text": "Agent types: ..."}]},
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]})
    assert [m["role"] for m in request.messages] == ["system", "user", "system", "assistant", "user"]
    assert request.messages[2]["content"] == "Agent types: ..."


# ----------------------------------------------------------------------------------------------------------------
# Responses: custom tools, reasoning pass-back, allowed_tools


def test_custom_tool_is_offered_as_one_string_argument_and_comes_back_as_custom_items():
    body = {"model": "m", "input": [
        {"role": "user", "content": "fix it"},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin Patch\n"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done!"},
    ], "tools": [{"type": "custom", "name": "apply_patch", "description": "Edit files.",
                  "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR}},
                 {"type": "function", "name": "shell", "parameters": SHELL}]}
    request = responses.parse_request(body)
    assert request.freeform_tools == frozenset({"apply_patch"})
    schema = request.tools[0]["function"]["parameters"]
    assert schema["required"] == ["input"] and PATCH_GRAMMAR in schema["properties"]["input"]["description"]
    assert request.messages[1]["tool_calls"][0]["function"] == {
        "name": "apply_patch", "arguments": json.dumps({"input": "*** Begin Patch\n"})}
    assert request.messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "Done!"}


def test_custom_tool_call_round_trip_through_a_session_extends_the_sample(tok):
    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
    engine = ScriptedEngine(tok, {"fix it": [call("apply_patch", input=patch), "Patched."]})
    session = Session("s", engine=engine, chat=ChatTokenizer(tok), parser=get_tool_parser("hermes"),
                      settings=SessionSettings(prompt_length=1024, response_length=1024, max_model_len=2048))
    tools = [{"type": "custom", "name": "apply_patch", "description": "Edit files.",
              "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR}}]
    first = responses.parse_request({"model": "m", "input": [{"role": "user", "content": "fix it"}], "tools": tools,
                                     "stream": True})
    result = asyncio.run(session.complete(first))
    body = responses.response_body(result, first)
    item = body["output"][-1]
    assert item["type"] == "custom_tool_call" and item["input"] == patch
    events = [json.loads(f.split("data: ", 1)[1]) for f in responses.stream_events(result, first)]
    kinds = [e["type"] for e in events]
    assert "response.custom_tool_call_input.done" in kinds and "response.function_call_arguments.delta" not in kinds
    assert "".join(e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta") == patch
    second = responses.parse_request({"model": "m", "tools": tools, "input": [
        {"role": "user", "content": "fix it"},
        {"type": "custom_tool_call", "call_id": item["call_id"], "name": "apply_patch", "input": item["input"]},
        {"type": "custom_tool_call_output", "call_id": item["call_id"], "output": "Done!"}]})
    asyncio.run(session.complete(second))
    assert len(session.samples) == 1 and session.samples[0].turns == 2  # an extension, not a fork


def test_reasoning_passed_back_in_encrypted_content_is_the_reasoning():
    result_request = responses.parse_request({"model": "m", "input": "hi",
                                              "include": ["reasoning.encrypted_content"]})
    assert result_request.reasoning_passback
    from mcore_agentic.endpoint.turn import TurnResult
    result = TurnResult(content="ok", reasoning="think: 2+2=4", tool_calls=[], finish_reason="stop",
                        prompt_tokens=3, completion_tokens=4, model="m")
    item = responses.response_body(result, result_request)["output"][0]
    assert item["type"] == "reasoning" and item["encrypted_content"].startswith(responses.REASONING_PASSBACK)
    back = responses.parse_request({"model": "m", "input": [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "id": item["id"], "summary": [], "encrypted_content": item["encrypted_content"]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
        {"role": "user", "content": "more"}]})
    assert back.messages[1] == {"role": "assistant", "content": "ok", "reasoning_content": "think: 2+2=4"}
    foreign = responses.parse_request({"model": "m", "input": [
        {"type": "reasoning", "summary": [], "encrypted_content": "gAAAAB-someone-elses"}]})
    assert foreign.messages[0]["reasoning_content"] == ""


@pytest.mark.parametrize(("choice", "want"), [
    ({"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "shell"}]}, "auto"),
    ({"type": "allowed_tools", "mode": "required", "tools": []}, "required"),
    ({"type": "custom", "name": "apply_patch"}, "apply_patch"),
])
def test_responses_tool_choice_forms(choice, want):
    assert responses.parse_request({"model": "m", "input": "hi", "tool_choice": choice}).tool_choice == want


# ----------------------------------------------------------------------------------------------------------------
# Anthropic count_tokens


def test_count_tokens_is_the_renders_prompt_length(tok):
    chat = ChatTokenizer(tok)
    session = Session("s", engine=ScriptedEngine(tok, {}), chat=chat, parser=get_tool_parser("hermes"),
                      settings=SessionSettings(prompt_length=1024, response_length=1024, max_model_len=2048))
    body = {"model": "m", "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "count me"}],
            "tools": [{"name": "Bash", "description": "Run", "input_schema": SHELL}]}
    request = anthropic_messages.parse_count_request(body)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "count me"}]
    want = len(chat.prompt_ids(messages, tools=request.tools))
    assert session.count_tokens(request) == want
    assert session.samples == [] and session.counts["count_tokens"] == 1 and session.side_requests() == 1
    assert session.ignored["cache_control"] == 1
    with pytest.raises(ApiError) as err:
        anthropic_messages.parse_request(body)  # a Messages request still needs max_tokens
    assert err.value.param == "max_tokens"


# ----------------------------------------------------------------------------------------------------------------
# Side requests


def _session(tok: Any, scripts: dict[str, list[str]]) -> Session:
    return Session("s", engine=ScriptedEngine(tok, scripts), chat=ChatTokenizer(tok), parser=get_tool_parser("hermes"),
                   settings=SessionSettings(prompt_length=1024, response_length=1024, max_model_len=2048))


def test_side_calls_open_threads_of_their_own_and_never_fork_the_episode(tok):
    tools = [{"type": "function", "function": {"name": "shell", "parameters": SHELL}}]
    session = _session(tok, {"Generate a title": ["Listing files"], "TASK": [call("shell", command="ls"), "Done."],
                             "Is this a new topic": ['{"isNewTopic": false}']})
    main_system = {"role": "system", "content": "You are a coding agent."}
    task = {"role": "user", "content": "TASK: list the files"}

    async def episode() -> None:
        # the harness's first call is a title for the task (no tools, another system prompt)...
        await session.complete(TurnRequest(messages=[{"role": "system", "content": "Generate a title."}, task],
                                           model="policy"))
        # ...then the real conversation
        history = [main_system, task]
        r1 = await session.complete(TurnRequest(messages=history, tools=tools, model="policy"))
        history += [{"role": "assistant", "content": r1.content, "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in r1.tool_calls]}, {"role": "tool", "tool_call_id": r1.tool_calls[0].id, "content": "a b"}]
        # a topic check on the small model between turns
        await session.complete(TurnRequest(messages=[{"role": "user", "content": "Is this a new topic? " + task[
            "content"]}], model="small"))
        await session.complete(TurnRequest(messages=history, tools=tools, model="policy"))

    asyncio.run(episode())
    main = session.main_samples()
    assert len(main) == 1 and main[0].turns == 2 and main[0].fork_reason == "start"
    assert [s.fork_reason for s in session.side_samples()] == ["start", "start"]
    assert session.side_requests() == 2
    assert not any(s.fork_reason == "tools_changed" for s in session.samples)
    summary = session.summary()
    assert [s["side"] for s in summary["samples"]] == [True, False, True]


def test_a_changed_tool_list_within_the_thread_is_still_a_fork(tok):
    shell = [{"type": "function", "function": {"name": "shell", "parameters": SHELL}}]
    more = [*shell, {"type": "function", "function": {"name": "read", "parameters": SHELL}}]
    session = _session(tok, {"TASK": ["First.", "Second."]})
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "TASK"}]

    async def episode() -> None:
        r = await session.complete(TurnRequest(messages=messages, tools=shell))
        await session.complete(TurnRequest(messages=[*messages, {"role": "assistant", "content": r.content},
                                                     {"role": "user", "content": "again"}], tools=more))

    asyncio.run(episode())
    assert [s.fork_reason for s in session.samples] == ["start", "tools_changed"]
    assert len(session.main_samples()) == 2 and not session.side_samples()
