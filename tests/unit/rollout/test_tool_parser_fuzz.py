"""The parser contract under fuzzing, for every format.

Valid call texts are built from random names and arguments, then mutated (truncated,
characters flipped, tags duplicated or nested, 1 MB strings and deep nesting inserted).
The contract: ``parse`` never raises; unmutated texts give back exactly their calls and
content; a text holding a call-start marker gives at least one call or error; every
call's ``raw`` is text of the input; call names and arguments are encodable Unicode; and
``validate_tool_call`` never raises.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mcore_agentic.rollout.tool_parser import ToolCall, ToolCallError, get_tool_parser, validate_tool_call
from mcore_agentic.tools.base import BaseTool
from tests.unit.rollout.test_tool_parser_corpus import (
    CALL_STARTS,
    ENUMS,
    FORBIDDEN,
    FORMATS,
    KINDS,
    MARKERS,
    SCHEMAS,
    calls_of,
    render,
)

FAST = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TOOLS = {name: BaseTool({}, {"type": "function", "function": {"name": name, "parameters": schema}}) for name, schema in SCHEMAS.items()}
TREE = {"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}, "$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}
TOOLS["tree"] = BaseTool({}, {"type": "function", "function": {"name": "tree", "parameters": TREE}})
PARSE_SCHEMAS = {**SCHEMAS, "tree": {"type": "object", "properties": {"a": {"type": "array"}}}}

# ---------------------------------------------------------------------------
# valid turns

NAMES = st.sampled_from(sorted(SCHEMAS)) | st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,15}", fullmatch=True)
MARKER_TEXT = st.lists(st.text(max_size=6) | st.sampled_from(MARKERS), max_size=4).map("".join)


def _free_text(fmt: str) -> st.SearchStrategy[str]:
    def allowed(text: str) -> bool:
        return not any(bad in text for bad in FORBIDDEN[fmt]) and text.strip().lower() != "null"

    return (st.text(max_size=30) | MARKER_TEXT).filter(allowed)


def _json_values(fmt: str) -> st.SearchStrategy[Any]:
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(-(10**30), 10**30)
        | st.floats(allow_nan=False, allow_infinity=False)
        | _free_text(fmt)
    )
    return st.recursive(
        scalars,
        lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
        max_leaves=8,
    )


def _typed(fmt: str, kind: str, key: str) -> st.SearchStrategy[Any]:
    """A qwen3_coder value that converts back to itself under its schema type."""
    if kind == "integer":
        return st.integers(-(10**30), 10**30)
    if kind == "number":
        return st.floats(allow_nan=False, allow_infinity=False) | st.integers(-(10**6), 10**6)
    if kind == "boolean":
        return st.booleans()
    if kind == "enum":
        return st.sampled_from(ENUMS[key])
    if kind == "object":
        return st.dictionaries(st.text(max_size=8), _json_values(fmt), max_size=3)
    if kind == "array":
        return st.lists(_json_values(fmt), max_size=3)
    return _free_text(fmt)


@st.composite
def calls(draw: st.DrawFn, fmt: str) -> tuple[str, dict[str, Any]]:
    name = draw(NAMES)
    if fmt != "qwen3_coder":
        return name, draw(st.dictionaries(st.text(max_size=10), _json_values(fmt), max_size=4))
    kinds = KINDS.get(name, {})
    keys = draw(st.lists(st.sampled_from(sorted(kinds)), unique=True)) if kinds else []
    args = {key: draw(_typed(fmt, kinds[key], key)) for key in keys}
    extra = draw(st.dictionaries(st.from_regex(r"[a-z_]{1,8}", fullmatch=True), _free_text(fmt), max_size=2))
    return name, {**args, **{k: v for k, v in extra.items() if k not in kinds}}  # undeclared: text


@st.composite
def turns(draw: st.DrawFn, fmt: str) -> tuple[str, str, list[tuple[str, dict[str, Any]]]]:
    """(text, content, calls) as the format's chat template writes them."""
    content = "".join(c for c in draw(st.text(max_size=30)) if c not in "{[<")
    found = draw(st.lists(calls(fmt), min_size=1, max_size=3))
    return render(fmt, content, found), content, found


