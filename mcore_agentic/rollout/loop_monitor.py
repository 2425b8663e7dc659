"""How long the rollout's event loop goes without getting to run: the longest stall during a rollout.

Every request's generation, tools and interaction share one asyncio event loop, so CPU
work done on it (rendering, tokenizing, parsing) delays all of them. A heartbeat task
asks to be woken every ``interval`` seconds; how late it wakes is how long the loop was
busy with something else. The longest lateness is reported as
``rollout/event_loop_max_stall_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time


class LoopStallMonitor:
    """Async context manager: ``async with LoopStallMonitor() as m: ...``; then ``m.max_stall_s``."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.max_stall_s = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _beat(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(self.interval)
            self.max_stall_s = max(self.max_stall_s, time.perf_counter() - start - self.interval)

    async def __aenter__(self) -> LoopStallMonitor:
        self._task = asyncio.get_running_loop().create_task(self._beat())
        await asyncio.sleep(0)  # the first beat starts before the work does
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
