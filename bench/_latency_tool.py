"""The default task's meter with a tool latency drawn from a log-normal (a long tail of slow environments), for
``bench/disaggregated.py``. The latency depends only on the conversation's meter instance, so every mode of the
bench waits the same for the same request."""

from __future__ import annotations

import asyncio
import hashlib
import random
from typing import Any

from mcore_agentic.tools.base import ToolResponse
from mcore_agentic.tools.meter import MeterTool


class SlowMeterTool(MeterTool):
    """``config``: ``median_s`` (0.3), ``sigma`` (1.0), ``max_s`` (8.0) of the latency of each call."""

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResponse:
        c = self.config
        seed = int.from_bytes(hashlib.sha256(str(self._instances.get(instance_id, {}).get("reading", instance_id))
                                             .encode() + instance_id.encode()).digest()[:8], "big")
        median, sigma = float(c.get("median_s", 0.3)), float(c.get("sigma", 1.0))
        latency = min(random.Random(seed).lognormvariate(0.0, sigma) * median, float(c.get("max_s", 8.0)))
        await asyncio.sleep(latency)
        return await super().execute(instance_id, parameters, **execute_kwargs)
