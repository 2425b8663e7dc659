"""Valid model outputs for every tool-call format, rendered as the chat templates write them.

Shared by the fuzz and SGLang-parity tests (``render``, ``random_turn``, ``corpus``). The tests
here check the renderers against the real chat templates and that every parser returns
exactly the rendered calls and content.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass, field
from typing import Any

import pytest

from mcore_agentic.rollout.tool_parser import ToolCall, get_tool_parser

FORMATS = ("hermes", "llama3_json", "mistral", "qwen3_coder")

# Tool name -> parameters schema. Typed so that qwen3_coder's text values convert back.
SCHEMAS: dict[str, dict[str, Any]] = {
    "run_code": {
        "type": "object",
        "properties": {"code": {"type": "string"}, "timeout": {"type": "integer"}, "verbose": {"type": "boolean"}},
        "required": ["code"],
    },
    "search": {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "what to look for"},
            "k": {"type": ["integer", "null"]},
            "filters": {"type": "object"},
            "lang": {"enum": ["en", "de"]},
        },
    },
    "calc": {
        "type": "object",
        "properties": {
            "x": {"type": "number"},
            "values": {"type": "array", "items": {"type": "number"}},
            "scale": {"anyOf": [{"type": "number"}, {"type": "null"}]},
            "mode": {"type": "string", "enum": ["fast", "exact"]},
        },
    },
    "noop": {"type": "object", "properties": {}},
}
# What a value of each parameter is (qwen3_coder); parameters not listed are free text.
KINDS: dict[str, dict[str, str]] = {
    "run_code": {"code": "string", "timeout": "integer", "verbose": "boolean"},
    "search": {"query": "string", "k": "integer", "filters": "object", "lang": "enum"},
    "calc": {"x": "number", "values": "array", "scale": "number", "mode": "enum"},
    "noop": {},
}
ENUMS = {"lang": ["en", "de"], "mode": ["fast", "exact"]}

# Text that each format's markers are built from, for strings that mention them.
MARKERS = ("<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "<function=", "</function>",
           "<parameter=", "</parameter>", "<tool_response>")
# Substrings a value cannot hold in a format (the format itself, or SGLang's parser, cuts there).
FORBIDDEN = {
    "hermes": ("</tool_call>",),  # SGLang's HermesDetector splits at the first one, even inside a JSON string
    "qwen2_5": (),
    "llama3_json": (),
    "mistral": (),
    "qwen3_coder": ("</parameter>", "<parameter=", "</function>", "</tool_call>"),
}
CALL_STARTS = {
    "hermes": ("<tool_call>",),
    "llama3_json": ("<|python_tag|>",),
    "mistral": ("[TOOL_CALLS]",),
    "qwen3_coder": ("<tool_call>", "<function="),
}
_TEXT_CHARS = string.ascii_letters + string.digits + " \t\n.,;:!?'\"\\/<>=[]{}()-_*&%$#@" + "éü中文😀\u2028"


@dataclass
class Turn:
    """One assistant turn: its content and calls, and the text a model would generate for it."""

    fmt: str
    content: str
    calls: list[tuple[str, dict[str, Any]]]
    text: str = field(default="")


# ---------------------------------------------------------------------------
# renderers: the exact text each chat template writes for an assistant turn


def _json(value: Any, rng: random.Random | None = None) -> str:
    return json.dumps(value, ensure_ascii=bool(rng and rng.random() < 0.3))


def render_hermes(content: str, calls: list[tuple[str, dict]], rng: random.Random | None = None) -> str:
    """Qwen2.5's template: content, then ``<tool_call>\\n{json}\\n</tool_call>`` blocks, one per line."""
    blocks = [f'<tool_call>\n{{"name": "{name}", "arguments": {_json(args, rng)}}}\n</tool_call>' for name, args in calls]
    return "\n".join(([content] if content else []) + blocks)


