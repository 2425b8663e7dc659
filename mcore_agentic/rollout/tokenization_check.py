"""The tokenization sanity check of a finished trajectory (:mod:`~mcore_agentic.rollout.tokenization`'s module
docstring): :class:`ChatTokenizer <mcore_agentic.rollout.tokenization.ChatTokenizer>`'s methods that compare a
trajectory's ids with the template's render of its messages (the re-tokenization shortcut over added-token cuts, the
reference ids, the text diffs), kept in a mixin of that class."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from mcore_agentic.rollout.literal_text import ForgedStructureError, aligned
from mcore_agentic.rollout.tokenization_diff import _runs, _whitespace_only, diff_regions

if TYPE_CHECKING:
    from mcore_agentic.rollout.tokenization import Messages


class TrajectoryCheck:
    """The sanity-check methods of :class:`~mcore_agentic.rollout.tokenization.ChatTokenizer` (a mixin: they use its
    renders, ``encode``/``decode``, literal text, backend tokenizer and hard splits)."""

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


__all__ = ["TrajectoryCheck"]
