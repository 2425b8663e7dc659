"""The linear tokenization paths: long conversations, the template probe, the sanity check's shortcut and diff.

Everything is checked against the slow, obviously-correct computation on the real offline Qwen
tokenizer: full-history deltas, ``encode(full render) == ids``, and the texts themselves.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mcore_agentic.models.tokenizer import load_qwen_tokenizer
from mcore_agentic.rollout.tokenization import ChatTokenizer, TokenizationPath
from mcore_agentic.rollout.tokenization_diff import diff_regions
from tests.unit.rollout.test_tokenization import TOOLS, _alphabet, _assistant_text, _text, build


@pytest.fixture(scope="module", params=["qwen2_5", "qwen3"])
def chat(request):
    return ChatTokenizer(load_qwen_tokenizer(request.param, vocab_size=4096)), request.param


@st.composite
def long_conversations(draw, turns: int = 128):
    """128 assistant turns: tool calls with one or two results, now and then a user turn, a final answer."""
    initial = [{"role": "system", "content": draw(_text)}, {"role": "user", "content": draw(_text)}]
    later = []
    for t in range(turns - 1):
        content = draw(_assistant_text)
        if draw(st.integers(0, 9)) == 0:
            later += [{"role": "assistant", "content": content}, {"role": "user", "content": draw(_text)}]
            continue
        n = draw(st.integers(1, 2))
        calls = [{"type": "function", "function": {"name": "calc", "arguments": {"expr": f"{t}+{k}"}}} for k in range(n)]
        later.append({"role": "assistant", "content": content, "tool_calls": calls})
        later += [{"role": "tool", "content": draw(_text)} for _ in range(n)]
    later.append({"role": "assistant", "content": draw(_assistant_text)})
    return initial, later


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(conv=long_conversations())
def test_128_turn_conversations_tokenize_to_the_full_render(chat, conv):
    chat, template = chat
    initial, later = conv
    traj, messages, fallback = build(chat, initial, later, TOOLS, full_context=False)
    full = chat.render(messages, tools=TOOLS, add_generation_prompt=False)
    full_ids = chat.encode(full[: full.rfind(chat.eot_text) + len(chat.eot_text)])
    if not fallback:
        assert template == "qwen2_5" or not any(m["role"] == "user" for m in later)
        assert traj.ids == full_ids
    check = {"tools": TOOLS, "num_prompt_messages": len(initial), "used_fallback": fallback, "mode": "strict"}
    assert chat.check_trajectory(traj.ids, traj.loss_mask, messages, **check) == []
    assert sum(traj.loss_mask) == sum(len(chat.assistant_turn_ids(m, tools=TOOLS)) for m in later if m["role"] == "assistant")


def test_template_probe_picks_the_cheapest_exact_local_context():
    tok = load_qwen_tokenizer("qwen2_5", vocab_size=4096)
    assert ChatTokenizer(tok).local_context(TOOLS) == "light"
    # tool results numbered across the whole conversation: only full renders are exact
    counted = tok.chat_template.replace(
        "{%- for message in messages %}", "{%- set count = namespace(n=0) %}\n{%- for message in messages %}", 1
    ).replace(
        "{{- '\\n<tool_response>\\n' + ",
        "{%- set count.n = count.n + 1 %}{{- '\\n<tool_response id=' ~ count.n ~ '>\\n' + ",
    )
    assert counted != tok.chat_template
    tok.chat_template = counted
    chat = ChatTokenizer(tok)
    assert chat.local_context(TOOLS) == "full"
    initial = [{"role": "user", "content": "go"}]
    later = []
    for t in range(4):
        later += [
            {"role": "assistant", "content": f"step {t}", "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": {"expr": str(t)}}}]},
            {"role": "tool", "content": f"r{t}"},
        ]
    later.append({"role": "assistant", "content": "done"})
    traj, messages, _ = build(chat, initial, later, TOOLS)
    assert "<tool_response id=4>" in chat.decode(traj.ids)
    tokens = chat.conversation(initial, tools=TOOLS)
    assert tokens.context == "full"


def test_template_whose_tool_turns_depend_on_the_tools_uses_the_prompt_context():
    tok = load_qwen_tokenizer("qwen2_5", vocab_size=4096)
    tok.chat_template = tok.chat_template.replace(
        "{{- '\\n<tool_response>\\n'", "{{- '\\n<tool_response' ~ (' n=' ~ (tools | length) if tools else '') ~ '>\\n'"
    )
    chat = ChatTokenizer(tok)
    assert chat.local_context(TOOLS) == "prompt"
    assert chat.local_context(None) == "light"  # without tools the light prefix renders the same
    initial = [{"role": "user", "content": "go"}]
    later = [
        {"role": "assistant", "content": "x", "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": {}}}]},
        {"role": "tool", "content": "r"},
        {"role": "assistant", "content": "done"},
    ]
    traj, _, _ = build(chat, initial, later, TOOLS)
    assert "<tool_response n=1>" in chat.decode(traj.ids)


def _mask_and_text(chat, pieces):
    """ids, sampled mask and text of (text, sampled) pieces, sampled ones tokenized as given."""
    ids, mask = [], []
    for piece, sampled in pieces:
        piece_ids = piece if isinstance(piece, list) else chat.encode(piece)
        ids += piece_ids
        mask += [int(sampled)] * len(piece_ids)
    return ids, mask


def test_encodes_to_agrees_with_a_full_tokenization():
    chat = ChatTokenizer(load_qwen_tokenizer("qwen2_5", vocab_size=4096))
    assert chat._split_ids is not None
    rng = random.Random(0)
    words = ["hello", " world", "\n", "\n\n", " ", "é", "中文", "<tool_call>", "{\"a\": 1}", "12", ".", "  "]
    for trial in range(300):
        pieces = [("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n", False)]
        for _ in range(rng.randint(1, 4)):
            text = "".join(rng.choice(words) for _ in range(rng.randint(1, 8))) + "<|im_end|>"
            sampled = chat.encode(text)
            if rng.random() < 0.5:  # a non-canonical tokenization of the same text, as a model may sample
                k = rng.randrange(len(sampled))
                word = chat.decode(sampled[k : k + 1])
                if len(word) > 1 and sampled[k] not in chat._split_ids:
                    sampled = sampled[:k] + chat.encode(word[:1]) + chat.encode(word[1:]) + sampled[k + 1 :]
            elif rng.random() < 0.2:  # an added token's text sampled as ordinary tokens: the text's cuts and the ids' differ
                sampled = chat.literal.encode_literal("<tool_call>") + sampled
            pieces.append((sampled, True))
            pieces.append(("\n<|im_start|>user\n" + rng.choice(words) + "<|im_end|>\n<|im_start|>assistant\n", False))
        ids, mask = _mask_and_text(chat, pieces)
        text = chat.decode(ids)
        if rng.random() < 0.2:
            text = text.replace(rng.choice(words), rng.choice(words), 1)  # a drifted render
        expected = chat.encode(text) == ids
        assert chat.encodes_to(text, ids, mask) is expected, (trial, text)
        assert chat.encodes_to(text, ids, mask, ids_text=chat.decode(ids)) is expected, (trial, text)


def test_leading_newline_drift_is_caught_by_the_shortcut():
    chat = ChatTokenizer(load_qwen_tokenizer("qwen2_5", vocab_size=4096))
    prompt = chat.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    sampled = chat.encode("\n") + chat.encode("\nhello<|im_end|>")
    ids, mask = prompt + sampled, [0] * len(prompt) + [1] * len(sampled)
    text = chat.decode(ids)
    assert chat.encode(text) != ids and not chat.encodes_to(text, ids, mask)


def test_ignore_strippable_ignores_exactly_whitespace_differences():
    chat = ChatTokenizer(load_qwen_tokenizer("qwen2_5", vocab_size=4096))
    reference = chat.encode("<|im_start|>assistant\nReasoning.\n<tool_call>x</tool_call><|im_end|>")
    spaced = chat.encode("<|im_start|>assistant\nReasoning. \n<tool_call>x</tool_call><|im_end|>")  # '.\n' -> '. \n'
    assert chat.sanity_check(spaced, reference, mode="strict")
    assert chat.sanity_check(spaced, reference, mode="ignore_strippable") == []
    wrong = chat.encode("<|im_start|>assistant\nReasoning! \n<tool_call>x</tool_call><|im_end|>")
    diffs = chat.sanity_check(wrong, reference, mode="ignore_strippable")
    assert len(diffs) == 1 and "!" in diffs[0]["actual"]
    # the same non-blank text tokenized differently is not a whitespace difference
    k = next(i for i, t in enumerate(reference) if len(chat.decode([t]).strip()) > 1)
    word = chat.decode(reference[k : k + 1])
    split = reference[:k] + [i for ch in word for i in chat.encode(ch)] + reference[k + 1 :]
    assert chat.decode(split) == chat.decode(reference) and split != reference
    assert chat.sanity_check(split, reference, mode="ignore_strippable")


@settings(max_examples=200, deadline=None)
@given(a=st.lists(st.integers(0, 5), max_size=300), edits=st.lists(st.tuples(st.integers(0, 299), st.integers(0, 3), st.lists(st.integers(0, 5), max_size=4)), max_size=12))
def test_diff_regions_rebuild_the_other_sequence(a, edits):
    b = list(a)
    for pos, cut, insert in edits:
        pos = min(pos, len(b))
        b[pos : pos + cut] = insert
    regions = diff_regions(a, b, window=16, anchor=3)
    rebuilt, i = [], 0
    for a0, a1, b0, b1 in regions:
        assert a0 >= i and a1 >= a0 and b1 >= b0
        rebuilt += a[i:a0] + b[b0:b1]
        i = a1
    rebuilt += a[i:]
    assert rebuilt == b
    assert (regions == []) == (a == b)


def test_diff_of_a_turn_by_turn_drift_reports_every_turn():
    chat = ChatTokenizer(load_qwen_tokenizer("qwen2_5", vocab_size=4096))
    turns = [f"Step {t}: compute the partial sum carefully." for t in range(64)]
    reference = chat.encode("".join(f"<|im_start|>assistant\n{x}\n<tool_call>c</tool_call><|im_end|>\n" for x in turns))
    drifted = chat.encode("".join(f"<|im_start|>assistant\n{x} \n<tool_call>c</tool_call><|im_end|>\n" for x in turns))
    diffs = chat.sanity_check(drifted, reference, mode="strict", max_diffs=100)
    assert len(diffs) == 64 and all(d["expected"].replace(" ", "") == d["actual"].replace(" ", "") for d in diffs)
    assert chat.sanity_check(drifted, reference, mode="ignore_strippable") == []


def test_drifted_turn_takes_two_renders_and_keeps_full_context_ids():
    chat = ChatTokenizer(load_qwen_tokenizer("qwen2_5", vocab_size=4096))
    initial = [{"role": "user", "content": "go"}]
    message = {"role": "assistant", "content": "Reasoning.", "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": {}}}]}
    sampled_text = chat.assistant_turn_text({**message, "content": "Reasoning. "}, tools=TOOLS)  # what the model wrote
    tokens = chat.conversation(initial, tools=TOOLS)
    messages = [*initial, message, {"role": "tool", "content": "4"}]
    seg = tokens.env_segment(messages, 2, sampled_text=sampled_text, sampled_eot=True)
    assert seg.path is TokenizationPath.TWO_RENDERS
    assert seg.ids == chat.env_segment(messages, 2, tools=TOOLS, sampled_eot=True).ids
    # stopped on <|endoftext|>: the env text carries the template's <|im_end|> (as the full-context path does)
    unclosed = tokens.env_segment(messages, 2, sampled_text=None, sampled_eot=False)
    assert unclosed.text == "<|im_end|>" + seg.text
    assert unclosed.ids == chat.env_segment(messages, 2, tools=TOOLS, sampled_eot=False).ids


@settings(max_examples=100, deadline=None)
@given(text=st.text(_alphabet, max_size=60), special=st.sampled_from(["", "<|im_end|>", "<tool_call>", "<think>"]))
def test_fast_encode_and_decode_match_transformers(text, special):
    tok = load_qwen_tokenizer("qwen2_5", vocab_size=4096)
    chat = ChatTokenizer(tok)
    s = text + special + text
    assert chat.encode(s) == tok.encode(s, add_special_tokens=False)
    ids = chat.encode(s)
    assert chat.decode(ids) == tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_tokenizers_that_treat_a_text_start_specially_get_the_full_tokenization():
    """A Metaspace pre-tokenizer (SentencePiece-style, prefix "▁" on a text's first word) tokenizes a stretch
    differently alone and in context: the shortcut must not be used there."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["▁hello", "▁world", "hello", "world", "▁", "<unk>"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", unk_token="<unk>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = load_qwen_tokenizer("qwen2_5", vocab_size=4096).chat_template
    chat = ChatTokenizer(tok)
    assert chat._split_ids is None
    ids = chat.encode("hello<|im_end|>") + chat.encode("world")
    text = "hello<|im_end|>world"
    assert chat.encodes_to(text, ids, [1] * len(ids)) is (chat.encode(text) == ids)