def render_llama3(content: str, calls: list[tuple[str, dict]], rng: random.Random | None = None) -> str:
    key = "parameters" if rng is None or rng.random() < 0.7 else "arguments"
    separator = "; " if rng is None else rng.choice([";", "; "])
    payload = separator.join(_json({"name": name, key: args}, rng) for name, args in calls)
    if not content and rng is not None and rng.random() < 0.3 and "<|python_tag|>" not in payload:
        return payload  # a bare call: the tag is optional
    return f"{content}<|python_tag|>{payload}"


def render_mistral(content: str, calls: list[tuple[str, dict]], rng: random.Random | None = None) -> str:
    if rng is not None and rng.random() < 0.4:  # v11 tokenizers: [TOOL_CALLS]name[ARGS]{...} per call
        return content + "".join(f"[TOOL_CALLS]{name}[ARGS]{_json(args, rng)}" for name, args in calls)
    listed = [{"name": name, "arguments": args} for name, args in calls]
    return f"{content}[TOOL_CALLS] {_json(listed, rng)}"


def _qwen3_coder_value(value: Any) -> str:
    """Qwen3-Coder's template: mappings and lists as JSON (``tojson``), strings raw, the rest with ``str``."""
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)
    return value if isinstance(value, str) else str(value)


def render_qwen3_coder(content: str, calls: list[tuple[str, dict]], rng: random.Random | None = None) -> str:
    """What Qwen3-Coder's template writes after ``<|im_start|>assistant\\n`` for a turn with calls."""
    head = content.strip() + "\n\n" if content.strip() else ""
    blocks = []
    for name, args in calls:
        params = "".join(f"<parameter={k}>\n{_qwen3_coder_value(v)}\n</parameter>\n" for k, v in args.items())
        blocks.append(f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>")
    return head + "\n".join(blocks)


RENDERERS = {
    "hermes": render_hermes,
    "llama3_json": render_llama3,
    "mistral": render_mistral,
    "qwen3_coder": render_qwen3_coder,
}


def render(fmt: str, content: str, calls: list[tuple[str, dict]], rng: random.Random | None = None) -> str:
    return RENDERERS[fmt](content, calls, rng)


# ---------------------------------------------------------------------------
# random turns


def random_text(rng: random.Random, fmt: str, max_len: int = 40, markers: bool = True) -> str:
    """Free text, sometimes holding another format's marker (never one ``FORBIDDEN`` in ``fmt``)."""
    chars = [rng.choice(_TEXT_CHARS) for _ in range(rng.randint(0, max_len))]
    if markers and chars and rng.random() < 0.3:
        chars.insert(rng.randrange(len(chars)), rng.choice(MARKERS))
    text = "".join(chars)
    while any(bad in text for bad in FORBIDDEN[fmt]):
        for bad in FORBIDDEN[fmt]:
            text = text.replace(bad, "")
    return "x" if text.strip().lower() == "null" else text


def random_json(rng: random.Random, fmt: str, depth: int = 0) -> Any:
    roll = rng.random()
    if depth < 3 and roll < 0.15:
        return [random_json(rng, fmt, depth + 1) for _ in range(rng.randint(0, 3))]
    if depth < 3 and roll < 0.3:
        return {random_text(rng, fmt, 8, False) or "k": random_json(rng, fmt, depth + 1) for _ in range(rng.randint(0, 3))}
    return rng.choice([
        lambda: random_text(rng, fmt),
        lambda: rng.randint(-(10**12), 10**12),
        lambda: rng.uniform(-1e6, 1e6),
        lambda: rng.choice([True, False, None]),
        lambda: rng.choice([0.1, 1e-7, 2.5e20, -0.0, 3.0]),
    ])()


def _typed_value(rng: random.Random, kind: str, key: str, fmt: str) -> Any:
    if kind == "integer":
        return rng.choice([0, 7, -3, rng.randint(-(10**18), 10**18), 10**25])
    if kind == "number":
        return rng.choice([rng.uniform(-1e3, 1e3), 1e-7, 1.5e16, 2.0, rng.randint(-99, 99), 123456789.5])
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "enum":
        return rng.choice(ENUMS[key])
    if kind == "object":
        return {random_text(rng, fmt, 6, False) or "k": random_json(rng, fmt, 1) for _ in range(rng.randint(0, 3))}
    if kind == "array":
        return [random_json(rng, fmt, 1) for _ in range(rng.randint(0, 4))]
    return random_text(rng, fmt, 60)


def random_arguments(rng: random.Random, fmt: str, name: str) -> dict[str, Any]:
    """Arguments for tool ``name``: schema-typed for qwen3_coder, any JSON for the JSON formats."""
    if fmt != "qwen3_coder":
        return {random_text(rng, fmt, 10, False) or "a": random_json(rng, fmt) for _ in range(rng.randint(0, 4))}
    kinds = KINDS[name]
    chosen = rng.sample(sorted(kinds), rng.randint(0, len(kinds)))
    args = {key: _typed_value(rng, kinds[key], key, fmt) for key in chosen}
    if rng.random() < 0.2:  # a parameter the schema does not declare stays text
        args["note_" + str(rng.randint(0, 9))] = random_text(rng, fmt, 20)
    return args


def random_turn(rng: random.Random, fmt: str, max_calls: int = 3) -> Turn:
    names = [rng.choice(sorted(SCHEMAS)) for _ in range(rng.randint(1, max_calls))]
    calls = [(name, random_arguments(rng, fmt, name)) for name in names]
    content = random_text(rng, fmt, 50, markers=False) if rng.random() < 0.6 else ""
    content = "".join(c for c in content if c not in "{[<")  # text before the calls: no call-like syntax
    if fmt in ("mistral", "llama3_json") and content and rng.random() < 0.5:
        content += " "
    return Turn(fmt, content, calls, render(fmt, content, calls, rng))


def corpus(fmt: str, size: int, seed: int = 0) -> list[Turn]:
    rng = random.Random(f"{fmt}-{seed}")
    return [random_turn(rng, fmt) for _ in range(size)]


def calls_of(parsed: list) -> list[tuple[str, dict]]:
    return [(c.name, c.arguments) if isinstance(c, ToolCall) else ("<error>", {"message": c.message}) for c in parsed]


# ---------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_parser_returns_exactly_the_rendered_calls(fmt):
    parser = get_tool_parser(fmt)
    for turn in corpus(fmt, 300):
        content, parsed = parser.parse(turn.text, schemas=SCHEMAS)
        assert calls_of(parsed) == turn.calls, turn.text
        assert content == turn.content.strip(), turn.text
        assert all(c.raw in turn.text for c in parsed)


@pytest.fixture(scope="module")
def qwen2_5_tok():
    from mcore_agentic.models.tokenizer import load_qwen_tokenizer

    return load_qwen_tokenizer("qwen2_5", vocab_size=1000)


@pytest.fixture(scope="module")
def qwen3_coder_tok():
    from mcore_agentic.models.tokenizer import load_qwen_tokenizer

    return load_qwen_tokenizer("qwen3_coder", vocab_size=1000)


def assistant_render(tok, content: str, calls: list[tuple[str, dict]]) -> str:
    """The chat template's text for one assistant turn, after ``<|im_start|>assistant\\n``, before ``<|im_end|>``."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": "abcdefghi", "type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    rendered = tok.apply_chat_template([{"role": "user", "content": "q"}, message], tokenize=False)
    return rendered.split("<|im_start|>assistant\n", 1)[1].removesuffix("\n").removesuffix("<|im_end|>")


@pytest.mark.parametrize(("fmt", "tok_fixture"), [("hermes", "qwen2_5_tok"), ("qwen3_coder", "qwen3_coder_tok")])
def test_renderers_write_what_the_chat_template_writes(fmt, tok_fixture, request):
    tok = request.getfixturevalue(tok_fixture)
    for turn in corpus(fmt, 40, seed=1):
        assert render(fmt, turn.content, turn.calls) == assistant_render(tok, turn.content, turn.calls), turn.calls
