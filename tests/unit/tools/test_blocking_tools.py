"""A tool's blocking code cannot stall the rollout: it runs on a worker thread, tool_timeout fires for it,
other requests go on, orphaned threads are bounded, blocking is warned about once, loop-safe tools stay on the loop."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from mcore_agentic.models.tokenizer import load_qwen_tokenizer
from mcore_agentic.rollout.config import MultiTurnConfig, RolloutConfig
from mcore_agentic.rollout.driver import generate_sequences
from mcore_agentic.tools import base
from mcore_agentic.tools.base import BaseTool, ToolResponse, call_tool, on_event_loop, safe_execute
from mcore_agentic.tools.calculator import CalculatorTool
from mcore_agentic.tools.executor import LocalExecutor
from mcore_agentic.tools.thread_runner import OrphanLimitError, ThreadRunner
from mcore_agentic.utils.plugins import resolve_class
from tests.unit.rollout.scripted import ScriptedEngine, call

REPO = Path(__file__).resolve().parents[3]


def _schema(name: str) -> dict[str, Any]:
    props = {"seconds": {"type": "number"}}
    return {"type": "function", "function": {"name": name, "description": name,
                                             "parameters": {"type": "object", "properties": props}}}


class BlockingTool(BaseTool):
    """What a first tool often looks like: ``time.sleep`` (or ``requests.get``) inside ``async def execute``."""

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kw: Any) -> ToolResponse:
        time.sleep(float(parameters.get("seconds", 3.0)))
        return ToolResponse(text="done")


class SyncTool(BaseTool):
    """A plain ``def`` lifecycle, keeping per-instance state across its calls."""

    def create(self, instance_id: str | None = None, **create_kwargs: Any) -> str:  # type: ignore[override]
        self._instances[instance_id or "x"] = {"calls": 0, "threads": {threading.current_thread().name}}
        return instance_id or "x"

    def execute(self, instance_id: str, parameters: dict[str, Any], **kw: Any) -> ToolResponse:  # type: ignore[override]
        time.sleep(float(parameters.get("seconds", 0.0)))
        state = self._instances[instance_id]
        state["calls"] += 1
        state["threads"].add(threading.current_thread().name)
        return ToolResponse(text=f"call {state['calls']}")

    def calc_reward(self, instance_id: str, **kwargs: Any) -> float:  # type: ignore[override]
        return float(self._instances[instance_id]["calls"])


class DeclaredLoopTool(BaseTool):
    """Says it is loop-safe, but blocks: it runs on the loop anyway, and is warned about."""

    runs_on_event_loop = True

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kw: Any) -> ToolResponse:
        time.sleep(float(parameters["seconds"]))
        return ToolResponse(text=threading.current_thread().name)


@pytest.fixture(autouse=True)
def _fresh_warnings():
    base._WARNED.clear()
    yield
    base._WARNED.clear()


@pytest.fixture(scope="module")
def tokenizer():
    return load_qwen_tokenizer("qwen2_5", vocab_size=4096)


def test_blocking_tool_times_out_while_another_request_keeps_going(tokenizer):
    """Real driver + agent loop: a tool sleeping 3 s under tool_timeout=0.5 answers "timed out" in about 0.5 s,
    and a concurrent request on the same event loop takes all its turns meanwhile."""
    cfg = RolloutConfig(n=1, prompt_length=400, response_length=200,
                        multi_turn=MultiTurnConfig(max_assistant_turns=6, tool_timeout=0.5))
    rows = [{"prompt": [{"role": "user", "content": "Q-block"}], "extra_info": {"tools_kwargs": {"slow": {}}}},
            {"prompt": [{"role": "user", "content": "Q-other"}]}]
    scripts = {"Q-block": [call("slow", seconds=3.0), "gave up"], "Q-other": ["one", "two"]}
    stamps: dict[str, list[float]] = {"Q-block": [], "Q-other": []}

    class Stamped(ScriptedEngine):
        async def generate(self, prompt_ids, params):
            key = "Q-block" if "Q-block" in self.tokenizer.decode(prompt_ids) else "Q-other"
            stamps[key].append(time.perf_counter())
            return await super().generate(prompt_ids, params)

    class Chatty(BaseTool):  # makes Q-other a four-turn conversation with a tool between turns
        async def execute(self, instance_id, parameters, **kw):
            return ToolResponse(text="ok")

    scripts["Q-other"] = [call("chat"), call("chat"), call("chat"), "bye"]
    rows[1]["extra_info"] = {"tools_kwargs": {"chat": {}}}
    engine = Stamped(tokenizer, scripts, delay=0.02)
    tools = {"slow": BlockingTool({}, _schema("slow")), "chat": Chatty({}, _schema("chat"))}
    started = time.perf_counter()
    batch = asyncio.run(generate_sequences(rows, engine, tools, None, cfg, tokenizer))
    elapsed = time.perf_counter() - started

    (entry,) = batch["tool_log"][0]
    assert entry["error"] and entry["error_type"] == "TimeoutError" and entry["traceback"] is None
    assert entry["result"] == "Error: tool 'slow' timed out after 0.5 s."
    assert entry["seconds"] < 1.5
    assert elapsed < 2.5  # not the 3 s the tool sleeps
    assert [e["error_type"] for e in batch["tool_log"][1]] == [None, None, None]
    # the other request took its turns while the blocking call ran (between its first and second engine turns)
    call_started, call_answered = stamps["Q-block"]
    assert sum(call_started < t < call_answered for t in stamps["Q-other"]) >= 3
    assert batch["request_metrics"][0]["state"] == batch["request_metrics"][1]["state"] == "completed"


def test_plain_def_tool_runs_on_a_thread_keeps_its_state_and_times_out():
    tool = SyncTool({}, _schema("sync"))

    async def main():
        loop_thread = threading.current_thread().name
        iid = await call_tool(tool, "create", instance_id="r0")
        first = await safe_execute(tool, iid, {"seconds": 0.0}, timeout=5)
        second = await safe_execute(tool, iid, {"seconds": 0.0}, timeout=5)
        began = time.perf_counter()
        slow = await safe_execute(tool, iid, {"seconds": 3.0}, timeout=0.5)
        waited = time.perf_counter() - began
        reward = await call_tool(tool, "calc_reward", iid)
        return loop_thread, first, second, slow, waited, reward

    loop_thread, first, second, slow, waited, reward = asyncio.run(main())
    assert (first.text, second.text) == ("call 1", "call 2") and not first.is_error
    assert reward == 2.0  # state kept across create / execute / calc_reward
    assert loop_thread not in tool._instances["r0"]["threads"]
    assert slow.is_error and slow.error_type == "TimeoutError" and "timed out after 0.5 s" in slow.text
    assert waited < 1.5


def test_blocking_is_warned_once_per_tool_naming_it_and_its_class(caplog):
    tool = BlockingTool({}, _schema("slow"))

    async def main():
        return [await safe_execute(tool, "r", {"seconds": 0.3}, timeout=5) for _ in range(2)]

    with caplog.at_level(logging.WARNING, logger="mcore_agentic.tools.base"):
        results = asyncio.run(main())
    assert [r.text for r in results] == ["done", "done"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert "tool 'slow'" in message and "BlockingTool" in message and "blocking code inside async def" in message


def test_a_loop_declared_tool_stays_on_the_loop_and_is_warned_when_it_blocks(caplog):
    tool = DeclaredLoopTool({}, _schema("declared"))

    async def main():
        return [await safe_execute(tool, "r", {"seconds": s}, timeout=5) for s in (0.0, 0.3, 0.3)]

    with caplog.at_level(logging.WARNING, logger="mcore_agentic.tools.base"):
        results = asyncio.run(main())
    assert {r.text for r in results} == {threading.current_thread().name}  # ran on the loop's thread
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "held the rollout's event loop" in warnings[0] and "DeclaredLoopTool" in warnings[0]


def test_shipped_tools_run_on_the_loop_and_user_code_does_not(monkeypatch):
    for path in sorted((REPO / "configs/tools").glob("*.yaml")):
        for i, entry in enumerate(yaml.safe_load(path.read_text())["tools"]):
            cls = resolve_class(entry["class_name"], f"{path.name}[{i}]")
            tool = object.__new__(cls)  # the code tool's constructor boots sandboxes: only the class matters here
            for method in ("create", "execute", "calc_reward", "release"):
                assert on_event_loop(tool, method), (path.name, cls.__name__, method)

    class MyCalculator(CalculatorTool):
        async def execute(self, instance_id, parameters, **kw):
            return await super().execute(instance_id, parameters, **kw)

    mine = MyCalculator({}, _schema("calc"))
    assert not on_event_loop(mine, "execute") and on_event_loop(mine, "create")  # BaseTool.create is ours

    def no_thread(*args, **kwargs):
        raise AssertionError("a shipped tool went to a worker thread")

    monkeypatch.setattr(ThreadRunner, "run", no_thread)
    calc = CalculatorTool({}, {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}})
    result = asyncio.run(safe_execute(calc, "r", {"expression": "6*7"}, timeout=1))
    assert result.text == "42" and result.error_type is None


def test_orphaned_threads_are_bounded_per_tool():
    tool = BlockingTool({}, _schema("slow"))
    base._RUNNERS[tool] = ThreadRunner("slow", max_orphans=1)

    async def main():
        first = await safe_execute(tool, "r", {"seconds": 0.6}, timeout=0.1)  # its thread sleeps on: an orphan
        refused = await safe_execute(tool, "r", {"seconds": 0.0}, timeout=5)
        await asyncio.sleep(0.8)  # the orphan returns
        again = await safe_execute(tool, "r", {"seconds": 0.0}, timeout=5)
        return first, refused, again

    first, refused, again = asyncio.run(main())
    assert first.error_type == "TimeoutError"
    assert refused.is_error and refused.error_type == "TimeoutError" and "was not run" in refused.text
    assert again.text == "done" and base._RUNNERS[tool].orphans == 0


class PooledSleepTool(BaseTool):
    """Not declared loop-safe, so it runs on a worker thread's loop, and hands its sleep to the executor."""

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kw: Any) -> ToolResponse:
        await self.run_blocking(time.sleep, float(parameters["seconds"]))
        return ToolResponse(text="slept")


