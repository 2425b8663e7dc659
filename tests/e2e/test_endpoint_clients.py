"""The session endpoint driven by real clients from PyPI: ``openai`` (Chat Completions and Responses, whole and
streamed), ``anthropic`` (Messages, whole and streamed), the OpenAI Agents SDK and a LangGraph ReAct agent.

Each runs a multi-turn, tool-using conversation against a live endpoint (uvicorn on its own thread) whose engine
answers scripted turns (a tiny random model almost never writes a tool call), then the session must hold exactly
one sample (no fork) that is the engine's generations token for token: every engine call was fed the sample's ids
so far, the mask-1 spans are, in order, the ids it returned, and a full render of the sample's messages agrees
(``check_trajectory(mode="strict")``). A client that rewrites history gets exactly one ``rewritten`` fork. One test
runs the real tiny HF model: one sample whose loss mask is exactly its sampled ids, and the log-probs the API
returns are the sample's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from tests.helpers.endpoint import (
    Endpoint,
    assert_one_exact_sample,
    assert_sample_exact,
    generations_of,
    qwen_tokenizer,
    sampled_spans,
    scripted,
    serve,
)
from tests.unit.rollout.scripted import call

SYSTEM = "You read electricity meters with the read_meter tool."
READINGS = {"A": "20", "B": "27", "C": "5"}
METER_PARAMS = {"type": "object", "properties": {"meter": {"type": "string"}}, "required": ["meter"]}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "read_meter", "description": "Read one meter.",
                                                  "parameters": METER_PARAMS}}]

# Turn 1: text then two parallel calls; turn 2: one call; turn 3: the answer; turn 4 (after a user follow-up): text.
SCRIPT = [
    "Reading both meters.\n" + call("read_meter", meter="A") + "\n" + call("read_meter", meter="B"),
    call("read_meter", meter="C"),
    "The total is 52 kWh.",
    "That is about 1.7 kWh a day.",
]
FOLLOW_UP = "And per day, over a month?"


@pytest.fixture(scope="module")
def endpoint() -> Iterator[Endpoint]:
    yield from serve()


@pytest.fixture
def ep(endpoint: Endpoint) -> Iterator[Endpoint]:
    yield endpoint
    endpoint.close_sessions()


def _reading(arguments: str | dict[str, Any]) -> str:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    return READINGS[args["meter"]]


# ------------------------------------------------------------------------------------------- Chat Completions
def _chat_stream(client: openai.OpenAI, **kw: Any) -> tuple[dict[str, Any], str]:
    """One streamed completion as a client accumulates it: the assistant message and the finish reason."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for d in delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": None, "type": "function",
                                               "function": {"name": "", "arguments": ""}})
                if d.id:
                    c["id"] = d.id
                if d.function and d.function.name:
                    c["function"]["name"] += d.function.name
                if d.function and d.function.arguments:
                    c["function"]["arguments"] += d.function.arguments
            finish = choice.finish_reason or finish
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_openai_chat_completions_tool_loop(ep, stream):
    engine = scripted({"meters": SCRIPT})
    session = ep.open(engine)
    client = openai.OpenAI(base_url=ep.openai_url(session), api_key=session.token, max_retries=0)
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                     {"role": "user", "content": "What do the meters A, B and C read in total?"}]
    finishes, rounds = [], 0
    while True:
        kw = {"model": "policy", "messages": history, "tools": OPENAI_TOOLS}
        if stream:
            message, finish = _chat_stream(client, **kw)
        else:
            choice = client.chat.completions.create(**kw).choices[0]
            message, finish = choice.message.model_dump(exclude_none=True), choice.finish_reason
        finishes.append(finish)
        history.append(message)
        for c in message.get("tool_calls") or []:
            history.append({"role": "tool", "tool_call_id": c["id"], "content": _reading(c["function"]["arguments"])})
        if not message.get("tool_calls"):
            rounds += 1
            if rounds == 2:
                break
            history.append({"role": "user", "content": FOLLOW_UP})
    assert finishes == ["tool_calls", "tool_calls", "stop", "stop"]
    assert history[2]["content"] == "Reading both meters."
    assert [c["function"]["name"] for c in history[2]["tool_calls"]] == ["read_meter", "read_meter"]
    assert history[-1]["content"] == "That is about 1.7 kWh a day."
    sample = assert_one_exact_sample(session, engine)
    assert sample.turns == 4 and session.counts["requests"] == 4 and session.counts["malformed_calls"] == 0


