"""Round trip with the real Qwen2.5 chat template: parse(generated) -> message -> render == generated.

The agent loop keeps the parsed message for later renders (delta tokenization), so the
parser's (content, calls) must re-render to the very text the model generated.
"""

import json

import pytest

from mcore_agentic.rollout.tool_parser import ToolCall, get_tool_parser


@pytest.fixture(scope="module")
def tokenizer():
    from mcore_agentic.models.tokenizer import load_qwen_tokenizer

    return load_qwen_tokenizer("qwen2_5", vocab_size=1000)  # the template is what matters, not the vocabulary


@pytest.mark.parametrize(
    "generated",
    [
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>',
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": {"query": "caf\\u00e9 \\"x\\"", "k": 3}}\n</tool_call>',
        "The answer is 42.",
    ],
)
def test_qwen2_5_render_of_parsed_calls_reproduces_the_text(tokenizer, generated):
    content, calls = get_tool_parser("qwen2_5").parse(generated)
    assert all(isinstance(c, ToolCall) for c in calls)
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [c.to_openai() for c in calls]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, message], tokenize=False)
    assistant = rendered.split("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    # Qwen's template writes arguments with tojson (ensure_ascii=False), so compare as JSON where they differ.
    if assistant != generated:
        _, again = get_tool_parser("qwen2_5").parse(assistant)
        assert [(c.name, c.arguments) for c in again] == [(c.name, c.arguments) for c in calls]
        assert assistant.split("<tool_call>")[0] == generated.split("<tool_call>")[0]
    else:
        assert assistant == generated


def test_tool_schema_from_yaml_is_rendered_verbatim(tokenizer):
    from pathlib import Path

    from mcore_agentic.tools.registry import load_tools

    repo = Path(__file__).resolve().parents[3]
    tools = load_tools(repo / "configs/tools/calculator_tool_config.yaml")
    schemas = [t.get_openai_tool_schema() for t in tools.values()]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "q"}], tools=schemas, tokenize=False)
    assert json.dumps(schemas[0], ensure_ascii=False) in rendered


# -- qwen3_coder: Qwen3-Coder's official template and the XML format ---------------------------------------------

QWEN3_CODER_SHA256 = "5a38bfa05833266240066aedc497decc9b00cc0d3e3b8cceea98cf530196ab06"  # 6211 bytes
CODER_SCHEMAS = {
    "run": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "description": "Python source"},
            "timeout": {"type": "integer"},
            "ratio": {"type": "number"},
            "verbose": {"type": "boolean"},
            "env": {"type": "object"},
            "argv": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["code"],
    },
    "noop": {"type": "object", "properties": {}},
}


@pytest.fixture(scope="module")
def coder_tokenizer():
    from mcore_agentic.models.tokenizer import load_qwen_tokenizer

    return load_qwen_tokenizer("qwen3_coder", vocab_size=1000)


def _coder_tools():
    return [{"type": "function", "function": {"name": n, "description": f"tool {n}", "parameters": s}} for n, s in CODER_SCHEMAS.items()]


def test_qwen3_coder_template_is_the_official_text_after_its_header():
    import hashlib

    from mcore_agentic.models.tokenizer import chat_template_text

    text = chat_template_text("qwen3_coder")
    official = text[text.index("-#}\n") + len("-#}\n") :]
    assert len(official.encode()) == 6211 and hashlib.sha256(official.encode()).hexdigest() == QWEN3_CODER_SHA256


def _assistant_text(tokenizer, message):
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, message], tools=_coder_tools(), tokenize=False)
    return rendered.split("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")


CODER_CALLS = [
    [("run", {"code": "print('hi')"})],
    [
        ("run", {"code": "for i in range(3):\n    print(i)  # <b> </param> <tool_call>\n", "timeout": 30, "ratio": 0.25,
                 "verbose": True, "env": {"A": "1", "n": [1, None]}, "argv": ["-v", "x y"]}),
        ("noop", {}),
        ("run", {"code": "\n  indented\n", "ratio": 3, "verbose": False, "timeout": -7}),
    ],
]


