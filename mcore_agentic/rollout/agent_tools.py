"""One assistant turn's tool calls in the agent loop (:mod:`~mcore_agentic.rollout.agent_loop`): each validated
against the request's tools and run (at most ``max_parallel_calls``, concurrently) through ``safe_execute``, or
answered with an error observation; their tool messages, rewards and ``tool_log`` entries. A mixin of
:class:`~mcore_agentic.rollout.agent_loop.AgentSession`, whose request, tool instances and settings it reads."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from mcore_agentic.rollout.tool_parser import ToolCall, ToolCallError, validate_tool_call
from mcore_agentic.tools.base import ToolResponse, error_response, safe_execute


class ToolCalls:
    """:class:`~mcore_agentic.rollout.agent_loop.AgentSession`'s tool calling (a mixin: it uses the session's
    ``req``, ``mt`` and ``instances``)."""

    async def _run_tools(self, calls: list[ToolCall | ToolCallError]) -> list[dict[str, Any]]:
        """Tool messages for ``calls``, in order; at most ``max_parallel_calls`` run, concurrently."""
        limit = self.mt.max_parallel_calls
        tools = {name: inst.tool for name, inst in self.instances.items()}
        started = time.perf_counter()

        async def one(index: int, call: ToolCall | ToolCallError) -> tuple[str | None, ToolResponse, float]:
            began = time.perf_counter()
            name, response = await run(index, call)
            return name, response, time.perf_counter() - began

        async def run(index: int, call: ToolCall | ToolCallError) -> tuple[str | None, ToolResponse]:
            if isinstance(call, ToolCallError):
                return call.name, _bad_call(call.message, "malformed_call")
            if index >= limit:
                return call.name, _bad_call(
                    f"Error: at most {limit} tool calls run per turn; call {index + 1} ('{call.name}') was not run.",
                    "too_many_calls",
                )
            problem = validate_tool_call(call, tools)
            if problem is not None:
                return call.name, _bad_call(problem.message, "unknown_tool" if call.name not in tools else "invalid_arguments")
            inst = self.instances[call.name]
            response = await safe_execute(
                inst.tool,
                inst.instance_id,
                call.arguments,
                self.mt.tool_timeout,
                **(inst.kwargs.get("execute_kwargs") or {}),
            )
            return call.name, response

        if len(calls) == 1:  # the common case, without a task per call
            results = [await one(0, calls[0])]
        else:
            results = await asyncio.gather(*(one(i, c) for i, c in enumerate(calls)))
        self.req.metrics.tool_seconds += time.perf_counter() - started
        messages = []
        for call, (name, response, seconds) in zip(calls, results):
            self.req.metrics.tool_calls += 1
            self.req.metrics.tool_errors += int(response.is_error)
            if name in self.instances:
                self.req.tool_rewards[name] = self.req.tool_rewards.get(name, 0.0) + float(response.reward)
                if self.req.turn_tool_rewards:
                    self.req.turn_tool_rewards[-1] += float(response.reward)
            content = _clip(response.text, self.mt.max_tool_response_length)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
            error_type = response.error_type or ("tool_error" if response.is_error else None)
            self.req.tool_log.append({
                "turn": self.req.metrics.assistant_turns,
                "name": name,
                "arguments": json.dumps(call.arguments) if isinstance(call, ToolCall) else call.raw,
                "result": content,
                "error": bool(response.is_error),
                "seconds": seconds,
                "error_type": error_type,
                "traceback": response.traceback,
            })
        return messages


def _bad_call(message: str, kind: str) -> ToolResponse:
    """The error observation of a call the model got wrong; ``kind`` is its ``tool_log`` ``error_type``."""
    response = error_response(message)
    response.error_type = kind
    return response


def _clip(text: str, limit: int) -> str:
    """``text`` cut in the middle to ``limit`` characters (0 keeps it whole)."""
    if limit <= 0 or len(text) <= limit:
        return text
    marker = "...(truncated)..."
    keep = max(limit - len(marker), 0)
    return text[: keep - keep // 2] + marker + text[len(text) - keep // 2 :]


__all__ = ["ToolCalls"]
