"""The synthetic tool tasks of CPU runs, pure functions of the seed: rows, rewards' data sources, demonstrations.

``meter_reading`` (the embedded default): "what does the meter read?" The reading (drawn per
row from ``min_operand..max_operand``) is known only to the ``read_meter`` tool
(:mod:`mcore_agentic.tools.meter`, created with the row's reading). The ideal trajectory::

    assistant: <tool_call>{"name": "read_meter", "arguments": {}}</tool_call>
    tool:      47
    assistant: #### 47

Its warm-start demonstrations come from an imperfect teacher: a ``demo_round_fraction`` of
them answer with the reading rounded down to tens (``#### 40``). Rows use
``data_source="synthetic/meter_reading"`` and the exact reading as ground truth.

``meter_pair``: two meters, read in turn by ``read_meter`` (``readings=[a, b]``); the ideal trajectory reads both
and answers ``#### <a><b>`` (``#### 4712`` for 47 and 12), the imperfect teacher's ``demo_round_fraction`` reads only
the first and repeats it (``#### 4747``). With the tool's ``step_reward`` each new read earns a per-turn reward: the
task on which episode- and turn-level credit are compared (``bench/turn_credit.py``).

``tool_arith``: "compute A + B with the calculator"; ideal trajectory: calculator call with
``A+B``, its result, ``#### <A+B>``; ``data_source="synthetic/tool_arith"``.

Both are scored by :mod:`mcore_agentic.rewards.tool_arith` (the final ``#### <int>`` after the
last tool result must equal the ground truth). :func:`sft_conversations` gives the
demonstrations (OpenAI ``tool_calls`` format; the chat template renders them).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mcore_agentic.data.config import SyntheticTaskConfig

DATA_SOURCE = "synthetic/tool_arith"
TOOL_NAME = "calculator"
SYSTEM_PROMPT = "Use the calculator tool, then reply #### <answer>."
METER_SOURCE = "synthetic/meter_reading"
METER_TOOL = "read_meter"
METER_SYSTEM_PROMPT = "Read the meter with the tool, then reply #### <reading>."
METER_QUESTION = "What does the meter read?"
PAIR_SOURCE = "synthetic/meter_pair"
PAIR_SYSTEM_PROMPT = "Read both meters with the tool, then reply #### <first reading><second reading>."
PAIR_QUESTION = "What do the two meters read?"


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


def _meter_row(reading: int, index: int, split: str) -> dict[str, Any]:
    return {
        "prompt": [{"role": "system", "content": METER_SYSTEM_PROMPT}, {"role": "user", "content": METER_QUESTION}],
        "data_source": METER_SOURCE,
        "ability": "tool_use",
        "reward_model": {"style": "rule", "ground_truth": str(reading)},
        "extra_info": {
            "index": index,
            "split": split,
            "tools_kwargs": {METER_TOOL: {"create_kwargs": {"reading": reading}}},
            "interaction_kwargs": {},
        },
    }


def _pair_row(first: int, second: int, index: int, split: str) -> dict[str, Any]:
    return {
        "prompt": [{"role": "system", "content": PAIR_SYSTEM_PROMPT}, {"role": "user", "content": PAIR_QUESTION}],
        "data_source": PAIR_SOURCE,
        "ability": "tool_use",
        "reward_model": {"style": "rule", "ground_truth": f"{first}{second}"},
        "extra_info": {
            "index": index,
            "split": split,
            "readings": [first, second],
            "tools_kwargs": {METER_TOOL: {"create_kwargs": {"readings": [first, second]}}},
            "interaction_kwargs": {},
        },
    }


def make_rows(cfg: SyntheticTaskConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Training and validation rows in the dataset's row layout (tool_arith: disjoint operand pairs)."""
    if cfg.task == "meter_pair":
        rng = np.random.default_rng([cfg.seed, 3])
        pairs = rng.integers(cfg.min_operand, cfg.max_operand + 1, size=(cfg.num_train + cfg.num_val, 2)).tolist()
        train = [_pair_row(int(a), int(b), i, "train") for i, (a, b) in enumerate(pairs[: cfg.num_train])]
        val = [_pair_row(int(a), int(b), i, "val") for i, (a, b) in enumerate(pairs[cfg.num_train :])]
        return train, val
    if cfg.task == "meter_reading":
        rng = np.random.default_rng([cfg.seed, 1])
        readings = rng.integers(cfg.min_operand, cfg.max_operand + 1, size=cfg.num_train + cfg.num_val).tolist()
        train = [_meter_row(int(v), i, "train") for i, v in enumerate(readings[: cfg.num_train])]
        val = [_meter_row(int(v), i, "val") for i, v in enumerate(readings[cfg.num_train :])]
        return train, val
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


def meter_conversation(row: dict[str, Any], answer: int) -> list[dict[str, Any]]:
    """The prompt, the ``read_meter`` call, the reading, then ``#### <answer>``."""
    reading = row["reward_model"]["ground_truth"]
    return [
        *row["prompt"],
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": METER_TOOL, "arguments": {}}}]},
        {"role": "tool", "content": reading},
        {"role": "assistant", "content": f"#### {answer}"},
    ]


def pair_conversation(row: dict[str, Any], *, read_both: bool) -> list[dict[str, Any]]:
    """The prompt, ``read_meter`` and the first reading, then (``read_both``) ``read_meter`` and the second, then
    ``#### <first><second>`` — or, without the second read, ``#### <first><first>``."""
    first, second = row["extra_info"]["readings"]
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": METER_TOOL, "arguments": {}}}]}
    out = [*row["prompt"], call, {"role": "tool", "content": str(first)}]
    if read_both:
        out += [dict(call), {"role": "tool", "content": str(second)}]
    out.append({"role": "assistant", "content": f"#### {first}{second if read_both else first}"})
    return out


def sft_conversations(cfg: SyntheticTaskConfig) -> list[list[dict[str, Any]]]:
    """The warm-start demonstrations, one per training problem: ideal conversations (tool_arith), or the
    imperfect teacher's (meter_reading: a seeded ``demo_round_fraction`` of answers rounded down to tens;
    meter_pair: that fraction reads only the first meter and repeats its reading)."""
    train, _ = make_rows(cfg)
    if cfg.task == "meter_pair":
        skips = np.random.default_rng([cfg.seed, 4]).random(len(train)) < cfg.demo_round_fraction
        return [pair_conversation(row, read_both=not skip) for row, skip in zip(train, skips)]
    if cfg.task == "meter_reading":
        rounds = np.random.default_rng([cfg.seed, 2]).random(len(train)) < cfg.demo_round_fraction
        out = []
        for row, rounded in zip(train, rounds):
            reading = int(row["reward_model"]["ground_truth"])
            out.append(meter_conversation(row, reading // 10 * 10 if rounded else reading))
        return out
    return [ideal_conversation(r) for r in train]
