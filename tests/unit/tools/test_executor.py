"""Tool executors: blocking work runs off the event loop; timeouts; real Ray tasks."""

import asyncio
import math
import os
import threading
import time
from pathlib import Path

import pytest

from mcore_agentic.tools.base import BaseTool, ToolResponse, safe_execute
from mcore_agentic.tools.executor import LocalExecutor, RayExecutor, ToolExecutor, make_executor
from mcore_agentic.tools.registry import load_tools
from mcore_agentic.utils.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]


def _blocking_square(x: int, delay: float = 0.0) -> tuple[int, int]:
    time.sleep(delay)
    return x * x, os.getpid()


def _boom() -> None:
    raise ValueError("bad input")


def test_local_runs_off_the_loop_concurrently():
    executor = LocalExecutor(max_workers=4)
    assert isinstance(executor, ToolExecutor)

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        start = time.monotonic()
        results = await asyncio.gather(*(executor.run(_blocking_square, i, delay=0.3) for i in range(4)))
        elapsed = time.monotonic() - start
        task.cancel()
        return results, elapsed, ticks

    try:
        results, elapsed, ticks = asyncio.run(main())
    finally:
        executor.shutdown()
    assert [r[0] for r in results] == [0, 1, 4, 9]
    assert elapsed < 1.0  # four 0.3 s sleeps in parallel, not 1.2 s in series
    assert ticks >= 5  # the loop kept running while the work blocked


def test_local_timeout_and_exception_propagate():
    executor = LocalExecutor(max_workers=2)

    async def main():
        with pytest.raises(TimeoutError):
            await executor.run(time.sleep, 2.0, timeout=0.1)
        with pytest.raises(ValueError, match="bad input"):
            await executor.run(_boom)
        return await executor.run(math.factorial, 5, timeout=5)

    try:
        assert asyncio.run(main()) == 120
    finally:
        executor.shutdown()
    executor.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="after shutdown"):
        asyncio.run(executor.run(math.factorial, 3))


def test_local_thread_is_not_the_loop_thread():
    executor = LocalExecutor(max_workers=1)

    async def main():
        return threading.get_ident(), await executor.run(threading.get_ident)

    try:
        loop_thread, worker_thread = asyncio.run(main())
    finally:
        executor.shutdown()
    assert loop_thread != worker_thread


def test_make_executor_rejects_unknown_kind():
    with pytest.raises(ConfigError, match=r"rollout.tool_executor.*'local' or 'ray'"):
        make_executor("dask")
    with pytest.raises(ConfigError, match="tool_executor_workers"):
        make_executor("local", max_workers=0)


@pytest.mark.slow  # ray.init alone takes 10-20 s on 2 busy cores
def test_ray_executor_runs_tasks_in_workers_and_cancels_on_timeout():
    ray = pytest.importorskip("ray")
    assert not ray.is_initialized()
    executor = make_executor("ray", num_cpus=1)
    assert isinstance(executor, RayExecutor)
    code_tool = load_tools(REPO / "configs/tools/code_tool_config.yaml", executor=executor)["code_interpreter"]

    async def main():
        value, pid = await executor.run(_blocking_square, 7)
        with pytest.raises(ValueError, match="bad input"):
            await executor.run(_boom)
        # A shipped tool's blocking work through Ray (the worker imports the project from PYTHONPATH).
        observation = await code_tool.execute("req-0", {"code": "print(6 * 7)"})
        with pytest.raises(TimeoutError):
            await executor.run(time.sleep, 30, timeout=0.5)
        return value, pid, observation

    try:
        value, pid, observation = asyncio.run(main())
    finally:
        executor.shutdown()
    assert value == 49 and pid != os.getpid()  # ran in a Ray worker process
    assert observation.text == "42" and not observation.is_error
    assert not ray.is_initialized()  # we started Ray, so we shut it down


def test_slot_wait_never_counts_against_the_run_timeout():
    """One slot, four calls of 0.3 s each with a 0.5 s run timeout: the last waits 0.9 s for its slot, then runs."""
    executor = LocalExecutor(max_workers=1)

    async def main():
        return await asyncio.gather(*(executor.run(time.sleep, 0.3, timeout=0.5) for _ in range(4)))

    try:
        started = time.monotonic()
        asyncio.run(main())
        assert time.monotonic() - started >= 1.2  # they really did run one at a time
    finally:
        executor.shutdown()


def test_a_run_past_its_timeout_still_times_out_and_keeps_its_slot_until_it_ends():
    executor = LocalExecutor(max_workers=1)

    async def main():
        with pytest.raises(TimeoutError):
            await executor.run(time.sleep, 0.6, timeout=0.1)
        started = time.monotonic()
        await executor.run(time.sleep, 0.0, timeout=5)
        return time.monotonic() - started

    try:
        waited = asyncio.run(main())
    finally:
        executor.shutdown()
    assert waited >= 0.3  # the timed-out sleep held the only slot until it returned


class _SleepTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        await self.run_blocking(time.sleep, parameters["seconds"])
        return ToolResponse(text=f"slept {instance_id}")


def test_safe_execute_timeout_excludes_the_wait_for_an_executor_slot():
    executor = LocalExecutor(max_workers=1)
    tool = _SleepTool({}, {"type": "function", "function": {"name": "sleep"}})
    tool.bind_executor(executor)

    async def main():
        calls = [safe_execute(tool, f"r{i}", {"seconds": 0.3}, timeout=0.6) for i in range(4)]
        return await asyncio.gather(*calls)

    try:
        results = asyncio.run(main())
        slow = asyncio.run(safe_execute(tool, "slow", {"seconds": 1.0}, timeout=0.3))
    finally:
        executor.shutdown()
    assert [r.text for r in results] == [f"slept r{i}" for i in range(4)]
    assert slow.is_error and "timed out after 0.3 s" in slow.text


def test_executor_size_is_a_config_key():
    from mcore_agentic.rollout.config import MultiTurnConfig

    assert MultiTurnConfig(tool_executor_workers=3).tool_executor_workers == 3
    with pytest.raises(ConfigError, match=r"rollout.multi_turn.tool_executor_workers: must be >= 1"):
        MultiTurnConfig(tool_executor_workers=0)
    executor = make_executor("local", max_workers=3)
    try:
        assert executor.max_workers == 3
    finally:
        executor.shutdown()
