"""Agent programs through the session endpoint vs the built-in agent loop, on the same engine and sampled tokens.

Both modes roll out ``--sessions`` conversations of ``--turns`` assistant turns each: ``turns - 1`` tool calls,
then an answer. The engine is a stand-in with a fixed per-call latency (a server with continuous batching) that
replies by turn number, so both modes sample the same tokens.

* ``built-in loop``: the product's agent loop (``generate_sequences``) with a tool in the tools registry;
* ``endpoint``: the same rollout through :class:`~mcore_agentic.endpoint.source.AgentSource`: an agent program
  per sample, written with the plain ``openai`` client (``AsyncOpenAI``, Chat Completions), running the same
  tool itself; every request goes over HTTP to the session endpoint (uvicorn, loopback), is matched against
  the session and delta-tokenized there.

Reported: trajectories/s of each and their ratio, and the latency the endpoint adds per request (the client's
round trip minus the engine's time per call, a fixed sleep whose median is taken): p50 / p99 in ms. Both modes' trajectories are checked
equal (ids and loss masks), so the comparison is like for like.

Usage: ``python bench/agent_endpoint.py [--sessions 64] [--turns 8] [--gen-ms 20]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from mcore_agentic.endpoint.source import AgentSource
from mcore_agentic.models.tokenizer import load_qwen_tokenizer
from mcore_agentic.rollout.config import AgentConfig, MultiTurnConfig, RolloutConfig
from mcore_agentic.rollout.driver import generate_sequences, run_sync
from mcore_agentic.rollout.engines.base import GenerationOutput, SamplingParams
from mcore_agentic.rollout.tokenization import ChatTokenizer
from mcore_agentic.tools.base import BaseTool, ToolResponse

LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "Look a key up.",
                                           "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                                                          "required": ["key"]}}}
CLIENT_LATENCIES: list[tuple[int, float]] = []
"""(turn, seconds) of every request a program sent."""


class LookupTool(BaseTool):
    def __init__(self) -> None:
        super().__init__({}, LOOKUP)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kw: Any) -> ToolResponse:
        return ToolResponse(text=f"value of {parameters['key']}")


class TurnEngine:
    """Replies to turn ``k`` (counted from the assistant headers in the prompt) with a lookup call while
    ``k < turns - 1``, then an answer; each call takes ``gen_s``. Records each call's duration."""

    def __init__(self, tok: Any, turns: int, gen_s: float):
        self.tok, self.turns, self.gen_s = tok, turns, gen_s
        self.eot = tok.convert_tokens_to_ids("<|im_end|>")
        self.header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
        self.weight_version = 0
        self.durations: list[float] = []

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        started = time.perf_counter()
        await asyncio.sleep(self.gen_s)
        h0, h1 = self.header[0], self.header[1]  # <|im_start|> assistant
        turn = sum(1 for a, b in zip(prompt_ids, prompt_ids[1:]) if a == h0 and b == h1) - 1
        if turn < self.turns - 1:
            text = '<tool_call>\n' + json.dumps({"name": "lookup", "arguments": {"key": f"k{turn}"}}) + '\n</tool_call>'
        else:
            text = "The values are found."
        ids = self.tok.encode(text, add_special_tokens=False) + [self.eot]
        self.durations.append(time.perf_counter() - started)
        return GenerationOutput(ids, [-1.0] * len(ids), "stop")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None: ...

    def finish_weight_update(self, version: int) -> None: ...

    def release_memory(self) -> None: ...

    def resume_memory(self, tags: Sequence[str] | None = None) -> None: ...

    def flush_cache(self) -> None: ...


async def lean_program(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    """The same agent program over a plain ``httpx`` client: JSON in, JSON out."""
    import httpx

    messages = list(row["prompt"])
    headers = {"Authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=60) as client:
        while True:
            sent = time.perf_counter()
            r = await client.post("/chat/completions", json={"model": "policy", "messages": messages, "tools": [LOOKUP]})
            CLIENT_LATENCIES.append((len(messages), time.perf_counter() - sent))
            message = r.json()["choices"][0]["message"]
            messages.append({k: v for k, v in message.items() if v is not None})
            if not message.get("tool_calls"):
                return 1.0
            for call in message["tool_calls"]:
                key = json.loads(call["function"]["arguments"])["key"]
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"value of {key}"})


