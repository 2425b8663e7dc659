"""Token-in, token-out tokenization of multi-turn trajectories, and its sanity check.

Assistant turns are never tokenized here: the trajectory keeps the exact ids the
engine sampled (up to and including the end-of-turn token ``<|im_end|>``). Only
what the environment adds is tokenized, as the *delta* of two chat-template
renders::

    prev = render(messages[:start], add_generation_prompt=False)   # ends "...<|im_end|>\\n"
    curr = render(messages,         add_generation_prompt=True)    # + tool/user turns + "<|im_start|>assistant\\n"
    env  = curr[cut:]   # cut = just after the <|im_end|> the model sampled

so the env segment also carries the template's end-of-turn suffix the model did
not sample (the ``\\n`` after ``<|im_end|>``; the whole ``<|im_end|>\\n`` if the
model stopped on another stop token).
When the new render starts with the decoded trajectory itself (the usual case: no
drift, no rewrite), that text stands in for ``prev``: one render per turn, same ids.

Templates that rewrite history (Qwen3 strips earlier ``<think>`` blocks once a
new user query arrives) break ``curr.startswith(prev)``. Then the delta is taken
against a fixed base conversation (system + user + a placeholder assistant turn,
verl's ``BASE_CHAT_HISTORY`` idea), cutting after the placeholder's end-of-turn
token, which no later message can rewrite.

The sanity check compares a finished trajectory with a full render of its
messages (or, when the fallback was used, with the stitched per-turn renders:
the full render legitimately differs there) and reports text diffs.
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# A conversation no later message can rewrite: no reasoning, one plain turn each.
BASE_CHAT_HISTORY: tuple[dict[str, str], ...] = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "I am a user."},
)
_BASE_ASSISTANT = {"role": "assistant", "content": "OK."}

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class EnvSegment:
    """Environment-added ids (loss mask 0) and whether the base-conversation fallback made them."""

    ids: list[int]
    text: str
    used_fallback: bool


class ChatTokenizer:
    """Chat-template renders and delta tokenization for one tokenizer (and tool schema list).

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

    @property
    def stop_token_ids(self) -> list[int]:
        """Token ids that end an assistant turn: the template's end-of-turn and the tokenizer's eos."""
        ids = {self.eot_id}
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return sorted(ids)

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
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    # -- trajectory pieces --------------------------------------------------------------------------

    def prompt_ids(self, messages: Messages, *, tools: list[dict] | None) -> list[int]:
        """The initial prompt: full render with the generation prompt (tool schemas included)."""
        return self.encode(self.render(messages, tools=tools, add_generation_prompt=True))

    def env_segment(
        self,
        messages: Messages,
        start: int,
        *,
        tools: list[dict] | None,
        sampled_eot: bool | None,
        history_text: str | None = None,
    ) -> EnvSegment:
        """Ids for ``messages[start:]`` (tool results, user turns) plus the next generation prompt.

        ``messages[start - 1]`` is the turn already in the trajectory. ``sampled_eot``: True if it is a
        sampled assistant turn that ended with the end-of-turn token, False if a sampled assistant turn
        that did not (the template's whole closing is then environment text), None if it is not a
        sampled turn (its render is already in the trajectory in full).

        ``history_text``: the decoded trajectory so far. When the new render starts with it exactly, it
        stands in for the first render (one template render per turn instead of two; same result, since
        then trajectory text + delta == the template's render).
        """
        if not 0 < start <= len(messages):
            raise ValueError(f"start={start} must be in 1..{len(messages)}")
        curr = self.render(messages, tools=tools, add_generation_prompt=True)
        if history_text is not None and sampled_eot is not False and curr.startswith(history_text):
            text = curr[len(history_text) :]
            return EnvSegment(self.encode(text), text, used_fallback=False)
        prev = self.render(messages[:start], tools=tools, add_generation_prompt=False)
        if curr.startswith(prev):
            text = curr[self._cut(prev, len(prev), sampled_eot) :]
            return EnvSegment(self.encode(text), text, used_fallback=False)
        # The template rewrote an earlier turn; take the delta after a base conversation instead.
        base = [*BASE_CHAT_HISTORY, _BASE_ASSISTANT] if sampled_eot is not None else list(BASE_CHAT_HISTORY)
        base_head = self.render(list(BASE_CHAT_HISTORY), tools=tools, add_generation_prompt=False)
        full = self.render([*base, *messages[start:]], tools=tools, add_generation_prompt=True)
        if not full.startswith(base_head):
            raise RuntimeError(
                "chat template rewrites even the base system/user turns when messages are appended; "
                "incremental tokenization is impossible with it"
            )
        if sampled_eot is None:
            text = full[len(self.render(base, tools=tools, add_generation_prompt=False)) :]
        else:
            text = full[self._cut(full, len(base_head), sampled_eot, search_from=len(base_head)) :]
        return EnvSegment(self.encode(text), text, used_fallback=True)

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

    def assistant_turn_ids(self, message: dict[str, Any], *, tools: list[dict] | None) -> list[int]:
        """How the template renders one assistant message, up to and including its end-of-turn token.

        Rendered after the base conversation, so the result does not depend on the history. Used as the
        reference for sampled turns in the sanity check (and as "sampled" ids in tests).
        """
        head = self.render(list(BASE_CHAT_HISTORY), tools=tools, add_generation_prompt=True)
        full = self.render([*BASE_CHAT_HISTORY, message], tools=tools, add_generation_prompt=False)
        if not full.startswith(head):
            raise RuntimeError("chat template's generation prompt is not a prefix of the assistant turn's render")
        end = full.find(self.eot_text, len(head))
        if end < 0:
            raise RuntimeError(f"assistant turn render has no end-of-turn token {self.eot_text!r}")
        return self.encode(full[len(head) : end + len(self.eot_text)])

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
            # A trajectory that ends on environment text (cut by a length limit) ends in a generation prompt.
            ends_with_env = bool(messages) and messages[-1].get("role") != "assistant"
            text = self.render(messages, tools=tools, add_generation_prompt=ends_with_env)
            if ids and ids[-1] == self.eot_id:
                text = text[: text.rfind(self.eot_text) + len(self.eot_text)]
            return self.encode(text)
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

    def sanity_check(
        self,
        ids: list[int],
        reference: list[int],
        *,
        mode: str,
        truncated: bool = False,
        context_chars: int = 20,
    ) -> list[dict[str, str]]:
        """Text diffs between the trajectory ``ids`` and ``reference`` that ``mode`` counts.

        ``truncated``: the trajectory was cut by a length limit, so only ``reference``'s prefix of the
        same text length is compared. Whitespace-only diffs are dropped in ``ignore_strippable`` mode;
        ``disable`` returns no diffs.
        """
        if mode == "disable" or ids == reference:
            return []
        if truncated:
            have = self.decode(ids)
            ref_text = self.decode(reference)
            if ref_text.startswith(have):
                return []
            reference = self.encode(ref_text[: len(have)])
            if ids == reference:
                return []
        diffs = []
        matcher = difflib.SequenceMatcher(a=reference, b=ids, autojunk=False)
        for tag, a0, a1, b0, b1 in matcher.get_opcodes():
            if tag == "equal":
                continue
            expected, actual = self.decode(reference[a0:a1]), self.decode(ids[b0:b1])
            if mode == "ignore_strippable" and not expected.strip() and not actual.strip():
                continue
            before = self.decode(ids[max(0, b0 - 8) : b0])[-context_chars:]
            after = self.decode(ids[b1 : b1 + 8])[:context_chars]
            diffs.append({"expected": expected, "actual": actual, "context": f"{before}[...]{after}"})
        return diffs


def _runs(mask: list[int]) -> list[tuple[bool, int, int]]:
    """Maximal runs of equal mask values as ``(is_one, start, end)``."""
    runs: list[tuple[bool, int, int]] = []
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((bool(mask[start]), start, i))
            start = i
    return runs


def log_mismatch(request_id: str, diffs: list[dict[str, str]]) -> None:
    """The warning users of verl recognise, with the mismatching text."""
    logger.warning(
        "Inconsistent training and inference tokenization detected in request %s. This may lead to unexpected "
        "behavior during training; review your chat template (see rollout.multi_turn.tokenization_sanity_check_mode). "
        "First diffs (expected -> actual): %s",
        request_id,
        "; ".join(f"{d['expected']!r} -> {d['actual']!r} at {d['context']!r}" for d in diffs[:3]),
    )
