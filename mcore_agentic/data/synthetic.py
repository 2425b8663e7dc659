"""The synthetic tool task of the embedded default: "compute A + B with the calculator".

Small enough for a tiny model (hidden 64, 2 layers) to learn on 2 CPU cores from
a short supervised warm start plus a few dozen RL steps, yet a real multi-turn
tool episode. The ideal trajectory is::

    assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "A+B"}}</tool_call>
    tool:      A+B evaluated (the calculator prints the integer)
    assistant: #### <A+B>

Rows use ``data_source="synthetic/tool_arith"`` (scored by
:mod:`mcore_agentic.rewards.tool_arith`) and the integer answer as ground truth.
:func:`sft_conversations` gives the ideal conversations (OpenAI ``tool_calls``
format; the chat template renders them) for the warm start. Everything is a
pure function of the seed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mcore_agentic.data.config import SyntheticTaskConfig

DATA_SOURCE = "synthetic/tool_arith"
TOOL_NAME = "calculator"
SYSTEM_PROMPT = "Use the calculator tool, then reply #### <answer>."


def _pairs(cfg: SyntheticTaskConfig) -> list[tuple[int, int]]:
    """``num_train + num_val`` distinct operand pairs in a seeded order."""
    side = cfg.max_operand - cfg.min_operand + 1
    total = cfg.num_train + cfg.num_val
    flat = np.random.default_rng(cfg.seed).choice(side * side, size=total, replace=False)
    return [(cfg.min_operand + int(v) // side, cfg.min_operand + int(v) % side) for v in flat]


def _row(a: int, b: int, index: int, split: str) -> dict[str, Any]:
    return {
        "prompt": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Compute {a} + {b}."},
        ],
        "data_source": DATA_SOURCE,
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {
            "index": index,
            "split": split,
            "operands": [a, b],
            # The calculator needs no per-sample state; listing it documents which tool the task uses.
            "tools_kwargs": {TOOL_NAME: {"create_kwargs": {}}},
            "interaction_kwargs": {},
        },
    }


def make_rows(cfg: SyntheticTaskConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Training and validation rows (disjoint operand pairs) in the dataset's row layout."""
    pairs = _pairs(cfg)
    train = [_row(a, b, i, "train") for i, (a, b) in enumerate(pairs[: cfg.num_train])]
    val = [_row(a, b, i, "val") for i, (a, b) in enumerate(pairs[cfg.num_train :])]
    return train, val


def ideal_expression(row: dict[str, Any]) -> str:
    a, b = row["extra_info"]["operands"]
    return f"{a}+{b}"


def ideal_conversation(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The prompt followed by the ideal tool call, the calculator's reply and the final answer."""
    answer = row["reward_model"]["ground_truth"]
    return [
        *row["prompt"],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"expression": ideal_expression(row)}}}
            ],
        },
        {"role": "tool", "content": answer},
        {"role": "assistant", "content": f"#### {answer}"},
    ]


def sft_conversations(cfg: SyntheticTaskConfig) -> list[list[dict[str, Any]]]:
    """Ideal conversations for every training problem (the warm-start demonstrations)."""
    train, _ = make_rows(cfg)
    return [ideal_conversation(r) for r in train]