@pytest.mark.parametrize("calls", CODER_CALLS)
@pytest.mark.parametrize("content", ["", "Let me run it.", "  padded\n"])
def test_qwen3_coder_parse_of_the_render_returns_the_calls_and_renders_again_exactly(coder_tokenizer, calls, content):
    message = {"role": "assistant", "content": content,
               "tool_calls": [{"id": "abcdefghi", "type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}
    generated = _assistant_text(coder_tokenizer, message)
    parsed_content, parsed = get_tool_parser("qwen3_coder").parse(generated, schemas=CODER_SCHEMAS)
    assert [(c.name, c.arguments) for c in parsed] == calls
    assert parsed_content == content.strip()
    again = {"role": "assistant", "content": parsed_content, "tool_calls": [c.to_openai() for c in parsed]}
    assert _assistant_text(coder_tokenizer, again) == generated


def test_qwen3_coder_render_of_calls_is_the_documented_xml(coder_tokenizer):
    message = {"role": "assistant", "content": "Sure.", "tool_calls": [
        {"type": "function", "function": {"name": "run", "arguments": {"code": "x = 1\ny = 2", "timeout": 5, "env": {"a": "é"}}}},
        {"type": "function", "function": {"name": "noop", "arguments": {}}},
    ]}
    assert _assistant_text(coder_tokenizer, message) == (
        "Sure.\n\n<tool_call>\n<function=run>\n<parameter=code>\nx = 1\ny = 2\n</parameter>\n<parameter=timeout>\n5\n"
        '</parameter>\n<parameter=env>\n{"a": "é"}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=noop>\n'
        "</function>\n</tool_call>"
    )


def test_qwen3_coder_tools_and_tool_responses_render_as_the_official_template_does(coder_tokenizer):
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "noop", "arguments": {}}}] * 2},
        {"role": "tool", "content": "first"},
        {"role": "tool", "content": "second"},
    ]
    rendered = coder_tokenizer.apply_chat_template(messages, tools=_coder_tools(), tokenize=False, add_generation_prompt=True)
    assert rendered.startswith(
        "<|im_start|>system\nYou are Qwen, a helpful AI assistant that can interact with a computer to solve tasks.\n\n"
        "# Tools\n\nYou have access to the following functions:\n\n<tools>\n<function>\n<name>run</name>\n"
        "<description>tool run</description>\n<parameters>\n<parameter>\n<name>code</name>\n<type>string</type>\n"
        "<description>Python source</description>\n</parameter>\n"
    )
    assert "<parameter>\n<name>argv</name>\n<type>array</type>\n<items>{\"type\": \"string\"}</items>\n</parameter>\n" \
           "<required>[\"code\"]</required>\n</parameters>\n</function>\n" in rendered
    assert rendered.endswith(
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nfirst\n</tool_response>\n"
        "<tool_response>\nsecond\n</tool_response>\n<|im_end|>\n<|im_start|>assistant\n"
    )


def test_qwen3_coder_tool_results_are_an_append_only_segment(coder_tokenizer):
    from mcore_agentic.rollout.tokenization import ChatTokenizer

    chat = ChatTokenizer(coder_tokenizer)
    call = {"type": "function", "function": {"name": "run", "arguments": {"code": "1"}}}
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    segment = chat.env_segment(messages, 2, tools=_coder_tools(), sampled_eot=True)
    assert not segment.used_fallback
    assert segment.text == "\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response>\n" \
                           "<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "generated",
    [
        "<tool_call>\n<function=run>\n<parameter=code>\nx\n</function>\n</tool_call>",
        "<tool_call>\n<function=run>\n<parameter=code>\nx\n</parameter>\n</tool_call>",
        "<tool_call>\n{\"name\": \"run\", \"arguments\": {}}\n</tool_call>",
    ],
)
def test_qwen3_coder_malformed_output_is_an_error_observation(generated):
    _, parsed = get_tool_parser("qwen3_coder").parse(generated, schemas=CODER_SCHEMAS)
    assert len(parsed) == 1 and not isinstance(parsed[0], ToolCall) and parsed[0].raw == generated
