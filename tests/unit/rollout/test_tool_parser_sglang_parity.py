"""Differential test: our parsers return the same calls as SGLang's on valid outputs.

SGLang's ``sglang.srt.function_call`` detectors are pure Python, but ``import sglang`` pulls in
torch, transformers and the whole server. Unless sglang is imported already, they are loaded
without the package ``__init__`` (and, without IPython, with a stand-in for ``sglang.utils``,
whose one name the OpenAI protocol module imports for response formats): enough for
``pip install --no-deps sglang==0.5.23`` plus ``pydantic orjson partial_json_parser msgspec
openai==2.8.0``. Skipped when sglang is not installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import sys
import types
from typing import Any

import pytest

from mcore_agentic.rollout.tool_parser import ToolCall, get_tool_parser
from tests.unit.rollout.test_tool_parser_corpus import SCHEMAS, Turn, corpus

DETECTORS = {
    "HermesDetector": "hermes_detector",
    "Qwen25Detector": "qwen25_detector",
    "Llama32Detector": "llama32_detector",
    "MistralDetector": "mistral_detector",
    "Qwen3CoderDetector": "qwen3_coder_detector",
}
# our format -> the SGLang detectors that parse it
PAIRS = [
    ("hermes", "HermesDetector"),
    ("hermes", "Qwen25Detector"),
    ("llama3_json", "Llama32Detector"),
    ("mistral", "MistralDetector"),
    ("qwen3_coder", "Qwen3CoderDetector"),
]
CORPUS_SIZE = 400


def _stub_package(name: str, path: str) -> None:
    module = types.ModuleType(name)
    module.__path__ = [path]
    sys.modules[name] = module


def _load_sglang() -> dict[str, Any]:
    """The detector classes and SGLang's ``Tool`` model, or skip.

    Unless sglang is imported already, its modules are loaded under stand-in packages and
    taken out of ``sys.modules`` again, so a later real ``import sglang`` is unaffected.
    """
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        pytest.skip("sglang is not installed")
    if "sglang" in sys.modules:
        return _import_detectors()
    before = set(sys.modules)
    root = spec.origin.rsplit("/", 1)[0]
    _stub_package("sglang", root)
    _stub_package("sglang.srt", root + "/srt")
    if importlib.util.find_spec("IPython") is None:  # sglang.utils imports numpy, requests, IPython, ...
        stand_in = types.ModuleType("sglang.utils")
        stand_in.convert_json_schema_to_str = json.dumps
        sys.modules["sglang.utils"] = stand_in
    try:
        return _import_detectors()
    finally:
        for name in set(sys.modules) - before:
            if name == "sglang" or name.startswith("sglang."):
                del sys.modules[name]


def _import_detectors() -> dict[str, Any]:
    try:
        found = {
            cls: getattr(importlib.import_module(f"sglang.srt.function_call.{module}"), cls)
            for cls, module in DETECTORS.items()
        }
        found["Tool"] = importlib.import_module("sglang.srt.entrypoints.openai.protocol").Tool
    except ImportError as exc:
        pytest.skip(f"sglang's function_call package does not import here: {exc}")
    return found


@pytest.fixture(scope="module")
def sglang() -> dict[str, Any]:
    return _load_sglang()


def _tools(sglang: dict[str, Any]) -> list[Any]:
    return [sglang["Tool"](type="function", function={"name": n, "parameters": s}) for n, s in SCHEMAS.items()]


def _sglang_parse(sglang: dict[str, Any], detector: str, text: str) -> tuple[str, list[tuple[str, Any]]]:
    result = sglang[detector]().detect_and_parse(text, _tools(sglang))
    return result.normal_text, [(c.name, json.loads(c.parameters)) for c in result.calls]


def _ours(fmt: str, text: str) -> tuple[str, list[tuple[str, Any]]]:
    content, calls = get_tool_parser(fmt).parse(text, schemas=SCHEMAS)
    assert all(isinstance(c, ToolCall) for c in calls), [c for c in calls if not isinstance(c, ToolCall)]
    return content, [(c.name, c.arguments) for c in calls]


def _qwen25_text(turn: Turn) -> bool:
    """Qwen25Detector only knows the Qwen template's ``<tool_call>\\n...\\n</tool_call>`` layout."""
    return turn.text.count("<tool_call>\n") >= len(turn.calls)


_PAIR_ESCAPE = re.compile(r"\\ud[89ab][0-9a-f]{2}\\ud[c-f]")


def _llama_literal_path(turn: Turn) -> bool:
    """Llama32Detector decodes a call after "; " with Python's literal_eval (its raw_decode fails on the
    space): a JSON surrogate-pair escape then becomes two lone surrogates (see the differences test)."""
    return "; {" in turn.text and _PAIR_ESCAPE.search(turn.text) is not None


