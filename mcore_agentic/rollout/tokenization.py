"""Token-in, token-out tokenization of multi-turn trajectories in linear time, and its sanity check.

Assistant turns are never tokenized here: the trajectory keeps the exact ids the engine
sampled (up to and including the end-of-turn token ``<|im_end|>``). Only what the
environment adds (tool results, user turns, the next generation prompt) is tokenized,
as the *delta* of chat-template renders.

Per turn, :class:`ConversationTokenizer` renders only a small conversation: a short
prefix, the assistant turn just sampled and the new messages (its *local context*), never
the whole history, and tokenizes only the new text::

    head  = render(prefix, add_generation_prompt=True)                  # once
    local = render(prefix + [last assistant] + new, add_generation_prompt=True)
    env   = local[len(head) + len(sampled turn text):]                  # "one render"

The prefix is one short user message without tool schemas (:data:`LIGHT_PREFIX`, the cheapest
render) or, for a template whose environment turns depend on the system prompt or the tools,
the request's own prompt messages and tools.

That is exact when the template re-renders the sampled turn as it was sampled (the usual
case: the agent loop builds the assistant message so that it does). Otherwise a second
render of ``prompt + [last assistant]`` finds where the environment text starts ("two
renders", the turn drifted and the end-of-trajectory check will say so). Templates that
rewrite history (Qwen3 strips earlier ``<think>`` blocks once a new user query arrives)
break that prefix too; then the delta is taken after a fixed base conversation (system +
user + a placeholder assistant turn, verl's ``BASE_CHAT_HISTORY`` idea), cut after the
placeholder's end-of-turn token, which no later message can rewrite ("base fallback").

The local context is enough when the template renders environment messages the same
whatever came before the last assistant turn. :meth:`ChatTokenizer.local_context` checks
that once per template and tool list, on a probe conversation (two tool groups, a user
turn, calls with and without content, a system prompt and the tools): local deltas must
equal full-history deltas there, first with the light prefix, then with the prompt. A
template that numbers tool results, or otherwise looks further back, fails both and its
requests take the correct, quadratic path (two full renders per turn, "full context"),
counted per request in ``metrics.tokenization_full_context``.

The sanity check compares a finished trajectory with one full render of its messages (or,
when the base fallback was used, with the stitched per-turn renders: the full render
legitimately differs there) and reports text diffs. It costs one render of the whole
conversation and the re-tokenization of the sampled turns only (:meth:`ChatTokenizer.encodes_to`:
the text between added tokens is tokenized independently, and everything else in the
trajectory was tokenized from the same text already); a mismatch is then described by a
linear diff (each resync looks a bounded window ahead; no quadratic ``difflib``). In ``ignore_strippable`` mode exactly the
differences that only add, drop or change whitespace are ignored, whatever the token
boundaries. The check's methods live in :mod:`~mcore_agentic.rollout.tokenization_check` (a mixin of
:class:`ChatTokenizer`), its token diff in :mod:`~mcore_agentic.rollout.tokenization_diff`.

Environment text is literal (:mod:`.literal_text`): in every render tokenized here (the prompt, each
delta, the sanity check's reference), the contents of messages other than the assistant's are
tokenized with their added-token strings as ordinary text, so a tool result or a user turn cannot
forge ``<|im_end|>``/``<|im_start|>`` or a ``<tool_call>``; only the template's own structure is
special. Sampled ids are never re-tokenized into the trajectory. Text without such strings (nearly
all) costs one pattern search per delta; text with them costs each such delta a second local render
(its neutral twin), and the sanity check one more full render: its shortcut then matches the
template's own added tokens (the twin's) one to one with the trajectory's and still re-tokenizes only
the sampled stretches (:meth:`ChatTokenizer._literal_encodes_to`).

Thread safety: renders and tokenizations may run in worker threads (the agent loop does,
to keep its event loop free); the fast tokenizer's ``encode`` releases the GIL.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections import Counter
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from mcore_agentic.rollout.literal_text import LiteralText
from mcore_agentic.rollout.tokenization_check import TrajectoryCheck

logger = logging.getLogger(__name__)

# A conversation no later message can rewrite: no reasoning, one plain turn each.
BASE_CHAT_HISTORY: tuple[dict[str, str], ...] = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "I am a user."},
)
_BASE_ASSISTANT = {"role": "assistant", "content": "OK."}
# The cheapest local context: the sampled turn and the new messages after one short user turn.
LIGHT_PREFIX: tuple[dict[str, str], ...] = ({"role": "user", "content": "."},)

Messages = list[dict[str, Any]]


class TokenizationPath(StrEnum):
    """How one environment delta was computed (see the module docstring)."""

    ONE_RENDER = "one_render"
    TWO_RENDERS = "two_renders"
    BASE_FALLBACK = "base_fallback"
    FULL_CONTEXT = "full_context"


@dataclass(frozen=True)
class EnvSegment:
    """Environment-added ids (loss mask 0), their text, and how they were computed."""

    ids: list[int]
    text: str
    used_fallback: bool
    """The base-conversation fallback made them: the template rewrote history."""
    path: TokenizationPath = TokenizationPath.FULL_CONTEXT


class ChatTokenizer(TrajectoryCheck):
    """Chat-template renders and delta tokenization for one tokenizer.

    ``tokenizer`` is a Hugging Face tokenizer with a chat template. ``eot_token`` is the
    token that ends an assistant turn in the template (default: the tokenizer's eos,
    ``<|im_end|>`` for Qwen). ``template_kwargs`` go to every ``apply_chat_template``.
    """

    def __init__(self, tokenizer: Any, *, eot_token: str | None = None, template_kwargs: dict | None = None):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("tokenizer has no chat_template; load one with a template (e.g. load_qwen_tokenizer)")
        self.tokenizer = tokenizer
        self.eot_text: str = eot_token or tokenizer.eos_token
        eot_id = tokenizer.convert_tokens_to_ids(self.eot_text)
        if eot_id is None or eot_id == tokenizer.unk_token_id:
            raise ValueError(f"end-of-turn token {self.eot_text!r} is not in the tokenizer's vocabulary")
        self.eot_id: int = int(eot_id)
        self.template_kwargs = dict(template_kwargs or {})
        # The Rust tokenizer directly (same ids, a third faster on long text) unless it truncates or pads.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        plain = backend is not None and backend.truncation is None and backend.padding is None
        self._backend = backend if plain else None
        self._local_context: dict[str, str] = {}
        self._lock = threading.Lock()
        stops = {self.eot_id}
        if tokenizer.eos_token_id is not None:
            stops.add(int(tokenizer.eos_token_id))
        self._stop_token_ids = sorted(stops)
        self._stop_texts = {i: self.decode([i]) for i in self._stop_token_ids}
        self._split_ids = self._hard_split_ids()
        self.literal = LiteralText(tokenizer, self.encode)
        self.literal.hard_splits = self._split_ids is not None

    @property
    def stop_token_ids(self) -> list[int]:
        """Token ids that end an assistant turn: the template's end-of-turn and the tokenizer's eos."""
        return list(self._stop_token_ids)

    def stop_text(self, token_id: int) -> str:
        """``decode([token_id])`` of a stop token (:attr:`stop_token_ids`), decoded once."""
        text = self._stop_texts.get(token_id)
        return self.decode([token_id]) if text is None else text

    # -- primitives ---------------------------------------------------------------------------------

    def render(self, messages: Messages, *, tools: list[dict] | None, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages),
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **self.template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        if self._backend is not None and self._backend.decoder is not None:
            return self._backend.decode(ids, skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    # -- trajectory pieces --------------------------------------------------------------------------

    def prompt_ids(self, messages: Messages, *, tools: list[dict] | None) -> list[int]:
        """The initial prompt: full render with the generation prompt (tool schemas included)."""
        return self.encode_render(messages, lambda m: self.render(m, tools=tools, add_generation_prompt=True))

    def encode_render(self, messages: Messages, render: Any, text: str | None = None) -> list[int]:
        """Ids of ``render(messages)`` (``text`` if already rendered) with every non-assistant content literal."""
        if text is None:
            text = render(messages)
        neutral = self.literal.neutralize(messages)
        if neutral is None:
            return self.encode(text)
        return self.literal.encode_rendered(text, render(neutral))

    def conversation(self, messages: Messages, *, tools: list[dict] | None) -> ConversationTokenizer:
        """Incremental tokenization of a conversation whose prompt is ``messages`` (rendered and tokenized now)."""
        return ConversationTokenizer(self, messages, tools=tools)

    def env_segment(
        self,
        messages: Messages,
        start: int,
        *,
        tools: list[dict] | None,
        sampled_eot: bool | None,
        history_text: str | None = None,
    ) -> EnvSegment:
        """Ids for ``messages[start:]`` (tool results, user turns) plus the next generation prompt, in full context.

        Renders the whole conversation (twice, or once with ``history_text``): correct for any template,
        quadratic over a trajectory. :class:`ConversationTokenizer` is the linear path; it falls back here.

        ``messages[start - 1]`` is the turn already in the trajectory. ``sampled_eot``: True if it is a
        sampled assistant turn that ended with the end-of-turn token, False if a sampled assistant turn
        that did not (the template's whole closing is then environment text), None if it is not a
        sampled turn (its render is already in the trajectory in full).

        ``history_text``: the decoded trajectory so far. When the new render starts with it exactly, it
        stands in for the first render (same result, since then trajectory text + delta == the render).
        """
        if not 0 < start <= len(messages):
            raise ValueError(f"start={start} must be in 1..{len(messages)}")

        def text_of(new: Messages) -> EnvSegment:
            full = [*messages[:start], *new]
            curr = self.render(full, tools=tools, add_generation_prompt=True)
            if history_text is not None and sampled_eot is not False and curr.startswith(history_text):
                return EnvSegment([], curr[len(history_text) :], used_fallback=False)
            prev = self.render(messages[:start], tools=tools, add_generation_prompt=False)
            if curr.startswith(prev):
                return EnvSegment([], curr[self._cut(prev, len(prev), sampled_eot) :], used_fallback=False)
            return self._base_fallback(new, tools=tools, sampled_eot=sampled_eot, path=TokenizationPath.FULL_CONTEXT)

        return self._with_ids(text_of, messages[start:])

    def local_env_segment(
        self,
        prompt: Messages,
        head: str,
        last: dict[str, Any],
        new: Messages,
        *,
        tools: list[dict] | None,
        sampled_text: str | None,
        sampled_eot: bool,
    ) -> EnvSegment:
        """Ids for ``new`` after the sampled assistant turn ``last``, rendered in the local context only.

        ``head`` is ``render(prompt, add_generation_prompt=True)``; ``sampled_text`` the decoded sampled
        turn, end-of-turn token included (None skips the one-render path). Exact for context-free
        templates (:meth:`local_context`); O(prompt + last turn + new text), whatever the history.
        """

        def text_of(new: Messages) -> EnvSegment:
            local = self.render([*prompt, last, *new], tools=tools, add_generation_prompt=True)
            if sampled_eot and sampled_text and local.startswith(head) and local.startswith(sampled_text, len(head)):
                text = local[len(head) + len(sampled_text) :]
                return EnvSegment([], text, used_fallback=False, path=TokenizationPath.ONE_RENDER)
            prev = self.render([*prompt, last], tools=tools, add_generation_prompt=False)
            if local.startswith(prev):
                text = local[self._cut(prev, len(prev), sampled_eot) :]
                return EnvSegment([], text, used_fallback=False, path=TokenizationPath.TWO_RENDERS)
            return self._base_fallback(new, tools=tools, sampled_eot=sampled_eot, path=TokenizationPath.BASE_FALLBACK)

        return self._with_ids(text_of, new)

    def _with_ids(self, text_of: Any, new: Messages) -> EnvSegment:
        """``text_of(new)`` (a segment's text and path) with its ids: with literal environment text
        (:mod:`.literal_text`), where ``new`` holds special-token strings, by ``text_of`` of its neutral twin."""
        segment = text_of(new)
        neutral_new = self.literal.neutralize(new)
        if neutral_new is None:
            ids = self.encode(segment.text)
        else:
            ids = self.literal.encode_rendered(segment.text, text_of(neutral_new).text)
        return EnvSegment(ids, segment.text, segment.used_fallback, segment.path)

    def _base_fallback(
        self, new: Messages, *, tools: list[dict] | None, sampled_eot: bool | None, path: TokenizationPath
    ) -> EnvSegment:
        """The template rewrote an earlier turn: the delta of ``new`` after the base conversation instead."""
        base = [*BASE_CHAT_HISTORY, _BASE_ASSISTANT] if sampled_eot is not None else list(BASE_CHAT_HISTORY)
        base_head = self.render(list(BASE_CHAT_HISTORY), tools=tools, add_generation_prompt=False)
        full = self.render([*base, *new], tools=tools, add_generation_prompt=True)
        if not full.startswith(base_head):
            raise RuntimeError(
                "chat template rewrites even the base system/user turns when messages are appended; "
                "incremental tokenization is impossible with it"
            )
        if sampled_eot is None:
            text = full[len(self.render(base, tools=tools, add_generation_prompt=False)) :]
        else:
            text = full[self._cut(full, len(base_head), sampled_eot, search_from=len(base_head)) :]
        return EnvSegment([], text, used_fallback=True, path=path)

    def _cut(self, text: str, end: int, sampled_eot: bool | None, search_from: int | None = None) -> int:
        """Where environment text starts in ``text``: after (or at) the closing end-of-turn token."""
        if sampled_eot is None:
            return end
        if search_from is None:
            pos = text.rfind(self.eot_text, 0, end)  # the closing of the last (assistant) message
        else:
            pos = text.find(self.eot_text, search_from)  # the closing of the base placeholder turn
        if pos < 0:
            raise RuntimeError(f"chat template render has no end-of-turn token {self.eot_text!r} after an assistant turn")
        return pos + len(self.eot_text) if sampled_eot else pos

    def assistant_turn_text(self, message: dict[str, Any], *, tools: list[dict] | None) -> str:
        """How the template renders one assistant message, up to and including its end-of-turn token.

        Rendered after the base conversation, so the result does not depend on the history.
        """
        head = self.render(list(BASE_CHAT_HISTORY), tools=tools, add_generation_prompt=True)
        full = self.render([*BASE_CHAT_HISTORY, message], tools=tools, add_generation_prompt=False)
        if not full.startswith(head):
            raise RuntimeError("chat template's generation prompt is not a prefix of the assistant turn's render")
        end = full.find(self.eot_text, len(head))
        if end < 0:
            raise RuntimeError(f"assistant turn render has no end-of-turn token {self.eot_text!r}")
        return full[len(head) : end + len(self.eot_text)]

    def assistant_turn_ids(self, message: dict[str, Any], *, tools: list[dict] | None) -> list[int]:
        """The ids of :meth:`assistant_turn_text`: the reference for sampled turns in the sanity check."""
        return self.encode(self.assistant_turn_text(message, tools=tools))

    # -- the context probe --------------------------------------------------------------------------

    def local_context(self, tools: list[dict] | None) -> str:
        """Which local context gives the full-history deltas on a probe conversation: ``light``, ``prompt`` or ``full``.

        ``light``: :data:`LIGHT_PREFIX` without tools; ``prompt``: the request's prompt and tools;
        ``full``: none does (or the template cannot render the probe), so every delta is taken from
        full renders, which is always correct. Checked once per tool list and cached.
        """
        key = json.dumps(tools or [], sort_keys=True, default=str)
        with self._lock:
            known = self._local_context.get(key)
        if known is not None:
            return known
        verdict = "full"
        try:
            if self._probe(tools, light=True):
                verdict = "light"
            elif self._probe(tools, light=False):
                verdict = "prompt"
        except Exception as exc:  # noqa: BLE001 -- an odd template takes the slow, correct path
            logger.info("chat template failed the tokenization probe (%s: %s); using full renders", type(exc).__name__, exc)
        if verdict == "full":
            logger.warning(
                "the chat template renders tool/user turns differently depending on earlier turns; "
                "multi-turn tokenization renders the whole conversation every turn (quadratic in the number of turns)"
            )
        with self._lock:
            self._local_context[key] = verdict
        return verdict

    @functools.cached_property
    def light_head(self) -> str:
        """``render(LIGHT_PREFIX, add_generation_prompt=True)``, rendered once."""
        return self.render(list(LIGHT_PREFIX), tools=None, add_generation_prompt=True)

    def _probe(self, tools: list[dict] | None, *, light: bool) -> bool:
        messages = _probe_conversation(tools)
        prompt = messages[:2]
        prefix, local_tools = (list(LIGHT_PREFIX), None) if light else (prompt, tools)
        head = self.light_head if light else self.render(prefix, tools=local_tools, add_generation_prompt=True)
        start = 0
        while start < len(messages):
            if messages[start]["role"] == "assistant" or start <= len(prompt):
                start += 1
                continue
            end = start
            while end < len(messages) and messages[end]["role"] != "assistant":
                end += 1
            last = messages[start - 1]
            full = self.env_segment(messages[:end], start, tools=tools, sampled_eot=True)
            local = self.local_env_segment(
                prefix, head, last, messages[start:end], tools=local_tools,
                sampled_text=self.assistant_turn_text(last, tools=tools), sampled_eot=True,
            )  # fmt: skip
            if (local.text, local.used_fallback) != (full.text, full.used_fallback):
                return False
            start = end
        return True

class ConversationTokenizer:
    """Linear-time tokenization of one conversation: its prompt once, then per turn only what is new.

    ``messages`` is the prompt (rendered with the generation prompt and tokenized here, see
    :attr:`prompt_ids`); later calls to :meth:`env_segment` get the whole conversation so far.
    Counts how each delta was computed (``paths``) and whether the template rewrote history
    (``used_fallback``: the sanity check's reference is then the stitched renders).
    """

    def __init__(self, chat: ChatTokenizer, messages: Messages, *, tools: list[dict] | None):
        self.chat = chat
        self.tools = tools
        self.prompt: Messages = list(messages)
        self.head = chat.render(self.prompt, tools=tools, add_generation_prompt=True)
        self.prompt_ids: list[int] = chat.encode_render(
            self.prompt, lambda m: chat.render(m, tools=tools, add_generation_prompt=True), text=self.head
        )
        self.context = chat.local_context(tools)
        if self.context == "light":
            self._prefix, self._prefix_tools = list(LIGHT_PREFIX), None
            self._prefix_head = chat.light_head
        else:
            self._prefix, self._prefix_tools, self._prefix_head = self.prompt, tools, self.head
        self.used_fallback = False
        self.paths: Counter[TokenizationPath] = Counter()
        self._texts: list[str] = [self.head]

    def sampled(self, text: str) -> None:
        """Record a sampled turn's decoded text (stop token included), for :attr:`text`."""
        self._texts.append(text)

    @property
    def text(self) -> str:
        """The trajectory's text so far: the prompt, each recorded sampled turn and each environment delta."""
        return "".join(self._texts)

    def env_segment(self, messages: Messages, start: int, *, sampled_text: str | None, sampled_eot: bool) -> EnvSegment:
        """Ids for ``messages[start:]`` plus the next generation prompt; ``messages[start - 1]`` was sampled.

        ``sampled_text``: that turn decoded, end-of-turn token included (``None`` if unknown).
        ``sampled_eot``: whether it ended with the end-of-turn token (see :meth:`ChatTokenizer.env_segment`).
        """
        if not len(self.prompt) < start <= len(messages):
            raise ValueError(f"start={start} must be in {len(self.prompt) + 1}..{len(messages)} (after a sampled turn)")
        if self.context != "full":
            segment = self.chat.local_env_segment(
                self._prefix, self._prefix_head, messages[start - 1], messages[start:],
                tools=self._prefix_tools, sampled_text=sampled_text, sampled_eot=sampled_eot,
            )  # fmt: skip
        else:
            segment = self.chat.env_segment(messages, start, tools=self.tools, sampled_eot=sampled_eot)
        self.used_fallback |= segment.used_fallback
        self.paths[segment.path] += 1
        self._texts.append(segment.text)
        return segment


def _probe_conversation(tools: list[dict] | None) -> Messages:
    """A conversation that exercises what a template may render context-dependently: tool groups, calls, a new query."""
    function = (tools or [{}])[0].get("function") or {}
    name = function.get("name") or "probe_tool"

    def call(i: int) -> dict[str, Any]:
        return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": {"value": str(i)}}}

    def result(i: int) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": f"call_{i}", "name": name, "content": f"result {i}"}

    return [
        {"role": "system", "content": "Probe system prompt."},
        {"role": "user", "content": "First probe question."},
        {"role": "assistant", "content": "Calling twice.", "tool_calls": [call(1), call(2)]},
        result(1),
        result(2),
        {"role": "assistant", "content": "Calling again.", "tool_calls": [call(3)]},
        result(3),
        {"role": "assistant", "content": "A first answer."},
        {"role": "user", "content": "Second probe question."},
        {"role": "assistant", "content": "", "tool_calls": [call(4)]},
        result(4),
        {"role": "assistant", "content": "", "tool_calls": [call(5)]},
        result(5),
        {"role": "assistant", "content": "Done."},
    ]
