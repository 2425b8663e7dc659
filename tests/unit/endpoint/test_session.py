"""The session's token exactness: parity with the built-in agent loop, and a property test over client behaviours.

A client that echoes history as the endpoint returned it must get, token for token, the trajectory the built-in
loop makes for the same sampled tokens. Over random client behaviours (append, re-serialise arguments, drop
thinking, compact, edit, parallel calls) x the product's templates, every sample must be the engine's exact
ids plus exact environment deltas (every generation was fed the sample's ids so far; the mask-1 spans are what
the engine returned; a full render of the sample's messages agrees), with one fork per history rewrite and none
for an extension.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import random
from typing import Any

import pytest

from mcore_agentic.endpoint.messages import message_key
from mcore_agentic.endpoint.samples import SessionSettings
from mcore_agentic.endpoint.session import Session
from mcore_agentic.endpoint.turn import ApiError, TurnRequest
from mcore_agentic.models.tokenizer import load_qwen_tokenizer
from mcore_agentic.rollout.agent_loop import AgentContext, run_request
from mcore_agentic.rollout.config import MultiTurnConfig, RolloutConfig
from mcore_agentic.rollout.engines.base import GenerationOutput, SamplingParams
from mcore_agentic.rollout.request import RolloutRequest
from mcore_agentic.rollout.tokenization import ChatTokenizer
from mcore_agentic.rollout.tool_parser import get_tool_parser
from tests.unit.rollout.scripted import AddTool, ScriptedEngine, call

SETTINGS = SessionSettings(prompt_length=2048, response_length=2048, max_model_len=4096)


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Any]:
    return {name: load_qwen_tokenizer(name, vocab_size=4096) for name in ("qwen2_5", "qwen3", "qwen3_coder")}


def _add_schema() -> dict[str, Any]:
    return AddTool().get_openai_tool_schema()


def _client_echo(result: Any) -> dict[str, Any]:
    """The assistant message a plain openai-client program appends: the returned message as it came."""
    message: dict[str, Any] = {"role": "assistant", "content": result.content or None}
    if result.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in result.tool_calls]
    if result.reasoning is not None:
        message["reasoning_content"] = result.reasoning
    return message


def test_an_echoing_client_gets_the_built_in_loops_trajectory(tokenizers):
    tok = tokenizers["qwen2_5"]
    scripts = {"Q-add": [call("add", a=2, b=3), call("add", a=5, b=7), "The answer is 12."]}
    messages = [{"role": "system", "content": "You can use tools."}, {"role": "user", "content": "Q-add: 2+3+7?"}]
    cfg = RolloutConfig(prompt_length=512, response_length=512, multi_turn=MultiTurnConfig(max_assistant_turns=5))
    req = RolloutRequest(request_id="r0", uid="u", messages=copy.deepcopy(messages))
    loop_engine = ScriptedEngine(tok, scripts)
    ctx = AgentContext(engine=loop_engine, chat=ChatTokenizer(tok), cfg=cfg, parser=get_tool_parser("hermes"),
                       tools={"add": AddTool()})
    asyncio.run(run_request(req, ctx))
    assert req.metrics.tool_calls == 2

    engine = ScriptedEngine(tok, scripts)
    session = Session("s", engine=engine, chat=ChatTokenizer(tok), parser=get_tool_parser("hermes"),
                      settings=SessionSettings(prompt_length=512, response_length=512, max_model_len=1024))
    tools = [_add_schema()]

    async def client() -> None:
        history = copy.deepcopy(messages)
        while True:
            result = await session.complete(TurnRequest(messages=history, tools=tools))
            history.append(_client_echo(result))
            if not result.tool_calls:
                return
            for c in result.tool_calls:
                args = json.loads(c.arguments)
                history.append({"role": "tool", "tool_call_id": c.id, "content": str(args["a"] + args["b"])})

    asyncio.run(client())
    assert dict(session.forks) == {"start": 1}
    (sample,) = session.samples
    assert sample.trajectory.ids == req.trajectory.ids
    assert sample.trajectory.loss_mask == req.trajectory.loss_mask
    assert sample.trajectory.log_probs == req.trajectory.log_probs
    assert sample.trajectory.prompt_len == req.trajectory.prompt_len


# ------------------------------------------------------------------------------------------- property test
class PoolEngine:
    """A real ``RolloutEngine`` whose reply is drawn (by a hash of the prompt ids) from a pool of turns: plain
    text, one or two tool calls in the template's format, with a thinking block for thinking templates. Records
    every prompt it was fed and the ids it returned."""

    def __init__(self, tok: Any, template: str):
        self.tok, self.template = tok, template
        self.eot = tok.convert_tokens_to_ids("<|im_end|>")
        self.weight_version = 0
        self.calls: list[tuple[list[int], list[int]]] = []

    def _call_text(self, a: int, b: int) -> str:
        if self.template == "qwen3_coder":
            return (f"<tool_call>\n<function=add>\n<parameter=a>\n{a}\n</parameter>\n<parameter=b>\n{b}\n"
                    "</parameter>\n</function>\n</tool_call>")
        return call("add", a=a, b=b)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        rng = random.Random(hashlib.sha256(json.dumps(prompt_ids).encode()).digest())
        kind = rng.choice(["text", "call", "call", "two_calls"])
        a, b = rng.randrange(10), rng.randrange(10)
        gap = "\n\n" if self.template == "qwen3_coder" else "\n"  # as the template writes content before calls
        body = {"text": f"The sum is {a + b}.", "call": f"Let me add.{gap}{self._call_text(a, b)}",
                "two_calls": f"{self._call_text(a, b)}\n{self._call_text(b, a)}"}[kind]
        if self.template == "qwen3":
            body = f"<think>\nadding {a} and {b}\n</think>\n\n{body}"
        ids = self.tok.encode(body, add_special_tokens=False)[: params.max_new_tokens - 1] + [self.eot]
        self.calls.append((list(prompt_ids), ids))
        return GenerationOutput(ids, [-(1.0 + i / 100) for i in range(len(ids))], "stop")


BEHAVIOURS = ("append", "reserialise", "drop_thinking", "truncate", "edit", "user_turn")


def _act(behaviour: str, history: list[dict[str, Any]], result: Any, rng: random.Random) -> tuple[list, bool]:
    """The client's next history after ``result`` under ``behaviour``, and whether it rewrites history."""
    echo = _client_echo(result)
    rewrites = False
    if behaviour == "reserialise" and echo.get("tool_calls"):
        for c in echo["tool_calls"]:
            c["function"]["arguments"] = json.dumps(json.loads(c["function"]["arguments"]), indent=2, sort_keys=True)
            c["id"] = "call_" + c["id"]
        echo["content"] = echo["content"] or ""
        echo["extra_field"] = {"ignored": True}
    if behaviour == "drop_thinking" and echo.get("reasoning_content"):
        del echo["reasoning_content"]
        rewrites = True
    history = [*history, echo]
    if echo.get("tool_calls"):
        for c in echo["tool_calls"]:
            args = json.loads(c["function"]["arguments"])
            content: Any = str(args["a"] + args["b"])
            if behaviour == "reserialise":
                content = [{"type": "text", "text": content}]
                content = "".join(p["text"] for p in content)  # the common form joins parts (the API layer does)
            history.append({"role": "tool", "tool_call_id": c["id"], "content": content})
    else:
        history.append({"role": "user", "content": f"and {rng.randrange(100)}?"})
    if behaviour == "truncate" and len(history) > 4:
        cut = 2 if history[2]["role"] == "assistant" else 1
        while cut < len(history) - 1 and history[cut]["role"] == "tool":
            cut += 1
        history = [history[0], *history[cut:]] if history[cut]["role"] != "tool" else history
        rewrites = True
    if behaviour == "edit":
        first_user = next((i for i, m in enumerate(history) if m["role"] == "user"), None)
        if first_user is not None:
            history[first_user] = {**history[first_user], "content": history[first_user]["content"] + " (edited)"}
        rewrites = True
    return history, rewrites


