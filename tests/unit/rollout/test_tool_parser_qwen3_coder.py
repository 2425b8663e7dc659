"""The qwen3_coder tool-call format: structure, SGLang's schema typing of values, malformed blocks."""

import pytest

from mcore_agentic.rollout.tool_parser import ToolCall, ToolCallError, get_tool_parser
from mcore_agentic.rollout.tool_parser_qwen3_coder import argument_properties, convert_value, parameter_type

SCHEMAS = {
    "run": {
        "type": "object",
        "properties": {
            "code": {"type": "string"},
            "timeout": {"type": "integer"},
            "ratio": {"type": "number"},
            "verbose": {"type": "boolean"},
            "env": {"type": "object"},
            "argv": {"type": "array"},
        },
    }
}


def block(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def parse(text: str, schemas=SCHEMAS):
    return get_tool_parser("qwen3_coder").parse(text, schemas=schemas)


def test_several_typed_calls_and_content():
    code = "for i in range(3):\n    print('<b>', i)  # </param> <tool_call> <function=x>\n"
    text = (
        "Let me run it.\n\n"
        + block("run", code=code, timeout="30", ratio="0.5", verbose="true", env='{"A": "1"}', argv='["-v", 2]')
        + "\n"
        + block("run", code="print(2)")
    )
    content, calls = parse(text)
    assert content == "Let me run it."
    assert [type(c) for c in calls] == [ToolCall, ToolCall]
    assert calls[0].name == "run" and calls[0].arguments == {
        "code": code,
        "timeout": 30,
        "ratio": 0.5,
        "verbose": True,
        "env": {"A": "1"},
        "argv": ["-v", 2],
    }
    assert calls[1].arguments == {"code": "print(2)"}
    assert all(c.raw in text for c in calls) and calls[0].raw.startswith("<tool_call>") and calls[0].raw.endswith("</tool_call>")


def test_one_edge_newline_is_removed_each_side():
    _, calls = parse(block("run", code="\n\nx\n\n") + block("run", code="") + block("run", code="  x  "))
    assert [c.arguments["code"] for c in calls] == ["\n\nx\n\n", "", "  x  "]  # block() adds one each side
    _, calls = parse("<tool_call>\n<function=run>\n<parameter=code>\n\nx\n\n</parameter>\n</function>\n</tool_call>")
    assert calls[0].arguments == {"code": "\nx\n"}
    _, calls = parse("<tool_call><function=run><parameter=code>x</parameter></function></tool_call>")
    assert calls[0].arguments == {"code": "x"}  # without the newlines


@pytest.mark.parametrize(
    "key, raw, expected",
    [
        ("timeout", "42", 42),
        ("timeout", " 7 ", 7),
        ("timeout", "4.5", "4.5"),  # not an integer: kept as text (validation reports it)
        ("ratio", "7", 7),  # integral without "." or "e": an int
        ("ratio", "7.0", 7.0),
        ("ratio", "1e3", 1000.0),
        ("ratio", "abc", "abc"),
        ("verbose", "True", True),
        ("verbose", "FALSE", False),
        ("verbose", "yes", False),  # SGLang: anything but true/false "degenerates to false"
        ("env", "{'a': (1, 2)}", {"a": [1, 2]}),  # not JSON: a Python literal, as JSON
        ("env", "{broken", "{broken"),  # neither: kept as text
        ("argv", "[1, 2", "[1, 2"),
        ("code", "42", "42"),
        ("code", "null", None),  # "null" is None whatever the type (SGLang)
        ("timeout", "NULL", None),
        ("undeclared", "42", "42"),  # not in the schema: text
    ],
)
def test_values_are_typed_as_sglang_types_them(key, raw, expected):
    _, calls = parse(block("run", **{key: raw}))
    assert isinstance(calls[0], ToolCall) and calls[0].arguments == {key: expected}
    assert type(calls[0].arguments[key]) is type(expected)


def test_without_schemas_every_value_is_text():
    _, calls = parse(block("run", timeout="42", env="{}"), schemas=None)
    assert calls[0].arguments == {"timeout": "42", "env": "{}"}
    _, calls = parse(block("other", timeout="42"))  # a tool without a schema: text too
    assert calls[0].arguments == {"timeout": "42"}


def test_parameter_types_follow_sglangs_inference():
    assert parameter_type({"type": ["null", "integer"]}) == "integer"
    assert parameter_type({"anyOf": [{"type": "number"}, {"type": "null"}]}) == "number"
    assert parameter_type({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}) == "integer"
    assert parameter_type({"oneOf": [{"type": "integer"}, {"type": "string"}]}) == "string"
    assert parameter_type({"enum": [1, 2]}) == "integer" and parameter_type({"enum": [1, "a"]}) == "string"
    assert parameter_type({"allOf": [{"type": "string"}, {"type": "object"}]}) == "object"
    assert parameter_type({"properties": {}}) == "object" and parameter_type({"items": {}}) == "array"
    assert parameter_type({}) == "string" and parameter_type({"type": " Integer "}) == "integer"
    assert parameter_type({"anyOf": [{"type": ["x"]}, {"type": {"bad": 1}}]}) == "x"  # malformed: no crash
    assert argument_properties({"anyOf": [{"properties": {"a": {"type": "integer"}}}]}) == {"a": {"type": "integer"}}
    assert argument_properties({"type": "object"}) == {"type": "object"}  # SGLang: the schema itself
    assert argument_properties(None) == {}
    assert convert_value("3", "a", {"a": {"type": "int64"}}) == 3 and convert_value("3", "a", {"a": {"type": "float"}}) == 3


def test_truncated_final_block_and_a_block_cut_by_the_next():
    text = block("run", code="a").removesuffix("</tool_call>") + "<tool_call>\n<function=run>\n</function>\n"
    _, calls = parse(text)
    assert [(c.name, c.arguments) for c in calls] == [("run", {"code": "a"}), ("run", {})]


@pytest.mark.parametrize(
    "text, reason",
    [
        ("<tool_call>\n<function=run>\n<parameter=code>\nx\n</parameter>\n</tool_call>", "or </function>"),
        ("<tool_call>\n<function=run>\n<parameter=code>\nx\n</function>\n</tool_call>", "not closed by </parameter>"),
        ("<tool_call>\n<function=run>\n<parameter=code>\nx</tool_call>", "not closed by </parameter>"),
        ("<tool_call>\n<function=run>\n<parameter=a>\n1\n<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>",
         "'a' is not closed"),
        ("<tool_call>\n<function=run>\n<parameter=>\nx\n</parameter>\n</function>\n</tool_call>", "needs a name"),
        ("<tool_call>\n<function=run>\n<parameter=code\nx\n</parameter>\n</function>\n</tool_call>", "needs a name"),
        ("<tool_call>\n<function=>\n</function>\n</tool_call>", "needs a name"),
        ("<tool_call>\nrun(1)\n</tool_call>", "followed by <function="),
        ("<tool_call>\n</tool_call>", "followed by <function="),
        ("<tool_call>\n<function=run>\nhello\n</function>\n</tool_call>", "expected <parameter="),
        ("<tool_call>\n<function=run>\n</function>\n<function=run>\n</function>\n</tool_call>", "one <function=...>"),
        ("<tool_call>\n<function=run>\n</function>\ntext\n</tool_call>", "expected </tool_call>"),
        ("<tool_call>\n<tool_call>\n<function=run>\n</function>\n</tool_call>", "followed by <function="),
        ("<tool_call>\n<function=run>\n<parameter=code>\nx = '</parameter>'\n</parameter>\n</function>\n</tool_call>",
         "expected <parameter="),
        ("<tool_call>\n<function=run>\n<parameter=env>\n{1, 2}\n</parameter>\n</function>\n</tool_call>", "Python set"),
        ("<tool_call>\n<function=run>\n<parameter=env>\nb'x'\n</parameter>\n</function>\n</tool_call>", "Python bytes"),
        ("<tool_call>\n<function=run>\n<parameter=code>", "not closed by </parameter>"),
        ("<tool_call>\n<function=run", "needs a name"),
        ("<tool_call>", "followed by <function="),
        ("<function=run>\n</function>", "nested within <tool_call>"),
    ],
)
def test_malformed_blocks_are_errors(text, reason):
    content, calls = parse(text + "\nafter")
    assert calls and isinstance(calls[0], ToolCallError), calls
    assert reason in calls[0].message and "<function=TOOL_NAME>" in calls[0].message
    assert all(c.raw in text + "\nafter" for c in calls)


def test_an_error_block_does_not_swallow_the_next_call():
    bad = "<tool_call>\n<function=run>\n<parameter=code>\nx\n</tool_call>\n"
    content, calls = parse("Try.\n" + bad + block("run", code="ok"))
    assert [type(c) for c in calls] == [ToolCallError, ToolCall] and calls[0].name == "run"
    assert calls[1].arguments == {"code": "ok"} and content == "Try."


def test_repeated_parameter_keeps_the_last_value():
    _, calls = parse("<tool_call>\n<function=run>\n<parameter=timeout>\n1\n</parameter>\n<parameter=timeout>\n2\n"
                     "</parameter>\n</function>\n</tool_call>")
    assert calls[0].arguments == {"timeout": 2}
