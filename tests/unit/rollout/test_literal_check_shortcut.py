"""The sanity check's shortcut when environment text holds special-token strings: same answer as the full path.

With a tool result or a user turn that holds ``<|im_end|>``, ``<tool_call>`` and the like, the reference is the
literal tokenization of the full render (:meth:`LiteralText.encode_rendered` with its neutral twin).
:meth:`ChatTokenizer.encodes_to` then matches the template's cuts one to one and re-tokenizes only the sampled
stretches. Checked against the full literal tokenization on random trajectories (non-canonical sampled splits,
drifted renders, special ids forged into environment text, misplaced structure) and through the agent loop; the
one-call literal encoding against the step-by-step one, and the halving alignment test against its
character-by-character definition.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from mcore_agentic.models.tokenizer import load_qwen_tokenizer
from mcore_agentic.rollout.agent_loop import AgentContext, run_request
from mcore_agentic.rollout.config import MultiTurnConfig, RolloutConfig
from mcore_agentic.rollout.literal_text import ForgedStructureError, aligned
from mcore_agentic.rollout.request import RequestState, RolloutRequest
from mcore_agentic.rollout.tokenization import ChatTokenizer
from mcore_agentic.rollout.tool_parser import get_tool_parser
from tests.unit.rollout.scripted import ScriptedEngine
from tests.unit.rollout.test_literal_environment_text import HostileTool, HostileUser, _call, hostile

SPECIAL = ["<|im_end|>", "<|im_start|>", "<tool_call>", "</tool_call>", "<|endoftext|>", "<tool_response>"]
WORDS = ["hello", " world", "\n", " ", "é", "中文", "{\"a\": 1}", "12", ".", "<|im_", "end|>", "<", "|>"]


@pytest.fixture(scope="module")
def chat():
    return ChatTokenizer(load_qwen_tokenizer("qwen2_5", vocab_size=4096))


def _outcome(fn, *args, **kwargs):
    """``fn(...)``'s answer, or "forged" where it raises :class:`ForgedStructureError`."""
    try:
        return fn(*args, **kwargs)
    except ForgedStructureError:
        return "forged"


def _env_text(rng: random.Random, hostile_content: bool) -> tuple[str, str]:
    """A user turn as the template writes it, and its neutral twin (the content's special strings as ``x``)."""
    words = WORDS + (SPECIAL if hostile_content else [])
    content = "".join(rng.choice(words) for _ in range(rng.randint(1, 8)))
    neutral = content
    for s in sorted(SPECIAL, key=len, reverse=True):
        neutral = neutral.replace(s, "x" * len(s))
    head, tail = "\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"
    return head + content + tail, head + neutral + tail


def test_the_shortcut_agrees_with_the_full_literal_tokenization(chat):
    literal = chat.literal
    assert chat._split_ids is not None
    rng = random.Random(0)
    seen = {True: 0, False: 0, "forged": 0}
    for trial in range(400):
        prompt = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
        texts, neutrals, ids, mask = [prompt], [prompt], chat.encode(prompt), [0] * len(chat.encode(prompt))
        for _ in range(rng.randint(1, 4)):
            text = "".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
            if rng.random() < 0.3:
                text += "<tool_call>" + rng.choice(WORDS) + "</tool_call>"
            text += "<|im_end|>"
            sampled = chat.encode(text)
            r = rng.random()
            if r < 0.3:  # a non-canonical split of the same text, as a model may sample
                k = rng.randrange(len(sampled))
                word = chat.decode(sampled[k : k + 1])
                if len(word) > 1 and sampled[k] not in chat._split_ids:
                    sampled = sampled[:k] + chat.encode(word[:1]) + chat.encode(word[1:]) + sampled[k + 1 :]
            elif r < 0.4:  # the model wrote a special token's text as ordinary tokens
                sampled = literal.encode_literal("<|im_end|>") + sampled
                text = "<|im_end|>" + text
            texts.append(text)
            neutrals.append(text)  # the assistant's own text is never neutralized
            ids += sampled
            mask += [1] * len(sampled)
            env, env_neutral = _env_text(rng, hostile_content=rng.random() < 0.7)
            env_ids = literal.encode_rendered(env, env_neutral)
            if rng.random() < 0.1:  # a bug that let environment text become control tokens
                env_ids = chat.encode(env)
            texts.append(env)
            neutrals.append(env_neutral)
            ids += env_ids
            mask += [0] * len(env_ids)
        text, neutral = "".join(texts), "".join(neutrals)
        r = rng.random()
        if r < 0.15:  # a drifted render
            text = text.replace(rng.choice(WORDS), rng.choice(WORDS), 1)
            neutral = text if text == neutral else neutral
        elif r < 0.25 and "<|im_start|>" in neutral:  # the twin says a structural token is environment text
            at = neutral.rfind("<|im_start|>")
            neutral = neutral[:at] + "x" * len("<|im_start|>") + neutral[at + len("<|im_start|>") :]
        full = _outcome(literal.encode_rendered, text, neutral)
        expected = full if full == "forged" else full == ids
        seen[expected] += 1
        assert _outcome(chat.encodes_to, text, ids, mask, neutral=neutral) == expected, (trial, text)
        assert _outcome(chat.encodes_to, text, ids, mask, neutral=neutral, ids_text="".join(texts)) == expected, trial
    assert min(seen.values()) >= 10, seen  # every outcome was exercised


