"""Environment text as ordinary tokens: only the chat template's own structure becomes special tokens.

A tool result, a simulated user's turn or a prompt can contain the text of the tokenizer's added
tokens (``<|im_end|>``, ``<|im_start|>``, ``<tool_call>``, ...). Tokenized as usual, that text
becomes those tokens, and environment text can forge turn boundaries, roles and tool calls in
what the model reads. Here every message's content except the assistant's (the policy's own
output, sampled or demonstrated) is *literal*: its added-token strings are tokenized as the text
they are, as if the tokenizer had no added tokens.

How the two kinds of occurrence are told apart in a render: the same messages are rendered once
more with each added-token string of a literal content replaced by as many ``x`` (its *neutral*
twin, :meth:`LiteralText.neutralize`). Every added-token string the template writes itself is
in both renders, at the same place; those written by the environment are only in the real one.
When the two renders differ in length (a template that transforms content by its characters),
nothing can be told apart safely and :class:`ForgedStructureError` is raised: the request fails
and trains on nothing rather than train on a forged structure.

Text without any added-token string (nearly all of it) takes the ordinary path unchanged: one
pattern search per rendered delta decides. Text with one is tokenized literally by the fast tokenizer's
own normalizer, pre-tokenizer and model without its added tokens (shared, not copied: one call, as fast
as an ordinary one), and :func:`aligned` compares the two renders at C speed but around the few
neutralized strings.
"""

from __future__ import annotations

import re
from typing import Any

_NEUTRAL = "x"  # what a template leaves alone: not whitespace (trimmed), not escaped by tojson, not a token's start


class ForgedStructureError(ValueError):
    """Environment text holds special-token strings, and this template's render of it cannot be checked."""