@pytest.mark.parametrize(("fmt", "detector"), PAIRS)
def test_same_calls_and_content_as_sglang(sglang, fmt, detector):
    compared = 0
    for turn in corpus(fmt, CORPUS_SIZE, seed=7):
        if detector == "Qwen25Detector" and not _qwen25_text(turn):
            continue
        content, calls = _ours(fmt, turn.text)
        assert calls == turn.calls, turn.text
        if detector == "Llama32Detector" and _llama_literal_path(turn):
            continue
        sgl_content, sgl_calls = _sglang_parse(sglang, detector, turn.text)
        assert calls == sgl_calls, turn.text
        assert content == sgl_content.strip(), turn.text  # SGLang leaves some formats' content unstripped
        compared += 1
    assert compared >= 0.95 * CORPUS_SIZE


def test_qwen3_coder_typing_matches_sglang_value_by_value(sglang):
    """Schema typing, including the values that do not convert (kept as text, or false for booleans)."""
    values = ["42", " 7 ", "4_2", "-0", "1e3", "2.50", "1.0", "inf", "NaN", "x1", "", "True", "FALSE", "yes", "Null",
              "null", "None", "[1, 2]", "{\"a\": null}", "{'a': (1, 2)}", "[1, 2", "'quoted'", "(1,)", "3", "{}"]
    schema = {
        "type": "object",
        "properties": {
            "i": {"type": "integer"}, "n": {"type": "number"}, "b": {"type": "boolean"}, "o": {"type": "object"},
            "a": {"type": "array"}, "s": {"type": "string"}, "u": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
            "e": {"enum": [1, 2]}, "t": {"type": ["null", "boolean"]}, "d": {"type": "dict"}, "x": {},
        },
    }
    tool = sglang["Tool"](type="function", function={"name": "f", "parameters": schema})
    for value in values:
        params = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key in [*schema["properties"], "undeclared"])
        text = f"<tool_call>\n<function=f>\n{params}</function>\n</tool_call>"
        _, ours = get_tool_parser("qwen3_coder").parse(text, schemas={"f": schema})
        result = sglang["Qwen3CoderDetector"]().detect_and_parse(text, [tool])
        expected = json.loads(result.calls[0].parameters)
        assert json.dumps(ours[0].arguments) == json.dumps(expected), value  # dumps: NaN == NaN


CALL = '{"name": "run_code", "arguments": {"code": "print(1)"}}'
DIFFERENCES = [
    # (why, our format, SGLang detector, text, our calls (None: an error observation), SGLang's calls)
    (
        "a closing tag inside a JSON string does not end our call; HermesDetector cuts there and drops the turn's calls",
        "hermes",
        "HermesDetector",
        '<tool_call>{"name": "run_code", "arguments": {"code": "s = \'</tool_call>\'"}}</tool_call>',
        [("run_code", {"code": "s = '</tool_call>'"})],
        [],
    ),
    (
        "one malformed block is an error observation; HermesDetector drops every call of the turn",
        "hermes",
        "HermesDetector",
        f'<tool_call>{{"name": "run_code"</tool_call><tool_call>{CALL}</tool_call>',
        [None, ("run_code", {"code": "print(1)"})],
        [],
    ),
    (
        "a later Llama call's surrogate-pair escape is the real character; SGLang's literal_eval fallback splits it",
        "llama3_json",
        "Llama32Detector",
        f'<|python_tag|>{CALL}; {{"name": "run_code", "parameters": {{"code": "\\ud83d\\ude00"}}}}',
        [("run_code", {"code": "print(1)"}), ("run_code", {"code": "\U0001f600"})],
        [("run_code", {"code": "print(1)"}), ("run_code", {"code": "\ud83d\ude00"})],
    ),
    (
        "a bare JSON answer is content for us; SGLang takes it for a call to an unknown tool and drops it",
        "llama3_json",
        "Llama32Detector",
        '{"answer": 3}',
        [],
        [],
    ),
    (
        "a qwen3_coder value holding </parameter> is an error observation; SGLang cuts the value there",
        "qwen3_coder",
        "Qwen3CoderDetector",
        "<tool_call>\n<function=run_code>\n<parameter=code>\nx = '</parameter>'\n</parameter>\n</function>\n</tool_call>",
        [None],
        [("run_code", {"code": "x = '"})],
    ),
    (
        "a final qwen3_coder block without </tool_call> after a complete one is parsed; SGLang drops it",
        "qwen3_coder",
        "Qwen3CoderDetector",
        "<tool_call>\n<function=noop>\n</function>\n</tool_call>\n<tool_call>\n<function=noop>\n</function>\n",
        [("noop", {}), ("noop", {})],
        [("noop", {})],
    ),
]


@pytest.mark.parametrize(("why", "fmt", "detector", "text", "ours", "theirs"), DIFFERENCES, ids=[d[0][:40] for d in DIFFERENCES])
def test_deliberate_differences_from_sglang(sglang, why, fmt, detector, text, ours, theirs):
    _, calls = get_tool_parser(fmt).parse(text, schemas=SCHEMAS)
    assert [(c.name, c.arguments) if isinstance(c, ToolCall) else None for c in calls] == ours
    assert _sglang_parse(sglang, detector, text)[1] == theirs
