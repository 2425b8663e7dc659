"""Where blocking tool work runs: a local thread/process pool (default) or Ray tasks.

The rollout drives many requests on one asyncio event loop. A tool that runs
code or scores an answer would stall every request if it blocked that loop, so
it hands the blocking callable to a :class:`ToolExecutor` and awaits the
result. ``rollout.tool_executor`` picks the kind (``local`` | ``ray``).

Slots and timeouts: at most ``max_workers`` callables run at once
(``rollout.multi_turn.tool_executor_workers``); a call first waits for a slot,
then runs. ``run(..., timeout=s)`` raises ``TimeoutError`` after ``s`` seconds
*of running*: the wait for a slot never counts, and neither does it count
against :func:`mcore_agentic.tools.base.safe_execute`'s tool timeout, which
pauses its clock (:class:`ToolClock`) while the call waits. A slot is given back
when the callable returns, not when its caller stops waiting: a thread cannot
be killed, so with :class:`LocalExecutor` a timed-out callable keeps its slot
until it ends (the code tool's sandbox bounds itself with its own wall-clock
kill). :class:`RayExecutor` force-cancels the task (kills its worker) on timeout.
Slots are shared by every event loop of the process, so the bound holds for
tools that run on worker threads' loops too.

A tool's *own* code runs on a :class:`ThreadRunner` (:mod:`.thread_runner`, re-exported here).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import contextvars
import functools
import multiprocessing
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from mcore_agentic.utils.errors import ConfigError


@runtime_checkable
class ToolExecutor(Protocol):
    async def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Run the blocking ``fn(*args, **kwargs)`` off the event loop; ``TimeoutError`` after ``timeout`` s."""
        ...

    def shutdown(self) -> None:
        """Release the pool (idempotent)."""
        ...


class ToolClock:
    """How long one tool call has waited for executor slots; :func:`safe_execute` leaves that time out of its timeout.

    Owned by the loop :func:`safe_execute` runs on; a tool running off that loop (a worker thread's loop, see
    :class:`ThreadRunner`) reports its waits from there, and they are applied on the owner loop in order.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.waited = 0.0
        self._waiting = 0
        self._since = 0.0
        self._resumed: asyncio.Event | None = None
        self._loop = loop

    @property
    def waiting(self) -> bool:
        return self._waiting > 0

    def resumed(self) -> asyncio.Event:
        """Set whenever no slot wait is in progress (created on the running loop)."""
        if self._resumed is None:
            self._resumed = asyncio.Event()
            if not self._waiting:
                self._resumed.set()
        return self._resumed

    def _elsewhere(self) -> bool:
        """Called from a loop or thread other than the owner's (the times are ``time.monotonic`` on both)."""
        if self._loop is None:
            return False
        try:
            return asyncio.get_running_loop() is not self._loop
        except RuntimeError:
            return True

    def pause(self, now: float) -> None:
        if self._elsewhere():
            self._post(self.pause, now)
            return
        if self._waiting == 0:
            self._since = now
            self.resumed().clear()
        self._waiting += 1

    def resume(self, now: float) -> None:
        if self._elsewhere():
            self._post(self.resume, now)
            return
        self._waiting -= 1
        if self._waiting == 0:
            self.waited += now - self._since
            self.resumed().set()

    def _post(self, method: Callable[[float], None], now: float) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the owner loop is closed: nobody is timing the call any more
            self._loop.call_soon_threadsafe(method, now)

    def waited_until(self, now: float) -> float:
        """Seconds spent waiting for slots so far, the current wait included."""
        return self.waited + (now - self._since if self._waiting else 0.0)


TOOL_CLOCK: contextvars.ContextVar[ToolClock | None] = contextvars.ContextVar("tool_clock", default=None)
"""Set by :func:`safe_execute` for the duration of one tool call."""


