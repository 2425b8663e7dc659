"""The stop rule for runs that train on nothing: consecutive failing steps, what counts, and the one line."""

from __future__ import annotations

import pytest

from mcore_agentic.trainer.run_health import RunFailed, RunHealth, StepFailures, is_tool_fault

ALL_FAIL = StepFailures(requests=32, failed_requests=32, tool_calls=0, tool_faults=0)
TOOL_BROKEN = StepFailures(requests=32, failed_requests=0, tool_calls=40, tool_faults=40, tool_broken_requests=32)
HEALTHY = StepFailures(requests=32, failed_requests=1, tool_calls=40, tool_faults=2)
RARE_TIMEOUT = StepFailures(requests=32, failed_requests=0, tool_calls=1, tool_faults=1, tool_broken_requests=1)


def test_consecutive_failing_steps_stop_the_run_with_one_line():
    health = RunHealth(stop_fraction=0.9, stop_steps=3)
    health.observe(1, ALL_FAIL)
    health.observe(2, TOOL_BROKEN)
    with pytest.raises(RunFailed) as info:
        health.observe(3, ALL_FAIL, why="tool calc: ValueError x40")
    line = str(info.value)
    assert "\n" not in line
    assert line.startswith("stopped after step 3: 3 steps in a row trained on almost nothing (32 of 32 requests failed (100%)")
    assert "tool calc: ValueError x40" in line and "trainer.failure_stop_steps=0" in line


def test_a_healthy_step_resets_the_streak_and_zero_never_stops():
    health = RunHealth(stop_fraction=0.9, stop_steps=2)
    for step in range(1, 11):  # never two failing steps in a row
        health.observe(step, ALL_FAIL if step % 2 else HEALTHY)
    assert health.streak == 0
    allowed = RunHealth(stop_fraction=0.9, stop_steps=0)
    for step in range(1, 10):
        allowed.observe(step, TOOL_BROKEN)
    assert allowed.summary_line() == (
        "failures: 0 of 288 requests failed (0%), 288 more had every tool call fail inside the tool, "
        "360 of 360 tool calls raised or timed out in the tool (100%)"
    )
    assert RunHealth().summary_line() is None


def test_a_rare_timed_out_call_never_stops_a_healthy_run():
    """100% of one call failed, but 31 of 32 requests trained on their task: not a failing step."""
    health = RunHealth(stop_fraction=0.9, stop_steps=2)
    for step in range(1, 6):
        health.observe(step, RARE_TIMEOUT)
    assert health.streak == 0


def test_only_the_tools_own_errors_are_faults():
    assert is_tool_fault({"error": True, "error_type": "ValueError", "traceback": "Traceback ..."})
    assert is_tool_fault({"error": True, "error_type": "TimeoutError"})
    assert not is_tool_fault({"error": True, "error_type": "invalid_arguments"})  # the model's call: its to learn
    assert not is_tool_fault({"error": False})
