"""The tool plug-in interface: ``BaseTool``, its result ``ToolResponse``, ``safe_execute`` and ``call_tool``.

A tool lives for the whole run; each rollout request gets its own *instance*
(``create`` -> ``execute``* -> ``calc_reward`` -> ``release``), keyed by an
``instance_id`` the caller keeps. Tools are named by class path in YAML (see
``registry.load_tools``), the format verl users know.

Contract with the rollout loop:

* a model's bad call must never crash the batch. Shipped tools return
  ``ToolResponse(is_error=True)`` on bad parameters; for any other tool the
  loop calls :func:`safe_execute`, which turns exceptions and timeouts into an
  error observation (and records the exception's type and traceback on it);
* a tool's blocking work never stalls the event loop that drives many requests
  at once. The loop calls every lifecycle method through :func:`call_tool`: a
  tool's own code runs on a worker thread (a coroutine on an event loop of its
  own there, see :class:`~mcore_agentic.tools.thread_runner.ThreadRunner`), so
  ``time.sleep``, ``requests.get`` or ``subprocess.run`` inside ``execute`` (a
  plain ``def execute`` too) cannot hold up other requests, and ``tool_timeout``
  answers the model in time. A tool whose code never blocks (it awaits
  non-blocking I/O and hands blocking work to ``self.run_blocking``) declares
  ``runs_on_event_loop = True`` and runs on the rollout's loop; this package's
  own tool code does so without declaring it. Blocking is detected and
  reported once per tool (:data:`BLOCKING_WARN_S`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
import time
import traceback as tb
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from mcore_agentic.tools.executor import TOOL_CLOCK, ToolClock, ToolExecutor, default_executor
from mcore_agentic.tools.schema import drop_null_keywords
from mcore_agentic.tools.thread_runner import MAX_ORPHANED_THREADS, OrphanLimitError, ThreadRunner, timed_steps
from mcore_agentic.utils.instance_state import InstanceState


@dataclass
class ToolResponse:
    """One tool call's result."""

    text: str
    """What the model sees as the tool result (the ``tool`` message content)."""
    reward: float = 0.0
    """Step reward; the rollout sums these into the request's tool rewards."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """Free-form numbers for logging (e.g. ``exit_code``, ``duration_s``)."""
    is_error: bool = False
    """Bad call, exception or timeout: counted as a tool error by the rollout."""
    error_type: str | None = None
    """Set by :func:`safe_execute`: the class name of the exception the tool raised, or ``"TimeoutError"``."""
    traceback: str | None = None
    """Set by :func:`safe_execute` for an exception raised in the tool: its traceback (:data:`MAX_TRACEBACK_CHARS`)."""


@runtime_checkable
class ToolProtocol(Protocol):
    """What the registry checks a configured class against (``BaseTool`` satisfies it)."""

    name: str

    def get_openai_tool_schema(self) -> dict[str, Any]: ...

    async def create(self, instance_id: str | None = None, **create_kwargs: Any) -> str: ...

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResponse:
        """May also be a plain ``def`` on a ``BaseTool`` subclass: it then runs on a worker thread."""
        ...

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float: ...

    async def release(self, instance_id: str, **kwargs: Any) -> None: ...


class BaseTool(InstanceState):
    """Base class for tools. Subclasses override ``execute`` and, if they keep state, the rest.

    ``config`` is the YAML entry's ``config:`` mapping; ``tool_schema`` its
    OpenAI function schema (``{"type": "function", "function": {"name", "description", "parameters"}}``).
    The default ``create``/``release`` keep a per-instance dict in ``self._instances``
    holding the ``create_kwargs`` (e.g. ``ground_truth``).
    """

    runs_on_event_loop: ClassVar[bool | None] = None
    """True: this class's methods never block, so they run on the rollout's event loop (cheapest). False: they run
    on a worker thread, a coroutine on an event loop of its own there (fresh per call: keep no loop-bound object,
    such as an ``aiohttp`` session, across calls). None (undeclared): the project's own code runs on the loop,
    anything else on a worker thread. See :func:`call_tool`."""

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any]):
        self.config = dict(config or {})
        self.tool_schema = drop_null_keywords(tool_schema)  # verl dumps write "enum": null
        self.name: str = tool_schema["function"]["name"]
        self._instances: dict[str, dict[str, Any]] = {}
        self._executor: ToolExecutor | None = None

    # -- executor ---------------------------------------------------------
    def bind_executor(self, executor: ToolExecutor) -> None:
        """Run this tool's blocking work on ``executor`` (the rollout's local pool or Ray)."""
        self._executor = executor

    @property
    def executor(self) -> ToolExecutor:
        """The bound executor, or a process-wide local thread pool if none was bound."""
        if self._executor is None:
            self._executor = default_executor()
        return self._executor

    async def run_blocking(self, fn: Any, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Await blocking ``fn(*args, **kwargs)`` on the executor; ``TimeoutError`` after ``timeout`` s.

        Blocking code called directly inside ``execute`` would stall every
        request on the event loop, and no timeout could interrupt it.
        """
        return await self.executor.run(fn, *args, timeout=timeout, **kwargs)

    # -- lifecycle --------------------------------------------------------
    def get_openai_tool_schema(self) -> dict[str, Any]:
        """The schema the chat template renders for the model (``tools=[...]``)."""
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **create_kwargs: Any) -> str:
        """Start per-request state; returns the instance id (a fresh one when none is given)."""
        if instance_id is None:
            instance_id = uuid.uuid4().hex
        self._instances[instance_id] = dict(create_kwargs)
        return instance_id

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResponse:
        """Run one call. ``parameters`` is the call's (already schema-validated) arguments.

        A subclass may define it as a plain ``def`` (blocking code is fine there: it runs on a worker thread).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement execute()")

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The instance's final reward, called once after the request finishes."""
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Free per-request state; safe to call for an unknown or already released id."""
        self._instances.pop(instance_id, None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def error_response(message: str, **metrics: Any) -> ToolResponse:
    """An error observation; ``message`` is what the model reads."""
    return ToolResponse(text=message, is_error=True, metrics=dict(metrics))


MAX_TRACEBACK_CHARS = 4000
"""A recorded traceback keeps its first line and its last frames up to this many characters."""


def format_traceback(exc: BaseException, limit: int = MAX_TRACEBACK_CHARS) -> str:
    """``exc``'s formatted traceback (its chain included), cut in the middle to ``limit`` characters."""
    text = "".join(tb.format_exception(exc)).rstrip("\n")
    if len(text) <= limit:
        return text
    head = text.partition("\n")[0]
    marker = "\n  ...({} characters cut)...\n"
    tail = max(limit - len(head) - len(marker.format(len(text))), 0)
    return head + marker.format(len(text) - len(head) - tail) + text[len(text) - tail :]


