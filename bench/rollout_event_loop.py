"""How long the rollout's event loop stalls, and the wall time, for many concurrent long tool loops.

``--conversations`` calculator tool loops of ``--turns`` turns (see ``tool_loop_workload``)
run concurrently through the agent loop with instant tools and an engine that answers at
once, so all the time is the loop's CPU work. The event loop's longest stall is measured by
the driver's heartbeat (``rollout/event_loop_max_stall_s``: how late a 5 ms timer fires).

* ``before``: the agent loop as it was (whole-trajectory decode and whole-conversation renders
  every turn, ``difflib`` sanity check, all on the event loop);
* ``after, on loop``: linear tokenization, ``tokenizer_threads=0``;
* ``after``: linear tokenization with rendering, tokenizing and the check on
  ``tokenizer_threads`` worker threads (the default, 2).

Strict sanity check on in every mode. Usage:
``python bench/rollout_event_loop.py [--conversations 256] [--turns 32] [--threads 2] [--skip-before]``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from tool_loop_workload import LegacyChat, legacy_rollout, rollout_config, workload  # noqa: E402

from mcore_agentic.models.tokenizer import load_qwen_tokenizer  # noqa: E402
from mcore_agentic.rollout.driver import generate_sequences  # noqa: E402
from mcore_agentic.rollout.tokenization import ChatTokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=256)
    ap.add_argument("--turns", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-before", action="store_true", help="skip the slow 'before' run")
    args = ap.parse_args()
    tokenizer = load_qwen_tokenizer("qwen2_5")
    chat = ChatTokenizer(tokenizer)
    rows, engine, tool = workload(chat, args.turns, args.conversations)
    n_calls = args.conversations * args.turns

    def after(threads: int) -> tuple[float, float, dict]:
        engine.reset()
        cfg = rollout_config(args.turns, strict=True, threads=threads)
        start = time.perf_counter()
        batch = asyncio.run(generate_sequences(rows, engine, {"calculator": tool}, None, cfg, chat))
        return time.perf_counter() - start, batch.info["rollout/event_loop_max_stall_s"], batch.info

    def before() -> tuple[float, float, dict]:
        engine.reset()
        cfg = rollout_config(args.turns, strict=True, threads=0)
        start = time.perf_counter()
        batch, stall = asyncio.run(legacy_rollout(rows, engine, tool, cfg, LegacyChat(tokenizer)))
        return time.perf_counter() - start, stall, batch.info

    modes = {"after": lambda: after(args.threads), "after, on loop": lambda: after(0)}
    if not args.skip_before:
        modes["before"] = before
    results = {}
    for name, fn in modes.items():
        wall, stall, info = fn()
        assert info["rollout/tool_calls"] == n_calls and info["rollout/failed_requests"] == 0, info
        results[name] = (wall, stall, info["rollout/sanity_check_mismatches"])
    print(f"{args.conversations} concurrent conversations x {args.turns} turns, instant tools and engine, "
          f"strict check; threads={args.threads}")
    print(f"{'mode':>16} {'wall s':>8} {'max stall ms':>13} {'mismatches':>10}")
    for name, (wall, stall, mismatches) in results.items():
        print(f"{name:>16} {wall:>8.2f} {stall * 1e3:>13.1f} {mismatches:>10}")
    if "before" in results:
        b, a = results["before"], results["after"]
        print(f"after vs before: wall {b[0] / a[0]:.1f}x faster, longest stall {b[1] / max(a[1], 1e-9):.0f}x shorter")


if __name__ == "__main__":
    main()
