"""Per-trajectory tokenization cost of the real agent loop, against the floor, at 8..128 turns.

A batch of ``--conversations`` calculator tool loops of ``T`` turns each (see
``tool_loop_workload``) runs through ``generate_sequences`` (parser, tool validation, instant tool, delta tokenization, the
sanity check) with a replay engine that answers instantly, so the wall time is the loop's
own CPU work; figures are per trajectory (the batch's time over its size). They are compared
with, in the same run:

* ``floor``: one render + tokenize of each final conversation (what any tokenization of
  a trajectory must cost at least);
* ``before``: the agent loop as it was (``LegacySession``: whole-trajectory decode and
  whole-conversation renders every turn, ``difflib`` check), strict check on.

``x floor`` should stay under 2 with the strict check on (it costs one floor by itself)
and the per-turn cost flat: ``exp`` is the local growth exponent of the time between
successive lengths (1 = linear, 2 = quadratic). CPU work runs inline (``tokenizer_threads=0``)
so the figures are CPU cost, not overlap. The tool declares that it never blocks, so it runs on
the loop (a tool that does not gets a thread and an event loop of its own per call, ~0.3-0.5 ms
here: more than a turn's tokenization).

``--hostile``: every tool result ends with special-token strings (``<|im_end|>``, ``<tool_call>``),
which are tokenized as text (literal environment text): each such delta renders its neutral twin too,
and so does the floor (one render + its twin + the literal tokenization).
Usage: ``python bench/rollout_tokenization.py [--turns 8 16 32 64 128] [--conversations 8] [--repeats 5]
[--before-max-turns 64] [--hostile]``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from tool_loop_workload import LegacyChat, best_of, legacy_rollout, rollout_config, workload  # noqa: E402

from mcore_agentic.models.tokenizer import load_qwen_tokenizer  # noqa: E402
from mcore_agentic.rollout.driver import generate_sequences  # noqa: E402
from mcore_agentic.rollout.tokenization import ChatTokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    ap.add_argument("--conversations", type=int, default=8, help="trajectories per batch")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--before-max-turns", type=int, default=64, help="skip the (quadratic) before column beyond this")
    ap.add_argument("--hostile", action="store_true", help="tool results hold special-token strings (literal text)")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                    help="cpu: the process's CPU time (all its threads; a busy machine does not inflate it); wall")
    args = ap.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    tokenizer = load_qwen_tokenizer("qwen2_5")  # the full Qwen vocabulary
    chat, legacy = ChatTokenizer(tokenizer), LegacyChat(tokenizer)
    print(f"{'turns':>5} {'tokens':>7} {'floor ms':>9} | {'strict ms':>9} {'x floor':>7} {'ms/turn':>7} {'exp':>5} | "
          f"{'no-check ms':>11} {'x floor':>7} | {'before ms':>9} {'x floor':>7} | {'paths':<24}")
    previous: tuple[int, float] | None = None
    for turns in args.turns:
        k = args.conversations
        rows, engine, tool = workload(chat, turns, k, hostile=args.hostile)

        def run(strict: bool, engine=engine, rows=rows, tool=tool, turns=turns):
            engine.reset()
            cfg = rollout_config(turns, strict=strict, threads=0)
            return asyncio.run(generate_sequences(rows, engine, {"calculator": tool}, None, cfg, chat))

        cfg = rollout_config(turns, strict=True, threads=0)

        def before(engine=engine, rows=rows, tool=tool, cfg=cfg):
            engine.reset()
            return asyncio.run(legacy_rollout(rows, engine, tool, cfg, legacy))

        batch = run(True)
        schemas = [tool.tool_schema]

        def floor(conversations=batch.meta["messages"], schemas=schemas):  # literal text: with its neutral twin
            render = functools.partial(chat.render, tools=schemas, add_generation_prompt=False)
            return [chat.encode_render(m, render) for m in conversations]

        # interleaved, fastest of each: the machine's speed drifts, so all columns see the same drift
        timed = {"strict": lambda: run(True), "floor": floor, "free": lambda: run(False)}
        if turns <= args.before_max_turns:
            timed["before"] = before
        best = dict.fromkeys(timed, float("inf"))
        for _ in range(args.repeats):
            for name, fn in timed.items():
                seconds, _ = best_of(fn, 1, clock)
                best[name] = min(best[name], seconds / k)
        strict_s, floor_s, free_s = best["strict"], best["floor"], best["free"]
        metrics = batch.meta["request_metrics"][0]
        assert all(m["state"] == "completed" and m["assistant_turns"] == turns + 1 for m in batch.meta["request_metrics"])
        assert batch.info["rollout/sanity_check_mismatches"] == 0, metrics
        for row, ids in enumerate(floor()):  # the trajectory is the full render's tokenization
            kept = batch.tensors["input_ids"][row][batch.tensors["attention_mask"][row].bool()].tolist()
            assert ids[: ids.index(chat.eot_id, len(ids) - 2) + 1] == kept
        n_tokens = int(batch.tensors["attention_mask"].sum()) // k
        if "before" in best:
            before_cols = f"{best['before'] * 1e3:>9.1f} {best['before'] / floor_s:>7.1f}"
        else:
            before_cols = f"{'-':>9} {'-':>7}"
        exp = f"{math.log(strict_s / previous[1]) / math.log(turns / previous[0]):>5.2f}" if previous else f"{'':>5}"
        previous = (turns, strict_s)
        paths = f"1r={turns - metrics['template_drift'] - metrics['template_fallback']} drift={metrics['template_drift']}"
        print(f"{turns:>5} {n_tokens:>7} {floor_s * 1e3:>9.1f} | {strict_s * 1e3:>9.1f} {strict_s / floor_s:>7.2f} "
              f"{strict_s / turns * 1e3:>7.2f} {exp} | {free_s * 1e3:>11.1f} {free_s / floor_s:>7.2f} | {before_cols} | {paths:<24}")


if __name__ == "__main__":
    main()