def _coerce(tool_name: str, result: Any) -> ToolResponse:
    """Accept a ``ToolResponse``, a bare string, or verl's ``(response, reward, metrics)`` tuple."""
    if isinstance(result, ToolResponse):
        return result
    if isinstance(result, str):
        return ToolResponse(text=result)
    if isinstance(result, tuple) and len(result) == 3:
        resp, reward, metrics = result
        base = _coerce(tool_name, resp)
        base.reward = float(reward)
        base.metrics = {**base.metrics, **dict(metrics or {})}
        return base
    raise TypeError(f"tool {tool_name!r} returned {type(result).__name__}; return a ToolResponse")


async def safe_execute(
    tool: ToolProtocol,
    instance_id: str,
    parameters: dict[str, Any],
    timeout: float | None = None,
    **execute_kwargs: Any,
) -> ToolResponse:
    """``tool.execute`` (through :func:`call_tool`) that never raises for the model's sake.

    An exception becomes ``ToolResponse(is_error=True, text="Error: ...")`` with ``error_type`` (its class
    name) and ``traceback``; running past ``timeout`` seconds cancels the call and becomes a timeout
    observation (``error_type="TimeoutError"``). Time the call spends waiting for an executor slot does not
    count (see :class:`~mcore_agentic.tools.executor.ToolClock`). Cancellation of the caller itself still
    propagates. The timeout holds for blocking tools too, since their code runs on a worker thread; one
    declared to run on the event loop can only be stopped at an ``await``.
    """
    clock = ToolClock(asyncio.get_running_loop())
    token = TOOL_CLOCK.set(clock)
    try:
        task = asyncio.ensure_future(call_tool(tool, "execute", instance_id, parameters, **execute_kwargs))  # inherits the clock
    finally:
        TOOL_CLOCK.reset(token)
    try:
        if not await _within(task, timeout, clock):
            after = f" after {timeout:g} s" if timeout is not None else ""
            return _failure(f"Error: tool '{tool.name}' timed out{after}.", "TimeoutError", timeout=1)
        return _coerce(tool.name, task.result())
    except OrphanLimitError:
        return _failure(
            f"Error: tool '{tool.name}' was not run: too many of its earlier calls timed out and are still running.",
            "TimeoutError", timeout=1,
        )
    except Exception as exc:  # noqa: BLE001 -- any tool failure is an observation, not a crash
        detail = str(exc).strip() or "(no message)"
        return _failure(
            f"Error: tool '{tool.name}' failed: {type(exc).__name__}: {detail}", type(exc).__name__,
            format_traceback(exc), exception=1,
        )


def _failure(message: str, error_type: str, traceback: str | None = None, **metrics: Any) -> ToolResponse:
    response = error_response(message, **metrics)
    response.error_type, response.traceback = error_type, traceback
    return response


