"""Per-trajectory cost of tokenizing multi-turn conversations: delta tokenization vs full re-tokenization.

Each turn of the conversation is an assistant message with a tool call followed by a
~300-character tool result. To produce the next prompt for the engine:

* ``delta`` (ours, as the agent loop does it): the assistant's ids are the engine's (already
  tokenized), the tool turn is :meth:`ChatTokenizer.env_segment` (one template render when it
  extends the decoded trajectory, else two; tokenize only the delta);
* ``full`` (baseline): render the whole conversation with the generation prompt and
  tokenize all of it, every turn (what a re-tokenizing rollout does).

Both run the same Jinja template; the difference is what gets tokenized each turn.
Usage: ``python bench/rollout_tokenization.py [--turns 8 16 32] [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from mcore_agentic.models.tokenizer import load_qwen_tokenizer
from mcore_agentic.rollout.request import Trajectory
from mcore_agentic.rollout.tokenization import ChatTokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
        },
    }
]
WORDS = "the model adds numbers and checks each partial result before it answers carefully".split()


def conversation(turns: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    initial = [
        {"role": "system", "content": "You are a careful math assistant."},
        {"role": "user", "content": "Add up the following numbers: " + ", ".join(str(rng.randint(1, 999)) for _ in range(20))},
    ]
    later = []
    for t in range(turns):
        expr = " + ".join(str(rng.randint(1, 999)) for _ in range(4))
        thought = " ".join(rng.choice(WORDS) for _ in range(25))
        later.append(
            {
                "role": "assistant",
                "content": f"Step {t}: {thought}",
                "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": expr}}}],
            }
        )
        later.append({"role": "tool", "content": json.dumps({"result": rng.randint(1, 5000), "log": " ".join(rng.choice(WORDS) for _ in range(45))})})
    return initial, later


def run_delta(chat: ChatTokenizer, initial, later, sampled: list[list[int]]) -> Trajectory:
    messages = list(initial)
    traj = Trajectory()
    traj.set_prompt(chat.prompt_ids(messages, tools=TOOLS))
    for k in range(0, len(later), 2):
        traj.append(sampled[k // 2], sampled=True, log_probs=[0.0] * len(sampled[k // 2]))
        messages.append(later[k])
        messages.append(later[k + 1])
        segment = chat.env_segment(
            messages, len(messages) - 1, tools=TOOLS, sampled_eot=True, history_text=chat.decode(traj.ids)
        )
        traj.append(segment.ids, sampled=False)
    return traj


def run_full(chat: ChatTokenizer, initial, later) -> list[int]:
    messages = list(initial)
    ids = chat.prompt_ids(messages, tools=TOOLS)
    for k in range(0, len(later), 2):
        messages.append(later[k])
        messages.append(later[k + 1])
        ids = chat.prompt_ids(messages, tools=TOOLS)  # re-render and re-tokenize everything
    return ids


def best_of(fn, args: tuple, repeats: int) -> float:
    """Fastest of ``repeats`` runs of ``fn(*args)``, in seconds (least disturbed by other load)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    chat = ChatTokenizer(load_qwen_tokenizer("qwen2_5"))  # the full Qwen vocabulary
    print(f"{'turns':>5} {'tokens':>7} {'delta ms':>9} {'full ms':>9} {'full/delta':>10}")
    for turns in args.turns:
        initial, later = conversation(turns)
        sampled = [chat.assistant_turn_ids(m, tools=TOOLS) for m in later[::2]]
        traj = run_delta(chat, initial, later, sampled)
        # same ids either way (the template is append-only), so the comparison is like for like
        assert traj.ids == run_full(chat, initial, later)[: len(traj.ids)]
        d_best = best_of(run_delta, (chat, initial, later, sampled), args.repeats)
        f_best = best_of(run_full, (chat, initial, later), args.repeats)
        print(f"{turns:>5} {len(traj.ids):>7} {d_best * 1e3:>9.1f} {f_best * 1e3:>9.1f} {f_best / d_best:>9.2f}x")


if __name__ == "__main__":
    main()
