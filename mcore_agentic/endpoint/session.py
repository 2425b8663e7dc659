"""One agent episode behind the endpoint: token-exact samples from the messages a client sends.

A client (an agent program) sends the whole conversation with every request. The session keeps, per
*sample*, the exact ids it fed and sampled (a :class:`~mcore_agentic.rollout.request.Trajectory`), the
messages as the chat template renders them (our assistant turns as sampled) and the messages as the client
should echo them back (:attr:`Sample.echo`). Each request is matched against the samples:

* **extension** — the request's messages start with a sample's whole echo (compared as a client may
  rewrite them: arguments JSON re-serialised, ``content`` null vs ``""``, content parts, reordered keys,
  whitespace around the model's text, extra fields, tool-call ids) and add messages after our last turn: only
  the new messages are delta-tokenized (:class:`~mcore_agentic.rollout.tokenization.ConversationTokenizer`,
  the built-in loop's own path) and the engine continues from the sample's exact ids. No fork.
* **fork** — no sample extends: a new sample starts from the render of the request's messages, its earlier
  assistant turns now prompt (loss mask 0). Sampled text is never re-tokenized into a sample's trained ids.
  The reason is counted: ``start`` (the first request), ``tools_changed``, ``thinking_dropped`` (the client
  sent our turn back without its reasoning), ``retried`` (the request re-sends a prefix of a sample's
  history: a retry or a branch), ``rewritten`` (a message differs: an edit, a compaction, a truncation),
  ``concurrent`` (the sample it extends has a request in flight).

Samples belong to **threads**. Harnesses make side calls beside the episode's conversation (a title, a topic or
"next speaker" check, a bash-command safety check, a summary: another model name, another system prompt, no tool
list) that must not fork or pollute it. A request joins the thread of an existing sample when it names the same
model, offers tools or not alike, and has the same system text or the same first user message; otherwise it opens
a thread of its own (its first sample's reason is ``start``, like the episode's first). Forks are matched and
named within a thread only. When the episode ends, its **main thread** is the one that sampled the most turns
(ties: the one that sampled last); every other thread's samples are side samples (:meth:`Session.side_samples`),
served and recorded, trained only when ``rollout.agent.side_requests=train``.

Every sample's loss mask covers exactly the tokens the engine sampled for it; :meth:`Session.samples` hands
them to the trainer (or, standalone, to the samples route).

A turn that samples nothing — the engine aborted it, or failed — leaves its sample as it was before the request:
the request's new messages are taken back out (ids, messages, what the client echoes, the tokenizer's text), so a
retry of the same request extends the sample again. :meth:`Session.close` ends the episode from another thread
(the rollout's): no request starts any more and the engine aborts the turns still generating (each is such a turn);
:attr:`Session.serving` says when the last of them has ended. The endpoint's loop changes the session only under
:attr:`Session.lock` (never across an await), and whoever reads a closed session's samples holds it too, so a
sample is never read half-changed.

What a session records is :mod:`.samples`; how messages compare and render, :mod:`.messages`. This module stays one
class over ~500 lines: matching, forking, sampling and recording are one state machine under one lock discipline,
and splitting it would spread that discipline over modules.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import json
import logging
import secrets
import threading
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from mcore_agentic.endpoint.messages import (
    bare_id,
    cut_at_stop,
    message_key,
    mismatch_reason,
    renderable,
    split_reasoning,
    tools_key,
)
from mcore_agentic.endpoint.round_gate import RoundClosed, RoundGate
from mcore_agentic.endpoint.samples import Mark, Sample, Segment, SessionSettings, ThreadKey, Turn, prompt_digest
from mcore_agentic.endpoint.turn import ApiError, TokenLogprob, ToolCallOut, TurnFinish, TurnRequest, TurnResult
from mcore_agentic.rollout.agent_loop import assistant_message
from mcore_agentic.rollout.engines.base import GenerationOutput, RolloutEngine, SamplingParams, engine_event_loop
from mcore_agentic.rollout.request import Trajectory
from mcore_agentic.rollout.tokenization import ChatTokenizer
from mcore_agentic.rollout.tool_call import ToolCall, ToolCallError, ToolCallParser

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 1.0
"""How often a request held for a round looks whether its client is still there."""


def call_id(seed: int, generation: int, index: int) -> str:
    """A tool call's id from the session's seed, its turn and the call's place: 9 hex characters, as
    :func:`~mcore_agentic.rollout.tool_call.new_call_id` makes, the same on every run of the turn."""
    return hashlib.sha256(f"{seed}:{generation}:{index}".encode()).hexdigest()[:9]


MAX_STORED_RESPONSES = 64
"""Responses a session keeps for ``previous_response_id`` (the latest ones)."""
FORK_REASONS: tuple[str, ...] = ("start", "tools_changed", "thinking_dropped", "retried", "rewritten", "concurrent")
_TURN_NUMBERS = itertools.count()  # turn keys are unique in the process: an engine's request ids, shared by sessions


class Session:
    """One agent episode (see the module docstring). Every request of a session runs on the endpoint's loop;
    :meth:`close` and the reads of a closed session come from another thread, under :attr:`lock`."""

    def __init__(self, session_id: str, *, engine: RolloutEngine, chat: ChatTokenizer, parser: ToolCallParser,
                 settings: SessionSettings, version: Callable[[], int] = lambda: 0, seed: int | None = None,
                 token: str | None = None):
        self.id = session_id
        self.token = token or secrets.token_urlsafe(32)
        self.engine = engine
        self.chat = chat
        self.parser = parser
        self.settings = settings
        self.version = version
        self.seed = seed
        self.samples: list[Sample] = []
        self.forks: Counter[str] = Counter()
        self.counts: Counter[str] = Counter()
        self.responses: dict[str, list[dict[str, Any]]] = {}
        """Responses API: each response's whole conversation (input + output), for ``previous_response_id``."""
        self.generations = 0
        self.closed = False
        self.thinking = "</think>" in str(getattr(chat.tokenizer, "chat_template", "") or "")
        self.reward: float | None = None
        """A reward the agent reported through the session's reward route (its sum, per-turn posts included), or None."""
        self.turn_refs: dict[str, tuple[Sample, int]] = {}
        """Each response's sample and the sample's turn it sampled (``/reward`` with ``turn``), by response id."""
        self.latest_turn: tuple[Sample, int] | None = None
        self.ignored: Counter[str] = Counter()
        """Requests that carried each field the endpoint accepts and ignores (:mod:`.field_policy`), by name."""
        self.lock = threading.Lock()
        """Held while the endpoint's loop changes the session (never across an await), by :meth:`close`, and by
        whoever reads a closed session's samples (the rollout takes its rows under it)."""
        self._turns: dict[str, Turn] = {}  # the turns the engine is sampling, by key
        self._abortable = callable(getattr(engine, "abort", None))  # a scripted stand-in may not abort
        self.gate: RoundGate | None = None
        """A rollout source's sessions (:mod:`.round_gate`): every engine call waits for a round and samples at most
        its tokens, and the session records its calls (:attr:`tape`). None (standalone): calls run at once."""
        self.tape: list[Segment] = []
        """Every engine call the session made, in order (sessions of a rollout source): what it is resumed from."""
        self.replay: deque[Segment] = deque()
        """A resumed session's earlier calls: a call that asks what the next one asked is answered by it (the program
        runs again from its start and, if it is deterministic, reaches where it stood); the first call that differs
        ends the replay and goes to the engine."""
        self.replay_diverged = False
        self.open_tokens = 0
        """Tokens of a turn cut by the round's token budget (the turn goes on in the next round)."""

    # ------------------------------------------------------------------------------------------- closing
    def close(self) -> None:
        """End the episode: no request starts any more, and the engine aborts the turns still generating (they
        sample nothing: each sample stays as its last complete turn left it). Thread-safe; idempotent."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            keys = [key for key, turn in self._turns.items() if not turn.answered]
        if self.gate is not None:
            self.gate.end()
        if keys and self._abortable:
            self.engine.abort(keys)

    @property
    def held(self) -> bool:
        """Whether every request of the session in progress waits for a round that does not let it run (a rollout
        source's round is over for the session)."""
        g = self.gate
        return g is not None and g.waiting > 0 and g.waiting == len(self._turns) and not g.allows

    def first_version(self) -> int | None:
        """The weight version of the session's first engine call (None before one)."""
        return min((s.version for s in self.tape), default=None)

    @property
    def serving(self) -> bool:
        """Whether a turn is still being sampled (after :meth:`close`: until the engine has answered the aborts)."""
        return bool(self._turns)

    def _closed_error(self) -> ApiError:
        return ApiError(409, f"session {self.id} is closed: its episode has ended", code="session_closed")

    # ------------------------------------------------------------------------------------------- a turn
    async def complete(self, request: TurnRequest, *,
                       disconnected: Callable[[], Awaitable[bool]] | None = None) -> TurnResult:
        """Sample the assistant turn ``request`` asks for, on the sample it extends or on a new one. ``disconnected``:
        whether the client has gone (a request held for a round is then abandoned, and taken back out)."""
        if self.closed:
            raise self._closed_error()
        with self.lock:
            turn = self._begin(request)
        try:
            out, versions = await self._generate(turn, disconnected)
        except RoundClosed:
            with self.lock:
                self._end(turn, sampled=False)
            raise self._closed_error() from None
        except BaseException:
            with self.lock:
                self._end(turn, sampled=False)
            raise
        turn.answered = True
        with self.lock:
            if self.closed or out.finish_reason == "abort":
                self._end(turn, sampled=False)
                if self.closed:
                    raise self._closed_error()
                raise ApiError(503, "the engine aborted this generation (its weights are being updated); retry",
                               type="api_error")
            try:
                return self._sampled(turn, out, versions)
            finally:
                self._end(turn, sampled=True)

    async def _generate(self, turn: Turn, disconnected: Callable[[], Awaitable[bool]] | None = None,
                        ) -> tuple[GenerationOutput, list[int]]:
        """The engine's answer to ``turn`` and the weight version of each of its tokens: one call, or under a
        :attr:`gate` one per round the round's tokens cut it into (each goes on from the last's exact ids and random
        stream); a call :attr:`replay` holds is answered from it."""
        ids: list[int] = []
        log_probs: list[float] = []
        versions: list[int] = []
        while True:
            left, prompt = turn.budget - len(ids), turn.prompt_ids + ids
            seg = self._replayed(prompt, len(ids))
            if seg is not None:
                out, n, version = seg.output(), seg.max_new_tokens, seg.version
            else:
                allowance = None if self.gate is None else await self._take(disconnected)
                n = left if allowance is None else min(left, allowance)
                params = dataclasses.replace(turn.params, max_new_tokens=n, draws_before=len(ids))
                version = self.version()
                out = await engine_call(self.engine, prompt, params, request_id=turn.key if self._abortable else None)
                if self.gate is not None:
                    self.gate.spent(min(len(out.token_ids), n))
                    if out.finish_reason != "abort":
                        self.tape.append(Segment(prompt_digest(prompt), len(ids), n, list(out.token_ids),
                                                 list(out.log_probs), out.finish_reason, version, out.routed_experts))
            got = list(out.token_ids[:n])
            ids += got
            log_probs += list(out.log_probs[:n])
            versions += [version] * len(got)
            ended = bool(got) and got[-1] in self.chat.stop_token_ids
            if out.finish_reason == "length" and not ended and n < left and len(got) >= n:
                self.open_tokens = len(ids)  # cut by the round's tokens: the turn goes on in the next round
                continue
            self.open_tokens = 0
            finish = "length" if len(out.token_ids) > n else out.finish_reason
            return GenerationOutput(ids, log_probs, finish, routed_experts=out.routed_experts), versions

    async def _take(self, disconnected: Callable[[], Awaitable[bool]] | None) -> int | None:
        """A turn from the round gate; a client that goes while its request waits abandons it (408; the turn is taken back out)."""
        assert self.gate is not None
        if disconnected is None:
            return await self.gate.take()
        waiting = asyncio.ensure_future(self.gate.take())
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=DISCONNECT_POLL_S)
            if done:
                return waiting.result()
            if await disconnected():
                waiting.cancel()
                await asyncio.gather(waiting, return_exceptions=True)
                raise ApiError(408, f"session {self.id}: the client went while its request waited for a round",
                               type="api_error", code="client_gone")

    def _replayed(self, prompt: list[int], draws_before: int) -> Segment | None:
        """The recorded call that asked for ``prompt`` (see :attr:`replay`), re-recorded; None to sample. A harness's
        concurrent calls may start in another order than they were recorded in, so any recorded call matches."""
        if not self.replay:
            return None
        digest = prompt_digest(prompt)
        seg = next((r for r in self.replay if r.prompt == digest and r.draws_before == draws_before), None)
        if seg is not None:
            self.replay.remove(seg)
            self.tape.append(seg)
            return seg
        logger.warning("session %s: the resumed agent program asked for another prompt than before the resume at its "
                       "call %d; it samples on from here (its earlier calls stay as they were)", self.id, len(self.tape))
        self.replay.clear()
        self.replay_diverged = True
        return None

    def _begin(self, request: TurnRequest) -> Turn:
        """Match ``request`` to a sample, add its new messages, and register the turn (session lock held)."""
        if self.closed:
            raise self._closed_error()
        messages = self._conversation(request)
        if len(messages) > self.settings.max_messages:
            raise ApiError(400, f"{len(messages)} messages exceed the endpoint's limit of {self.settings.max_messages}",
                           param="messages")
        if messages[-1]["role"] == "assistant":
            raise ApiError(400, "the last message is the assistant's: a prefilled assistant turn is not supported; "
                                "end with a user or tool message", param="messages")
        self.counts["requests"] += 1
        self.ignored.update(request.ignored)
        keys = [message_key(m) for m in messages]
        thread = ThreadKey.of(request.model, messages, request.tools)
        sample, start = self._match(messages, keys, request.tools, thread)
        sample.busy = True
        mark = Mark.of(sample)
        try:
            room = self._add_messages(sample, messages, keys, start)
            budget = room if request.max_tokens is None else min(room, request.max_tokens)
            params = self._sampling(request, budget)
        except BaseException:
            sample.busy = False
            self._drop_if_empty(sample)
            raise
        turn = Turn(f"{self.id}-{next(_TURN_NUMBERS)}", sample, messages, request, mark,
                     list(sample.trajectory.ids), params, budget)
        self._turns[turn.key] = turn
        return turn

    def _end(self, turn: Turn, *, sampled: bool) -> None:
        """The turn is over (session lock held); one that sampled nothing takes its messages back out."""
        del self._turns[turn.key]
        turn.sample.busy = False
        if not sampled:
            turn.mark.restore(turn.sample)
        self._drop_if_empty(turn.sample)

    def _drop_if_empty(self, sample: Sample) -> None:
        if sample.turns == 0 and sample in self.samples:  # a new sample that never sampled: nothing to keep
            self.samples.remove(sample)
            self.forks[sample.fork_reason] -= 1

    def _conversation(self, request: TurnRequest) -> list[dict[str, Any]]:
        """The request's whole conversation: a Responses request's earlier one first, its instructions as system."""
        messages = list(request.messages)
        if request.previous_response_id is not None:
            earlier = self.responses.get(request.previous_response_id)
            if earlier is None:
                raise ApiError(404, f"previous_response_id {request.previous_response_id!r} is not a response of this "
                                    "session", param="previous_response_id", type="not_found_error")
            messages = [m for m in earlier if m["role"] != "system"] + messages
        if request.instructions:
            messages = [{"role": "system", "content": request.instructions}, *messages]
        if not messages:
            raise ApiError(400, "the request has no messages", param="messages")
        return messages

    def count_tokens(self, request: TurnRequest) -> int:
        """The prompt tokens ``request`` would be fed as a new sample: its messages rendered with its tools and the
        generation prompt (Anthropic's ``count_tokens``; a side request, counted, never a sample)."""
        with self.lock:
            self.counts["count_tokens"] += 1
            self.ignored.update(request.ignored)
            conversation = self._conversation(request)
        messages = [renderable(m) for m in conversation]
        in_prompt = (request.tools or None) if self.settings.tools_in_prompt else None
        return len(self.chat.conversation(messages, tools=in_prompt).prompt_ids)

    def _match(self, messages: list[dict[str, Any]], keys: list[tuple[Any, ...]],
               tools: list[dict[str, Any]] | None, thread: ThreadKey) -> tuple[Sample, int]:
        """The sample the request extends and the index of its first new message, or a new sample (a fork, or the
        first of a new thread); ``keys`` are the messages' :func:`message_key`."""
        tkey = tools_key(tools)
        extends: list[Sample] = []
        reasons = ["start"]  # why each sample of the thread does not extend; the latest's reason names the fork
        joined = next((s.thread for s in reversed(self.samples) if thread.joins(s.thread_key)), None)
        for s in self.samples:
            if s.thread != joined:
                continue
            n = len(s.echo)
            if s.tools_key != tkey:
                reasons.append("tools_changed")
            elif len(keys) > n and keys[:n] == s.echo and s.awaiting_environment:
                if not s.busy:
                    extends.append(s)
                    continue
                reasons.append("concurrent")
            else:
                reasons.append(mismatch_reason(keys, s.echo))
        if extends:
            best = max(extends, key=lambda s: len(s.echo))
            return best, len(best.echo)
        if len(self.samples) >= self.settings.max_samples:
            raise ApiError(429, f"session {self.id} already holds {len(self.samples)} samples (forks), the limit: "
                                "send history back as the endpoint returned it", type="rate_limit_error")
        sample = self._fork(messages, keys, tools, reasons[-1], thread, joined)
        return sample, len(messages)

    def _fork(self, messages: list[dict[str, Any]], keys: list[tuple[Any, ...]], tools: list[dict[str, Any]] | None,
              reason: str, thread: ThreadKey, joined: int | None) -> Sample:
        rendered = [renderable(m) for m in messages]
        in_prompt = (tools or None) if self.settings.tools_in_prompt else None
        tokens = self.chat.conversation(rendered, tools=in_prompt)
        prompt = tokens.prompt_ids
        if len(prompt) > self.settings.prompt_length:
            raise ApiError(400, f"the conversation renders to {len(prompt)} prompt tokens, over the "
                                f"endpoint's prompt length {self.settings.prompt_length} (a new sample starts from "
                                f"the whole conversation: it was {reason})", param="messages",
                           code="context_length_exceeded")
        trajectory = Trajectory()
        trajectory.set_prompt(prompt)
        index = len(self.samples)
        sample = Sample(index=index, fork_reason=reason, thread=index if joined is None else joined,
                        thread_key=thread, tools=in_prompt, tools_key=tools_key(tools),
                        messages=rendered, echo=list(keys), tokens=tokens,
                        trajectory=trajectory, num_prompt_messages=len(messages))
        self.samples.append(sample)
        self.forks[reason] += 1
        return sample

    def _add_messages(self, sample: Sample, messages: list[dict[str, Any]], keys: list[tuple[Any, ...]],
                      start: int) -> int:
        """Add an extension's new messages to ``sample`` (a delta of ids); the room left in its budget."""
        s, traj = self.settings, sample.trajectory
        if start < len(messages) and sample.turns > 0:  # an extension: the environment's new messages, as a delta
            new = [renderable(m) for m in messages[start:]]
            sample.messages.extend(new)
            segment = sample.tokens.env_segment(list(sample.messages), len(sample.messages) - len(new),
                                                sampled_text=sample.last_text if sample.last_eot else None,
                                                sampled_eot=sample.last_eot)
            sample.echo.extend(keys[start:])
            traj.append(segment.ids, sampled=False)
        room = min(s.response_length - traj.response_len, s.max_model_len - len(traj))
        if room <= 0:
            traj.truncate(min(s.max_model_len, traj.prompt_len + s.response_length))
            sample.finish_reason = "length"
            sample.exhausted = True
            raise ApiError(400, f"the sample has no room left: {traj.response_len} response tokens of "
                                f"{s.response_length} (the endpoint's response length)", param="messages",
                           code="context_length_exceeded")
        return room

    def _sampled(self, turn: Turn, out: GenerationOutput, versions: list[int]) -> TurnResult:
        """Record what the engine sampled for ``turn`` (``versions``: each token's weight version) on its sample; the
        client's view of it (session lock held)."""
        sample, request, chat, traj = turn.sample, turn.request, self.chat, turn.sample.trajectory
        budget, messages = turn.budget, turn.messages
        self.generations += 1
        sample.last_generation = self.generations
        if sample.first_generation < 0:
            sample.first_generation = self.generations
        ids, log_probs = list(out.token_ids[:budget]), list(out.log_probs[:budget])
        stop_text = None
        if request.stop:
            ids, stop_text = cut_at_stop(chat, ids, request.stop)
            log_probs = log_probs[: len(ids)]
        context = len(traj)
        at = 0
        while at < len(ids):  # a turn cut over rounds holds tokens of several weight versions
            end = at
            while end < len(ids) and versions[end] == versions[at]:
                end += 1
            traj.append(ids[at:end], sampled=True, log_probs=log_probs[at:end], version=versions[at])
            at = end
        sample.turn_ends.append(traj.response_len - 1 if ids else -1)
        sample.turn_rewards.append(0.0)
        if out.routed_experts is not None:
            prompt_rows = len(out.routed_experts) - max(len(out.token_ids) - 1, 0)
            traj.record_routing(out.routed_experts[:prompt_rows])
            traj.record_routing(out.routed_experts[prompt_rows:], start=context)
        sample.turns += 1
        ended = stop_text is None and bool(ids) and ids[-1] in chat.stop_token_ids
        text = chat.decode(ids[:-1] if ended else ids)
        sample.last_text = text + chat.decode(ids[-1:]) if ended else text
        sample.tokens.sampled(sample.last_text)
        sample.last_eot = ended and ids[-1] == chat.eot_id
        return self._result(sample, messages, text, ids, log_probs, request, stop_text,
                            hit_length=out.finish_reason == "length" or len(out.token_ids) > budget)

    def _sampling(self, request: TurnRequest, budget: int) -> SamplingParams:
        s = self.settings
        temperature, top_p = s.temperature, s.top_p
        if s.honor_client_sampling:
            temperature = s.temperature if request.temperature is None else request.temperature
            top_p = s.top_p if request.top_p is None else request.top_p
        elif (request.temperature is not None and request.temperature != s.temperature) or (
                request.top_p is not None and request.top_p != s.top_p):
            self.counts["client_sampling_ignored"] += 1
        seed = None if self.seed is None else (self.seed * 1_000_003 + self.generations) % (1 << 62)
        return SamplingParams(max_new_tokens=budget, stop_token_ids=self.chat.stop_token_ids, temperature=temperature,
                              top_p=top_p, top_k=s.top_k, seed=seed)

    def _result(self, sample: Sample, messages: list[dict[str, Any]], text: str, ids: list[int], log_probs: list[float], request: TurnRequest,
                stop_text: str | None, *, hit_length: bool) -> TurnResult:
        """The client's view of the turn; records the template's and the client's message of it."""
        reasoning, visible = split_reasoning(text) if self.thinking else (None, text)
        if stop_text is not None:
            visible = visible[: visible.find(stop_text)] if stop_text in visible else visible
        calls: list[ToolCall | ToolCallError] = []
        content = visible
        if request.tools and request.tool_choice != "none" and stop_text is None:
            names = {t["function"]["name"] for t in request.tools}
            schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in request.tools}
            content, parsed = self.parser.parse(visible, schemas=schemas)
            for c in parsed:
                if isinstance(c, ToolCall) and c.name not in names:
                    c = ToolCallError(raw=c.raw, message=f"unknown tool {c.name!r}", name=c.name)
                calls.append(c)
        bad = sum(isinstance(c, ToolCallError) for c in calls)
        sample.malformed_calls += bad
        self.counts["malformed_calls"] += bad
        valid = [c for c in calls if isinstance(c, ToolCall)]
        if self.seed is not None:  # ids a re-run of the same turn gets again (a resumed program replays its prompts)
            for k, c in enumerate(valid):
                c.id = call_id(self.seed, self.generations, k)
        # The parser's content matters only when text and calls interleave (assistant_message); the template's
        # message keeps the reasoning in front of it.
        internal = assistant_message(text, text[: len(text) - len(visible)] + content, calls)
        shown = assistant_message(visible, content, calls)
        sample.messages.append(internal)
        out_calls = [ToolCallOut(c.id, c.name, json.dumps(c.arguments, ensure_ascii=False)) for c in valid]
        client = {"role": "assistant", "content": shown["content"],
                  "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in out_calls]}
        if reasoning is not None:
            client["reasoning_content"] = reasoning
        sample.echo.append(message_key(client))
        finish: TurnFinish
        if stop_text is not None:
            finish = "stop_sequence"
        elif hit_length:
            finish = "length"
        elif valid:
            finish = "tool_calls"
        else:
            finish = "stop"
        sample.finish_reason = finish
        lp = None
        if request.logprobs:
            lp = [TokenLogprob(chat_piece, float(p), list(chat_piece.encode("utf-8", "replace")))
                  for chat_piece, p in zip(self._pieces(ids), log_probs)]
        result = TurnResult(content=shown["content"], reasoning=reasoning, tool_calls=out_calls, finish_reason=finish,
                            prompt_tokens=len(sample.trajectory) - len(ids), completion_tokens=len(ids),
                            model=request.model, stop_sequence=stop_text, logprobs=lp)
        self.responses[result.id] = [*messages, client]  # the messages themselves are shared, not copied
        self.turn_refs[result.id] = self.latest_turn = (sample, sample.turns - 1)
        while len(self.responses) > MAX_STORED_RESPONSES:  # bounded: a long session keeps its latest responses
            del self.responses[next(iter(self.responses))]
        return result

    def _pieces(self, ids: Sequence[int]) -> list[str]:
        return [self.chat.decode([i]) for i in ids]

    # ----------------------------------------------------------------------------------------- rewards
    def post_reward(self, value: float, turn: str | None = None) -> None:
        """Add ``value`` to the episode's reward; with ``turn`` (a response id the client got — ``chatcmpl-…``,
        ``resp_…``, ``msg_…`` — or ``"latest"``) it is also that turn's own reward, which ``algorithm.turn_rewards``
        places on the turn's last sampled token."""
        with self.lock:
            self._post_reward(value, turn)

    def _post_reward(self, value: float, turn: str | None) -> None:
        if turn is not None:
            ref = self.latest_turn if turn == "latest" else self.turn_refs.get(bare_id(turn))
            if ref is None:
                raise ApiError(404, f"turn {turn!r} is not a response of this session"
                                    + (" (it has sampled no turn yet)" if turn == "latest" else ""),
                               param="turn", type="not_found_error")
            sample, k = ref
            sample.turn_rewards[k] += value
        self.reward = (self.reward or 0.0) + value
        self.counts["rewards"] += 1

    # ----------------------------------------------------------------------------------------- threads
    def main_thread(self) -> int | None:
        """The episode's thread: the one that sampled the most turns (ties: the one that sampled last); None before
        any turn."""
        turns: Counter[int] = Counter()
        last: dict[int, int] = {}
        for s in self.samples:
            if s.turns:
                turns[s.thread] += s.turns
                last[s.thread] = max(last.get(s.thread, -1), s.last_generation)
        return max(turns, key=lambda t: (turns[t], last[t]), default=None)

    def main_samples(self) -> list[Sample]:
        """The main thread's samples that sampled, in session order."""
        main = self.main_thread()
        return [s for s in self.samples if s.turns and s.thread == main]

    def side_samples(self) -> list[Sample]:
        """Every other thread's samples that sampled, in session order (the harness's side calls)."""
        main = self.main_thread()
        return [s for s in self.samples if s.turns and s.thread != main]

    def side_requests(self) -> int:
        """Requests outside the main thread: side samples' turns and token counts."""
        return sum(s.turns for s in self.side_samples()) + self.counts["count_tokens"]

    # ----------------------------------------------------------------------------------------- reporting
    def summary(self) -> dict[str, Any]:
        """The session's samples as plain data: ids, text pieces, loss mask, log-probs, fork reasons, and per turn its
        last sampled token's response index and the rewards posted for it."""
        out = []
        main = self.main_thread()
        for s in self.samples:
            t = s.trajectory
            out.append({
                "index": s.index, "fork_reason": s.fork_reason, "thread": s.thread, "side": s.thread != main,
                "turns": s.turns, "finish_reason": s.finish_reason,
                "prompt_len": t.prompt_len, "ids": list(t.ids), "loss_mask": list(t.loss_mask),
                "log_probs": list(t.log_probs), "weight_versions": list(t.versions),
                "pieces": self._pieces(t.ids), "messages": s.messages, "malformed_calls": s.malformed_calls,
                "tokenization_paths": {str(k): v for k, v in s.tokens.paths.items()},
                "turn_ends": list(s.turn_ends), "turn_rewards": list(s.turn_rewards),
            })
        return {"session_id": self.id, "samples": out, "forks": dict(self.forks), "counts": dict(self.counts),
                "ignored_fields": dict(self.ignored), "side_requests": self.side_requests(), "reward": self.reward}


async def engine_call(engine: RolloutEngine, prompt_ids: list[int], params: SamplingParams, *,
                      request_id: str | None = None) -> GenerationOutput:
    """``engine.generate`` from the endpoint's own event loop, as request ``request_id`` (which ``engine.abort``
    takes; None: the engine names it). An engine bound to one loop (``engine.event_loop``: SGLang's request handler
    lives on the loop of its first request) gets the call on that loop, which the rollout runs
    (``driver.run_sync``) or, standalone, a thread of its own (:mod:`.serve`)."""
    call = (engine.generate(prompt_ids, params) if request_id is None
            else engine.generate(prompt_ids, params, request_id=request_id))
    bound = engine_event_loop(engine)
    if bound is None or bound is asyncio.get_running_loop():
        return await call
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call, bound))
