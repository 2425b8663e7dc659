"""Partial rollouts vs waiting for every request, on a long tail of turn counts or of generation lengths.

One process, the real agent loop, tokenizer and :class:`RolloutBuffer`; the engine replays scripted
answers and sleeps for what a decode would cost (``asyncio.sleep``: the time without the compute that would
drown a 2-core machine). Every mode trains ``--prompts`` groups of ``--n`` samples per step for ``--steps``
steps from the same prompt stream.

``--scenario turns`` (the default): scripted calculator conversations (``bench/tool_loop_workload.py``); the
engine takes ``--turn-ms`` per assistant turn, the tool ``--tool-ms`` per call. A fraction ``--long-fraction``
of the prompts needs ``--long-factor`` times the turns of the others: the long tail of agentic RL. Modes:

* **wait** — the baseline (what the trainer does without ``rollout.partial_rollout``): each step rolls out
  one batch of prompts and waits for every request;
* **partial** — ``rollout.partial_rollout`` as :class:`mcore_agentic.feed.partial_rounds.PartialRounds` runs it for one rollout
  group: a step starts a new batch (and more while fewer than ``1 + --over-sampling`` batches of groups
  are in flight), runs rounds of at most ``--budget`` turns per request until ``--prompts`` groups are
  complete, and trains the oldest complete ones; the rest stay paused in the buffer.

``--scenario tokens``: single-generation requests (no tools) whose lengths are log-normal (``--median``
tokens, ``--sigma``, capped at ``--max-tokens`` = ``rollout.response_length``, where a request ends with
finish reason "length"): the long tail of reasoning lengths. The engine is a simulated decode: a call costs
``--prefill-ms`` plus ``--token-ms`` per token it returns, so a step's wall time is its longest request's
tokens times ``--token-ms``. It honours ``max_new_tokens`` (finish "length" where it cuts) and
``draws_before`` (a cut generation continues from that offset of its script; the prompt must end with the
ids sampled so far). A sample's script depends only on its prompt row and its index in the group, so every
mode draws the same lengths. Modes:

* **wait** — as above;
* **turns** — partial rollout with a budget of ``--budget`` turns per round: a single-turn request never
  pauses, so it waits for the longest generation like **wait** does;
* **tokens** — partial rollout with a budget of ``--token-budget`` sampled tokens per request and round
  (``rollout.partial_rollout.max_tokens_per_step``; ``--max-staleness`` as well if given): a longer
  generation pauses mid-turn and goes on in the next round or step.

Prints wall seconds per step (mean and the longest step), trajectories trained per second and the ratio
over **wait**, and counts samples: every started request must be trained exactly once or still be in the
buffer (lost = 0, duplicated = 0), and the age (in steps) of the oldest trained token. The tokens scenario
also prints the mean response length of trained rows, their length distribution next to the synchronous
run's, and that of what is still buffered at the end (the length bias: over the run, the trained rows are the
started population less the buffered, longer, rows); and checks that every trained row equals its uncut
scripted generation.

    python bench/partial_rollout.py
    python bench/partial_rollout.py --long-fraction 0.1 --budget 3
    python bench/partial_rollout.py --scenario tokens
    python bench/partial_rollout.py --scenario tokens --median 256 --sigma 1.0 --max-tokens 4096 \\
        --token-ms 1 --token-budget 384 --over-sampling 1
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.tool_loop_workload import SCHEMA, WORDS, CalculatorTool, ReplayEngine, conversation  # noqa: E402
from mcore_agentic.models.tokenizer import load_qwen_tokenizer  # noqa: E402
from mcore_agentic.rollout.config import (  # noqa: E402
    AgentConfig,  # noqa: E402
    MultiTurnConfig,
    RolloutConfig,
)
from mcore_agentic.rollout.engines.base import GenerationOutput, SamplingParams  # noqa: E402
from mcore_agentic.rollout.partial import LoopSource  # noqa: E402
from mcore_agentic.rollout.request import RequestState  # noqa: E402
from mcore_agentic.rollout.source import Budget, TrajectorySource, roll_to_end  # noqa: E402
from mcore_agentic.rollout.tokenization import ChatTokenizer  # noqa: E402
from mcore_agentic.tools.base import ToolResponse  # noqa: E402

SEED_STRIDE = 1_000_003
"""The agent loop seeds turn ``k`` of a request seeded ``s`` with ``s * SEED_STRIDE + k`` (``AgentSession._generate``)."""

CfgFn = Callable[[int, int, int], RolloutConfig]
"""(step, batch of the step, index of the batch's first prompt row) -> the batch's rollout config."""


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=("turns", "tokens"), default="turns",
                   help="long tail of turn counts (tool loops) or of generation lengths (single generations)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompts", type=int, default=16, help="prompt groups trained per step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--over-sampling", type=int, default=1, help="rollout.partial_rollout.over_sampling_batches")
    p.add_argument("--seed", type=int, default=0)
    t = p.add_argument_group("--scenario turns")
    t.add_argument("--turns", type=int, default=2, help="tool-calling turns of an ordinary request")
    t.add_argument("--long-fraction", type=float, default=0.05, help="share of prompts in the long tail")
    t.add_argument("--long-factor", type=int, default=10, help="the long tail's turns / an ordinary request's")
    t.add_argument("--turn-ms", type=float, default=20.0, help="engine time per assistant turn")
    t.add_argument("--tool-ms", type=float, default=30.0, help="tool time per call")
    t.add_argument("--budget", type=int, default=3,
                   help="rollout.partial_rollout.max_turns_per_step (the partial mode; the turns mode of --scenario tokens)")
    k = p.add_argument_group("--scenario tokens")
    k.add_argument("--median", type=float, default=256.0, help="median generation length (tokens)")
    k.add_argument("--sigma", type=float, default=1.0, help="sigma of the log-normal generation length")
    k.add_argument("--max-tokens", type=int, default=4096, help="rollout.response_length: longer generations are cut")
    k.add_argument("--token-ms", type=float, default=1.0, help="engine time per returned token (a decode step)")
    k.add_argument("--prefill-ms", type=float, default=2.0, help="engine time per call (prefill, scheduling)")
    k.add_argument("--token-budget", type=int, default=384, help="rollout.partial_rollout.max_tokens_per_step")
    k.add_argument("--max-staleness", type=int, default=None, help="rollout.partial_rollout.max_staleness")
    k.add_argument("--source", choices=("loop", "agent"), default="loop",
                   help="who rolls out: the built-in loop, or an agent program (one httpx request per sample) "
                        "through the session endpoint")
    return p.parse_args(argv)


async def one_answer(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    """The agent program of ``--source agent``: one chat completion of its row's prompt (httpx: the lightest
    client), reward 1."""
    import httpx

    async with httpx.AsyncClient(timeout=None) as client:
        r = await client.post(f"{base_url}/chat/completions", headers={"Authorization": f"Bearer {api_key}"},
                              json={"model": "policy", "messages": row["prompt"]})
        r.raise_for_status()
    return 1.0


def _source(a: argparse.Namespace, engine: Any, tools: dict, chat: ChatTokenizer, cfg: RolloutConfig, *,
            partial: bool) -> TrajectorySource:
    """The mode's trajectory source: the built-in loop, or (``--source agent``) agent programs."""
    if getattr(a, "source", "loop") == "agent":
        from mcore_agentic.endpoint.source import AgentSource

        agent = AgentConfig(entrypoint=f"{Path(__file__).resolve()}:one_answer", max_concurrent=256,
                            timeout_s=3600.0)
        return AgentSource(dataclasses.replace(cfg, agent=agent), engine, chat, version=lambda: 0, partial=partial)
    return LoopSource(engine, tools, None, cfg, chat)


