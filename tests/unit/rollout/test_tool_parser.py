"""Tool-call parsing (hermes / llama3_json / mistral / qwen3_coder) and schema validation of the arguments."""

import sys

import pytest

from mcore_agentic.rollout.tool_parser import ToolCall, ToolCallError, get_tool_parser, validate_tool_call
from mcore_agentic.tools.base import BaseTool
from mcore_agentic.utils.errors import ConfigError

CALC_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "evaluate",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string"},
                "precision": {"type": "integer"},
                "ratio": {"type": "number"},
                "exact": {"type": "boolean"},
                "values": {"type": "array", "items": {"type": "number"}},
                "options": {"type": "object"},
                "mode": {"type": "string", "enum": ["fast", "exact"]},
            },
            "required": ["expression"],
        },
    },
}
TOOLS = {"calc": BaseTool({}, CALC_SCHEMA), "search": BaseTool({}, {"type": "function", "function": {"name": "search"}})}


# -- hermes ------------------------------------------------------------------


def test_hermes_several_calls_and_content():
    text = (
        "Let me compute both.\n"
        '<tool_call>\n{"name": "calc", "arguments": {"expression": "1+2"}}\n</tool_call>\n'
        '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>'
    )
    content, calls = get_tool_parser("hermes").parse(text)
    assert content == "Let me compute both."
    assert [type(c) for c in calls] == [ToolCall, ToolCall]
    assert calls[0].name == "calc" and calls[0].arguments == {"expression": "1+2"}
    assert calls[0].raw.startswith("<tool_call>") and calls[0].raw.endswith("</tool_call>")
    assert calls[1].arguments == {"q": "x"}  # OpenAI-style JSON-string arguments are decoded
    assert calls[0].id != calls[1].id and len(calls[0].id) == 9 and calls[0].id.isalnum()
    assert calls[0].to_openai()["function"] == {"name": "calc", "arguments": {"expression": "1+2"}}


def test_qwen_alias_and_no_calls():
    parser = get_tool_parser("qwen2_5")
    assert parser.parse("  The answer is 42.  ") == ("  The answer is 42.  ", [])  # no call: the text as generated


def test_hermes_malformed_json_is_an_error_not_a_crash():
    content, calls = get_tool_parser("hermes").parse(
        'ok <tool_call>{"name": "calc", "arguments": {"expression": "1+2"}</tool_call>'
        '<tool_call>{"name": "calc", "arguments": {"expression": "3"}}</tool_call>'
    )
    assert content == "ok"
    assert isinstance(calls[0], ToolCallError) and isinstance(calls[1], ToolCall)
    assert "not valid JSON" in calls[0].message and "<tool_call>" in calls[0].message  # tells the model the format
    assert calls[0].name == "calc"


@pytest.mark.parametrize(
    "body, expected",
    [
        ("", "empty tool call"),
        ("[1, 2]", "must be a JSON object"),
        ('{"arguments": {}}', 'no "name"'),
        ('{"name": "calc", "arguments": [1]}', "must be a JSON object, got array"),
        ('{"name": "calc", "arguments": "{bad"}', "not valid JSON"),
        ('{"name": "calc", "arguments": {}} trailing', "unexpected text"),
    ],
)
def test_hermes_bad_shapes(body, expected):
    _, calls = get_tool_parser("hermes").parse(f"<tool_call>{body}</tool_call>")
    assert len(calls) == 1 and isinstance(calls[0], ToolCallError)
    assert expected in calls[0].message


def test_hermes_unterminated_final_call_still_parses():
    # Engines that stop on "</tool_call>" trim it from the text.
    _, calls = get_tool_parser("hermes").parse('<tool_call>\n{"name": "calc", "arguments": {"expression": "2"}}\n')
    assert isinstance(calls[0], ToolCall) and calls[0].arguments == {"expression": "2"}
    _, calls = get_tool_parser("hermes").parse('<tool_call>{"name": "calc", "argu')
    assert isinstance(calls[0], ToolCallError)


# -- llama3_json -------------------------------------------------------------


def test_llama3_python_tag_semicolon_separated():
    text = 'Sure.<|python_tag|>{"name": "calc", "parameters": {"expression": "1"}}; {"name": "search", "arguments": {"q": "a"}}'
    content, calls = get_tool_parser("llama3_json").parse(text)
    assert content == "Sure."
    assert [(c.name, c.arguments) for c in calls] == [("calc", {"expression": "1"}), ("search", {"q": "a"})]