class LiteralText:
    """The added tokens of one tokenizer: find them in text, neutralize messages, tokenize with literal content."""

    def __init__(self, tokenizer: Any, encode: Any):
        self._encode = encode
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        # Control tokens: every added token but pure whitespace runs (some vocabularies add those for code).
        tokens = {t.content: (int(i), t) for i, t in decoder.items() if t.content and not t.content.isspace()}
        self.ids: dict[str, int] = {content: i for content, (i, _) in tokens.items()}
        contents = sorted(self.ids, key=len, reverse=True)  # leftmost, then longest, as the tokenizer matches
        self.pattern = re.compile("|".join(re.escape(c) for c in contents)) if contents else None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if backend is not None and getattr(backend, "model", None) is not None else None
        self._tokenizer = tokenizer
        # Tokens matched after normalisation (NFKC, lowercasing) also match text that only normalizes to them.
        normalizer = self._backend.normalizer if self._backend is not None else None
        normalized = any(getattr(t, "normalized", False) for _, t in tokens.values())
        self._normalize = normalizer.normalize_str if normalized and normalizer is not None else None
        self._plain = self._without_added_tokens()
        self.hard_splits = False
        """Set by the owner when the tokenizer cuts text at every added token independently (see
        :meth:`encode_rendered`); off, every stretch is tokenized on its own."""

    def _without_added_tokens(self) -> Any:
        """The fast tokenizer's own normalizer, pre-tokenizer and model (shared, not copied) without its added
        tokens: :meth:`encode_literal` in one call. None where it cannot be built (the pieces path is used)."""
        if self._backend is None:
            return None
        try:
            from tokenizers import Tokenizer

            plain = Tokenizer(self._backend.model)
            if self._backend.normalizer is not None:
                plain.normalizer = self._backend.normalizer
            if self._backend.pre_tokenizer is not None:
                plain.pre_tokenizer = self._backend.pre_tokenizer
        except Exception:  # noqa: BLE001 -- an unusual backend: the pieces path is the same, only slower
            return None
        return plain

    def contains(self, text: str) -> bool:
        """Whether ``text`` holds the text of any added token (or, for normalized tokens, normalizes to one)."""
        if self.pattern is None:
            return False
        if self.pattern.search(text) is not None:
            return True
        return self._normalize is not None and self.pattern.search(self._normalize(text)) is not None

    # -- messages -----------------------------------------------------------------------------------

    def neutralize(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        """``messages`` with every added-token string of a literal content replaced by as many ``x``, or None if none has one."""
        if self.pattern is None:
            return None
        out: list[dict[str, Any]] | None = None
        for i, message in enumerate(messages):
            if message.get("role") == "assistant":
                continue
            content = message.get("content")
            replaced = self._neutral_content(content)
            if replaced is not content:
                if out is None:
                    out = list(messages)
                out[i] = {**message, "content": replaced}
        return out

    def _neutral_content(self, content: Any) -> Any:
        assert self.pattern is not None
        if isinstance(content, str):
            if self.pattern.search(content):
                return self.pattern.sub(lambda m: _NEUTRAL * len(m.group()), content)
            if self.contains(content):  # only its normalized form holds a token: all of it is neutralized
                return _NEUTRAL * len(content)
            return content
        if isinstance(content, list):
            parts = [self._neutral_content_part(part) for part in content]
            return parts if any(a is not b for a, b in zip(parts, content)) else content
        return content

    def _neutral_content_part(self, part: Any) -> Any:
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            text = self._neutral_content(part["text"])
            return part if text is part["text"] else {**part, "text": text}
        if isinstance(part, str):
            return self._neutral_content(part)
        return part

    # -- tokenization -------------------------------------------------------------------------------

    def encode_literal(self, text: str) -> list[int]:
        """Ids of ``text`` with no added token recognised: added-token strings become the ordinary tokens of their text."""
        if not self.contains(text):
            return self._encode(text)
        if self._plain is not None:
            return self._plain.encode(text, add_special_tokens=False).ids
        return self._encode_literal_by_pieces(text)

    def _encode_literal_by_pieces(self, text: str) -> list[int]:
        """:meth:`encode_literal` step by step: normalize, pre-tokenize, and the model on each piece."""
        if self._backend is None:  # a slow tokenizer: its own switch (which splits every added token there)
            return list(self._tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
        normalizer, pre = self._backend.normalizer, self._backend.pre_tokenizer
        normalized = normalizer.normalize_str(text) if normalizer is not None else text
        pieces = pre.pre_tokenize_str(normalized) if pre is not None else [(normalized, (0, len(normalized)))]
        model = self._backend.model
        return [token.id for piece, _ in pieces for token in model.tokenize(piece)]

    def encode_rendered(self, text: str, neutral: str) -> list[int]:
        """Ids of a render ``text`` whose literal contents are neutralized in ``neutral`` (the same render otherwise).

        The template's added-token strings (those at the same place in ``neutral``) become their tokens and cut
        the text, as the tokenizer cuts it; every stretch between them is tokenized literally. With
        :attr:`hard_splits` (the tokenizer cuts text at its added tokens before anything else, and no two of
        them can overlap), the stretches without any added-token string and the template's tokens between them
        are tokenized by one ordinary call: the same ids, in fewer calls.
        """
        if not aligned(text, neutral):
            raise ForgedStructureError(
                "environment text holds the chat template's special-token strings and the template renders it "
                "transformed, so its own special tokens cannot be told apart from the environment's; the request "
                "is failed rather than trained on forged structure"
            )
        assert self.pattern is not None
        out: list[int] = []
        pos = run = 0  # the next stretch starts at pos; text[run:pos] is an ordinary run not yet tokenized
        for m in self.pattern.finditer(neutral):
            token = m.group()
            if text[m.start() : m.end()] != token or m.start() < pos:
                raise ForgedStructureError(f"the template's {token!r} is not where its neutral render has it")
            stretch = text[pos : m.start()]
            if not self.hard_splits or self.contains(stretch):
                if run < pos:
                    out += self._encode(text[run:pos])
                out += self.encode_literal(stretch)
                out.append(self.ids[token])
                run = m.end()
            pos = m.end()
        tail = text[pos:]
        if not self.hard_splits or self.contains(tail):
            if run < pos:
                out += self._encode(text[run:pos])
            return out + self.encode_literal(tail)
        return out + self._encode(text[run:])


_LEAF = 32  # characters below which a differing stretch is compared character by character


def aligned(text: str, neutral: str) -> bool:
    """Whether the two renders are the same text but where the neutral one has its ``x`` (so they are aligned).

    Nearly all at C speed: differing stretches are halved until short (equal halves are dropped by one string
    comparison each), and only those few short stretches, each around a neutralized string, are walked
    character by character.
    """
    if len(text) != len(neutral):
        return False
    stack = [(0, len(text))]
    while stack:
        lo, hi = stack.pop()
        if text[lo:hi] == neutral[lo:hi]:
            continue
        if hi - lo > _LEAF:
            mid = (lo + hi) // 2
            stack += [(mid, hi), (lo, mid)]
        elif any(b != _NEUTRAL for a, b in zip(text[lo:hi], neutral[lo:hi]) if a != b):
            return False
    return True