@pytest.mark.parametrize("template", ["qwen2_5", "qwen3", "qwen3_coder"])
def test_samples_are_exact_and_forks_minimal(tokenizers, template):
    tok = tokenizers[template]
    chat = ChatTokenizer(tok)
    parser = get_tool_parser("qwen3_coder" if template == "qwen3_coder" else "hermes")
    tools = [_add_schema()]
    for trial in range(6):
        rng = random.Random(1000 * trial + len(template))
        engine = PoolEngine(tok, template)
        session = Session("s", engine=engine, chat=chat, parser=parser, settings=SETTINGS)
        history: list[dict[str, Any]] = [{"role": "system", "content": "Add numbers."},
                                         {"role": "user", "content": f"What is {trial}+1?"}]
        expected_forks = 1
        behaviours = [rng.choice(BEHAVIOURS) for _ in range(7)]

        async def run(session: Session, behaviours: list[str], rng: random.Random) -> None:
            nonlocal history, expected_forks
            returned: list[tuple] = []  # what the session would take as an extension: the last request + its reply
            for behaviour in behaviours:
                sent = [message_key(m) for m in history]
                if returned and not (len(sent) > len(returned) and sent[: len(returned)] == returned):
                    expected_forks += 1  # the client rewrote what it was given: exactly one new sample
                result = await session.complete(TurnRequest(messages=history, tools=tools))
                returned = [*sent, message_key(_client_echo(result))]
                history, _rewrites = _act(behaviour, history, result, rng)

        asyncio.run(run(session, behaviours, rng))
        assert sum(session.forks.values()) == expected_forks, (behaviours, dict(session.forks))
        by_prompt = {}
        for prompt, out in engine.calls:
            by_prompt.setdefault(len(prompt), []).append((prompt, out))
        for sample in session.samples:
            t = sample.trajectory
            spans, i = [], t.prompt_len
            while i < len(t.ids):  # the mask-1 spans, each one generation's ids
                if t.loss_mask[i]:
                    j = i
                    while j < len(t.ids) and t.loss_mask[j]:
                        j += 1
                    spans.append((i, j))
                    i = j
                else:
                    i += 1
            assert len(spans) == sample.turns
            for start, end in spans:  # token in: the engine was fed exactly the sample so far, and sampled these
                fed = [p for p, out in engine.calls if p == t.ids[:start] and out == t.ids[start:end]]
                assert fed, (template, trial, behaviours)
            diffs = chat.check_trajectory(t.ids, t.loss_mask, sample.messages, tools=sample.tools,
                                          num_prompt_messages=sample.num_prompt_messages,
                                          used_fallback=sample.tokens.used_fallback, mode="strict")
            assert diffs == [], (template, trial, behaviours, diffs[:2])


