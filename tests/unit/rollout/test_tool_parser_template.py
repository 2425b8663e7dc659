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