def test_llama3_bare_json_call_and_plain_answers():
    parser = get_tool_parser("llama3_json")
    content, calls = parser.parse('{"name": "calc", "parameters": {"expression": "6*7"}}')
    assert content == "" and calls[0].arguments == {"expression": "6*7"}
    assert parser.parse("The answer is 3.") == ("The answer is 3.", [])
    assert parser.parse('{"answer": 3}') == ('{"answer": 3}', [])  # JSON, but not a call
    assert parser.parse("{not json at all") == ("{not json at all", [])


def test_llama3_malformed_after_tag_is_error():
    _, calls = get_tool_parser("llama3_json").parse('<|python_tag|>{"name": "calc", "parameters": {"expression": }')
    assert len(calls) == 1 and isinstance(calls[0], ToolCallError) and calls[0].name == "calc"
    _, calls = get_tool_parser("llama3_json").parse('{"name": "calc", "parameters": {')
    assert isinstance(calls[0], ToolCallError)


# -- mistral -----------------------------------------------------------------


def test_mistral_list_form_keeps_ids():
    text = 'Working. [TOOL_CALLS] [{"name": "calc", "arguments": {"expression": "1"}, "id": "abcDEF123"}, {"name": "search", "arguments": {"q": "b"}}]'
    content, calls = get_tool_parser("mistral").parse(text)
    assert content == "Working."
    assert calls[0].id == "abcDEF123" and calls[1].name == "search" and len(calls[1].id) == 9


def test_mistral_v11_name_args_form():
    content, calls = get_tool_parser("mistral").parse('[TOOL_CALLS]calc[ARGS]{"expression": "2"}[TOOL_CALLS]search[ARGS]{"q": "c"}')
    assert content == ""
    assert [(c.name, c.arguments) for c in calls] == [("calc", {"expression": "2"}), ("search", {"q": "c"})]


def test_mistral_errors_and_plain_text():
    parser = get_tool_parser("mistral")
    assert parser.parse("no calls here") == ("no calls here", [])
    _, calls = parser.parse("[TOOL_CALLS] [{bad json")
    assert isinstance(calls[0], ToolCallError) and "[TOOL_CALLS]" in calls[0].message
    _, calls = parser.parse("[TOOL_CALLS] []")
    assert isinstance(calls[0], ToolCallError)


def test_unknown_format_names_the_key():
    with pytest.raises(ConfigError, match=r"rollout.multi_turn.format.*hermes"):
        get_tool_parser("chatml-ish")


# -- validation --------------------------------------------------------------


def _call(name, args):
    return ToolCall(name=name, arguments=args, raw="raw")


def test_valid_call_passes():
    assert validate_tool_call(_call("calc", {"expression": "1", "precision": 3, "ratio": 2, "mode": "fast"}), TOOLS) is None
    assert validate_tool_call(_call("search", {}), TOOLS) is None  # a tool without a parameters schema


def test_unknown_tool_lists_known_ones():
    err = validate_tool_call(_call("calculator", {}), TOOLS)
    assert isinstance(err, ToolCallError)
    assert "unknown tool 'calculator'" in err.message and "calc, search" in err.message


def test_missing_required_argument():
    err = validate_tool_call(_call("calc", {"precision": 2}), TOOLS)
    assert "missing required argument 'expression'" in err.message
    assert "Expected arguments: expression: string" in err.message


@pytest.mark.parametrize(
    "args, expected",
    [
        ({"expression": 12}, "'expression' must be of type string, got integer 12"),
        ({"expression": "1", "precision": "3"}, "'precision' must be of type integer, got string \"3\""),
        ({"expression": "1", "precision": 2.5}, "'precision' must be of type integer, got number 2.5"),
        ({"expression": "1", "ratio": "x"}, "'ratio' must be of type number"),
        ({"expression": "1", "ratio": True}, "'ratio' must be of type number, got boolean"),
        ({"expression": "1", "exact": "yes"}, "'exact' must be of type boolean"),
        ({"expression": "1", "values": 3}, "'values' must be of type array"),
        ({"expression": "1", "values": [1, "a"]}, "'values.1' must be of type number"),
        ({"expression": "1", "options": []}, "'options' must be of type object"),
        ({"expression": "1", "mode": "slow"}, "'mode' must be one of [\"fast\", \"exact\"], got \"slow\""),
    ],
)
def test_wrong_types_are_reported(args, expected):
    err = validate_tool_call(_call("calc", args), TOOLS)
    assert isinstance(err, ToolCallError) and err.name == "calc"
    assert expected in err.message, err.message


