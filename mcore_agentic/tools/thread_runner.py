"""A tool's own code off the rollout's event loop: :class:`ThreadRunner`.

A tool's *own* code (its ``execute``, ``create``, ...) runs on a
:class:`ThreadRunner` unless the tool declares it never blocks (see
:func:`mcore_agentic.tools.base.call_tool`): a daemon thread per call, a
coroutine on a fresh event loop there. A call whose caller timed out cannot be
killed; its thread is an *orphan* until it returns, and a tool may have at most
:data:`MAX_ORPHANED_THREADS` of them before its further calls are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import threading
import time
import types
from collections.abc import Awaitable, Callable, Generator
from typing import Any

MAX_ORPHANED_THREADS = 16
"""Calls of one tool that timed out and still run (a thread cannot be killed) before its next calls are refused."""


class OrphanLimitError(RuntimeError):
    """A tool already has :data:`MAX_ORPHANED_THREADS` timed-out calls still running; the call was not started."""


class _Call:
    """One off-loop call: whether its caller gave up, and the worker loop's task to cancel when it did."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.finished = False
        self.orphaned = False
        self.cancelled = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Task[Any] | None = None

    def bind(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any]) -> None:
        with self.lock:
            self.loop, self.task = loop, task
            if self.cancelled:
                task.cancel()

    def cancel(self) -> None:
        """Cancel the worker's coroutine at its next ``await`` (blocking code in it runs on until it returns)."""
        with self.lock:
            self.cancelled = True
            loop, task = self.loop, self.task
        if loop is not None and task is not None:
            with contextlib.suppress(RuntimeError):  # the worker loop already closed: the call is over
                loop.call_soon_threadsafe(task.cancel)


class ThreadRunner:
    """Runs a tool's own code off the rollout's event loop: every call on a fresh daemon thread.

    A plain function is called there; a coroutine function's coroutine runs there on an event loop of its own
    (:class:`asyncio.Runner`: a fresh loop per call, closed after it, so nothing bound to a loop outlives a call).
    The caller awaits the result on its loop, which keeps serving every other request meanwhile. When the caller
    stops waiting (its timeout), the worker's coroutine is cancelled at its next ``await``; blocking code runs on
    until it returns, and that thread is *orphaned*. At most ``max_orphans`` orphans per runner (per tool) may
    run at once: past that, :meth:`run` raises :class:`OrphanLimitError` without starting the call, so a tool
    that hangs every call holds a bounded number of threads. Daemon threads: an orphan never holds up the
    interpreter's exit.
    """

    def __init__(self, name: str, max_orphans: int = MAX_ORPHANED_THREADS):
        self.name = name
        self.max_orphans = max_orphans
        self._lock = threading.Lock()
        self.orphans = 0
        """Calls whose caller gave up and that still run."""

    async def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        on_step: Callable[[float], None] | None = None,
    ) -> Any:
        """``fn(*args, **kwargs)`` on a worker thread (awaited there if it returns an awaitable).

        ``on_step(seconds)`` is called on the worker with how long each uninterrupted stretch of ``fn`` held
        the thread (the whole call for a plain function, each step between ``await``s for a coroutine).
        The caller's context variables (:data:`~.executor.TOOL_CLOCK`) are visible to ``fn``.
        """
        with self._lock:
            if self.orphans >= self.max_orphans:
                raise OrphanLimitError(
                    f"{self.orphans} earlier calls of {self.name} timed out and are still running "
                    "(a thread cannot be stopped); this call was not started"
                )
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        call = _Call()
        context = contextvars.copy_context()

        def deliver(outcome: Callable[[], None]) -> None:
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits for the result
                loop.call_soon_threadsafe(outcome)

        def settle_result(value: Any) -> None:
            if not done.done():
                done.set_result(value)

        def settle_error(exc: BaseException) -> None:
            if done.done():
                return
            if isinstance(exc, asyncio.CancelledError):
                done.cancel()
            else:
                done.set_exception(exc)

        def body() -> None:
            try:
                value = _invoke(fn, args, kwargs or {}, context, call, on_step)
            except BaseException as exc:  # noqa: BLE001 -- handed to the caller, who decides
                deliver(functools.partial(settle_error, exc))
            else:
                deliver(functools.partial(settle_result, value))
            finally:
                with call.lock:
                    call.finished = True
                    orphaned = call.orphaned
                if orphaned:
                    with self._lock:
                        self.orphans -= 1

        threading.Thread(target=body, name=f"tool-{self.name}", daemon=True).start()
        try:
            return await done
        except asyncio.CancelledError:
            with call.lock:
                if not call.finished:
                    call.orphaned = True
                    with self._lock:
                        self.orphans += 1
            call.cancel()
            raise


def _invoke(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    context: contextvars.Context,
    call: _Call,
    on_step: Callable[[float], None] | None,
) -> Any:
    """Body of a :class:`ThreadRunner` worker: call ``fn``; run what it returns to completion if it is awaitable."""
    started = time.perf_counter()
    result = context.run(fn, *args, **kwargs)
    if not inspect.isawaitable(result):
        if on_step is not None:
            on_step(time.perf_counter() - started)
        return result

    async def main() -> Any:
        task = asyncio.current_task()
        assert task is not None
        call.bind(asyncio.get_running_loop(), task)
        return await (timed_steps(result, on_step) if on_step is not None else result)

    with asyncio.Runner() as runner:
        return runner.run(main(), context=context)


@types.coroutine
def timed_steps(awaitable: Awaitable[Any], on_step: Callable[[float], None]) -> Generator[Any, Any, Any]:
    """``await awaitable``, calling ``on_step(seconds)`` after each step it takes between two suspensions.

    A step is what holds the thread (and its event loop): blocking code inside an ``async def`` shows up
    as a long step.
    """
    steps = awaitable.__await__()
    value: Any = None
    error: BaseException | None = None
    while True:
        started = time.perf_counter()
        try:
            yielded = steps.throw(error) if error is not None else steps.send(value)
        except StopIteration as stop:
            on_step(time.perf_counter() - started)
            return stop.value
        except BaseException:
            on_step(time.perf_counter() - started)
            raise
        on_step(time.perf_counter() - started)
        try:
            value, error = (yield yielded), None
        except GeneratorExit:
            steps.close()
            raise
        except BaseException as exc:  # noqa: BLE001 -- passed on into the awaitable, as ``await`` does
            value, error = None, exc
