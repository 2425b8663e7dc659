"""Delta tokenization against full renders, on the offline Qwen tokenizer with both chat templates.

The property test builds trajectories the way the agent loop does: the "sampled" ids of an
assistant turn are the tokenization of that turn's rendered text up to and including
``<|im_end|>``; everything else comes from :meth:`ChatTokenizer.env_segment` (full context) and,
side by side, from the linear :class:`ConversationTokenizer` (local context), which must agree.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mcore_agentic.models.tokenizer import load_qwen_tokenizer
from mcore_agentic.rollout.request import Trajectory
from mcore_agentic.rollout.tokenization import ChatTokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "evaluate an arithmetic expression",
            "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]},
        },
    }
]


@pytest.fixture(scope="module", params=["qwen2_5", "qwen3"])
def chat(request):
    return ChatTokenizer(load_qwen_tokenizer(request.param, vocab_size=4096)), request.param


_alphabet = st.sampled_from(list("abcdefghijklmnopqrstuvwxyz ABC0123456789.,:;!?'\"()[]{}+-*/=\n\téü中文"))
_text = st.text(_alphabet, min_size=0, max_size=40)
# Sampled text never starts with whitespace: "assistant\n" + "\n..." merges across the turn boundary
# in a full tokenization (one "\n\n" token), a real drift the sanity check reports (tested below).
_assistant_text = st.text(_alphabet, min_size=1, max_size=40).filter(lambda s: not s[0].isspace())


@st.composite
def conversations(draw):
    """(initial messages, later messages): later ones start with an assistant turn and end with one."""
    initial = []
    if draw(st.booleans()):
        initial.append({"role": "system", "content": draw(_text)})
    initial.append({"role": "user", "content": draw(_text)})
    later = []
    for _ in range(draw(st.integers(1, 4))):
        content = draw(_assistant_text)
        if draw(st.booleans()):
            content = f"<think>{draw(_text)}</think>{content}"
        message = {"role": "assistant", "content": content}
        n_calls = draw(st.integers(0, 2))
        if n_calls:
            message["tool_calls"] = [
                {"type": "function", "function": {"name": "calc", "arguments": {"expr": draw(_text)}}}
                for _ in range(n_calls)
            ]
        later.append(message)
        if n_calls:
            later.extend({"role": "tool", "content": draw(_text)} for _ in range(n_calls))
        else:  # a turn without tool calls continues only through user feedback (an interaction turn)
            later.append({"role": "user", "content": draw(_text)})
    later.append({"role": "assistant", "content": draw(_assistant_text)})
    return initial, later


def build(chat: ChatTokenizer, initial, later, tools, *, full_context: bool = True):
    """Trajectory + messages + whether the fallback was used, as the agent loop would build them.

    The linear tokenizer gives every delta; with ``full_context`` the full-history delta is computed
    too (twice: two renders, and the one-render shortcut) and must be the same.
    """
    messages = [dict(m) for m in initial]
    traj = Trajectory()
    tokens = chat.conversation(messages, tools=tools)
    assert tokens.prompt_ids == chat.prompt_ids(messages, tools=tools)
    traj.set_prompt(tokens.prompt_ids)
    fallback = False
    i = 0
    while i < len(later):
        sampled = chat.assistant_turn_ids(later[i], tools=tools)
        traj.append(sampled, sampled=True, log_probs=[-1.0] * len(sampled))
        tokens.sampled(chat.decode(sampled))
        messages.append(later[i])
        i += 1
        start = len(messages)
        while i < len(later) and later[i]["role"] != "assistant":
            messages.append(later[i])
            i += 1
        if len(messages) > start:
            seg = tokens.env_segment(messages, start, sampled_text=chat.decode(sampled), sampled_eot=True)
            if full_context:
                full = chat.env_segment(messages, start, tools=tools, sampled_eot=True)
                # the one-render shortcut (history text = decoded trajectory) gives the same ids
                fast = chat.env_segment(messages, start, tools=tools, sampled_eot=True, history_text=chat.decode(traj.ids))
                assert seg.ids == full.ids == fast.ids
                assert seg.used_fallback == full.used_fallback
            fallback |= seg.used_fallback
            traj.append(seg.ids, sampled=False)
    assert tokens.text == chat.decode(traj.ids)
    assert fallback == tokens.used_fallback
    return traj, messages, fallback


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conv=conversations(), with_tools=st.booleans())
def test_delta_equals_full_render_and_mask_covers_assistant_turns(chat, conv, with_tools):
    chat, template = chat
    initial, later = conv
    tools = TOOLS if with_tools else None
    traj, messages, fallback = build(chat, initial, later, tools)

    full = chat.render(messages, tools=tools, add_generation_prompt=False)
    full = full[: full.rfind(chat.eot_text) + len(chat.eot_text)]
    full_ids = chat.encode(full)
    if template == "qwen2_5":
        assert not fallback  # the qwen2_5 template never rewrites history
    if not fallback:
        assert traj.ids == full_ids
    else:
        # Qwen3 strips earlier <think> blocks once a new user query arrives: the full render of the final
        # conversation legitimately differs, and the reference is the per-turn (stitched) render.
        assert template == "qwen3"
        assert traj.ids != full_ids
    reference = chat.reference_ids(
        traj.ids, traj.loss_mask, messages, tools=tools, num_prompt_messages=len(initial), used_fallback=fallback
    )
    assert reference == traj.ids
    assert chat.sanity_check(traj.ids, reference, mode="strict") == []
    check = {"tools": tools, "num_prompt_messages": len(initial), "used_fallback": fallback, "mode": "strict"}
    assert chat.check_trajectory(traj.ids, traj.loss_mask, messages, **check) == []

    # loss mask: exactly the assistant turns, each ending with <|im_end|>
    assistants = [m for m in later if m["role"] == "assistant"]
    runs, start = [], None
    for k, m in enumerate([*traj.loss_mask, 0]):
        if m and start is None:
            start = k
        elif not m and start is not None:
            runs.append(traj.ids[start:k])
            start = None
    assert runs == [chat.assistant_turn_ids(m, tools=tools) for m in assistants]
    assert sum(traj.loss_mask) == sum(len(r) for r in runs)
    assert all(r[-1] == chat.eot_id for r in runs)


def test_qwen3_history_rewrite_uses_fallback():
    chat = ChatTokenizer(load_qwen_tokenizer("qwen3", vocab_size=4096))
    initial = [{"role": "user", "content": "2+2?"}]
    later = [
        {"role": "assistant", "content": "<think>easy</think>4"},
        {"role": "user", "content": "why?"},
        {"role": "assistant", "content": "<think>count</think>Because."},
    ]
    traj, messages, fallback = build(chat, initial, later, None)
    assert fallback
    full = chat.render(messages, tools=None, add_generation_prompt=False)
    assert "easy" not in full  # the template dropped the first turn's reasoning...
    assert "easy" in chat.decode(traj.ids)  # ...the trajectory keeps what was sampled
    env = chat.decode(traj.ids[traj.loss_mask.index(1) :])
    assert "<|im_end|>\n<|im_start|>user\nwhy?<|im_end|>\n<|im_start|>assistant\n" in env


def test_env_segment_adds_template_closing_the_model_did_not_sample():
    tok = load_qwen_tokenizer("qwen2_5", vocab_size=4096)
    chat = ChatTokenizer(tok)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    closed = chat.env_segment(msgs, 2, tools=None, sampled_eot=True)
    assert closed.text == "\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    # stopped on <|endoftext|> instead of <|im_end|>: the env text carries the template's <|im_end|>
    unclosed = chat.env_segment(msgs, 2, tools=None, sampled_eot=False)
    assert unclosed.text == "<|im_end|>" + closed.text
    assert sorted(chat.stop_token_ids) == sorted({tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id})


def test_sanity_check_modes():
    chat = ChatTokenizer(load_qwen_tokenizer("qwen2_5", vocab_size=4096))
    reference = chat.encode("<|im_start|>assistant\nThe answer is 4.<|im_end|>")
    spaced = chat.encode("<|im_start|>assistant\nThe answer  is 4.<|im_end|>")
    wrong = chat.encode("<|im_start|>assistant\nThe answer is 5.<|im_end|>")
    assert chat.sanity_check(reference, reference, mode="strict") == []
    strict = chat.sanity_check(spaced, reference, mode="strict")
    assert strict and strict[0]["actual"] != strict[0]["expected"]
    assert chat.sanity_check(spaced, reference, mode="ignore_strippable") == []
    diffs = chat.sanity_check(wrong, reference, mode="ignore_strippable")
    assert [(d["expected"], d["actual"]) for d in diffs] == [("4", "5")]
    assert chat.sanity_check(wrong, reference, mode="disable") == []
    # a trajectory cut by a length limit is compared with the reference's prefix
    assert chat.sanity_check(reference[:-3], reference, mode="strict", truncated=True) == []


def test_leading_newline_drift_is_detected():
    """Re-tokenization drift at the turn boundary: the model sampled "\\n" and "\\n" separately."""
    chat = ChatTokenizer(load_qwen_tokenizer("qwen2_5", vocab_size=4096))
    msgs = [{"role": "user", "content": "hi"}]
    prompt = chat.prompt_ids(msgs, tools=None)
    sampled = chat.encode("\n") + chat.encode("\nhello<|im_end|>")
    msgs.append({"role": "assistant", "content": "\n\nhello"})
    traj = prompt + sampled
    ref = chat.reference_ids(traj, [0] * len(prompt) + [1] * len(sampled), msgs, tools=None, num_prompt_messages=1, used_fallback=False)
    assert ref != traj
    assert chat.decode(ref) == chat.decode(traj)  # same text, different ids
    assert chat.sanity_check(traj, ref, mode="strict")