class _Slots:
    """At most ``limit`` callables in flight across every event loop and thread of the process, first come first served.

    A tool running off the rollout's loop (:class:`ThreadRunner`) waits on its own loop for the same slots.
    """

    def __init__(self, limit: int | None):
        self.limit = limit
        self._lock = threading.Lock()
        self._busy = 0
        self._waiters: collections.deque[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = collections.deque()

    async def run(self, start: Callable[[], concurrent.futures.Future[Any]], timeout: float | None) -> Any:
        """Wait for a slot (not timed), call ``start()``, then wait ``timeout`` s for its future; free the slot when it ends.

        The slot is freed by the work's own (thread-safe) future, so it comes back even when the loop that
        started the work is closed first (a timed-out call of a tool running on a worker thread's loop).
        """
        if self.limit is None:
            return await asyncio.wait_for(asyncio.wrap_future(start()), timeout)
        loop = asyncio.get_running_loop()
        clock = TOOL_CLOCK.get()
        if clock is not None:
            clock.pause(loop.time())
        try:
            await self._acquire(loop)
        finally:
            if clock is not None:
                clock.resume(loop.time())
        try:
            future = start()
        except BaseException:
            self._release()
            raise
        future.add_done_callback(lambda _: self._release())
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout)

    async def _acquire(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self.limit is not None
        with self._lock:
            if self._busy < self.limit:
                self._busy += 1
                return
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append((loop, waiter))
        try:
            await waiter
        except asyncio.CancelledError:
            with self._lock:
                queued = (loop, waiter) in self._waiters
                if queued:
                    self._waiters.remove((loop, waiter))
            if not queued and waiter.done() and not waiter.cancelled():
                self._release()  # handed a slot just as this wait was cancelled: pass it on
            raise  # (a hand-over still in flight finds the waiter cancelled and passes the slot on itself)

    def _release(self) -> None:
        with self._lock:
            while self._waiters:
                loop, waiter = self._waiters.popleft()
                try:
                    loop.call_soon_threadsafe(self._hand_over, waiter)  # the slot moves; ``_busy`` stays
                    return
                except RuntimeError:  # that waiter's loop is closed
                    continue
            self._busy -= 1

    def _hand_over(self, waiter: asyncio.Future[None]) -> None:
        if waiter.done():
            self._release()
        else:
            waiter.set_result(None)


class LocalExecutor:
    """asyncio + a ``concurrent.futures`` pool in this process (threads by default).

    ``processes=True`` uses a spawn-based process pool: true parallelism for
    CPU-bound Python, but ``fn`` and its arguments must be picklable
    (module-level functions).
    """

    def __init__(self, max_workers: int | None = None, processes: bool = False):
        if max_workers is not None and max_workers < 1:
            raise ConfigError("rollout.multi_turn.tool_executor_workers", f"must be >= 1, got {max_workers}")
        max_workers = max_workers or min(32, (os.cpu_count() or 1) + 4)  # concurrent.futures' own default
        self.max_workers = max_workers
        self._slots = _Slots(max_workers)
        self.processes = processes
        if processes:
            # spawn, not fork: the trainer process holds threads (torch, gloo) that fork would copy mid-lock.
            self._pool: concurrent.futures.Executor = concurrent.futures.ProcessPoolExecutor(
                max_workers=max_workers, mp_context=multiprocessing.get_context("spawn")
            )
        else:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="tool")
        self._closed = False

    async def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        if self._closed:
            raise RuntimeError("LocalExecutor.run after shutdown()")
        return await self._slots.run(lambda: self._pool.submit(functools.partial(fn, *args, **kwargs)), timeout)

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=False, cancel_futures=True)


def _call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Body of the Ray task (module-level so Ray pickles it by reference)."""
    return fn(*args, **kwargs)


def _project_root() -> str:
    """Directory holding the ``mcore_agentic`` package, so Ray workers can import it from a source checkout."""
    return str(Path(__file__).resolve().parents[2])


class RayExecutor:
    """Each call is a Ray remote task (``num_cpus_per_task`` CPUs).

    Joins a running Ray session, or starts a local one with
    ``ray.init(num_cpus=num_cpus)`` and shuts it down again in :meth:`shutdown`.
    Workers get the project root on ``PYTHONPATH`` so tools' module-level
    functions resolve in a source checkout.
    """

    def __init__(
        self,
        num_cpus: int | None = None,
        num_cpus_per_task: float = 1.0,
        init_kwargs: dict[str, Any] | None = None,
        max_workers: int | None = None,
    ):
        import ray

        if max_workers is not None and max_workers < 1:
            raise ConfigError("rollout.multi_turn.tool_executor_workers", f"must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self._slots = _Slots(max_workers)

        self._ray = ray
        self._owns_ray = False
        if not ray.is_initialized():
            pythonpath = os.pathsep.join(p for p in (_project_root(), os.environ.get("PYTHONPATH", "")) if p)
            kwargs: dict[str, Any] = {
                "num_cpus": num_cpus,
                "include_dashboard": False,
                "runtime_env": {"env_vars": {"PYTHONPATH": pythonpath}},
                "logging_level": "warning",
            }
            kwargs.update(init_kwargs or {})
            ray.init(**kwargs)
            self._owns_ray = True
        self._remote = ray.remote(num_cpus=num_cpus_per_task, max_retries=0)(_call)
        self._closed = False
        self._lock = threading.Lock()

    async def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        if self._closed:
            raise RuntimeError("RayExecutor.run after shutdown()")
        refs: list[Any] = []

        def start() -> concurrent.futures.Future[Any]:
            refs.append(self._remote.remote(fn, args, kwargs))
            return refs[0].future()

        try:
            return await self._slots.run(start, timeout)
        except TimeoutError:
            # A thread can't be stopped, but a Ray worker can: don't leave runaway work behind.
            if refs:
                self._ray.cancel(refs[0], force=True)
            raise

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._owns_ray and self._ray.is_initialized():
                self._ray.shutdown()


def make_executor(kind: Literal["local", "ray"], **kwargs: Any) -> ToolExecutor:
    """Build the executor named by ``rollout.tool_executor``; ``kwargs`` go to its constructor."""
    if kind == "local":
        return LocalExecutor(**kwargs)
    if kind == "ray":
        return RayExecutor(**kwargs)
    raise ConfigError("rollout.tool_executor", f"unknown executor {kind!r}: use 'local' or 'ray'")


_default: LocalExecutor | None = None
_default_lock = threading.Lock()


def default_executor() -> LocalExecutor:
    """A process-wide thread pool for tools that were never bound to the rollout's executor."""
    global _default
    with _default_lock:
        if _default is None or _default._closed:
            _default = LocalExecutor()
        return _default