@pytest.fixture(scope="module")
def hostile_rollout():
    """A qwen2_5 rollout whose tool result, user turn and prompt hold every added token's text."""
    tokenizer = load_qwen_tokenizer("qwen2_5", vocab_size=4096)
    tool_text, user_text = hostile(tokenizer, "the tool"), hostile(tokenizer, "the user")
    messages = [{"role": "system", "content": "You can use tools."}, {"role": "user", "content": f"Q-lit {hostile(tokenizer, 'x')}"}]
    req = RolloutRequest(request_id="r0", uid="u", messages=messages, interaction_kwargs={"name": "user"})
    engine = ScriptedEngine(tokenizer, {"Q-lit": [_call("hermes"), "First answer.", "Final <b>answer</b>."]})
    ctx = AgentContext(
        engine=engine,
        chat=ChatTokenizer(tokenizer),
        cfg=RolloutConfig(prompt_length=2048, response_length=4096, multi_turn=MultiTurnConfig(max_user_turns=3, max_tool_response_length=0)),
        parser=get_tool_parser("hermes"),
        tools={"echo": HostileTool(tool_text)},
        interactions={"user": HostileUser(user_text)},
    )
    asyncio.run(run_request(req, ctx))
    assert req.state is RequestState.COMPLETED, req.error
    assert req.metrics.sanity_check_mismatch == 0, req.sanity_check_diffs
    return ctx.chat, req, [HostileTool(tool_text).get_openai_tool_schema()]


def _check(chat, ids, mask, req, tools):
    return chat.check_trajectory(
        ids, mask, req.messages, tools=tools, num_prompt_messages=2, used_fallback=False, mode="strict"
    )


def test_a_hostile_trajectory_is_checked_without_the_full_tokenization(hostile_rollout, monkeypatch):
    chat, req, tools = hostile_rollout
    ids, mask = list(req.trajectory.ids), list(req.trajectory.loss_mask)
    text, neutral = chat._reference_texts(ids, req.messages, tools)
    assert neutral is not None  # literal contents hold special-token text
    assert chat.literal.encode_rendered(text, neutral) == ids  # what the shortcut must agree with
    calls = []
    full = chat.literal.encode_rendered
    monkeypatch.setattr(chat.literal, "encode_rendered", lambda t, n: calls.append(len(t)) or full(t, n))
    assert _check(chat, ids, mask, req, tools) == []
    assert calls == []  # nothing was tokenized in full


def test_a_hostile_trajectory_with_a_non_canonical_turn_gets_the_full_paths_diffs(hostile_rollout, monkeypatch):
    chat, req, tools = hostile_rollout
    ids, mask = list(req.trajectory.ids), list(req.trajectory.loss_mask)
    k = next(i for i, s in enumerate(mask) if s and len(chat.decode(ids[i : i + 1])) > 1 and ids[i] not in chat._split_ids)
    word = chat.decode(ids[k : k + 1])
    split = chat.encode(word[:1]) + chat.encode(word[1:])
    ids, mask = ids[:k] + split + ids[k + 1 :], mask[:k] + [1] * len(split) + mask[k + 1 :]
    diffs = _check(chat, ids, mask, req, tools)
    assert len(diffs) == 1 and diffs[0]["expected"] == diffs[0]["actual"] == word
    monkeypatch.setattr(chat, "encodes_to", lambda *a, **k: False)  # the full path alone
    assert _check(chat, ids, mask, req, tools) == diffs


def test_literal_encoding_in_one_call_equals_the_pieces_path(chat):
    """encode_literal's tokenizer without added tokens gives the ids of normalize -> pre-tokenize -> model by hand."""
    literal = chat.literal
    assert literal._plain is not None
    rng = random.Random(2)
    words = [*WORDS, *SPECIAL, "ﬁ", "\u0301", "\t", "Ǆ", "  ", "\r\n", "'s", "ALL CAPS"]
    for _ in range(1000):
        text = "".join(rng.choice(words) for _ in range(rng.randint(0, 30)))
        assert literal.encode_literal(text) == literal._encode_literal_by_pieces(text), text
    assert chat.literal.encode_literal("<|im_end|>") != [chat.eot_id]
    assert chat.encode("<|im_end|>") == [chat.eot_id]  # the tokenizer itself still has its added tokens


def test_grouped_literal_tokenization_equals_stretch_by_stretch(chat):
    """With hard splits, encode_rendered tokenizes the ordinary stretches and the template's tokens between them
    in one call: the same ids (and the same refusals) as one stretch at a time."""
    literal = chat.literal
    assert literal.hard_splits
    rng = random.Random(3)
    for _ in range(400):
        text = neutral = ""
        for _ in range(rng.randint(0, 6)):
            env, env_neutral = _env_text(rng, hostile_content=rng.random() < 0.4)
            text, neutral = text + env, neutral + env_neutral
        if rng.random() < 0.3:
            tail = "".join(rng.choice([*WORDS, *SPECIAL]) for _ in range(rng.randint(0, 4)))
            text, neutral = text + tail, neutral + (tail if rng.random() < 0.5 else "x" * len(tail))
        literal.hard_splits = True
        grouped = _outcome(literal.encode_rendered, text, neutral)
        literal.hard_splits = False
        try:
            assert grouped == _outcome(literal.encode_rendered, text, neutral), text
        finally:
            literal.hard_splits = True


def test_block_alignment_matches_its_definition():
    rng = random.Random(1)

    def by_characters(text: str, neutral: str) -> bool:
        return len(text) == len(neutral) and all(a == b or b == "x" for a, b in zip(text, neutral))

    for _ in range(300):
        text = "".join(rng.choice(["a", "<|im_end|>", "x", "é", " " * 7]) for _ in range(rng.randint(0, 400)))
        neutral = list(text)
        for _ in range(rng.randint(0, 3)):
            if neutral:
                at = rng.randrange(len(neutral))
                neutral[at] = rng.choice(["x", "x", "y"])
        neutral = "".join(neutral)
        if rng.random() < 0.1:
            neutral += "x"
        assert aligned(text, neutral) is by_characters(text, neutral)
