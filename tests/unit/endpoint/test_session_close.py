"""A closed session's generations are aborted before the rollout ends (GPU review C2), and what an aborted turn leaves.

When an agent program returns, fails or times out with a request still generating, its session closes: the engine
aborts that request and the rollout waits for it, so the sharding manager's ``engine.release_memory()`` right after
the rollout finds no request live (the engines refuse to release under one; SGLang's scheduler would SIGQUIT the
trainer). The aborted turn adds nothing: its sample ends at its last complete turn. The endpoint changes a session
only under its lock, and the rows are taken under it.

The transformers engine runs a real random tiny model, each decoding step slowed to 50 ms (a long turn on a loaded
GPU: a 400-token turn takes 20 s, past the rollout's bound on waiting for a closed session, shortened here to 2 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import threading
import time
from typing import Any

import pytest
import torch
import transformers

from mcore_agentic.endpoint import source as source_module
from mcore_agentic.endpoint.samples import SessionSettings
from mcore_agentic.endpoint.session import Session
from mcore_agentic.endpoint.source import AgentSource
from mcore_agentic.endpoint.turn import ApiError, TurnRequest
from mcore_agentic.rollout.config import AgentConfig, RolloutConfig
from mcore_agentic.rollout.engines.hf import HFEngine
from mcore_agentic.rollout.tokenization import ChatTokenizer
from mcore_agentic.rollout.tool_parser import get_tool_parser
from tests.helpers.endpoint import qwen_tokenizer, strict_diffs
from tests.helpers.hf import tiny_qwen2_config
from tests.unit.rollout.scripted import ScriptedEngine

STEP_S = 0.05
FIRST_TOKENS = 4
LONG_TOKENS = 400
PROMPT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
ROWS = [{"prompt": PROMPT, "data_source": "test"}]
SETTINGS = SessionSettings(prompt_length=256, response_length=768, max_model_len=1024)


class SlowHFEngine(HFEngine):
    """The transformers engine with every decoding step ``STEP_S`` long."""

    def _step(self, rows: Any, cache: Any, mask: Any) -> Any:
        time.sleep(STEP_S)
        return super()._step(rows, cache, mask)


def _engine() -> SlowHFEngine:
    """A random tiny Qwen2 whose vocabulary is the tokenizer's; it never samples a stop token (they are suppressed),
    so a turn runs to its ``max_tokens``."""
    tok = qwen_tokenizer()
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(tiny_qwen2_config(vocab=len(tok), max_positions=1024))
    return SlowHFEngine(model, seed=0, suppress_token_ids=ChatTokenizer(tok).stop_token_ids)


def _chat(base_url: str, api_key: str, messages: list[dict[str, Any]], max_tokens: int) -> tuple[str, dict, dict]:
    return (f"{base_url}/chat/completions", {"Authorization": f"Bearer {api_key}"},
            {"model": "policy", "messages": messages, "max_tokens": max_tokens})


async def agent_leaves_a_turn_generating(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    """One short turn, then a long one it stops waiting for: it returns its reward with that request generating."""
    import httpx

    messages = list(row["prompt"])
    async with httpx.AsyncClient(timeout=30.0) as client:
        url, headers, body = _chat(base_url, api_key, messages, FIRST_TOKENS)
        first = await client.post(url, headers=headers, json=body)
        first.raise_for_status()
        messages += [first.json()["choices"][0]["message"], {"role": "user", "content": "Go on, at length."}]
        url, headers, body = _chat(base_url, api_key, messages, LONG_TOKENS)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(client.post(url, headers=headers, json=body), 0.5)
    return 1.0


async def agent_times_out_generating(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    """Waits for a long turn: rollout.agent.timeout_s ends the program with its request generating."""
    import httpx

    async with httpx.AsyncClient(timeout=60.0) as client:
        url, headers, body = _chat(base_url, api_key, list(row["prompt"]), LONG_TOKENS)
        await client.post(url, headers=headers, json=body)
    return 1.0


@pytest.mark.parametrize(("program", "timeout_s"), [("agent_leaves_a_turn_generating", 30.0),
                                                    ("agent_times_out_generating", 1.0)])
def test_a_closed_sessions_generation_is_aborted_before_the_rollout_ends(program, timeout_s, monkeypatch):
    monkeypatch.setattr(source_module._settled, "__defaults__", (2.0,))  # the bound on waiting, 30 s in a run
    agent = AgentConfig(entrypoint=f"tests.unit.endpoint.test_session_close:{program}", timeout_s=timeout_s)
    cfg = RolloutConfig(prompt_length=256, response_length=768, n=1, seed=7, agent=agent)
    engine = _engine()
    source = AgentSource(cfg, engine, ChatTokenizer(qwen_tokenizer()), version=lambda: 3)
    try:
        started = time.monotonic()
        batch = source.roll_out(ROWS, cfg)
        elapsed = time.monotonic() - started
        engine.release_memory()  # what the sharding manager does next: refused while a request is generating
    finally:
        source.close()
        engine.shutdown()
    assert elapsed < LONG_TOKENS * STEP_S / 2  # the long turn was cut, not waited for
    (metrics,) = batch["request_metrics"]
    prompt_width = batch["prompts"].shape[1]
    real = batch["attention_mask"][0]
    response_len = int(real[prompt_width:].sum())
    mask, log_probs = batch["response_mask"][0], batch["rollout_log_probs"][0]
    assert not mask[response_len:].any() and not log_probs[response_len:].any()  # nothing past the row's end
    if program == "agent_times_out_generating":
        assert metrics["state"] == "failed" and metrics["agent_timed_out"] == 1 and metrics["error_type"] == "TimeoutError"
        assert mask.sum() == 0  # a failed row trains on nothing
        return
    assert ((log_probs != 0) == (mask == 1)).all()  # a log-prob on each sampled token, on nothing else
    # The program's reward stands; its row is the first turn alone: the aborted turn's message was taken back out.
    assert metrics["state"] == "completed" and batch["source_reward"] == [1.0]
    assert response_len == FIRST_TOKENS and int(mask.sum()) == FIRST_TOKENS
    assert metrics["assistant_turns"] == 1 and metrics["sanity_check_mismatch"] == 0
    messages = batch["messages"][0]
    assert len(messages) == len(PROMPT) + 1 and messages[-1]["role"] == "assistant"


def _session(engine: Any) -> Session:
    return Session("s", engine=engine, chat=ChatTokenizer(qwen_tokenizer()), parser=get_tool_parser("hermes"),
                   settings=SETTINGS, seed=3)


def _state(session: Session) -> tuple[Any, ...]:
    (sample,) = session.samples
    t = sample.trajectory
    return (list(t.ids), list(t.loss_mask), list(t.log_probs), list(t.versions), copy.deepcopy(sample.messages),
            list(sample.echo), sample.tokens.text, dict(sample.tokens.paths), sample.turns)


def test_a_turn_the_engine_aborts_leaves_its_sample_as_it_was_and_a_retry_extends_it():
    """A weight update aborts every generation: the client gets a 503, the sample is exactly as before the request
    (its new message taken back out), and the client's retry extends the sample (no ``retried`` fork)."""
    engine = _engine()
    session = _session(engine)
    history = copy.deepcopy(PROMPT)

    async def main() -> None:
        first = await session.complete(TurnRequest(messages=history, max_tokens=FIRST_TOKENS))
        history.extend([{"role": "assistant", "content": first.content}, {"role": "user", "content": "More."}])
        before = _state(session)
        steps = engine.steps_run
        cut = asyncio.create_task(session.complete(TurnRequest(messages=history, max_tokens=LONG_TOKENS)))
        while engine.steps_run < steps + 2:  # decoding the long turn
            await asyncio.sleep(0.005)
        engine.abort()
        with pytest.raises(ApiError) as refused:
            await cut
        assert refused.value.status == 503 and not session.serving
        assert _state(session) == before
        await session.complete(TurnRequest(messages=history, max_tokens=FIRST_TOKENS))

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    (sample,) = session.samples
    assert dict(session.forks) == {"start": 1} and sample.turns == 2
    assert strict_diffs(session, sample) == []


