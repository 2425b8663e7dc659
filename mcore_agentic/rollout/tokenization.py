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
boundaries.

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
import itertools
import json
import logging
import re
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from mcore_agentic.rollout.literal_text import ForgedStructureError, LiteralText, aligned

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


class ChatTokenizer:
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

    def _hard_split_ids(self) -> frozenset[int] | None:
        """Added-token ids at which any tokenization of any text splits, or None when that cannot be relied on.

        The fast tokenizer cuts text at added tokens before anything else, so the stretches between two
        of them tokenize independently: unless a token strips or eats its neighbours (``lstrip``,
        ``rstrip``, ``single_word``), is matched after normalisation, or could overlap another added
        token (one holds another's first character past its own start, or is another's prefix), or the
        pre-tokenizer treats the start of a text specially (only byte-level ones without a prefix space
        qualify: Qwen, Llama 3, GPT-style vocabularies).
        """
        tokens = getattr(self.tokenizer, "added_tokens_decoder", None)
        if self._backend is None or not tokens:
            return None
        # Byte-level pre-tokenization without a prefix space: a stretch tokenizes the same wherever it
        # stands. Metaspace ("prepend_scheme: first") and prefix spaces treat a text's start specially.
        pre, norm = repr(self._backend.pre_tokenizer), repr(self._backend.normalizer)
        if "ByteLevel" not in pre or "Metaspace" in pre or "add_prefix_space=True" in pre or "Prepend" in norm:
            return None
        contents = [t.content for t in tokens.values()]
        firsts = {c[0] for c in contents if c}
        for t in tokens.values():
            if t.lstrip or t.rstrip or t.single_word or t.normalized or not t.content:
                return None
            if any(ch in firsts for ch in t.content[1:]) or any(o != t.content and o.startswith(t.content) for o in contents):
                return None
        return frozenset(int(i) for i in tokens)

    def encodes_to(
        self, text: str, ids: list[int], sampled: list[int], *, ids_text: str | None = None, neutral: str | None = None
    ) -> bool:
        """Whether ``encode(text) == ids``, where ``ids`` is this module's tokenization of a conversation.

        ``sampled[i]`` is 1 where the engine sampled ``ids[i]``: everything else came from :meth:`encode`
        of template text that starts or ends at an added token. So when the texts agree, only the
        stretches between added tokens that hold a sampled id (the sampled turns with the text next to
        them, e.g. ``"assistant\\n"``) can tokenize differently: those are re-tokenized, nothing else. Same
        answer as a full tokenization at about half its cost; a tokenizer whose added tokens do not cut
        text cleanly (see :meth:`_hard_split_ids`) gets the full tokenization.

        ``ids_text``: the text ``ids`` were made from (:attr:`ConversationTokenizer.text`), when known:
        compared with ``text`` as it is, it saves decoding ``ids`` and normalising ``text``.

        ``neutral``: ``text``'s neutral twin when some literal content holds special-token text
        (:mod:`.literal_text`); the reference is then ``literal.encode_rendered(text, neutral)``, and the
        shortcut is :meth:`_literal_encodes_to`'s (it raises :class:`ForgedStructureError` as that does).
        """
        if neutral is not None:
            return self._literal_encodes_to(text, neutral, ids, sampled, ids_text=ids_text)
        splits = self._split_ids
        if splits is None or len(sampled) != len(ids):
            return self.encode(text) == ids
        if ids_text is not None:
            if ids_text != text:
                return self.encode(text) == ids  # e.g. the same text up to normalisation
            pieces = self._pieces(text, text, ids)
            if pieces is not None:  # the stretches' texts are slices of ``text``: nothing to decode
                return all(
                    self.encode(text[a:b]) == ids[lo:hi] for lo, hi, a, b in pieces if 1 in sampled[lo:hi]
                )
        else:
            normalizer = self._backend.normalizer
            if self.decode(ids) != (normalizer.normalize_str(text) if normalizer is not None else text):
                return False  # decode(encode(x)) is normalize(x) for a byte-level tokenizer
        stretches: list[list[int]] = []  # each stretch between added tokens that holds sampled ids
        start: int | None = None  # the open one
        for is_sampled, lo, hi in _runs(sampled):
            if is_sampled:
                if start is None:
                    start = lo
                    while start > 0 and ids[start - 1] not in splits:
                        start -= 1
                continue
            if start is None:
                continue
            cut = next((k for k in range(lo, hi) if ids[k] in splits), None)
            if cut is None:
                continue  # no added token in this environment stretch: the sampled stretch goes on
            stretches.append(ids[start:cut])
            start = None
        if start is not None:
            stretches.append(ids[start:])
        # (decode one at a time: the fast tokenizer's decode_batch hands a batch to its thread pool, which costs
        # more than these short stretches do)
        return all(self.encode(self.decode(stretch)) == stretch for stretch in stretches)

    def _literal_encodes_to(
        self, text: str, neutral: str, ids: list[int], sampled: list[int], *, ids_text: str | None = None
    ) -> bool:
        """Whether ``literal.encode_rendered(text, neutral) == ids``: :meth:`encodes_to` for a conversation whose
        literal contents hold special-token text.

        The reference cuts ``text`` at the template's added tokens (those of ``neutral``) and tokenizes each
        stretch between them literally. ``ids`` holds an added-token id exactly at each cut when it is that
        tokenization (environment stretches never tokenize to one), so the cuts are matched one to one; then a
        stretch holding a sampled id is re-tokenized (literally), and every other stretch only has to decode to
        the reference's text there (it was tokenized from that text when it was added: :meth:`encodes_to`'s
        premise). Any doubt (no hard splits, a different number of cuts, a stretch that differs) takes the full
        tokenization, which also raises :class:`ForgedStructureError` where the reference cannot be aligned.
        """
        literal, splits = self.literal, self._split_ids
        assert literal.pattern is not None  # neutral twins exist only for vocabularies with added tokens

        def full() -> bool:
            return literal.encode_rendered(text, neutral) == ids

        if splits is None or len(sampled) != len(ids) or (ids_text is not None and ids_text != text):
            return full()
        if not aligned(text, neutral):
            return full()  # raises ForgedStructureError
        pieces = self._pieces(text, neutral, ids)
        if pieces is None:
            return full()
        normalizer = self._backend.normalizer if self._backend is not None else None
        env_ids: list[list[int]] = []
        env_texts: list[str] = []
        for lo, hi, a, b in pieces:
            piece_ids, piece = ids[lo:hi], text[a:b]
            if 1 in sampled[lo:hi]:
                if literal.encode_literal(piece) != piece_ids:
                    return full()
            elif piece_ids or piece:
                env_ids.append(piece_ids)
                env_texts.append(piece)
        for piece_ids, want in zip(env_ids, env_texts):
            have = self.decode(piece_ids)
            if have != want and (normalizer is None or have != normalizer.normalize_str(want)):
                return full()  # decode(encode(x)) is normalize(x)
        return True

    def _pieces(self, text: str, marks: str, ids: list[int]) -> list[tuple[int, int, int, int]] | None:
        """``ids`` and ``text`` cut at the template's added tokens, as ``(lo, hi, a, b)``: ``ids[lo:hi]`` stands for
        ``text[a:b]``. The added tokens are found in ``marks`` (``text`` itself, or its neutral twin when literal
        contents hold special-token text) and must match the ids' hard splits one to one, each the same token;
        None when they do not (the caller then takes a slower, full comparison)."""
        literal, splits = self.literal, self._split_ids
        if literal.pattern is None or splits is None:
            return None
        structural = list(literal.pattern.finditer(marks))
        cuts = list(itertools.compress(range(len(ids)), map(splits.__contains__, ids)))  # at C speed
        if len(cuts) != len(structural):
            return None
        tokens = [m.group() for m in structural]
        if list(map(ids.__getitem__, cuts)) != list(map(literal.ids.__getitem__, tokens)):
            return None
        starts, ends = [m.start() for m in structural], [m.end() for m in structural]
        if marks is not text and list(map(text.__getitem__, map(slice, starts, ends))) != tokens:
            return None
        return list(zip([0, *(k + 1 for k in cuts)], [*cuts, len(ids)], [0, *ends], [*starts, len(text)]))

    def check_trajectory(
        self,
        ids: list[int],
        loss_mask: list[int],
        messages: Messages,
        *,
        tools: list[dict] | None,
        num_prompt_messages: int,
        used_fallback: bool,
        mode: str,
        truncated: bool = False,
        ids_text: str | None = None,
    ) -> list[dict[str, str]]:
        """The sanity check of one finished trajectory: :meth:`sanity_check` against :meth:`reference_ids`.

        A trajectory that matches the full render (the usual case) costs one render and the
        re-tokenization of its sampled stretches (:meth:`encodes_to`; ``ids_text`` as there); the full
        reference is tokenized only to describe a mismatch.
        """
        if mode == "disable":
            return []
        if used_fallback:
            reference = self.reference_ids(
                ids, loss_mask, messages, tools=tools, num_prompt_messages=num_prompt_messages, used_fallback=True
            )
            return self.sanity_check(ids, reference, mode=mode, truncated=truncated)
        text, neutral = self._reference_texts(ids, messages, tools)
        if not truncated:
            try:
                if self.encodes_to(text, ids, loss_mask, ids_text=ids_text, neutral=neutral):
                    return []
            except ForgedStructureError:
                pass  # reported below
        try:
            reference = self._encode_reference(text, neutral)  # the mismatch is described against the render made
        except ForgedStructureError as exc:  # the reference cannot be aligned: a mismatch to report, not a failure
            return [{"expected": "(the full render could not be tokenized)", "actual": "", "context": str(exc)[:200]}]
        return self.sanity_check(ids, reference, mode=mode, truncated=truncated, neutral_text=neutral)

    def _ids_within(self, ids: list[int], chars: int) -> list[int]:
        """The longest prefix of ``ids`` that decodes to at most ``chars`` characters (binary search)."""
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(self.decode(ids[:mid])) <= chars:
                lo = mid
            else:
                hi = mid - 1
        return ids[:lo]

    def _encode_reference(self, text: str, neutral: str | None) -> list[int]:
        """A render's ids: ``neutral`` (its twin with literal contents neutralized, when any holds special text) tells
        the template's special tokens from the environment's text (:mod:`.literal_text`)."""
        return self.encode(text) if neutral is None else self.literal.encode_rendered(text, neutral)

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

    # -- sanity check -------------------------------------------------------------------------------

    def reference_ids(
        self,
        ids: list[int],
        loss_mask: list[int],
        messages: Messages,
        *,
        tools: list[dict] | None,
        num_prompt_messages: int,
        used_fallback: bool,
    ) -> list[int]:
        """What the trajectory should be according to the template.

        Without fallback: the full render of ``messages``, cut after the last end-of-turn token when the
        trajectory ends with one (the template's trailing newline is not part of any turn we keep).
        With fallback (the template rewrote history, so the full render legitimately differs): the
        trajectory's environment segments as they are, each sampled span replaced by the template's
        render of its assistant message.
        """
        if not used_fallback:
            return self._encode_reference(*self._reference_texts(ids, messages, tools))
        assistants = [m for m in messages[num_prompt_messages:] if m.get("role") == "assistant"]
        out: list[int] = []
        turn = 0
        for sampled, start, end in _runs(loss_mask):
            if not sampled:
                out.extend(ids[start:end])
                continue
            if turn >= len(assistants):
                raise RuntimeError("more sampled spans than assistant messages in the trajectory")
            out.extend(self.assistant_turn_ids(assistants[turn], tools=tools))
            turn += 1
        return out

    def _reference_texts(self, ids: list[int], messages: Messages, tools: list[dict] | None) -> tuple[str, str | None]:
        """:meth:`_reference_text` and, when a literal content holds special-token text, its neutral twin."""
        neutral_messages = self.literal.neutralize(messages)
        neutral = None if neutral_messages is None else self._reference_text(ids, neutral_messages, tools)
        return self._reference_text(ids, messages, tools), neutral

    def _reference_text(self, ids: list[int], messages: Messages, tools: list[dict] | None) -> str:
        """The full render a trajectory without fallback should tokenize to."""
        # A trajectory that ends on environment text (cut by a length limit) ends in a generation prompt.
        ends_with_env = bool(messages) and messages[-1].get("role") != "assistant"
        text = self.render(messages, tools=tools, add_generation_prompt=ends_with_env)
        if ids and ids[-1] == self.eot_id:
            text = text[: text.rfind(self.eot_text) + len(self.eot_text)]
        return text

    def sanity_check(
        self,
        ids: list[int],
        reference: list[int],
        *,
        mode: str,
        truncated: bool = False,
        context_chars: int = 20,
        max_diffs: int = 16,
        neutral_text: str | None = None,
    ) -> list[dict[str, str]]:
        """Text diffs between the trajectory ``ids`` and ``reference`` that ``mode`` counts (at most ``max_diffs``).

        ``truncated``: the trajectory was cut by a length limit, so only ``reference``'s prefix of the
        same text length is compared. ``ignore_strippable`` drops every difference that is whitespace
        only (the two stretches are equal once whitespace is removed, whatever the token boundaries);
        ``disable`` returns no diffs. ``neutral_text``: the reference's render with literal contents
        neutralized, when some hold special-token text (:mod:`.literal_text`), for re-tokenizing a prefix.
        """
        if mode == "disable" or ids == reference:
            return []
        if truncated:
            have = self.decode(ids)
            ref_text = self.decode(reference)
            if ref_text.startswith(have):
                return []
            if neutral_text is None:
                reference = self.encode(ref_text[: len(have)])
            else:  # decode(encode(x)) is normalize(x), and the neutral twin normally normalizes to the same length
                normalizer = self._backend.normalizer if self._backend is not None else None
                neutral = normalizer.normalize_str(neutral_text) if normalizer is not None else neutral_text
                try:
                    reference = self.literal.encode_rendered(ref_text[: len(have)], neutral[: len(have)])
                except ForgedStructureError:  # it does not (a character composing with an x): cut the ids instead
                    reference = self._ids_within(reference, len(have))
            if ids == reference:
                return []
        diffs = []
        for a0, a1, b0, b1 in diff_regions(reference, ids):
            expected, actual = self.decode(reference[a0:a1]), self.decode(ids[b0:b1])
            if mode == "ignore_strippable" and _whitespace_only(expected, actual):
                continue
            before = self.decode(ids[max(0, b0 - 8) : b0])[-context_chars:]
            after = self.decode(ids[b1 : b1 + 8])[:context_chars]
            diffs.append({
                "expected": expected, "actual": actual, "context": f"{before}[...]{after}",
                "expected_ids": list(reference[a0:a1]), "actual_ids": list(ids[b0:b1]),
            })
            if len(diffs) >= max_diffs:
                break
        return diffs


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