# -- turns scenario ----------------------------------------------------------------------------------


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


# -- tokens scenario ---------------------------------------------------------------------------------


class DecodeReplayEngine:
    """Single generations of log-normal length, replayed as a decode that costs ``token_s`` per returned token.

    Sample ``j`` of prompt row ``r`` is the request seeded ``r * n + j`` (the bench seeds each batch with its
    first row times ``n``); its script (word ids, then the stop token; none when it runs past the cap) is drawn
    from ``(seed, r, j)`` alone. A call returns the next ``max_new_tokens`` ids of the script from
    ``draws_before`` on, finish "stop" when the script ends in them, else "length".
    """

    def __init__(self, chat: ChatTokenizer, a: argparse.Namespace):
        self.chat, self.a = chat, a
        self.words = [i for w in WORDS for i in chat.encode(" " + w)]
        self.prompts: dict[int, list[int]] = {}
        self.scripts: dict[int, list[int]] = {}
        self.calls = 0
        self.weight_version = 0

    def register(self, row: int, prompt: list[dict]) -> None:
        self.prompts[row] = self.chat.prompt_ids(prompt, tools=None)

    def length(self, sample: int) -> int:
        """The scripted generation length of request seed ``sample`` (uncapped)."""
        return len(self.script(sample))

    def script(self, sample: int) -> list[int]:
        if sample not in self.scripts:
            a = self.a
            rng = random.Random(a.seed * SEED_STRIDE + sample)
            length = max(1, round(a.median * math.exp(a.sigma * rng.gauss(0.0, 1.0))))
            ids = [rng.choice(self.words) for _ in range(min(length, a.max_tokens + 1) - 1)]
            self.scripts[sample] = ids + [self.chat.eot_id] if length <= a.max_tokens else ids + [rng.choice(self.words)]
        return self.scripts[sample]

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        assert params.seed is not None and params.seed % SEED_STRIDE == 0, "single-turn requests, seeded"
        sample = params.seed // SEED_STRIDE
        script, done = self.script(sample), params.draws_before
        head = prompt_ids[: len(prompt_ids) - done]
        assert head == self.prompts[sample // self.a.n], f"sample {sample}: not its prompt"
        assert prompt_ids[len(head) :] == script[:done], f"sample {sample}: the prompt does not end with its cut turn"
        ids = script[done : done + params.max_new_tokens]
        finish = "stop" if done + len(ids) == len(script) and ids[-1:] == [self.chat.eot_id] else "length"
        self.calls += 1
        await asyncio.sleep((self.a.prefill_ms + len(ids) * self.a.token_ms) / 1000)
        return GenerationOutput(list(ids), [-0.5] * len(ids), finish)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None: ...
    def finish_weight_update(self, version: int) -> None: ...
    def release_memory(self) -> None: ...
    def resume_memory(self, tags: Sequence[str] | None = None) -> None: ...
    def flush_cache(self) -> None: ...


def _token_workload(a: argparse.Namespace, chat: ChatTokenizer) -> tuple[list[dict], DecodeReplayEngine]:
    rows, engine = [], DecodeReplayEngine(chat, a)
    for r in range(a.prompts * (a.steps + a.over_sampling + 1)):
        prompt = [{"role": "user", "content": f"[{r}] Think it through, then answer: what is {r} squared?"}]
        engine.register(r, prompt)
        rows.append({"prompt": prompt})
    return rows, engine


def _token_cfg(a: argparse.Namespace, first_row: int) -> RolloutConfig:
    mt = MultiTurnConfig(max_assistant_turns=1, max_tool_response_length=0, tokenization_sanity_check_mode="disable")
    return RolloutConfig(n=a.n, seed=first_row * a.n, prompt_length=4096, response_length=a.max_tokens, multi_turn=mt)


# -- the modes -----------------------------------------------------------------------------------------


def run_wait(a: argparse.Namespace, rows: list[dict], engine: Any, tools: dict, chat: ChatTokenizer, cfg: CfgFn) -> dict:
    times, trained, lengths, failed = [], 0, [], 0
    for step in range(a.steps):
        batch = rows[step * a.prompts : (step + 1) * a.prompts]
        step_cfg = cfg(step, 0, step * a.prompts)
        source = _source(a, engine, tools, chat, step_cfg, partial=False)
        t = time.perf_counter()
        try:
            requests, _ = roll_to_end(source, batch, step_cfg, weight_version=step)
        finally:
            source.close()
        times.append(time.perf_counter() - t)
        trained += len(requests)
        lengths += [r.trajectory.response_len for r in requests]
        failed += sum(r.state is not RequestState.COMPLETED for r in requests)
    return {"times": times, "trained": trained, "started": trained, "buffered": 0, "duplicated": 0, "age": 0,
            "lengths": lengths, "failed": failed, "rounds": a.steps, "mid_turn": 0, "prioritised": 0,
            "requests": [], "in_flight": [], "buffered_seeds": []}


def run_partial(a: argparse.Namespace, rows: list[dict], engine: Any, tools: dict, chat: ChatTokenizer, cfg: CfgFn,
                *, turn_budget: int | None = None, token_budget: int | None = None,
                max_staleness: int | None = None) -> dict:
    """``rollout.partial_rollout`` as :class:`~mcore_agentic.feed.partial_rounds.PartialRounds` drives a trajectory
    source for one rollout group (the mode's: the built-in loop or agent programs)."""
    source = _source(a, engine, tools, chat, cfg(0, 0, 0), partial=True)
    budget = Budget(turn_budget, token_budget, max_staleness)
    cursor, times, seen = 0, [], set()
    trained = started = duplicated = age = rounds = mid_turn = prioritised = 0
    lengths, kept = [], []
    for step in range(a.steps):
        t = time.perf_counter()
        batches = 1
        while len(source.groups) + batches * a.prompts < (1 + a.over_sampling) * a.prompts:
            batches += 1
        for k in range(batches):
            source.start(rows[cursor : cursor + a.prompts], cfg(step, k, cursor), step)
            cursor += a.prompts
            started += a.prompts * a.n
        while True:
            report = source.advance(step, budget)
            rounds += 1
            mid_turn += report.paused_mid_turn
            prioritised += report.prioritised
            if sum(g.complete for g in source.groups) >= a.prompts or source.live_sessions == 0:
                break
        chosen = [g for g in source.groups if g.complete][: a.prompts]
        source.remove(chosen)
        requests = [r for g in chosen for r in g.requests()]
        times.append(time.perf_counter() - t)
        for r in requests:
            duplicated += r.request_id in seen
            seen.add(r.request_id)
            versions = [v for v in r.trajectory.versions if v >= 0]
            age = max(age, step - min(versions))
        trained += len(requests)
        lengths += [r.trajectory.response_len for r in requests]
        kept += requests
    live = [s for g in source.groups for s in g.sessions]
    buffered = len(live)
    live_lengths = iter(source.in_flight_lengths())  # the live sessions', in group and session order
    in_flight = [sum(r.trajectory.response_len for r in s.rows) if s.done else next(live_lengths) for s in live]
    buffered_seeds = [s.req.seed for s in live]
    source.close()
    return {"times": times, "trained": trained, "started": started, "buffered": buffered,
            "duplicated": duplicated, "age": age, "lengths": lengths, "rounds": rounds, "mid_turn": mid_turn,
            "prioritised": prioritised, "failed": sum(r.state is RequestState.FAILED for r in kept),
            "requests": kept, "in_flight": in_flight, "buffered_seeds": buffered_seeds}


# -- reports -----------------------------------------------------------------------------------------


def _pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))] if s else float("nan")