def test_a_prefilled_assistant_turn_and_an_unknown_previous_response_are_refused(tokenizers):
    tok = tokenizers["qwen2_5"]
    session = Session("s", engine=PoolEngine(tok, "qwen2_5"), chat=ChatTokenizer(tok), parser=get_tool_parser("hermes"),
                      settings=SETTINGS)
    with pytest.raises(ApiError) as e:
        asyncio.run(session.complete(TurnRequest(messages=[{"role": "user", "content": "hi"},
                                                           {"role": "assistant", "content": "Sure"}])))
    assert e.value.status == 400 and "prefilled" in e.value.message
    with pytest.raises(ApiError) as e:
        asyncio.run(session.complete(TurnRequest(messages=[{"role": "user", "content": "hi"}],
                                                 previous_response_id="nope")))
    assert e.value.status == 404
    assert session.samples == []


def test_a_retry_of_the_same_request_forks_as_retried(tokenizers):
    tok = tokenizers["qwen2_5"]
    session = Session("s", engine=PoolEngine(tok, "qwen2_5"), chat=ChatTokenizer(tok), parser=get_tool_parser("hermes"),
                      settings=SETTINGS)
    request = TurnRequest(messages=[{"role": "user", "content": "hi"}])
    asyncio.run(session.complete(request))
    asyncio.run(session.complete(request))
    assert dict(session.forks) == {"start": 1, "retried": 1}