_SPACE = re.compile(r"\s+")


def _whitespace_only(expected: str, actual: str) -> bool:
    """Whether two differing stretches differ only in whitespace: equal once it is removed, and either
    different as text or blank (the same non-blank text tokenized differently is a real difference)."""
    return _SPACE.sub("", expected) == _SPACE.sub("", actual) and (expected != actual or not expected.strip())


def diff_regions(a: list[int], b: list[int], *, window: int = 256, anchor: int = 8) -> list[tuple[int, int, int, int]]:
    """The regions ``(a0, a1, b0, b1)`` where ``a`` and ``b`` differ, in order.

    After each difference, the next common run is the nearest position pair (within ``window`` tokens
    ahead on each side) where ``anchor`` tokens agree; failing that, the rest is one region. Linear in
    the lengths (plus ``window * anchor`` per region), unlike ``difflib``'s quadratic matcher.
    """
    regions: list[tuple[int, int, int, int]] = []
    i = j = 0
    n, m = len(a), len(b)
    while True:
        while i < n and j < m and a[i] == b[j]:
            i += 1
            j += 1
        if i == n and j == m:
            return regions
        starts: dict[tuple[int, ...], int] = {}
        for dj in range(min(window, m - j) + 1):
            starts.setdefault(tuple(b[j + dj : j + dj + anchor]), dj)
        best: tuple[int, int] | None = None
        for di in range(min(window, n - i) + 1):
            dj = starts.get(tuple(a[i + di : i + di + anchor]))
            if dj is not None and (best is None or di + dj < sum(best)):
                best = (di, dj)
        if best is None:
            regions.append((i, n, j, m))
            return regions
        regions.append((i, i + best[0], j, j + best[1]))
        i, j = i + best[0], j + best[1]