# ------------------------------------------------------------------------------------------------- Responses
RESPONSES_TOOLS = [{"type": "function", "name": "read_meter", "description": "Read one meter.",
                    "parameters": METER_PARAMS, "strict": False}]


def _responses_turn(client: openai.OpenAI, stream: bool, **kw: Any) -> Any:
    """One Responses turn: the response object, taken from the stream's events when streamed (the items each
    ``response.output_item.done`` carried must be the completed response's output)."""
    if not stream:
        return client.responses.create(**kw)
    done_items, final, kinds = [], None, []
    for event in client.responses.create(stream=True, **kw):
        kinds.append(event.type)
        if event.type == "response.output_item.done":
            done_items.append(event.item)
        elif event.type == "response.completed":
            final = event.response
    assert final is not None and kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert [i.model_dump() for i in done_items] == [i.model_dump() for i in final.output]
    return final


@pytest.mark.parametrize("mode", ["whole_input", "previous_response_id"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_openai_responses_tool_loop(ep, stream, mode):
    engine = scripted({"meters": SCRIPT})
    session = ep.open(engine)
    client = openai.OpenAI(base_url=ep.openai_url(session), api_key=session.token, max_retries=0)
    items: list[Any] = [{"role": "user", "content": "What do the meters A, B and C read in total?"}]
    to_send: list[Any] = list(items)
    previous, texts, statuses, rounds = None, [], [], 0
    while True:
        kw: dict[str, Any] = {"model": "policy", "instructions": SYSTEM, "input": to_send, "tools": RESPONSES_TOOLS}
        if previous is not None:
            kw["previous_response_id"] = previous
        response = _responses_turn(client, stream, **kw)
        statuses.append(response.status)
        texts.append(response.output_text)
        outputs = [{"type": "function_call_output", "call_id": item.call_id, "output": _reading(item.arguments)}
                   for item in response.output if item.type == "function_call"]
        if not outputs:
            rounds += 1
            outputs = [{"role": "user", "content": FOLLOW_UP}]
        items += [item.model_dump(exclude_none=True) for item in response.output] + outputs
        to_send = outputs if mode == "previous_response_id" else list(items)
        previous = response.id if mode == "previous_response_id" else None
        if rounds == 2:
            break
    assert statuses == ["completed"] * 4
    assert texts == ["Reading both meters.", "", "The total is 52 kWh.", "That is about 1.7 kWh a day."]
    assert [i["type"] for i in items[1:4]] == ["message", "function_call", "function_call"]
    sample = assert_one_exact_sample(session, engine)
    assert sample.turns == 4 and session.counts["malformed_calls"] == 0


# ------------------------------------------------------------------------------------------ Anthropic Messages
ANTHROPIC_TOOLS = [{"name": "read_meter", "description": "Read one meter.", "input_schema": METER_PARAMS}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_anthropic_messages_tool_loop(ep, stream):
    engine = scripted({"meters": SCRIPT})
    session = ep.open(engine)
    client = anthropic.Anthropic(base_url=ep.anthropic_url(session), api_key=session.token, max_retries=0)
    history: list[dict[str, Any]] = [{"role": "user", "content": "What do the meters A, B and C read in total?"}]
    stops, rounds, final_texts = [], 0, []
    while True:
        kw = {"model": "policy", "max_tokens": 256, "system": SYSTEM, "messages": history, "tools": ANTHROPIC_TOOLS}
        if stream:
            with client.messages.stream(**kw) as s:
                message = s.get_final_message()
        else:
            message = client.messages.create(**kw)
        stops.append(message.stop_reason)
        history.append({"role": "assistant", "content": message.content})  # as Anthropic's docs echo it
        results = [{"type": "tool_result", "tool_use_id": b.id, "content": _reading(b.input)}
                   for b in message.content if b.type == "tool_use"]
        if results:
            history.append({"role": "user", "content": results})
            continue
        final_texts.append("".join(b.text for b in message.content if b.type == "text"))
        rounds += 1
        if rounds == 2:
            break
        history.append({"role": "user", "content": FOLLOW_UP})
    assert stops == ["tool_use", "tool_use", "end_turn", "end_turn"]
    assert [b.type for b in history[1]["content"]] == ["text", "tool_use", "tool_use"]
    assert final_texts == ["The total is 52 kWh.", "That is about 1.7 kWh a day."]
    sample = assert_one_exact_sample(session, engine)
    assert sample.messages[0] == {"role": "system", "content": SYSTEM}
    assert sample.turns == 4 and session.counts["malformed_calls"] == 0


# ------------------------------------------------------------------------------------------- OpenAI Agents SDK
AGENT_SCRIPT = [call("read_meter", meter="A"), call("read_meter", meter="B"), "Meters A and B read 47 kWh in total."]


@pytest.mark.parametrize("stream", [False, True], ids=["run", "run_streamed"])
@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_openai_agents_sdk(ep, api, stream):
    import agents

    agents.set_tracing_disabled(True)
    engine = scripted({"meters": AGENT_SCRIPT})
    session = ep.open(engine)
    read: list[str] = []

    @agents.function_tool
    def read_meter(meter: str) -> str:
        """Read one electricity meter.

        Args:
            meter: the meter's letter.
        """
        read.append(meter)
        return READINGS[meter]

    async def run() -> Any:
        client = openai.AsyncOpenAI(base_url=ep.openai_url(session), api_key=session.token, max_retries=0)
        model_cls = agents.OpenAIChatCompletionsModel if api == "chat_completions" else agents.OpenAIResponsesModel
        agent = agents.Agent(name="meter reader", instructions=SYSTEM, tools=[read_meter],
                             model=model_cls(model="policy", openai_client=client))
        question = "What do the meters A and B read in total?"
        try:
            if not stream:
                return await agents.Runner.run(agent, question, max_turns=5)
            streamed = agents.Runner.run_streamed(agent, question, max_turns=5)
            async for _event in streamed.stream_events():
                pass
            return streamed
        finally:
            await client.close()

    result = asyncio.run(run())
    assert result.final_output == "Meters A and B read 47 kWh in total."
    assert read == ["A", "B"]
    sample = assert_one_exact_sample(session, engine)
    assert sample.turns == 3


# --------------------------------------------------------------------------------------------------- LangGraph
@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")
def test_langgraph_react_agent(ep):
    from langchain_core.messages import AIMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    engine = scripted({"meters": AGENT_SCRIPT})
    session = ep.open(engine)

    @tool
    def read_meter(meter: str) -> str:
        """Read one electricity meter by its letter."""
        return READINGS[meter]

    llm = ChatOpenAI(base_url=ep.openai_url(session), api_key=session.token, model="policy", max_retries=0)
    agent = create_react_agent(llm, [read_meter], prompt=SYSTEM)
    state = agent.invoke({"messages": [("user", "What do the meters A and B read in total?")]})
    messages = state["messages"]
    tool_messages = [m for m in messages if isinstance(m, ToolMessage)]
    assert [m.content for m in tool_messages] == ["20", "27"]
    assert isinstance(messages[-1], AIMessage) and messages[-1].content == "Meters A and B read 47 kWh in total."
    assert [c["args"] for m in messages if isinstance(m, AIMessage) for c in m.tool_calls] == [{"meter": "A"},
                                                                                               {"meter": "B"}]
    sample = assert_one_exact_sample(session, engine)
    assert sample.turns == 3


# ------------------------------------------------------------------------------------ a client rewriting history
@pytest.mark.parametrize("rewrite", ["edit_user", "drop_system"])
def test_a_rewritten_history_forks_once(ep, rewrite):
    engine = scripted({"meters": AGENT_SCRIPT})
    session = ep.open(engine)
    client = openai.OpenAI(base_url=ep.openai_url(session), api_key=session.token, max_retries=0)
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                     {"role": "user", "content": "What do the meters A and B read in total?"}]
    for turn in range(3):
        message = client.chat.completions.create(model="policy", messages=history,
                                                 tools=OPENAI_TOOLS).choices[0].message.model_dump(exclude_none=True)
        history.append(message)
        for c in message.get("tool_calls") or []:
            history.append({"role": "tool", "tool_call_id": c["id"], "content": _reading(c["function"]["arguments"])})
        if turn == 1:  # after the second call: the client rewrites what it sends from now on
            if rewrite == "edit_user":
                history[1] = {"role": "user", "content": "What do the meters A and B read together?"}
            else:
                del history[0]
    assert history[-1]["content"] == "Meters A and B read 47 kWh in total."
    assert dict(session.forks) == {"start": 1, "rewritten": 1}
    first, second = session.samples
    assert (first.fork_reason, first.turns, second.fork_reason, second.turns) == ("start", 2, "rewritten", 1)
    assert engine.generations[2].prompt == second.trajectory.prompt_ids  # the fork's prompt: the render so far
    for sample in (first, second):
        assert_sample_exact(session, sample, generations_of(sample, engine))
    assert generations_of(first, engine) == engine.generations[:2]
    assert not any(second.trajectory.loss_mask[:second.trajectory.prompt_len])  # earlier turns are prompt now


# ------------------------------------------------------------------------------------------ the real tiny model
def test_the_tiny_hf_model_behind_the_openai_client(ep):
    import torch
    import transformers

    from mcore_agentic.rollout.engines.hf import HFEngine
    from tests.helpers.endpoint import RecordingEngine, strict_diffs
    from tests.helpers.hf import tiny_qwen2_config

    torch.manual_seed(0)  # a random tiny Qwen2 whose vocabulary is exactly the tokenizer's (no padding rows)
    model = transformers.Qwen2ForCausalLM(tiny_qwen2_config(vocab=len(qwen_tokenizer()), max_positions=1024))
    engine = RecordingEngine(HFEngine(model, seed=0))
    session = ep.open(engine, seed=3)
    client = openai.OpenAI(base_url=ep.openai_url(session), api_key=session.token, max_retries=0)
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."},
                                     {"role": "user", "content": "Name a colour."}]
    completion = client.chat.completions.create(model="policy", messages=history, max_tokens=12, logprobs=True)
    choice = completion.choices[0]
    assert choice.finish_reason == "length"  # no end of turn: the follow-up's delta must close the turn itself
    first = [lp.logprob for lp in choice.logprobs.content]
    history += [choice.message.model_dump(exclude_none=True), {"role": "user", "content": "Another one?"}]

    content, second, usage = "", [], None
    for chunk in client.chat.completions.create(model="policy", messages=history, max_tokens=12, logprobs=True,
                                                stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            content += c.delta.content or ""
            if c.logprobs is not None:
                second += [lp.logprob for lp in c.logprobs.content or []]
    history.append({"role": "assistant", "content": content})

    sample = assert_one_exact_sample(session, engine, strict=False)
    t = sample.trajectory
    spans = sampled_spans(sample)
    assert sum(t.loss_mask) == sum(len(g.ids) for g in engine.generations)  # the mask is exactly the sampled ids
    assert [t.log_probs[a:b] for a, b in spans] == [first, second]  # one log-prob per sampled token, the sample's
    assert len(first) == completion.usage.completion_tokens and len(second) == usage.completion_tokens
    assert all(p < 0 for p in first + second)
    assert strict_diffs(session, sample) == []


# ----------------------------------------------------------------------------------------- a thinking template
THINKING_SCRIPT = [
    "<think>\nI need meter A first.\n</think>\n\n" + call("read_meter", meter="A"),
    "<think>\nNow meter B.\n</think>\n\nChecking B.\n" + call("read_meter", meter="B"),
    "<think>\n20 + 27 = 47.\n</think>\n\nThe total is 47 kWh.",
    "<think>\n47 / 30 is about 1.6.\n</think>\n\nAbout 1.6 kWh a day.",
]


def _thinking_openai_chat(client: openai.OpenAI, history: list[dict[str, Any]]) -> tuple[list[Any], list[Any]]:
    message = client.chat.completions.create(model="policy", messages=history, tools=OPENAI_TOOLS).choices[0].message
    echo = message.model_dump(exclude_none=True)  # reasoning_content rides along as an extra field
    results = [{"role": "tool", "tool_call_id": c.id, "content": _reading(c.function.arguments)}
               for c in message.tool_calls or []]
    return [echo, *results], [echo.get("reasoning_content")]


@pytest.mark.parametrize("api", ["chat_completions", "responses", "messages"])
def test_a_thinking_templates_reasoning_round_trips_through_each_client(ep, api):
    """qwen3: each client sends our reasoning back in its own form (``reasoning_content``, a ``reasoning`` item, a
    ``thinking`` block with its empty signature); the session extends one sample, token for token."""
    engine = scripted({"meters": THINKING_SCRIPT}, tokenizer=qwen_tokenizer("qwen3"))
    session = ep.open(engine, tokenizer=engine.engine.tokenizer)
    question = "What do the meters A and B read in total?"
    reasoning: list[str] = []
    if api == "messages":
        claude = anthropic.Anthropic(base_url=ep.anthropic_url(session), api_key=session.token, max_retries=0)
        history: list[Any] = [{"role": "user", "content": question}]
        for _ in range(4):
            message = claude.messages.create(model="policy", max_tokens=256, messages=history, tools=ANTHROPIC_TOOLS)
            history.append({"role": "assistant", "content": message.content})
            reasoning += [b.thinking for b in message.content if b.type == "thinking"]
            results = [{"type": "tool_result", "tool_use_id": b.id, "content": _reading(b.input)}
                       for b in message.content if b.type == "tool_use"]
            history.append({"role": "user", "content": results or FOLLOW_UP})
    elif api == "responses":
        client = openai.OpenAI(base_url=ep.openai_url(session), api_key=session.token, max_retries=0)
        items: list[Any] = [{"role": "user", "content": question}]
        for _ in range(4):
            response = client.responses.create(model="policy", input=items, tools=RESPONSES_TOOLS)
            items += [item.model_dump(exclude_none=True) for item in response.output]
            reasoning += [i.content[0].text for i in response.output if i.type == "reasoning"]
            outputs = [{"type": "function_call_output", "call_id": i.call_id, "output": _reading(i.arguments)}
                       for i in response.output if i.type == "function_call"]
            items += outputs or [{"role": "user", "content": FOLLOW_UP}]
    else:
        client = openai.OpenAI(base_url=ep.openai_url(session), api_key=session.token, max_retries=0)
        history = [{"role": "user", "content": question}]
        for _ in range(4):
            sent, thought = _thinking_openai_chat(client, history)
            history += sent if len(sent) > 1 else [*sent, {"role": "user", "content": FOLLOW_UP}]
            reasoning += thought
    assert reasoning == ["I need meter A first.", "Now meter B.", "20 + 27 = 47.", "47 / 30 is about 1.6."]
    sample = assert_one_exact_sample(session, engine)
    assert sample.turns == 4