async def _within(task: asyncio.Future[Any], timeout: float | None, clock: ToolClock) -> bool:
    """Wait for ``task``; False (and ``task`` cancelled) once it has run ``timeout`` s outside slot waits."""
    if timeout is None:
        await task
        return True
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        while not task.done():
            if clock.waiting:
                resumed = asyncio.ensure_future(clock.resumed().wait())
                try:
                    await asyncio.wait({task, resumed}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    resumed.cancel()
                continue
            now = loop.time()
            remaining = timeout - (now - started - clock.waited_until(now))
            if remaining <= 0:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return False
            await asyncio.wait({task}, timeout=remaining)
    except asyncio.CancelledError:
        task.cancel()
        raise
    task.result()  # re-raise the tool's own exception, if any
    return True


# -- where a tool's code runs -----------------------------------------------------------------------

BLOCKING_WARN_S = 0.25
"""A tool's code holding its thread this long without an ``await`` counts as blocking (warned once per tool)."""

_FIRST_PARTY = __name__.split(".")[0]
_RUNNERS: weakref.WeakKeyDictionary[Any, ThreadRunner] = weakref.WeakKeyDictionary()
_WARNED: set[tuple[str, str, str]] = set()
_WARNED_LOCK = threading.Lock()
logger = logging.getLogger(__name__)


def on_event_loop(tool: Any, method: str) -> bool:
    """Whether ``tool.<method>`` runs on the rollout's event loop (else on a worker thread).

    The tool's ``runs_on_event_loop`` decides when it declares it; undeclared, the method runs on the loop
    exactly when its code is this package's own (``BaseTool``'s defaults, the shipped tools: reviewed to
    hand blocking work to ``run_blocking``). A user's subclass of a shipped tool that overrides a method gets
    that method run on a thread.
    """
    declared = getattr(tool, "runs_on_event_loop", None)
    if declared is not None:
        return bool(declared)
    module = getattr(getattr(type(tool), method, None), "__module__", None) or ""
    return module.split(".")[0] == _FIRST_PARTY


async def call_tool(tool: Any, method: str, /, *args: Any, **kwargs: Any) -> Any:
    """``tool.<method>(*args, **kwargs)``, awaited, where it belongs (:func:`on_event_loop`).

    On the loop, each step of the call is timed: one that holds the loop :data:`BLOCKING_WARN_S` or longer
    is warned about once per tool. Off the loop the call runs on the tool's
    :class:`~mcore_agentic.tools.thread_runner.ThreadRunner` (a plain ``def`` is called there, a coroutine runs on
    its own loop there); a caller that stops waiting (a timeout) orphans the thread, at most
    :data:`~mcore_agentic.tools.thread_runner.MAX_ORPHANED_THREADS` per tool.
    """
    fn = getattr(tool, method)
    if on_event_loop(tool, method):
        started = time.perf_counter()
        result = fn(*args, **kwargs)
        if not inspect.isawaitable(result):
            _held_loop(tool, method, time.perf_counter() - started)
            return result
        return await timed_steps(result, functools.partial(_held_loop, tool, method))
    plain = not inspect.iscoroutinefunction(fn)
    return await _runner(tool).run(fn, args, kwargs, on_step=functools.partial(_held_thread, tool, method, plain))


def _label(tool: Any) -> str:
    return f"tool {getattr(tool, 'name', '?')!r} ({type(tool).__module__}.{type(tool).__qualname__})"


def _runner(tool: Any) -> ThreadRunner:
    try:
        runner = _RUNNERS.get(tool)
        if runner is None:
            runner = _RUNNERS[tool] = ThreadRunner(_label(tool))
        return runner
    except TypeError:  # not weak-referenceable: a runner per call (no orphan bound shared across its calls)
        return ThreadRunner(_label(tool))


def _warn_once(tool: Any, kind: str, message: str, *args: Any) -> None:
    key = (kind, getattr(tool, "name", "?"), type(tool).__qualname__)
    with _WARNED_LOCK:
        if key in _WARNED:
            return
        _WARNED.add(key)
    logger.warning(message, *args)


def _held_loop(tool: Any, method: str, seconds: float) -> None:
    if seconds < BLOCKING_WARN_S:
        return
    why = "declares runs_on_event_loop = True" if getattr(tool, "runs_on_event_loop", None) else "is this package's code"
    _warn_once(
        tool, "loop",
        "%s held the rollout's event loop for %.2f s in %s() without an await: every other request waited, and "
        "rollout.multi_turn.tool_timeout cannot stop it. It %s; move its blocking work to `await "
        "self.run_blocking(...)`, or set runs_on_event_loop = False so it runs on a worker thread",
        _label(tool), seconds, method, why,
    )


def _held_thread(tool: Any, method: str, plain: bool, seconds: float) -> None:
    if seconds < BLOCKING_WARN_S:
        return
    how = "a plain def" if plain else "blocking code inside async def"
    _warn_once(
        tool, "thread",
        "%s blocked for %.2f s in %s() (%s). It runs on a worker thread, so other requests go on and "
        "rollout.multi_turn.tool_timeout still answers the model in time; but a timed-out call cannot be stopped "
        "and keeps its thread until it returns (at most %d such threads per tool, then its calls are refused). "
        "To run it on the event loop instead, await non-blocking I/O or `self.run_blocking(...)` and declare "
        "runs_on_event_loop = True",
        _label(tool), seconds, method, how, MAX_ORPHANED_THREADS,
    )
