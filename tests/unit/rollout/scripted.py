"""Test inputs for the agent loop: an engine that replies with scripted text, and small tools.

The scripted engine is a real ``RolloutEngine``: it reads the prompt ids it is given,
picks the script whose key occurs in the prompt, and answers turn ``k`` (counted from
the assistant headers in the prompt) with the tokenization of the scripted text plus
the end-of-turn token. It is a test input that lets the loop see well-formed,
malformed and unknown tool calls deterministically, which a random model rarely emits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from mcore_agentic.rollout.engines.base import GenerationOutput, SamplingParams
from mcore_agentic.tools.base import BaseTool, ToolResponse

ASSISTANT_HEADER = "<|im_start|>assistant"


def scripted_routing(fed: list[int], call: int) -> np.ndarray:
    """``[len(fed), 2, 2]`` int16 "experts" naming each fed token: its id and position, and the engine call."""
    pos = np.arange(len(fed))
    ids = np.asarray(fed)
    return np.stack([np.stack([ids % 30000, pos], -1), np.stack([pos, np.full_like(pos, call)], -1)], 1).astype(np.int16)


class ScriptedEngine:
    """Answers from ``scripts[key][turn]`` where ``key`` is found in the decoded prompt."""

    def __init__(self, tokenizer: Any, scripts: dict[str, list[str]], *, fail_on: str | None = None, delay: float = 0.0,
                 routing: bool = False):
        self.tokenizer = tokenizer
        self.routing = routing
        """Also return ``routed_experts`` (2 layers x top-2) that name each fed token: see :func:`scripted_routing`."""
        self.scripts = scripts
        self.fail_on = fail_on
        self.delay = delay
        self.eot_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.weight_version = 0
        self.prompts: list[list[int]] = []
        self.calls = 0

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        self.calls += 1
        self.prompts.append(list(prompt_ids))
        if self.delay:
            await asyncio.sleep(self.delay)
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        if self.fail_on is not None and self.fail_on in text:
            raise RuntimeError(f"scripted engine failure for {self.fail_on!r}")
        key = next((k for k in self.scripts if k in text), None)
        if key is None:
            raise KeyError(f"no script matches prompt {text[-200:]!r}")
        # the system prompt may hold an example header; count headers that open a turn
        turn = text.count(ASSISTANT_HEADER + "\n") - 1
        replies = self.scripts[key]
        reply = replies[min(turn, len(replies) - 1)]
        ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.eot_id]
        skip = params.draws_before  # a cut turn goes on: its first ids end the prompt
        if skip and list(prompt_ids[-skip:]) != ids[:skip]:
            raise AssertionError(f"a continued turn's prompt does not end with its first {skip} ids")
        ids = ids[skip:]
        finish = "stop"
        if len(ids) > params.max_new_tokens:
            ids, finish = ids[: params.max_new_tokens], "length"
        # distinct, recognisable logprobs: -(1 + position in the turn / 100)
        routed = scripted_routing(list(prompt_ids) + ids[:-1], self.calls) if self.routing else None
        return GenerationOutput(ids, [-(1.0 + (skip + i) / 100) for i in range(len(ids))], finish, routed_experts=routed)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        raise NotImplementedError("scripted engine has no weights")

    def finish_weight_update(self, version: int) -> None:
        self.weight_version = version

    def release_memory(self) -> None: ...

    def resume_memory(self, tags: Sequence[str] | None = None) -> None: ...

    def flush_cache(self) -> None: ...


def _schema(name: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"test tool {name}",
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


class AddTool(BaseTool):
    """Adds two integers; step reward 0.1; final reward 1.0 if ``ground_truth`` was produced."""

    created: list[str] = []
    released: list[str] = []

    def __init__(self, name: str = "add"):
        super().__init__({}, _schema(name, {"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"]))
        self.executions = 0
        self.results: dict[str, list[int]] = {}

    async def create(self, instance_id: str | None = None, **create_kwargs: Any) -> str:
        iid = await super().create(instance_id, **create_kwargs)
        self.created.append(iid)
        self.results[iid] = []
        return iid

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kw: Any) -> ToolResponse:
        self.executions += 1
        value = int(parameters["a"]) + int(parameters["b"])
        self.results[instance_id].append(value)
        return ToolResponse(text=str(value), reward=0.1)

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        target = self._instances[instance_id].get("ground_truth")
        return 1.0 if target is not None and int(target) in self.results[instance_id] else 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self.released.append(instance_id)
        await super().release(instance_id, **kwargs)


class RaisingTool(BaseTool):
    def __init__(self) -> None:
        super().__init__({}, _schema("explode", {}, []))

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kw: Any) -> ToolResponse:
        raise ZeroDivisionError("boom")


class SleepTool(BaseTool):
    """Sleeps ``seconds`` (async); records when each call ran, to check concurrency and timeouts."""

    def __init__(self, name: str = "sleep") -> None:
        super().__init__({}, _schema(name, {"seconds": {"type": "number"}}, ["seconds"]))
        self.spans: list[tuple[float, float]] = []

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kw: Any) -> ToolResponse:
        start = time.perf_counter()
        await asyncio.sleep(float(parameters["seconds"]))
        self.spans.append((start, time.perf_counter()))
        return ToolResponse(text="slept")


def call(name: str, **arguments: Any) -> str:
    """A well-formed hermes tool call as a model would write it."""
    import json

    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'