def _dist(xs: Sequence[float]) -> str:
    if not xs:
        return "none"
    return (f"mean {statistics.mean(xs):6.0f}  p50 {_pct(xs, 0.5):5.0f}  p90 {_pct(xs, 0.9):5.0f}  "
            f"max {max(xs):5.0f}  ({len(xs)} rows)")


def _table(results: dict[str, dict], lengths: bool) -> dict[str, float]:
    print(f"{'mode':8} {'s/step mean':>11} {'s/step max':>10} {'traj/s':>8} {'trained':>8} {'buffered':>8} "
          f"{'lost':>5} {'dup':>4} {'max age':>7}" + (f" {'mean len':>8}" if lengths else ""))
    rate = {}
    for mode, r in results.items():
        total = sum(r["times"])
        rate[mode] = r["trained"] / total
        lost = r["started"] - r["trained"] - r["buffered"]
        line = (f"{mode:8} {statistics.mean(r['times']):11.3f} {max(r['times']):10.3f} {rate[mode]:8.1f} "
                f"{r['trained']:8d} {r['buffered']:8d} {lost:5d} {r['duplicated']:4d} {r['age']:7d}")
        if lengths:
            line += f" {statistics.mean(r['lengths']):8.1f}"
        print(line)
    return rate


def main_turns(a: argparse.Namespace, chat: ChatTokenizer) -> None:
    results = {}
    for mode in ("wait", "partial"):
        rows, engine, tool, longest = _workload(a, chat)
        if mode == "wait":
            results[mode] = run_wait(a, rows, engine, {"calculator": tool}, chat,
                                     lambda step, k, first, longest=longest: _cfg(a, longest, step))
        else:
            results[mode] = run_partial(a, rows, engine, {"calculator": tool}, chat,
                                        lambda step, k, first, longest=longest: _cfg(a, longest, step * 100 + k),
                                        turn_budget=a.budget)
    print(f"{a.steps} steps x {a.prompts} prompts x n={a.n}; {a.long_fraction:.0%} of prompts take "
          f"{a.turns * a.long_factor} turns, the rest {a.turns}; {a.turn_ms:g} ms/turn, {a.tool_ms:g} ms/tool call; "
          f"partial: {a.budget} turns/step, {a.over_sampling} extra batch(es) in flight")
    rate = _table(results, lengths=False)
    print(f"partial / wait trajectories per second: {rate['partial'] / rate['wait']:.2f}x")