# ---------------------------------------------------------------------------
# mutations

LONG = "x" * 1_000_000
INSERTS = [LONG, '"' + LONG, "[" * 1000, '{"a":' * 1000, "]" * 1000, "\\ud83d", "\ud83d", "\\", '"', "\n", ";", ",",
           "</parameter>", "<parameter=", "null", "{}", "[]", *MARKERS]


@st.composite
def mutated(draw: st.DrawFn, fmt: str) -> str:
    text = draw(turns(fmt))[0]
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(text)))
        kind = draw(st.sampled_from(["truncate", "flip", "insert", "delete", "duplicate", "nest"]))
        if kind == "truncate":
            text = text[:at]
        elif kind == "flip" and at < len(text):
            text = text[:at] + draw(st.characters() | st.sampled_from('"\\{}[]<>=/;,\n\ud800')) + text[at + 1 :]
        elif kind == "insert":
            text = text[:at] + draw(st.sampled_from(INSERTS) | st.text(max_size=5)) + text[at:]
        elif kind == "delete":
            text = text[:at] + text[at + draw(st.integers(1, 20)) :]
        elif kind == "duplicate":
            marker = draw(st.sampled_from(CALL_STARTS[fmt] + MARKERS))
            text = text.replace(marker, marker * draw(st.integers(2, 3)), 1) if marker in text else text
        elif kind == "nest":  # another call inside this one
            text = text[:at] + draw(turns(fmt))[0] + text[at:]
    return text


# ---------------------------------------------------------------------------
# the contract


def _check_contract(fmt: str, text: str) -> tuple[str, list]:
    content, parsed = get_tool_parser(fmt).parse(text, schemas=PARSE_SCHEMAS)
    assert isinstance(content, str)
    for call in parsed:
        assert isinstance(call, (ToolCall, ToolCallError))
        assert call.raw and call.raw in text
        if isinstance(call, ToolCall):
            assert isinstance(call.name, str) and call.name and isinstance(call.arguments, dict)
            call.name.encode("utf-8")
            json.dumps(call.arguments, ensure_ascii=False).encode("utf-8")  # no lone surrogates
            problem = validate_tool_call(call, TOOLS)
            assert problem is None or isinstance(problem, ToolCallError)
        else:
            call.message.encode("utf-8")
            assert call.name is None or call.name.encode("utf-8")
    if any(marker in text for marker in CALL_STARTS[fmt]):
        assert parsed, text[:500]
    return content, parsed


@pytest.mark.parametrize("fmt", FORMATS)
@FAST
@given(data=st.data())
def test_valid_texts_give_back_exactly_their_calls(fmt, data):
    text, content, expected = data.draw(turns(fmt))
    parsed_content, parsed = _check_contract(fmt, text)
    assert calls_of(parsed) == expected
    assert parsed_content == content.strip()


@pytest.mark.parametrize("fmt", FORMATS)
@FAST
@given(data=st.data())
def test_mutated_texts_keep_the_contract(fmt, data):
    _check_contract(fmt, data.draw(mutated(fmt)))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("depth", [129, 1000, 50_000])
def test_deeply_nested_payloads_never_raise(fmt, depth):
    payload = "[" * depth + "]" * depth
    texts = {
        "hermes": f'<tool_call>{{"name": "tree", "arguments": {{"a": {payload}}}}}</tool_call>',
        "llama3_json": f'{{"name": "tree", "parameters": {{"a": {payload}}}}}',
        "mistral": f"[TOOL_CALLS]tree[ARGS]{{\"a\": {payload}}}",
        "qwen3_coder": f"<tool_call>\n<function=tree>\n<parameter=a>\n{payload}\n</parameter>\n</function>\n</tool_call>",
    }
    _, parsed = _check_contract(fmt, texts[fmt])
    assert len(parsed) == 1 and isinstance(parsed[0], ToolCallError) and "128" in parsed[0].message