def test_error_keeps_the_call_id():
    call = _call("calc", {})
    assert validate_tool_call(call, TOOLS).id == call.id


def test_raw_is_the_exact_generated_text_of_each_call():
    # The agent loop removes valid calls' raw text from the message; it must occur verbatim.
    texts = {
        "hermes": 'a <tool_call>{"name": "calc", "arguments": {"expression": "1"}}</tool_call> <tool_call>{bad}</tool_call>',
        "llama3_json": '<|python_tag|>{"name": "calc", "parameters": {"expression": "1"}} ;{"name": "search", "parameters": {}}',
        "mistral": 'x [TOOL_CALLS] [{"name": "calc",  "arguments": {"expression": "1"}} , {"name": "search", "arguments": {}}, {bad',
    }
    for fmt, text in texts.items():
        _, calls = get_tool_parser(fmt).parse(text)
        assert len(calls) >= 2, fmt
        for call in calls:
            assert call.raw and call.raw in text, (fmt, call.raw)
    _, calls = get_tool_parser("mistral").parse(texts["mistral"])
    assert isinstance(calls[2], ToolCallError) and calls[2].name is None  # not confused with the earlier 'calc'


def test_mistral_unterminated_list_keeps_its_calls():
    _, calls = get_tool_parser("mistral").parse('[TOOL_CALLS] [{"name": "calc", "arguments": {"expression": "1"}}')
    assert len(calls) == 1 and isinstance(calls[0], ToolCall)


def test_hermes_unclosed_block_does_not_swallow_the_next_call():
    _, calls = get_tool_parser("hermes").parse('<tool_call>{"name": "calc", <tool_call>{"name": "search", "arguments": {}}</tool_call>')
    assert isinstance(calls[0], ToolCallError) and isinstance(calls[1], ToolCall) and calls[1].name == "search"


# -- exactness and robustness, every format ------------------------------------

