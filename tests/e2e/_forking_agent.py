"""An agent program whose every episode forks: after the first tool result it drops the system message (a
compaction), so its session makes a second sample. The default meter task otherwise, as ``examples/meter_agent.py``."""

from __future__ import annotations

import re
from typing import Any

from openai import AsyncOpenAI

READ_METER = {"type": "function", "function": {"name": "read_meter", "description": "Read the meter.",
                                               "parameters": {"type": "object", "properties": {}, "required": []}}}


async def run(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    reading = row["extra_info"]["tools_kwargs"]["read_meter"]["create_kwargs"]["reading"]
    messages: list[dict[str, Any]] = list(row["prompt"])
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        for _ in range(2):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=[READ_METER])
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls or reply.choices[0].finish_reason == "length":
                break
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(reading)})
            messages = [m for m in messages if m["role"] != "system"]  # the compaction: a new sample from here
    final = messages[-1].get("content") if messages[-1]["role"] == "assistant" else None
    match = re.search(r"####\s*(-?\d+)", final or "")
    return 1.0 if match and int(match.group(1)) == int(reading) else 0.0
