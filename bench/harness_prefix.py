"""A coding harness's episode on each CPU engine, with and without prefix reuse: what each turn prefills, and its time.

A harness (Claude Code, Codex CLI...) re-sends its whole conversation every turn: a long system prompt and its
tool schemas (here ``--prefix-tokens``, ~15k), then the turns so far. Through the session endpoint the engine gets
exactly the sample's ids: the previous prompt + the ids it sampled + the environment's new ids (a short tool
result and the next generation prompt). This bench plays such an episode of ``--turns`` turns straight into the
engine (no HTTP: the endpoint's own cost is ``bench/agent_endpoint.py``'s), greedy, ``--sample-tokens`` sampled per
turn, on a tiny random Qwen2 of long context (2 layers, hidden 64, head_dim 32, ``max_position_embeddings``
32768), with the Qwen chat template rendering the system prompt, the tools and the first user turn.

Per engine, one run with reuse and one without (transformers: its prefix store on / ``prefix_cache_entries=0``;
vLLM: ``enable_prefix_caching`` on / off), side by side: per turn the new ids, the ids the engine prefilled
(``prefix_cache_stats()``: prompt tokens minus those served from cache) and the turn's wall time. Summary: prefilled
ids per new id over turns 2.., and the no-reuse run's wall time over the reuse run's, in the same process.

Usage: ``python bench/harness_prefix.py [--prefix-tokens 15000] [--turns 20] [--sample-tokens 32]
[--engines hf,vllm] [--vllm-block-size 128] [--result-words 24]`` (vLLM's CPU build hits whole KV blocks: 128 tokens unless set, a
multiple of 32).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mcore_agentic.rollout.engines.base import SamplingParams, prefix_cache_stats

WORDS = ("file", "test", "module", "function", "class", "error", "branch", "commit", "diff", "patch", "lint",
         "build", "cache", "config", "shell", "path", "token", "review", "format", "docs", "import", "return")


@dataclass
class Turn:
    new: int
    """Ids this turn's prompt adds to the previous turn's whole sequence (turn 1: the whole prompt)."""
    prompt: int
    prefilled: int
    wall_s: float


@dataclass
class Run:
    name: str
    turns: list[Turn] = field(default_factory=list)
    sampled: list[list[int]] = field(default_factory=list)


def build_model(out: Path) -> Path:
    from mcore_agentic.models.tiny import make_tiny_hf_model

    if not (out / "config.json").exists():
        make_tiny_hf_model(out, "qwen2", vocab_size=4096, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=2, intermediate_size=128, max_position_embeddings=32768, seed=0)
    return out


def tool_schemas(count: int) -> list[dict[str, Any]]:
    rng = random.Random(1)
    tools = []
    for i in range(count):
        props = {f"{rng.choice(WORDS)}_{j}": {"type": rng.choice(["string", "integer", "boolean"]),
                                              "description": " ".join(rng.choices(WORDS, k=12))} for j in range(6)}
        tools.append({"type": "function", "function": {
            "name": f"{rng.choice(WORDS)}_{rng.choice(WORDS)}_{i}", "description": " ".join(rng.choices(WORDS, k=40)),
            "parameters": {"type": "object", "properties": props, "required": list(props)[:2]}}})
    return tools


def first_prompt(tokenizer: Any, prefix_tokens: int) -> list[int]:
    """System prompt + tool schemas + a user turn, rendered by the chat template, about ``prefix_tokens`` ids."""
    rng = random.Random(0)
    tools = tool_schemas(max(1, prefix_tokens // 1500))
    rules: list[str] = []

    def render() -> list[int]:
        system = "You are a coding agent working in a repository.\n" + "\n".join(rules)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Fix the failing test."}]
        ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    ids = render()
    while len(ids) < prefix_tokens:
        need = prefix_tokens - len(ids)
        rules.extend(f"Rule {len(rules) + 1}: " + " ".join(rng.choices(WORDS, k=14)) + "."
                     for _ in range(max(1, need // 40)))
        ids = render()
    return ids


def environment_ids(tokenizer: Any, turn: int, result_words: int = 24) -> list[int]:
    """What the environment adds after a sampled turn: the turn's end, a tool result of about ``result_words``
    words (the default, 18-30, is a one-line command's: ~40-60 ids with the framing), the next generation prompt."""
    rng = random.Random(100 + turn)
    spread = max(1, result_words // 4)
    result = (f"exit code {turn % 3}; {rng.randint(1, 40)} files checked; "
              + " ".join(rng.choices(WORDS, k=rng.randint(result_words - spread, result_words + spread))))
    text = (f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n")
    return tokenizer.encode(text, add_special_tokens=False)


def play(engine: Any, name: str, first: list[int], envs: list[list[int]], sample_tokens: int) -> Run:
    """The episode on ``engine``: each turn's wall time, new and prefilled ids."""
    run = Run(name)

    async def episode() -> None:
        # a first request warms the engine up (vLLM's first step costs seconds); its ids share nothing with the episode
        await engine.generate([7] * 16, SamplingParams(max_new_tokens=2, temperature=0.0))
        prompt, previous = list(first), 0
        for env in envs:
            before = prefix_cache_stats(engine)
            start = time.perf_counter()
            out = await engine.generate(prompt, SamplingParams(max_new_tokens=sample_tokens, temperature=0.0))
            wall = time.perf_counter() - start
            delta = prefix_cache_stats(engine) - before
            run.turns.append(Turn(len(prompt) - previous, len(prompt), delta.prefilled_tokens, wall))
            run.sampled.append(out.token_ids)
            previous = len(prompt) + len(out.token_ids)
            prompt = prompt + out.token_ids + env

    asyncio.run(episode())
    return run


def build(engine: str, reuse: bool, model: Path, max_len: int, block_size: int | None) -> Any:
    if engine == "hf":
        from mcore_agentic.rollout.engines.hf import HFEngine

        return HFEngine.from_pretrained(model, seed=0, prefix_cache_entries=4 if reuse else 0)
    from mcore_agentic.rollout.engines.vllm import VLLMEngine
    from mcore_agentic.rollout.engines.vllm_args import default_kv_cache_bytes

    return VLLMEngine(model, seed=0, max_model_len=max_len, enable_prefix_caching=reuse,
                      kv_cache_memory_bytes=default_kv_cache_bytes(model, max_model_len=max_len, dtype="float32",
                                                                   sequences=2),
                      engine_kwargs={"block_size": block_size} if block_size else None)


def summary(run: Run) -> dict[str, float]:
    later = run.turns[1:]
    return {"prefill_per_new": sum(t.prefilled for t in later) / max(1, sum(t.new for t in later)),
            "prefill_per_new_max": max((t.prefilled / t.new for t in later), default=0.0),
            "later_wall_s": sum(t.wall_s for t in later), "first_wall_s": run.turns[0].wall_s,
            "total_wall_s": sum(t.wall_s for t in run.turns)}


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix-tokens", type=int, default=15000)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--sample-tokens", type=int, default=32)
    ap.add_argument("--engines", default="hf,vllm", help="comma-separated: hf, vllm")
    ap.add_argument("--vllm-block-size", type=int, default=None, help="vLLM's KV block (CPU: a multiple of 32)")
    ap.add_argument("--model-dir", default=None, help="where the tiny model is kept (default: a temporary dir)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--result-words", type=int, default=24,
                    help="words of each tool result (24: a one-line command's output; a file read or a test run's "
                         "is hundreds)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(args.model_dir) if args.model_dir else Path(tmp) / "tiny_long")
        tokenizer = AutoTokenizer.from_pretrained(str(model))
        first = first_prompt(tokenizer, args.prefix_tokens)
        envs = [environment_ids(tokenizer, k, args.result_words) for k in range(args.turns)]
        max_len = len(first) + sum(len(e) for e in envs) + args.turns * args.sample_tokens + 64
        results: dict[str, dict[str, Any]] = {}
        for engine_name in [e.strip() for e in args.engines.split(",") if e.strip()]:
            runs = {}
            for reuse in (True, False):
                engine = build(engine_name, reuse, model, max_len, args.vllm_block_size)
                runs[reuse] = play(engine, f"{engine_name} {'reuse' if reuse else 'no reuse'}", first, envs,
                                   args.sample_tokens)
                if engine_name == "vllm":
                    runs[reuse].name += f" (block {engine.block_size})"
                engine.shutdown()
                del engine
            results[engine_name] = {"reuse": runs[True], "plain": runs[False],
                                    "same_ids": runs[True].sampled == runs[False].sampled,
                                    "summary": summary(runs[True]), "plain_summary": summary(runs[False])}
    report(results, first, args)
    return results


def report(results: dict[str, dict[str, Any]], first: list[int], args: Any) -> None:
    print(f"harness episode: {len(first)}-id first prompt (system prompt + tools + user turn), {args.turns} turns of "
          f"{args.sample_tokens} greedy ids + a tool result; tiny Qwen2 (2 layers, hidden 64, 32k positions), "
          f"{args.threads} thread(s)")
    for r in results.values():
        reuse, plain = r["reuse"], r["plain"]
        print(f"\n{reuse.name} vs {plain.name} (same sampled ids: {'yes' if r['same_ids'] else 'NO'})")
        print(f"{'turn':>4} {'prompt':>7} {'new':>5} | {'prefilled':>9} {'ms':>8} | {'prefilled':>9} {'ms':>8} | "
              f"{'prefill/new':>11} {'time ratio':>10}")
        for k, (a, b) in enumerate(zip(reuse.turns, plain.turns), 1):
            print(f"{k:>4} {a.prompt:>7} {a.new:>5} | {a.prefilled:>9} {1000 * a.wall_s:>8.1f} | {b.prefilled:>9} "
                  f"{1000 * b.wall_s:>8.1f} | {a.prefilled / a.new:>11.2f} {b.wall_s / a.wall_s:>9.1f}x")
        s, p = r["summary"], r["plain_summary"]
        print(f"turns 2..{len(reuse.turns)}: prefilled {s['prefill_per_new']:.2f}x the new ids (max "
              f"{s['prefill_per_new_max']:.2f}x; without reuse {p['prefill_per_new']:.1f}x), wall "
              f"{s['later_wall_s']:.2f} s vs {p['later_wall_s']:.2f} s without reuse: "
              f"{p['later_wall_s'] / s['later_wall_s']:.1f}x faster; whole episode "
              f"{p['total_wall_s'] / s['total_wall_s']:.1f}x")
    print(json.dumps({name: {"reuse": r["summary"], "no_reuse": r["plain_summary"]} for name, r in results.items()}))


if __name__ == "__main__":
    main()
