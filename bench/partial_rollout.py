"""Partial rollouts vs waiting for every request, on a long-tailed turn-count workload.

One process, the real agent loop, tokenizer, tool parser and :class:`RolloutBuffer`; the engine replays
scripted calculator conversations (``bench/tool_loop_workload.py``) and takes ``--turn-ms`` per assistant
turn, the tool ``--tool-ms`` per call (``asyncio.sleep``: what a decode and a sandboxed tool cost, without
the compute that would drown a 2-core machine). A fraction ``--long-fraction`` of the prompts needs
``--long-factor`` times the turns of the others: the long tail of agentic RL.

Both modes train ``--prompts`` groups of ``--n`` samples per step for ``--steps`` steps from the same
prompt stream:

* **wait** — the baseline (what the trainer does without ``rollout.partial_rollout``): each step rolls out
  one batch of prompts and waits for every request;
* **partial** — ``rollout.partial_rollout`` as :class:`mcore_agentic.feed.partial_rounds.PartialRounds` runs it for one rollout
  group: a step starts a new batch (and more while fewer than ``1 + --over-sampling`` batches of groups
  are in flight), runs rounds of at most ``--budget`` turns per request until ``--prompts`` groups are
  complete, and trains the oldest complete ones; the rest stay paused in the buffer.

Prints wall seconds per step, trajectories trained per second and the partial / wait ratio, and counts
samples: every started request must be trained exactly once or still be in the buffer (lost = 0,
duplicated = 0), and the age (in steps) of the oldest trained token.

    python bench/partial_rollout.py
    python bench/partial_rollout.py --long-fraction 0.1 --budget 3
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.tool_loop_workload import SCHEMA, CalculatorTool, ReplayEngine, conversation  # noqa: E402
from mcore_agentic.models.tokenizer import load_qwen_tokenizer  # noqa: E402
from mcore_agentic.rollout.config import MultiTurnConfig, RolloutConfig  # noqa: E402
from mcore_agentic.rollout.driver import close_context, generate_sequences, rollout_context  # noqa: E402
from mcore_agentic.rollout.engines.base import GenerationOutput, SamplingParams  # noqa: E402
from mcore_agentic.rollout.partial import RolloutBuffer  # noqa: E402
from mcore_agentic.rollout.tokenization import ChatTokenizer  # noqa: E402
from mcore_agentic.tools.base import ToolResponse  # noqa: E402


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompts", type=int, default=16, help="prompt groups trained per step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--turns", type=int, default=2, help="tool-calling turns of an ordinary request")
    p.add_argument("--long-fraction", type=float, default=0.05, help="share of prompts in the long tail")
    p.add_argument("--long-factor", type=int, default=10, help="the long tail's turns / an ordinary request's")
    p.add_argument("--turn-ms", type=float, default=20.0, help="engine time per assistant turn")
    p.add_argument("--tool-ms", type=float, default=30.0, help="tool time per call")
    p.add_argument("--budget", type=int, default=3, help="rollout.partial_rollout.max_turns_per_step")
    p.add_argument("--over-sampling", type=int, default=1, help="rollout.partial_rollout.over_sampling_batches")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class TimedReplayEngine(ReplayEngine):
    """The replay engine, turn ``k`` found from the prompt itself (so the ``n`` samples of a prompt and a
    request resumed in a later step each get their own next turn), taking ``turn_s`` per turn."""

    def __init__(self, chat: ChatTokenizer, turn_s: float):
        super().__init__(chat)
        self.turn_s = turn_s
        self.header = chat.encode("<|im_start|>assistant\n")

    def _turn(self, ids: list[int]) -> int:
        h, n = self.header, len(self.header)
        return sum(ids[i : i + n] == h for i in range(len(ids) - n + 1)) - 1

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        key = tuple(prompt_ids[self.offset : self.offset + 12])
        ids = self.scripts[key][self._turn(prompt_ids)]
        await asyncio.sleep(self.turn_s)
        return GenerationOutput(list(ids), [-0.5] * len(ids), "stop")


class SlowCalculator(CalculatorTool):
    def __init__(self, results: dict[str, str], tool_s: float):
        super().__init__(results)
        self.tool_s = tool_s

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> ToolResponse:
        await asyncio.sleep(self.tool_s)
        return await super().execute(instance_id, parameters, **kwargs)


def _workload(a: argparse.Namespace, chat: ChatTokenizer) -> tuple[list[dict], TimedReplayEngine, SlowCalculator, int]:
    """Enough prompts for both modes (the partial one starts more), each with its turn count."""
    rng = random.Random(a.seed)
    engine = TimedReplayEngine(chat, a.turn_ms / 1000)
    rows, results, longest = [], {}, a.turns
    for seed in range(a.prompts * (a.steps + a.over_sampling + 1)):
        turns = a.turns * a.long_factor if rng.random() < a.long_fraction else a.turns
        longest = max(longest, turns)
        prompt, assistants, res = conversation(turns, seed)
        engine.register(prompt, assistants)
        results.update(res)
        rows.append({"prompt": prompt})
    return rows, engine, SlowCalculator(results, a.tool_ms / 1000), longest


def _cfg(a: argparse.Namespace, longest: int, seed: int) -> RolloutConfig:
    mt = MultiTurnConfig(max_assistant_turns=longest + 1, max_tool_response_length=0,
                         tokenization_sanity_check_mode="disable")
    return RolloutConfig(n=a.n, seed=seed, prompt_length=4096, response_length=200_000, multi_turn=mt)


def run_wait(a: argparse.Namespace, rows: list[dict], engine: Any, tool: Any, chat: ChatTokenizer, longest: int) -> dict:
    times, trained = [], 0
    for step in range(a.steps):
        batch = rows[step * a.prompts : (step + 1) * a.prompts]
        t = time.perf_counter()
        out = asyncio.run(generate_sequences(batch, engine, {"calculator": tool}, None, _cfg(a, longest, step), chat))
        times.append(time.perf_counter() - t)
        trained += len(out)
    return {"times": times, "trained": trained, "started": trained, "buffered": 0, "duplicated": 0, "age": 0}


def run_partial(a: argparse.Namespace, rows: list[dict], engine: Any, tool: Any, chat: ChatTokenizer, longest: int) -> dict:
    buf, cursor, times, seen = RolloutBuffer(), 0, [], set()
    trained = started = duplicated = age = 0
    for step in range(a.steps):
        t = time.perf_counter()
        ctx = rollout_context(engine, {"calculator": tool}, None, _cfg(a, longest, step), chat,
                              weight_version=step, turn_budget=a.budget)
        batches = 1
        while len(buf) + batches * a.prompts < (1 + a.over_sampling) * a.prompts:
            batches += 1
        for k in range(batches):
            cfg = dataclasses.replace(_cfg(a, longest, step * 100 + k))
            buf.add(rows[cursor : cursor + a.prompts], cfg, ctx, step)
            cursor += a.prompts
            started += a.prompts * a.n
        while True:
            asyncio.run(buf.run(ctx))
            if buf.complete_groups >= a.prompts or buf.live_sessions == 0:
                break
        close_context(ctx)
        requests = buf.take(a.prompts)
        times.append(time.perf_counter() - t)
        for r in requests:
            duplicated += r.request_id in seen
            seen.add(r.request_id)
            versions = [v for v in r.trajectory.versions if v >= 0]
            age = max(age, step - min(versions))
        trained += len(requests)
    buffered = sum(len(g.sessions) for g in buf.groups)
    asyncio.run(buf.close())
    return {"times": times, "trained": trained, "started": started, "buffered": buffered,
            "duplicated": duplicated, "age": age}


def main(argv: list[str] | None = None) -> None:
    a = _args(argv)
    chat = ChatTokenizer(load_qwen_tokenizer("qwen2_5"))
    chat.prompt_ids([{"role": "user", "content": "warm up"}], tools=[SCHEMA])
    results = {}
    for mode, run in (("wait", run_wait), ("partial", run_partial)):
        rows, engine, tool, longest = _workload(a, chat)
        results[mode] = run(a, rows, engine, tool, chat, longest)
    print(f"{a.steps} steps x {a.prompts} prompts x n={a.n}; {a.long_fraction:.0%} of prompts take "
          f"{a.turns * a.long_factor} turns, the rest {a.turns}; {a.turn_ms:g} ms/turn, {a.tool_ms:g} ms/tool call; "
          f"partial: {a.budget} turns/step, {a.over_sampling} extra batch(es) in flight")
    print(f"{'mode':8} {'s/step mean':>11} {'s/step max':>10} {'traj/s':>8} {'trained':>8} {'buffered':>8} "
          f"{'lost':>5} {'dup':>4} {'max age':>7}")
    rate = {}
    for mode, r in results.items():
        total = sum(r["times"])
        rate[mode] = r["trained"] / total
        lost = r["started"] - r["trained"] - r["buffered"]
        print(f"{mode:8} {statistics.mean(r['times']):11.3f} {max(r['times']):10.3f} {rate[mode]:8.1f} "
              f"{r['trained']:8d} {r['buffered']:8d} {lost:5d} {r['duplicated']:4d} {r['age']:7d}")
    print(f"partial / wait trajectories per second: {rate['partial'] / rate['wait']:.2f}x")


if __name__ == "__main__":
    main()