def _runs(mask: list[int]) -> list[tuple[bool, int, int]]:
    """Maximal runs of equal values of a 0/1 mask as ``(is_one, start, end)`` (found by C-level ``index``)."""
    runs: list[tuple[bool, int, int]] = []
    start, n = 0, len(mask)
    while start < n:
        one = bool(mask[start])
        try:
            end = mask.index(0 if one else 1, start)
        except ValueError:
            end = n
        runs.append((one, start, end))
        start = end
    return runs


def describe_diff(d: Mapping[str, Any]) -> str:
    """One sanity-check difference as ``'expected' -> 'actual' at 'context'``; when the two texts are equal (the
    same text as other tokens: a sampled non-canonical split) the token ids say what differs."""
    text = f"{d['expected']!r} -> {d['actual']!r}"
    if d["expected"] == d["actual"] and "expected_ids" in d:
        text += f" (same text, token ids {list(d['expected_ids'])} -> {list(d['actual_ids'])})"
    return f"{text} at {d['context']!r}"


def mismatch_summary(request_id: str, diffs: Sequence[Mapping[str, Any]], mismatched: int, total: int) -> str:
    """The one line of a step's sanity-check mismatches: how many trajectories, and the first one's first diffs."""
    return (
        f"tokenization sanity check: {mismatched} of {total} trajectories differ from a full render of their messages "
        f"(rollout.multi_turn.tokenization_sanity_check_mode); first, request {request_id} (expected -> actual): "
        + "; ".join(describe_diff(d) for d in diffs[:3])
    )