FORMATS = ["hermes", "llama3_json", "mistral", "qwen3_coder"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("text", ["  The answer is 42.\n", "\n", "", "a {json} [list] </tool_call> ; x\n\n"])
def test_no_call_leaves_the_text_exactly_as_generated(fmt, text):
    assert get_tool_parser(fmt).parse(text) == (text, [])


CODE = "print('</tool_call>'); s = '[TOOL_CALLS]' + '<|python_tag|>' + \"<tool_call>\""


@pytest.mark.parametrize(
    "fmt, text",
    [
        ("hermes", '<tool_call>{"name": "python", "arguments": {"code": "print(\'</tool_call>\')"}}</tool_call>'),
        ("hermes", '<tool_call>\n{"name": "python", "arguments": {"code": "print(\'</tool_call>\')"}}\n</tool_call>'),
        ("mistral", '[TOOL_CALLS] [{"name": "python", "arguments": {"code": "print(\'[TOOL_CALLS]\')"}}]'),
        ("mistral", '[TOOL_CALLS]python[ARGS]{"code": "print(\'[TOOL_CALLS]\')"}'),
        ("llama3_json", '{"name": "python", "parameters": {"code": "print(\'<|python_tag|>\')"}}'),
    ],
)
def test_a_closing_delimiter_inside_a_json_string_does_not_end_the_call(fmt, text):
    content, calls = get_tool_parser(fmt).parse(text)
    assert [type(c) for c in calls] == [ToolCall], calls
    assert calls[0].name == "python" and calls[0].arguments["code"].startswith("print('")
    assert calls[0].arguments["code"].split("'")[1] in text and content == ""


def test_delimiters_inside_strings_in_every_json_format_round_trip():
    import json

    args = {"code": CODE}
    texts = {
        "hermes": f'<tool_call>{json.dumps({"name": "python", "arguments": args})}</tool_call>',
        "mistral": f"[TOOL_CALLS] {json.dumps([{'name': 'python', 'arguments': args}] * 2)}",
        "llama3_json": f'<|python_tag|>{json.dumps({"name": "python", "parameters": args})}; {json.dumps({"name": "python", "parameters": args})}',
    }
    for fmt, text in texts.items():
        _, calls = get_tool_parser(fmt).parse(text)
        assert [(c.name, c.arguments) for c in calls] in ([("python", args)], [("python", args)] * 2), fmt


def _schemas(fmt: str, schemas: dict) -> dict:
    """``parse`` keyword arguments: the JSON formats need no schemas."""
    return {"schemas": schemas} if fmt == "qwen3_coder" else {}


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


@pytest.mark.parametrize(
    "fmt, template",
    [
        ("hermes", '<tool_call>{{"name": "f", "arguments": {{"a": {deep}}}}}</tool_call>'),
        ("llama3_json", '<|python_tag|>{{"name": "f", "parameters": {{"a": {deep}}}}}'),
        ("llama3_json", '{{"name": "f", "parameters": {{"a": {deep}}}}}'),
        ("mistral", '[TOOL_CALLS] [{{"name": "f", "arguments": {{"a": {deep}}}}}]'),
        ("mistral", '[TOOL_CALLS]f[ARGS]{{"a": {deep}}}'),
        ("hermes", '<tool_call>{{"name": "f", "arguments": "{{\\"a\\": {deep}}}"}}</tool_call>'),
        ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\n{deep}\n</parameter>\n</function>\n</tool_call>"),
    ],
)
def test_deep_nesting_is_an_error_naming_the_limit_not_a_recursion_error(fmt, template):
    typed = _schemas(fmt, {"f": {"type": "object", "properties": {"a": {"type": "array"}}}})
    _, calls = get_tool_parser(fmt).parse(template.format(deep=_deep(1000)), **typed)
    assert len(calls) == 1 and isinstance(calls[0], ToolCallError), calls
    assert "128" in calls[0].message and calls[0].name == "f"
    _, calls = get_tool_parser(fmt).parse(template.format(deep=_deep(100)), **typed)
    assert isinstance(calls[0], ToolCall) and len(calls) == 1


def test_the_nesting_limit_is_128_levels_of_the_whole_payload():
    from mcore_agentic.rollout.tool_call import nesting_exceeds

    assert not nesting_exceeds(_deep(128)) and nesting_exceeds(_deep(129))
    assert not nesting_exceeds('["[[[[", {"a": "]]]\\"[["}]')  # brackets in strings do not count
    assert not nesting_exceeds(_deep(200), 100)  # starts inside: only the value at that index counts
    _, calls = get_tool_parser("hermes").parse(f'<tool_call>{{"name": "f", "arguments": {{"a": {_deep(126)}}}}}</tool_call>')
    assert isinstance(calls[0], ToolCall)  # call object + arguments + 126 = 128
    _, calls = get_tool_parser("hermes").parse(f'<tool_call>{{"name": "f", "arguments": {{"a": {_deep(127)}}}}}</tool_call>')
    assert isinstance(calls[0], ToolCallError)


def _nested_list(levels: int, leaf):
    for _ in range(levels):
        leaf = [leaf]
    return leaf


def test_validation_never_raises():
    recursive = {
        "type": "function",
        "function": {
            "name": "tree",
            "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/node"}},
                           "$defs": {"node": {"type": "array", "items": {"$ref": "#/$defs/node"}}}},
        },
    }
    broken = {"type": "function", "function": {"name": "broken", "parameters": {"type": "no-such-type"}}}
    tools = {"tree": BaseTool({}, recursive), "broken": BaseTool({}, broken)}
    assert validate_tool_call(_call("tree", {"a": _nested_list(127, [])}), tools) is None
    assert "argument 'a.0.0" in validate_tool_call(_call("tree", {"a": _nested_list(127, 1)}), tools).message
    err = validate_tool_call(_call("tree", {"a": _nested_list(400, [])}), tools)  # deeper than any parser allows
    assert isinstance(err, ToolCallError) and "could not be checked: they nest" in err.message
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(100_000)  # the answer must not depend on the interpreter's recursion limit
    try:
        assert validate_tool_call(_call("tree", {"a": _nested_list(400, [])}), tools).message == err.message
    finally:
        sys.setrecursionlimit(limit)
    err = validate_tool_call(_call("broken", {"x": 1}), tools)
    assert isinstance(err, ToolCallError) and "could not be checked" in err.message


