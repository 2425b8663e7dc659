"""An agent program for the default meter-reading task, written with the plain ``openai`` client.

It is what a user brings: its own loop, its own tool, its own reward. The trainer runs it once per sample
against that sample's session of the endpoint (``rollout.agent.entrypoint=examples/meter_agent.py:run``):

    make train ARGS="rollout.agent.entrypoint=examples/meter_agent.py:run rollout.multi_turn.tool_config_path=null"

The model may call ``read_meter`` (the reading is in the row, where only this program looks); the program
answers the call and asks again until the model replies without a call, then pays 1 for ``#### <exact reading>``.
Run it by hand against a standalone endpoint (``python -m mcore_agentic.endpoint serve``) the same way.
"""

from __future__ import annotations

import json
import re
from typing import Any

from openai import AsyncOpenAI

READ_METER = {"type": "function", "function": {"name": "read_meter", "description": "Read the meter.",
                                               "parameters": {"type": "object", "properties": {}, "required": []}}}
MAX_TURNS = 2


async def run(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    reading = row["extra_info"]["tools_kwargs"]["read_meter"]["create_kwargs"]["reading"]
    messages: list[dict[str, Any]] = list(row["prompt"])
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        for _ in range(MAX_TURNS):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=[READ_METER])
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls or reply.choices[0].finish_reason == "length":
                break
            for call in message.tool_calls:
                known = call.function.name == "read_meter"
                result = str(reading) if known else f"Error: no tool named {call.function.name!r}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    final = messages[-1].get("content") if messages[-1]["role"] == "assistant" else None
    match = re.search(r"####\s*(-?\d+)", final or "")
    return 1.0 if match and int(match.group(1)) == int(reading) else 0.0


if __name__ == "__main__":  # the command form: OPENAI_BASE_URL / OPENAI_API_KEY set, the row on stdin
    import asyncio
    import os
    import sys

    row = json.load(sys.stdin)
    print(asyncio.run(run(os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"], row)))