async def program(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    """The agent program: the plain openai client, its own loop and tool."""
    from openai import AsyncOpenAI

    messages = list(row["prompt"])
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        while True:
            sent = time.perf_counter()
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=[LOOKUP])
            CLIENT_LATENCIES.append((len(messages), time.perf_counter() - sent))
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return 1.0
            for call in message.tool_calls:
                key = json.loads(call.function.arguments)["key"]
                messages.append({"role": "tool", "tool_call_id": call.id, "content": f"value of {key}"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--gen-ms", type=float, default=20.0)
    args = ap.parse_args()
    tok = load_qwen_tokenizer("qwen2_5", vocab_size=4096)
    rows = [{"prompt": [{"role": "system", "content": "Look things up."}, {"role": "user", "content": f"Task {i}."}]}
            for i in range(args.sessions)]
    base = dict(prompt_length=1024, response_length=4096, multi_turn=MultiTurnConfig(max_assistant_turns=args.turns))

    engine = TurnEngine(tok, args.turns, args.gen_ms / 1000)
    cfg = RolloutConfig(**base)
    started = time.perf_counter()
    loop_batch = run_sync(generate_sequences(rows, engine, {"lookup": LookupTool()}, None, cfg, tok))
    loop_s = time.perf_counter() - started

    n = len(rows)
    print(f"sessions={n} turns={args.turns} engine {args.gen_ms:.0f} ms/call")
    print(f"{'mode':>26} {'wall s':>7} {'traj/s':>7} {'ratio':>6} {'same':>5} {'added p50/p99 ms':>17} "
          f"{'after turn 1':>17} {'server CPU':>10} {'client CPU':>10}")
    print(f"{'built-in loop':>26} {loop_s:>7.2f} {n / loop_s:>7.1f} {1.0:>6.2f}")
    for label, entry in (("endpoint, httpx client", "lean_program"), ("endpoint, openai client", "program")):
        CLIENT_LATENCIES.clear()
        engine = TurnEngine(tok, args.turns, args.gen_ms / 1000)
        cfg = RolloutConfig(**base, agent=AgentConfig(entrypoint=f"__main__:{entry}", max_concurrent=args.sessions))
        source = AgentSource(cfg, engine, ChatTokenizer(tok), version=lambda: 0)
        _ = source.url  # the server starts once per run, not per rollout
        server_cpu = _thread_cpu(source.server._thread)
        started, main_cpu = time.perf_counter(), time.thread_time()
        batch = source.roll_out(rows, cfg)
        wall, client_cpu = time.perf_counter() - started, time.thread_time() - main_cpu
        server_cpu = _thread_cpu(source.server._thread) - server_cpu
        source.close()
        same = (torch.equal(loop_batch["input_ids"], batch["input_ids"])
                and torch.equal(loop_batch["response_mask"], batch["response_mask"])
                and not any(m.get("state") == "failed" for m in batch["request_metrics"]))
        engine_s = statistics.median(engine.durations)  # a fixed sleep per call: the same for every request
        first = min(k for k, _ in CLIENT_LATENCIES)
        added = sorted(1000 * (c - engine_s) for _, c in CLIENT_LATENCIES)
        later = sorted(1000 * (c - engine_s) for k, c in CLIENT_LATENCIES if k > first)
        requests = len(CLIENT_LATENCIES)
        print(f"{label:>26} {wall:>7.2f} {n / wall:>7.1f} {loop_s / wall:>6.2f} {str(same):>5} "
              f"{_p(added, 50):>8.1f}/{_p(added, 99):<8.1f} {_p(later, 50):>8.1f}/{_p(later, 99):<8.1f} "
              f"{1000 * server_cpu / requests:>10.2f} {1000 * client_cpu / requests:>10.2f}")
    print("ratio: trajectories/s vs the built-in loop; same: trajectories identical to the loop's; added: a request's "
          "round trip less the engine's time, every request and from the second turn on (the first turn waits behind "
          "64 clients being built on the programs' event loop); CPU: ms per request of the endpoint's thread (HTTP, "
          "matching, tokenization) and of the programs (same process, same interpreter lock)")


def _p(values: list[float], q: int) -> float:
    return values[min(len(values) - 1, int(q / 100 * len(values)))] if values else float("nan")


def _thread_cpu(thread: Any) -> float:
    """CPU seconds a thread has used (Linux: its /proc stat), 0 where unreadable."""
    import os

    try:
        with open(f"/proc/self/task/{thread.native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


if __name__ == "__main__":
    main()