def main_tokens(a: argparse.Namespace, chat: ChatTokenizer) -> None:
    results, engines = {}, {}
    budgets = {"turns": {"turn_budget": a.budget},
               "tokens": {"token_budget": a.token_budget, "max_staleness": a.max_staleness}}
    for mode in ("wait", "turns", "tokens"):
        rows, engine = _token_workload(a, chat)
        engines[mode] = engine
        cfg: CfgFn = lambda step, k, first: _token_cfg(a, first)  # noqa: E731
        if mode == "wait":
            results[mode] = run_wait(a, rows, engine, {}, chat, cfg)
        else:
            results[mode] = run_partial(a, rows, engine, {}, chat, cfg, **budgets[mode])
    staleness = "" if a.max_staleness is None else f", max staleness {a.max_staleness}"
    print(f"source: {a.source}; {a.steps} steps x {a.prompts} prompts x n={a.n}; single generations of log-normal length (median "
          f"{a.median:g} tokens, sigma {a.sigma:g}, cut at {a.max_tokens}); {a.token_ms:g} ms/token + "
          f"{a.prefill_ms:g} ms/call; turns: {a.budget} turns/step; tokens: {a.token_budget} tokens/step{staleness}; "
          f"{a.over_sampling} extra batch(es) in flight")
    rate = _table(results, lengths=True)
    for mode in ("turns", "tokens"):
        r = results[mode]
        print(f"{mode}: {r['rounds']} rounds, {r['mid_turn']} mid-turn pauses, {r['prioritised']} prioritised session-rounds")
    print("response length of trained rows (tokens):")
    for mode, r in results.items():
        print(f"  {mode:37} {_dist(r['lengths'])}")
    r, engine = results["tokens"], engines["tokens"]
    final = [min(engine.length(s), a.max_tokens) for s in r["buffered_seeds"]]
    started = r["lengths"] + final
    print(f"  buffered at the end, sampled so far   {_dist(r['in_flight'])}")
    print(f"  buffered at the end, final (scripted) {_dist(final)}")
    print(f"  tokens trained + buffered final       {_dist(started)}  (= every row tokens started)")
    bad = failed = 0
    for mode in ("turns", "tokens"):
        for req in results[mode]["requests"]:
            script = engines[mode].script(req.seed)[: a.max_tokens]
            bad += req.trajectory.response_ids != script
        failed += results[mode]["failed"]
    failed += results["wait"]["failed"]
    print(f"trained rows that differ from their uncut generation: {bad}; failed requests: {failed}")
    print(f"tokens / wait trajectories per second: {rate['tokens'] / rate['wait']:.2f}x "
          f"(turns / wait: {rate['turns'] / rate['wait']:.2f}x)")
    if bad or failed:
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    a = _args(argv)
    chat = ChatTokenizer(load_qwen_tokenizer("qwen2_5"))
    chat.prompt_ids([{"role": "user", "content": "warm up"}], tools=[SCHEMA])
    (main_tokens if a.scenario == "tokens" else main_turns)(a, chat)


if __name__ == "__main__":
    main()