def test_a_turn_answered_after_the_session_closed_changes_nothing():
    """An engine that cannot abort (a scripted stand-in) answers after the session closed and its row was taken:
    the turn records nothing and its message is taken back out."""
    engine = ScriptedEngine(qwen_tokenizer(), {"colour": ["Blue.", "Green."]}, delay=0.3)
    session = _session(engine)

    async def main() -> None:
        first = await session.complete(TurnRequest(messages=PROMPT))
        history = [*PROMPT, {"role": "assistant", "content": first.content}, {"role": "user", "content": "Another?"}]
        before = _state(session)
        late = asyncio.create_task(session.complete(TurnRequest(messages=history)))
        while not session.serving:
            await asyncio.sleep(0.001)
        session.close()
        await source_module._settled(session, wait_s=0.05)
        assert session.serving  # no abort: the turn is still out
        with session.lock:
            row = copy.deepcopy(session.samples[0].trajectory)
        with pytest.raises(ApiError) as closed:
            await late
        assert closed.value.status == 409 and not session.serving
        assert _state(session) == before and row.ids[: len(before[0])] == before[0]

    asyncio.run(main())
    assert engine.calls == 2


def test_the_endpoint_changes_a_session_only_under_its_lock():
    """While another thread holds the session's lock (the rollout taking its rows), a request waits before it
    touches a sample."""
    session = _session(ScriptedEngine(qwen_tokenizer(), {"colour": ["Blue."]}))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        with session.lock:
            reply = asyncio.run_coroutine_threadsafe(session.complete(TurnRequest(messages=PROMPT)), loop)
            time.sleep(0.2)
            assert not reply.done() and not session.samples and not session.serving
        assert reply.result(timeout=10).content == "Blue."
        assert session.samples[0].turns == 1
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