@pytest.mark.parametrize(
    "fmt, text",
    [
        ("hermes", '<tool_call>{"name": "f", "arguments": {"text": "smile \\ud83d!"}}</tool_call>'),
        ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"text": "smile \\ud83d!"}}'),
        ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"text": "smile \\ud83d!"}}]'),
        ("mistral", '[TOOL_CALLS]f[ARGS]{"text": "smile \\ude00"}'),
        ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"text\\": \\"\\\\ud83d\\"}"}</tool_call>'),
        ("qwen3_coder", '<tool_call>\n<function=f>\n<parameter=text>\n["\\ud83d"]\n</parameter>\n</function>\n</tool_call>'),
    ],
)
def test_a_lone_surrogate_is_an_error_naming_the_argument(fmt, text):
    _, calls = get_tool_parser(fmt).parse(text, **_schemas(fmt, {"f": {"type": "object", "properties": {"text": {"type": "array"}}}}))
    assert len(calls) == 1 and isinstance(calls[0], ToolCallError), calls
    assert "argument 'text" in calls[0].message and "lone UTF-16 surrogate" in calls[0].message
    assert "not valid Unicode" in calls[0].message and calls[0].name == "f"
    calls[0].message.encode("utf-8")  # the observation itself is encodable


def test_lone_surrogates_in_nested_keys_and_names_and_paired_ones():
    parser = get_tool_parser("hermes")
    _, calls = parser.parse('<tool_call>{"name": "f", "arguments": {"a": [{"k\\udc00": 1}]}}</tool_call>')
    assert isinstance(calls[0], ToolCallError) and "argument 'a.0.k\\udc00'" in calls[0].message
    _, calls = parser.parse('<tool_call>{"name": "f\\ud800", "arguments": {}}</tool_call>')
    assert isinstance(calls[0], ToolCallError) and "tool name" in calls[0].message and calls[0].name is None
    _, calls = parser.parse('<tool_call>{"name": "f\\ud800", "arguments": [1]}</tool_call>')  # an error quoting the name
    assert isinstance(calls[0], ToolCallError) and "'f\\ud800'" in calls[0].message and calls[0].name is None
    calls[0].message.encode("utf-8")
    _, calls = parser.parse('<tool_call>{"name": "f", "arguments": {"text": "\\ud83d\\ude00"}}</tool_call>')
    assert isinstance(calls[0], ToolCall) and calls[0].arguments == {"text": "\U0001f600"}


@pytest.mark.parametrize("payload, kind", [("[1, 2]", "array"), ("42", "integer"), ("null", "null"), ('"x"', "string")])
def test_llama3_non_object_after_python_tag_is_an_error(payload, kind):
    content, calls = get_tool_parser("llama3_json").parse(f"Let me see.<|python_tag|>{payload}")
    assert content == "Let me see." and len(calls) == 1 and isinstance(calls[0], ToolCallError)
    assert f"must be a JSON object, got {kind}" in calls[0].message


@pytest.mark.parametrize("text", ["<|python_tag|>", "<|python_tag|> ; ", "<|python_tag|>print(1)"])
def test_llama3_python_tag_without_a_call_is_an_error(text):
    _, calls = get_tool_parser("llama3_json").parse(text)
    assert len(calls) == 1 and isinstance(calls[0], ToolCallError)


def test_llama3_text_after_the_calls_and_json_answers_stay_content():
    parser = get_tool_parser("llama3_json")
    content, calls = parser.parse('<|python_tag|>{"name": "calc", "parameters": {}} and then I wait.')
    assert content == "and then I wait." and [c.name for c in calls] == ["calc"]
    assert parser.parse('{"answer": 3}\n') == ('{"answer": 3}\n', [])
    content, calls = parser.parse("[1, 2] <|python_tag|>")  # a tag anywhere starts a call attempt
    assert content == "[1, 2]" and isinstance(calls[0], ToolCallError)
    _, calls = parser.parse('{"answer": "<|python_tag|>"}')
    assert len(calls) == 1 and isinstance(calls[0], ToolCallError)


def test_hermes_content_is_the_text_around_the_calls_stripped_and_joined():
    text = ' Before. <tool_call>{"name": "calc", "arguments": {}}</tool_call> middle <tool_call>{"name": "calc"}</tool_call>\n'
    content, calls = get_tool_parser("hermes").parse(text)
    assert content == "Before.\nmiddle" and len(calls) == 2


def test_arguments_follow_sglang_parameters_then_arguments_rule():
    parser = get_tool_parser("hermes")
    _, calls = parser.parse('<tool_call>{"name": "f", "arguments": {"a": 1}, "parameters": {"b": 2}}</tool_call>')
    assert calls[0].arguments == {"b": 2}
    _, calls = parser.parse('<tool_call>{"name": "f", "arguments": {"a": 1}, "parameters": {}}</tool_call>')
    assert calls[0].arguments == {"a": 1}
