"""``MeterTool``: reads a meter whose value only the environment knows (the embedded default's tool).

Each rollout request gets its own meter: ``create(instance_id, reading=<int>)`` (the row's
``extra_info.tools_kwargs.read_meter.create_kwargs``) stores the value, ``execute`` returns it
as text. The model cannot know the reading without calling the tool, so a right answer is
evidence of a tool call whose result the model read. Takes no arguments.

Several meters (``readings=[a, b, ...]``, the ``meter_pair`` task): each call reads the next meter, and a call
after the last one is an error observation. ``config.step_reward`` (default 0) is the step reward of each call
that reads a meter not read before: a per-turn reward for each correct read.
"""

from __future__ import annotations

from typing import Any

from mcore_agentic.tools.base import BaseTool, ToolResponse, error_response


class MeterTool(BaseTool):
    """No parameters; returns this request's reading, e.g. ``"47"`` (with ``readings``: the next meter's)."""

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResponse:
        state = self._instances.get(instance_id)
        if state is not None and "readings" in state:
            done = state.setdefault("read", 0)
            if done >= len(state["readings"]):
                return error_response(f"Error: all {done} meters have been read.")
            state["read"] = done + 1
            return ToolResponse(text=str(state["readings"][done]), reward=float(self.config.get("step_reward", 0.0)))
        if state is None or "reading" not in state:
            return error_response(f"Error: tool '{self.name}' has no meter for this conversation.")
        return ToolResponse(text=str(state["reading"]))
