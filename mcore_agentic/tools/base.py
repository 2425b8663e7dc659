"""The tool plug-in interface: ``BaseTool``, its result ``ToolResponse``, and ``safe_execute``.

A tool lives for the whole run; each rollout request gets its own *instance*
(``create`` -> ``execute``* -> ``calc_reward`` -> ``release``), keyed by an
``instance_id`` the caller keeps. Tools are named by class path in YAML (see
``registry.load_tools``), the format verl users know.

Contract with the rollout loop:

* a model's bad call must never crash the batch. Shipped tools return
  ``ToolResponse(is_error=True)`` on bad parameters; for any other tool the
  loop calls :func:`safe_execute`, which turns exceptions and timeouts into an
  error observation;
* blocking work (running code, scoring) goes through ``self.executor``
  (:mod:`mcore_agentic.tools.executor`), so the event loop that drives many
  requests at once is never blocked.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from mcore_agentic.tools.executor import TOOL_CLOCK, ToolClock, ToolExecutor, default_executor
from mcore_agentic.tools.schema import drop_null_keywords
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


@runtime_checkable
class ToolProtocol(Protocol):
    """What the registry checks a configured class against (``BaseTool`` satisfies it)."""

    name: str

    def get_openai_tool_schema(self) -> dict[str, Any]: ...

    async def create(self, instance_id: str | None = None, **create_kwargs: Any) -> str: ...

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResponse: ...

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float: ...

    async def release(self, instance_id: str, **kwargs: Any) -> None: ...


class BaseTool(InstanceState):
    """Base class for tools. Subclasses override ``execute`` and, if they keep state, the rest.

    ``config`` is the YAML entry's ``config:`` mapping; ``tool_schema`` its
    OpenAI function schema (``{"type": "function", "function": {"name", "description", "parameters"}}``).
    The default ``create``/``release`` keep a per-instance dict in ``self._instances``
    holding the ``create_kwargs`` (e.g. ``ground_truth``).
    """

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
        """Run one call. ``parameters`` is the call's (already schema-validated) arguments."""
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
    """``tool.execute`` that never raises for the model's sake.

    An exception becomes ``ToolResponse(is_error=True, text="Error: ...")``;
    running past ``timeout`` seconds cancels the call and becomes a timeout
    observation. Time the call spends waiting for an executor slot does not
    count (see :class:`~mcore_agentic.tools.executor.ToolClock`). Cancellation
    of the caller itself still propagates. The timeout can only fire at an
    ``await``: a tool that blocks inside ``execute`` must move that work to
    ``run_blocking`` / its executor.
    """
    clock = ToolClock()
    token = TOOL_CLOCK.set(clock)
    try:
        task = asyncio.ensure_future(tool.execute(instance_id, parameters, **execute_kwargs))  # inherits the clock
    finally:
        TOOL_CLOCK.reset(token)
    try:
        if not await _within(task, timeout, clock):
            after = f" after {timeout:g} s" if timeout is not None else ""
            return error_response(f"Error: tool '{tool.name}' timed out{after}.", timeout=1)
        return _coerce(tool.name, task.result())
    except Exception as exc:  # noqa: BLE001 -- any tool failure is an observation, not a crash
        detail = str(exc).strip() or "(no message)"
        return error_response(f"Error: tool '{tool.name}' failed: {type(exc).__name__}: {detail}", exception=1)


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
