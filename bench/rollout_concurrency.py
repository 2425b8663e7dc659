"""Request-level async rollout vs batch-synchronous rollout, with tools of random latency.

Both modes run the real driver and agent loop (``generate_sequences``) on the same
requests. The engine is a stand-in with a fixed per-call latency (a server with
continuous batching: one request's latency does not depend on the others); every
request makes ``--turns`` tool calls whose latency is drawn from an exponential
distribution (seeded, the same draws in both modes).

* ``async`` (ours): each request proceeds as soon as its own tool returns;
* ``sync`` (baseline): all requests of a turn wait for the slowest one before any
  of them generates again (a barrier per turn, as in batch-level rollout).

Usage: ``python bench/rollout_concurrency.py [--requests 64] [--turns 3] [--tool-ms 100] [--gen-ms 30]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from mcore_agentic.models.tokenizer import load_qwen_tokenizer
from mcore_agentic.rollout.config import MultiTurnConfig, RolloutConfig
from mcore_agentic.rollout.driver import generate_sequences
from mcore_agentic.rollout.engines.base import GenerationOutput, SamplingParams
from mcore_agentic.tools.base import BaseTool, ToolResponse


class LatencyTool(BaseTool):
    """Sleeps a pre-drawn latency per (request, call), so both modes see the same draws."""

    def __init__(self, latencies: dict[str, list[float]]):
        schema = {"type": "function", "function": {"name": "lookup", "description": "slow lookup",
                                                   "parameters": {"type": "object", "properties": {"key": {"type": "string"}}}}}
        super().__init__({}, schema)
        self.latencies = latencies

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kw: Any) -> ToolResponse:
        await asyncio.sleep(self.latencies[parameters["key"]].pop(0))
        return ToolResponse(text="found")


class TimedEngine:
    """Replies with a tool call for ``turns`` turns, then an answer; each call takes ``gen_s``.

    With ``lockstep`` every generate call of turn k > 0 waits at a barrier until all requests reach
    turn k (the batch-synchronous baseline).
    """

    def __init__(self, tokenizer: Any, turns: int, gen_s: float, requests: int, lockstep: bool):
        self.tok = tokenizer
        self.turns = turns
        self.gen_s = gen_s
        self.eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.barriers = [asyncio.Barrier(requests) for _ in range(turns + 1)] if lockstep else None
        self.weight_version = 0

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        text = self.tok.decode(prompt_ids)
        turn = text.count("<|im_start|>assistant\n") - 1
        if self.barriers is not None and turn > 0:
            await self.barriers[turn].wait()
        await asyncio.sleep(self.gen_s)
        key = text.split("request-", 1)[1].split(" ", 1)[0]
        if turn < self.turns:
            body = json.dumps({"name": "lookup", "arguments": {"key": key}})
            reply = f"<tool_call>\n{body}\n</tool_call>"
        else:
            reply = "done"
        ids = self.tok.encode(reply, add_special_tokens=False) + [self.eot]
        return GenerationOutput(ids, [-1.0] * len(ids), "stop")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None: ...
    def finish_weight_update(self, version: int) -> None: ...
    def release_memory(self) -> None: ...
    def resume_memory(self, tags: Sequence[str] | None = None) -> None: ...
    def flush_cache(self) -> None: ...


def draws(requests: int, turns: int, mean_s: float, seed: int) -> dict[str, list[float]]:
    rng = random.Random(seed)
    return {str(i): [rng.expovariate(1 / mean_s) for _ in range(turns)] for i in range(requests)}


async def one_run(tok, args, lockstep: bool) -> tuple[float, Any]:
    rows = [{"prompt": [{"role": "user", "content": f"request-{i} please look it up"}]} for i in range(args.requests)]
    tool = LatencyTool(draws(args.requests, args.turns, args.tool_ms / 1e3, seed=0))
    engine = TimedEngine(tok, args.turns, args.gen_ms / 1e3, args.requests, lockstep)
    cfg = RolloutConfig(prompt_length=512, response_length=1024,
                        multi_turn=MultiTurnConfig(max_assistant_turns=args.turns + 1, tokenization_sanity_check_mode="disable"))
    start = time.perf_counter()
    batch = await generate_sequences(rows, engine, {"lookup": tool}, None, cfg, tok)
    return time.perf_counter() - start, batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tool-ms", type=float, default=100.0, help="mean tool latency (exponential)")
    ap.add_argument("--gen-ms", type=float, default=30.0, help="engine latency per generate call")
    args = ap.parse_args()
    tok = load_qwen_tokenizer("qwen2_5", vocab_size=4096)
    sync_s, sync_batch = asyncio.run(one_run(tok, args, lockstep=True))
    async_s, async_batch = asyncio.run(one_run(tok, args, lockstep=False))
    assert sync_batch.info["rollout/tool_calls"] == async_batch.info["rollout/tool_calls"] == args.requests * args.turns
    ideal = (args.turns + 1) * args.gen_ms / 1e3 + max(sum(v) for v in draws(args.requests, args.turns, args.tool_ms / 1e3, 0).values())
    print(f"requests={args.requests} turns={args.turns} tool latency ~ Exp(mean {args.tool_ms:.0f} ms) gen {args.gen_ms:.0f} ms/call")
    print(f"{'mode':>14} {'wall s':>8}")
    print(f"{'batch-sync':>14} {sync_s:>8.2f}")
    print(f"{'request-async':>14} {async_s:>8.2f}")
    print(f"{'lower bound':>14} {ideal:>8.2f}   (slowest request's own tools + generation)")
    print(f"speed-up async vs batch-sync: {sync_s / async_s:.2f}x")


if __name__ == "__main__":
    main()