def test_executor_slots_span_worker_loops_and_come_back_after_a_timeout():
    """A one-slot executor: the timed-out call's worker loop is gone when its sleep ends, and the slot still
    comes back; the next calls wait for it without that wait counting against their timeout."""
    executor = LocalExecutor(max_workers=1)
    tool = PooledSleepTool({}, _schema("pooled"))
    tool.bind_executor(executor)

    async def main():
        timed_out = await safe_execute(tool, "r0", {"seconds": 0.5}, timeout=0.1)
        rest = asyncio.gather(*(safe_execute(tool, f"r{i}", {"seconds": 0.25}, timeout=0.4) for i in (1, 2, 3)))
        return timed_out, await asyncio.wait_for(rest, 5.0)

    try:
        timed_out, rest = asyncio.run(main())
    finally:
        executor.shutdown()
    assert timed_out.error_type == "TimeoutError"
    assert [r.text for r in rest] == ["slept"] * 3  # one at a time, 0.25 s each, none timed out


def test_thread_runner_cancels_an_async_tool_at_its_next_await():
    runner = ThreadRunner("t", max_orphans=1)
    finished = threading.Event()

    async def tool_code():
        try:
            await asyncio.sleep(10)
        finally:
            finished.set()

    async def main():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(runner.run(tool_code), 0.1)

    asyncio.run(main())
    assert finished.wait(2.0)  # cancelled on its own loop, not left to sleep 10 s
    deadline = time.monotonic() + 2.0
    while runner.orphans and time.monotonic() < deadline:
        time.sleep(0.01)
    assert runner.orphans == 0
    runner.orphans = 1  # as if a call were still stuck
    with pytest.raises(OrphanLimitError):
        asyncio.run(runner.run(lambda: None))
