"""Failures are visible: each tool_log entry says what went wrong (error_type, the tool's traceback), a failed
request keeps its error's type, first line and traceback, and the step's FailureReport counts them and warns
once per failing tool and once for failed requests."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from mcore_agentic.models.tokenizer import load_qwen_tokenizer
from mcore_agentic.rollout.config import MultiTurnConfig, RolloutConfig
from mcore_agentic.rollout.driver import generate_sequences
from mcore_agentic.rollout.failures import FailureReport, summarize_failures
from mcore_agentic.tools.base import MAX_TRACEBACK_CHARS, format_traceback
from tests.unit.rollout.scripted import AddTool, RaisingTool, ScriptedEngine, SleepTool, call

CFG = RolloutConfig(n=1, prompt_length=400, response_length=2000,
                    # 2 s: 0.2 s timed out a plain add on a loaded CI machine
                    multi_turn=MultiTurnConfig(max_assistant_turns=8, max_parallel_calls=1, tool_timeout=2.0))
BAD_CALLS = [
    "<tool_call>\n{not json}\n</tool_call>",
    call("nope"),
    call("add", a="two", b=3),
    call("add", a=1, b=2) + "\n" + call("add", a=3, b=4),
    call("explode"),
    call("sleep", seconds=5.0),
    "done",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_qwen_tokenizer("qwen2_5", vocab_size=4096)


def _row(question: str, **extra: Any) -> dict[str, Any]:
    return {"prompt": [{"role": "user", "content": question}], "extra_info": extra}


@pytest.fixture(scope="module")
def batch(tokenizer):
    """Three requests: every kind of bad call, one that raises on every call, one that fails (no such tool)."""
    rows = [_row("Q-bad"), _row("Q-boom"), _row("Q-lost", tools_kwargs={"calculator": {}})]
    scripts = {"Q-bad": BAD_CALLS, "Q-boom": [call("explode"), call("explode"), "ok"], "Q-lost": ["never"]}
    tools = {"add": AddTool(), "explode": RaisingTool(), "sleep": SleepTool()}
    return asyncio.run(generate_sequences(rows, ScriptedEngine(tokenizer, scripts), tools, None, CFG, tokenizer))


def test_tool_log_records_error_type_and_the_tools_traceback(batch):
    log = batch["tool_log"][0]
    assert [e["error_type"] for e in log] == [
        "malformed_call", "unknown_tool", "invalid_arguments", None, "too_many_calls", "ZeroDivisionError",
        "TimeoutError",
    ]
    assert [e["error"] for e in log] == [True, True, True, False, True, True, True]
    for entry in log:  # the keys the dumps and the inspector read are still there
        assert {"turn", "name", "arguments", "result", "error", "seconds"} <= set(entry)
    raised = log[5]
    assert raised["traceback"].startswith("Traceback (most recent call last):")
    assert 'raise ZeroDivisionError("boom")' in raised["traceback"] and raised["traceback"].endswith("ZeroDivisionError: boom")
    assert all(e["traceback"] is None for i, e in enumerate(log) if i != 5)


def test_failed_request_keeps_type_first_line_and_traceback(batch):
    rm = batch["request_metrics"][2]
    assert rm["state"] == "failed" and rm["error_type"] == "RequestDataError"
    assert rm["error"].startswith("RequestDataError: extra_info.tools_kwargs.calculator: no such tool")
    assert "\n" not in rm["error"]
    assert rm["error_traceback"].startswith("Traceback") and "_select_tools" in rm["error_traceback"]
    assert batch["request_metrics"][0]["error_type"] is None and batch["request_metrics"][0]["error_traceback"] is None


def test_report_counts_and_warns_once_per_failing_tool_with_its_traceback(batch, caplog):
    report = summarize_failures(batch.meta)
    assert (report.requests, report.failed_requests) == (3, 1)
    assert report.request_errors == {"RequestDataError": 1}
    assert report.tool_calls == 9
    assert report.tool_errors == {
        ("(unnamed)", "malformed_call"): 1, ("nope", "unknown_tool"): 1, ("add", "invalid_arguments"): 1,
        ("add", "too_many_calls"): 1, ("explode", "ZeroDivisionError"): 3, ("sleep", "TimeoutError"): 1,
    }
    assert report.tool_faults == {"explode": 3, "sleep": 1}
    assert report.summary_lines() == [
        "requests: 1/3 failed (RequestDataError x1)",
        "tool explode: 3/3 calls failed (ZeroDivisionError x3)",
        "tool sleep: 1/1 calls failed (TimeoutError x1)",
        # The model's bad calls, whatever names it wrote: one line.
        "the model's own bad tool calls: 4 of 9 (invalid_arguments x1, malformed_call x1, too_many_calls x1, "
        "unknown_tool x1)",
    ]

    logger = logging.getLogger("test.failures")
    with caplog.at_level(logging.WARNING, logger="test.failures"):
        report.log(logger, step=7, split="train")
    messages = [r.getMessage() for r in caplog.records if r.name == "test.failures"]
    assert all(r.levelno == logging.WARNING for r in caplog.records if r.name == "test.failures")
    assert len(messages) == 3  # explode, sleep (the tools' own faults) and the failed requests; not the model's calls
    explode, sleep, requests = messages
    assert explode.startswith("step 7 (train): tool explode: 3/3 calls failed (ZeroDivisionError x3)")
    assert "Traceback (most recent call last)" in explode and 'raise ZeroDivisionError("boom")' in explode
    assert sleep.startswith("step 7 (train): tool sleep: 1/1 calls failed") and "timed out after 2 s" in sleep
    assert requests.startswith("step 7 (train): 1/3 rollout requests failed (RequestDataError x1)")
    assert "_select_tools" in requests


def test_nothing_is_logged_when_all_is_well_and_reports_merge(caplog):
    ok = summarize_failures({"request_metrics": [{"state": "completed"}] * 2,
                             "tool_log": [[{"name": "add", "error": False, "error_type": None}], []]})
    with caplog.at_level(logging.DEBUG, logger="test.quiet"):
        ok.log(logging.getLogger("test.quiet"), step=1, split="val")
    assert not [r for r in caplog.records if r.name == "test.quiet"]
    assert ok.ok and ok.summary_lines() == []

    bad = summarize_failures({
        "request_metrics": [{"state": "failed", "error": "RuntimeError: engine lost it"}],  # an older dump: no type
        "tool_log": [[{"name": "add", "error": True, "error_type": "ValueError", "traceback": "Traceback: first"}]],
    })
    later = summarize_failures({
        "request_metrics": [{"state": "completed"}],
        "tool_log": [[{"name": "add", "error": True, "error_type": "ValueError", "traceback": "Traceback: later"}]],
    })
    total = FailureReport().merge(ok).merge(bad).merge(later)
    assert (total.requests, total.failed_requests, total.tool_calls) == (4, 1, 3)
    assert total.first_tool_fault == {"add": "Traceback: first"}
    assert total.first_request_error == {"RuntimeError": "RuntimeError: engine lost it"}
    assert total.summary_lines() == ["requests: 1/4 failed (RuntimeError x1)",
                                     "tool add: 2/3 calls failed (ValueError x2)"]


def test_tracebacks_are_capped_keeping_the_first_line_and_the_end():
    with pytest.raises(ValueError) as info:
        raise ValueError("start " + "x" * 2 * MAX_TRACEBACK_CHARS + " end")
    text = format_traceback(info.value)
    assert len(text) <= MAX_TRACEBACK_CHARS
    assert text.startswith("Traceback (most recent call last):\n  ...(") and "characters cut" in text
    assert text.endswith("x end") and "start" not in text
