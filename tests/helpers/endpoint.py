"""Shared fixtures of the endpoint's end-to-end tests: one live server per module, sessions added and removed per
test, an engine wrapper that records every generation, and the token-exactness assertions on a session's samples."""

from __future__ import annotations

import functools
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from mcore_agentic.endpoint.samples import Sample, SessionSettings
from mcore_agentic.endpoint.server import EndpointServer, Limits, SessionRegistry, build_app
from mcore_agentic.endpoint.session import Session
from mcore_agentic.rollout.engines.base import GenerationOutput, SamplingParams
from mcore_agentic.rollout.tokenization import ChatTokenizer
from mcore_agentic.rollout.tool_parser import get_tool_parser
from tests.unit.rollout.scripted import ScriptedEngine

SETTINGS = SessionSettings(prompt_length=1024, response_length=1024, max_model_len=2048)


@functools.cache
def qwen_tokenizer(template: str = "qwen2_5", vocab_size: int = 4096) -> Any:
    """The tiny-vocab Qwen tokenizer of ``template`` (loaded once per process)."""
    from mcore_agentic.models.tokenizer import load_qwen_tokenizer

    return load_qwen_tokenizer(template, vocab_size=vocab_size)


@dataclass
class Generation:
    prompt: list[int]
    ids: list[int]
    log_probs: list[float]


class RecordingEngine:
    """A ``RolloutEngine`` that forwards to ``engine`` and records every prompt it was fed and what it returned."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.weight_version = 0
        self.generations: list[Generation] = []

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        out = await self.engine.generate(list(prompt_ids), params)
        self.generations.append(Generation(list(prompt_ids), list(out.token_ids), list(out.log_probs)))
        return out


def scripted(scripts: dict[str, list[str]], *, tokenizer: Any = None, **kw: Any) -> RecordingEngine:
    """A recording :class:`ScriptedEngine` (the qwen2_5 tokenizer unless ``tokenizer``)."""
    return RecordingEngine(ScriptedEngine(tokenizer or qwen_tokenizer(), scripts, **kw))


@dataclass
class Endpoint:
    """A live endpoint (uvicorn on its own thread) over a registry the tests add sessions to."""

    registry: SessionRegistry
    server: EndpointServer
    opened: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, limits: Limits = Limits()) -> Endpoint:
        registry = SessionRegistry()
        return cls(registry, EndpointServer(build_app(registry, limits)))

    @property
    def url(self) -> str:
        return self.server.url

    def open(self, engine: Any, *, settings: SessionSettings = SETTINGS, tokenizer: Any = None,
             session_id: str | None = None, seed: int | None = None) -> Session:
        """A new session on ``engine`` (hermes tool calls, the qwen2_5 template unless ``tokenizer``)."""
        session_id = session_id or secrets.token_hex(8)
        session = Session(session_id, engine=engine, chat=ChatTokenizer(tokenizer or qwen_tokenizer()),
                          parser=get_tool_parser("hermes"), settings=settings, seed=seed)
        self.registry.add(session)
        self.opened.append(session_id)
        return session

    def openai_url(self, session: Session) -> str:
        return f"{self.url}/sessions/{session.id}/v1"

    def anthropic_url(self, session: Session) -> str:
        return f"{self.url}/sessions/{session.id}"

    def close_sessions(self) -> None:
        while self.opened:
            self.registry.remove(self.opened.pop())

    def close(self) -> None:
        self.close_sessions()
        self.server.close()


def serve(limits: Limits = Limits()) -> Iterator[Endpoint]:
    """A module fixture's body: yields a live endpoint, closes it after the module."""
    endpoint = Endpoint.start(limits)
    try:
        yield endpoint
    finally:
        endpoint.close()


# ----------------------------------------------------------------------------------------------- assertions
def sampled_spans(sample: Sample) -> list[tuple[int, int]]:
    """The ``[start, end)`` spans of the sample's loss mask 1, in order."""
    mask, spans, i = sample.trajectory.loss_mask, [], 0
    while i < len(mask):
        if mask[i]:
            j = i
            while j < len(mask) and mask[j]:
                j += 1
            spans.append((i, j))
            i = j
        else:
            i += 1
    return spans


def strict_diffs(session: Session, sample: Sample) -> list[dict[str, str]]:
    """The strict end-of-trajectory check of ``sample``, called as the agent source calls it (a turn cut at the
    length budget is truncated)."""
    t = sample.trajectory
    return session.chat.check_trajectory(t.ids, t.loss_mask, sample.messages, tools=sample.tools,
                                         num_prompt_messages=sample.num_prompt_messages,
                                         used_fallback=sample.tokens.used_fallback, mode="strict",
                                         truncated=sample.finish_reason == "length", ids_text=sample.tokens.text)


def assert_sample_exact(session: Session, sample: Sample, generations: list[Generation], *,
                        strict: bool = True) -> None:
    """``sample`` is exactly ``generations`` (in order) plus environment deltas: each generation was fed the
    sample's ids so far (token in), its ids are the next mask-1 span (token out) with their log-probs, and (when
    ``strict``) a full render of the sample's messages agrees token for token."""
    t = sample.trajectory
    spans = sampled_spans(sample)
    assert len(spans) == len(generations) == sample.turns, (len(spans), len(generations), sample.turns)
    assert t.prompt_len == len(generations[0].prompt)
    for (start, end), g in zip(spans, generations, strict=True):
        assert t.ids[:start] == g.prompt, "an engine call was not fed the sample's ids so far"
        assert t.ids[start:end] == g.ids, "a mask-1 span is not the ids the engine returned"
        assert t.log_probs[start:end] == g.log_probs
    assert all(p == 0.0 for p, m in zip(t.log_probs, t.loss_mask) if not m)
    if strict:
        diffs = strict_diffs(session, sample)
        assert diffs == [], diffs[:3]


def assert_one_exact_sample(session: Session, engine: RecordingEngine, *, strict: bool = True) -> Sample:
    """The session holds one sample (no fork), exactly the engine's generations (:func:`assert_sample_exact`)."""
    assert dict(session.forks) == {"start": 1}, dict(session.forks)
    (sample,) = session.samples
    assert_sample_exact(session, sample, engine.generations, strict=strict)
    return sample


def generations_of(sample: Sample, engine: RecordingEngine) -> list[Generation]:
    """The engine's generations that made ``sample`` (for a session with several samples): those fed a prefix of
    it that it continues with what they returned, in the order of its spans."""
    t = sample.trajectory
    out = []
    for start, end in sampled_spans(sample):
        found = [g for g in engine.generations if g.prompt == t.ids[:start] and g.ids == t.ids[start:end]]
        assert found, f"no engine call made the span [{start}, {end}) of sample {sample.index}"
        out.append(found[0])
    return out
