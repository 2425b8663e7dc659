"""The agent loop on scripted engines: tool calls (good, malformed, unknown, failing, slow), interactions,
turn and length limits, failures that end one request but not the batch."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from mcore_agentic.interactions.base import BaseInteraction
from mcore_agentic.models.tokenizer import load_qwen_tokenizer
from mcore_agentic.rollout.agent_loop import AgentContext, run_request
from mcore_agentic.rollout.config import MultiTurnConfig, RolloutConfig
from mcore_agentic.rollout.request import FinishReason, RequestState, RolloutRequest
from mcore_agentic.rollout.tokenization import ChatTokenizer
from mcore_agentic.rollout.tool_parser import get_tool_parser
from tests.unit.rollout.scripted import AddTool, RaisingTool, ScriptedEngine, SleepTool, call


@pytest.fixture(scope="module")
def tokenizer():
    return load_qwen_tokenizer("qwen2_5", vocab_size=4096)


def _cfg(**mt: Any) -> RolloutConfig:
    top = {k: mt.pop(k) for k in ("response_length", "prompt_length") if k in mt}
    return RolloutConfig(**{"prompt_length": 512, "response_length": 512, **top}, multi_turn=MultiTurnConfig(**mt))


def _request(question: str, rid: str = "r0", **kw: Any) -> RolloutRequest:
    messages = [{"role": "system", "content": "You can use tools."}, {"role": "user", "content": question}]
    return RolloutRequest(request_id=rid, uid="u", messages=messages, **kw)


def _run(tokenizer, requests, scripts, tools=None, interactions=None, cfg=None, engine=None):
    engine = engine or ScriptedEngine(tokenizer, scripts)
    ctx = AgentContext(
        engine=engine,
        chat=ChatTokenizer(tokenizer),
        cfg=cfg or _cfg(),
        parser=get_tool_parser("hermes"),
        tools=tools or {},
        interactions=interactions or {},
    )

    async def main():
        return await asyncio.gather(*(run_request(r, ctx) for r in requests))

    return asyncio.run(main()), engine


def _spans(mask: list[int]) -> list[tuple[int, int]]:
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_tool_call_round_trip_masks_and_rewards(tokenizer):
    AddTool.created.clear()
    AddTool.released.clear()
    add = AddTool()
    req = _request("Q-add: what is 2+3?", tools_kwargs={"add": {"create_kwargs": {"ground_truth": "5"}}})
    (req,), engine = _run(tokenizer, [req], {"Q-add": [call("add", a=2, b=3), "The answer is 5."]}, tools={"add": add})
    assert req.state is RequestState.COMPLETED and req.finish_reason is FinishReason.STOP, req.error
    t = req.trajectory
    assert len(t.ids) == len(t.loss_mask) == len(t.log_probs)
    # exactly two sampled spans: the two assistant turns, each ending with <|im_end|>
    spans = _spans(t.loss_mask)
    assert len(spans) == 2
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for a, b in spans:
        assert t.ids[b - 1] == eot
        assert t.log_probs[a:b] == pytest.approx([-(1.0 + i / 100) for i in range(b - a)])
    # the tool result sits between them with mask 0
    between = tokenizer.decode(t.ids[spans[0][1] : spans[1][0]])
    assert "<tool_response>\n5\n</tool_response>" in between
    assert all(lp == 0.0 for i, lp in enumerate(t.log_probs) if not t.loss_mask[i])
    # the engine saw exactly the trajectory's ids (token-in, token-out)
    assert engine.prompts[1] == t.ids[: spans[1][0]]
    assert [m["role"] for m in req.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert req.messages[2]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert req.tool_rewards == {"add": pytest.approx(1.1)}  # step 0.1 + calc_reward 1.0
    # per turn: the step reward at the turn that called the tool, each turn's end at its last sampled token
    assert req.turn_tool_rewards == [pytest.approx(0.1), 0.0]
    assert req.turn_ends == [b - 1 - t.prompt_len for _, b in spans]
    assert req.metrics.tool_calls == 1 and req.metrics.tool_errors == 0
    assert req.metrics.sanity_check_mismatch == 0, req.sanity_check_diffs
    assert AddTool.created == ["r0"] and AddTool.released == ["r0"]


def test_bad_calls_become_observations(tokenizer):
    add = AddTool()
    script = [
        "<tool_call>\n{not json}\n</tool_call>",
        call("nope", x=1),
        call("add", a="two", b=3),
        call("explode"),
        call("sleep", seconds=5.0),
        "I give up.",
    ]
    cfg = _cfg(max_assistant_turns=10, tool_timeout=2.0)  # 0.2 s timed out a plain add on a loaded CI machine
    tools = {"add": add, "explode": RaisingTool(), "sleep": SleepTool()}
    (req,), _ = _run(tokenizer, [_request("Q-bad")], {"Q-bad": script}, tools=tools, cfg=cfg)
    assert req.state is RequestState.COMPLETED, req.error
    assert req.finish_reason is FinishReason.STOP
    tool_texts = [m["content"] for m in req.messages if m["role"] == "tool"]
    assert len(tool_texts) == 5
    assert "not valid JSON" in tool_texts[0]
    assert "unknown tool 'nope'" in tool_texts[1]
    assert "invalid arguments for tool 'add'" in tool_texts[2]
    assert "ZeroDivisionError" in tool_texts[3]
    assert "timed out" in tool_texts[4]
    assert req.metrics.tool_calls == 5 and req.metrics.tool_errors == 5
    assert add.executions == 0
    # the malformed call's text stays in the assistant message, as sampled
    assert "{not json}" in req.messages[2]["content"]


def test_parallel_calls_run_concurrently_and_are_capped(tokenizer):
    sleep = SleepTool()
    three = "\n".join([call("sleep", seconds=0.3)] * 3)
    cfg = _cfg(max_parallel_calls=2)
    (req,), _ = _run(tokenizer, [_request("Q-par")], {"Q-par": [three, "done"]}, tools={"sleep": sleep}, cfg=cfg)
    assert req.state is RequestState.COMPLETED, req.error
    assert len(sleep.spans) == 2  # the third call was not run
    (s0, e0), (s1, e1) = sleep.spans
    assert max(s0, s1) < min(e0, e1)  # overlapping: run concurrently
    tool_texts = [m["content"] for m in req.messages if m["role"] == "tool"]
    assert tool_texts[:2] == ["slept", "slept"] and "at most 2 tool calls" in tool_texts[2]


def test_turn_limit_with_pending_tool_calls(tokenizer):
    add = AddTool()
    cfg = _cfg(max_assistant_turns=2)
    (req,), _ = _run(tokenizer, [_request("Q-loop")], {"Q-loop": [call("add", a=1, b=1)]}, tools={"add": add}, cfg=cfg)
    assert req.finish_reason is FinishReason.TOOL_CALLS
    assert req.metrics.assistant_turns == 2 and add.executions == 1
    assert req.trajectory.ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_length_limit_cuts_consistently(tokenizer):
    add = AddTool()
    cfg = _cfg(response_length=40, max_assistant_turns=10)
    (req,), _ = _run(tokenizer, [_request("Q-len")], {"Q-len": [call("add", a=1, b=1)]}, tools={"add": add}, cfg=cfg)
    t = req.trajectory
    assert req.finish_reason is FinishReason.LENGTH
    assert t.response_len <= 40
    assert len(t.ids) == len(t.loss_mask) == len(t.log_probs)
    assert req.metrics.sanity_check_mismatch == 0, req.sanity_check_diffs


def test_overlong_prompt_fails_only_that_request(tokenizer):
    cfg = _cfg(prompt_length=40)
    good = _request("Q-ok")
    bad = RolloutRequest(request_id="r1", uid="u", messages=[{"role": "user", "content": "Q-ok " + "word " * 50}])
    (r_good, r_bad), _ = _run(tokenizer, [good, bad], {"Q-ok": ["fine"]}, cfg=cfg)
    assert r_good.state is RequestState.COMPLETED, r_good.error
    assert r_bad.state is RequestState.FAILED and r_bad.finish_reason is FinishReason.ABORTED
    assert "rollout.prompt_length=40" in r_bad.error
    assert r_bad.trajectory.prompt_len == 40 and r_bad.trajectory.response_len == 0


def test_engine_failure_fails_request_and_releases_tools(tokenizer):
    AddTool.released.clear()
    add = AddTool()
    engine = ScriptedEngine(tokenizer, {"Q-": ["ok"]}, fail_on="Q-fail")
    reqs = [_request("Q-fail", "bad"), _request("Q-fine", "good")]
    (bad, good), _ = _run(tokenizer, reqs, {}, tools={"add": add}, engine=engine)
    assert bad.state is RequestState.FAILED and "scripted engine failure" in bad.error
    assert good.state is RequestState.COMPLETED
    assert sorted(AddTool.released) == ["bad", "good"]


def test_tools_kwargs_selects_tools(tokenizer):
    add, sleep = AddTool(), SleepTool()
    tools = {"add": add, "sleep": sleep}
    only_add = _request("Q-sel", tools_kwargs={"add": {}})
    unknown = _request("Q-sel", "r1", tools_kwargs={"calculator": {}})
    (r0, r1), engine = _run(tokenizer, [only_add, unknown], {"Q-sel": [call("sleep", seconds=0.0), "ok"]}, tools=tools)
    prompt = tokenizer.decode(engine.prompts[0])
    assert '"name": "add"' in prompt and '"name": "sleep"' not in prompt
    assert "unknown tool 'sleep'" in r0.messages[3]["content"]  # not this sample's tool
    assert r1.state is RequestState.FAILED and "extra_info.tools_kwargs.calculator" in r1.error


class _Teacher(BaseInteraction):
    """Says "try again" until the answer contains "42", scoring each turn."""

    async def generate_response(self, instance_id, messages, **kw):
        answer = messages[-1]["content"]
        done = "42" in answer
        return done, "Try again." if not done else "Correct.", 1.0 if done else 0.0, {}

    async def calculate_score(self, instance_id, **kw):
        return 7.0


def test_interaction_turns(tokenizer):
    teacher = _Teacher({"name": "teacher"})
    req = _request("Q-int", interaction_kwargs={"name": "teacher"})
    script = {"Q-int": ["It is 41.", "It is 40.", "It is 42."]}
    (req,), _ = _run(tokenizer, [req], script, interactions={"teacher": teacher}, cfg=_cfg(max_user_turns=5))
    assert req.state is RequestState.COMPLETED and req.finish_reason is FinishReason.STOP, req.error
    assert req.interaction_scores == [0.0, 0.0, 1.0]
    assert req.turn_interaction_scores == [0.0, 0.0, 1.0]  # each reply's score at the turn it answered
    assert req.turn_ends == [b - 1 - req.trajectory.prompt_len for _, b in _spans(req.trajectory.loss_mask)]
    assert req.interaction_final_score == 7.0
    assert [m["role"] for m in req.messages[2:]] == ["assistant", "user", "assistant", "user", "assistant"]
    assert len(_spans(req.trajectory.loss_mask)) == 3
    assert req.metrics.sanity_check_mismatch == 0

    capped = _request("Q-int", "r1", interaction_kwargs={"name": "teacher"})
    (capped,), _ = _run(tokenizer, [capped], script, interactions={"teacher": teacher}, cfg=_cfg(max_user_turns=1))
    assert capped.metrics.user_turns == 1 and capped.metrics.assistant_turns == 2


def test_requests_overlap_in_time(tokenizer):
    """Request-level async: 8 requests whose engine call takes 0.1 s finish in far less than 0.8 s."""
    engine = ScriptedEngine(tokenizer, {"Q-": ["ok"]}, delay=0.1)
    reqs = [_request(f"Q-{i}", f"r{i}") for i in range(8)]
    start = time.perf_counter()
    done, _ = _run(tokenizer, reqs, {}, engine=engine)
    assert time.perf_counter() - start < 0.6
    assert all(r.state is RequestState.COMPLETED for r in done)


@pytest.mark.parametrize("inference_template", [False, True])
def test_use_inference_chat_template(inference_template):
    """Qwen3 drops earlier reasoning once a new user query arrives: with use_inference_chat_template the
    engine's prompt does too (production-like), while the trained trajectory keeps what was sampled."""
    tok = load_qwen_tokenizer("qwen3", vocab_size=4096)
    teacher = _Teacher({"name": "teacher"})
    req = _request("Q-think", interaction_kwargs={"name": "teacher"})
    script = {"Q-think": ["<think>\nsecret plan\n</think>\n\nIt is 41.", "<think>\nretry\n</think>\n\nIt is 42."]}
    cfg = _cfg(use_inference_chat_template=inference_template)
    (req,), engine = _run(tok, [req], script, interactions={"teacher": teacher}, cfg=cfg)
    assert req.state is RequestState.COMPLETED, req.error
    assert "secret plan" in tok.decode(req.trajectory.ids)
    second_prompt = tok.decode(engine.prompts[1])
    if inference_template:
        assert "secret plan" not in second_prompt
    else:
        assert engine.prompts[1] == req.trajectory.ids[: len(engine.prompts[1])]
    assert req.metrics.template_fallback == 1  # the user turn's delta needed the base conversation
    assert req.metrics.sanity_check_mismatch == 0, req.sanity_check_diffs


def test_single_turn_when_multi_turn_disabled(tokenizer):
    add = AddTool()
    cfg = _cfg(enable=False)
    (req,), _ = _run(tokenizer, [_request("Q-one")], {"Q-one": [call("add", a=1, b=2), "never"]}, tools={"add": add}, cfg=cfg)
    assert req.finish_reason is FinishReason.STOP and req.metrics.assistant_turns == 1
    assert add.executions == 0 and "tool_calls" not in req.messages[-1]
    assert '"name": "add"' not in tokenizer.decode(req.trajectory.prompt_ids)  # no tool schemas offered
