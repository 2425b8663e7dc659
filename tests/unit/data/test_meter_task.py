"""The embedded default's task: meter_reading rows, the imperfect teacher's demonstrations, the read_meter tool,
its reward, and prompts rendered without the tool section (``rollout.multi_turn.tool_schemas_in_prompt=false``)."""

from __future__ import annotations

import asyncio

import pytest

from mcore_agentic.data.config import SyntheticTaskConfig
from mcore_agentic.data.synthetic import METER_SOURCE, METER_TOOL, make_rows, sft_conversations
from mcore_agentic.models.tokenizer import load_qwen_tokenizer
from mcore_agentic.rewards import compute_score, score_of
from mcore_agentic.rollout.config import MultiTurnConfig, RolloutConfig
from mcore_agentic.rollout.driver import generate_sequences
from mcore_agentic.tools.registry import load_tools
from mcore_agentic.utils.errors import ConfigError
from tests.unit.rollout.scripted import ScriptedEngine, call

CFG = SyntheticTaskConfig(enable=True, task="meter_reading", num_train=400, num_val=16, min_operand=10,
                          max_operand=99, demo_round_fraction=0.7, seed=5)


def test_rows_hand_each_reading_to_the_tool_and_the_reward_only():
    train, val = make_rows(CFG)
    assert len(train) == 400 and len(val) == 16
    for row in train + val:
        reading = row["extra_info"]["tools_kwargs"][METER_TOOL]["create_kwargs"]["reading"]
        assert 10 <= reading <= 99 and row["reward_model"]["ground_truth"] == str(reading)
        assert row["data_source"] == METER_SOURCE
        assert str(reading) not in str(row["prompt"])  # only the tool knows it
    assert make_rows(CFG) == (train, val)  # a pure function of the seed
    assert len({r["reward_model"]["ground_truth"] for r in train}) > 60


def test_the_teacher_reads_the_meter_always_and_rounds_in_the_given_fraction():
    demos = sft_conversations(CFG)
    train, _ = make_rows(CFG)
    rounded = 0
    for demo, row in zip(demos, train):
        reading = int(row["reward_model"]["ground_truth"])
        assert demo[2]["tool_calls"][0]["function"] == {"name": METER_TOOL, "arguments": {}}
        assert demo[3] == {"role": "tool", "content": str(reading)}
        answer = int(demo[4]["content"].removeprefix("#### "))
        assert answer in (reading, reading // 10 * 10)
        rounded += answer != reading
    exact_tens = sum(int(r["reward_model"]["ground_truth"]) % 10 == 0 for r in train)
    assert 0.6 < (rounded + exact_tens * 0.7) / len(train) < 0.8


def test_reward_pays_the_exact_reading_after_the_tool_result_only():
    score = lambda text: score_of(compute_score(METER_SOURCE, text, "47"))  # noqa: E731
    reply = "<tool_call>...</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n47\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert score(reply + "#### 47<|im_end|>") == 1.0
    assert score(reply + "#### 40<|im_end|>") == 0.0
    assert score("#### 47<|im_end|>" + reply) == 0.0  # the answer must come after the tool's reply


def test_config_names_a_bad_task_or_fraction():
    with pytest.raises(ConfigError, match="data.synthetic.task"):
        SyntheticTaskConfig(task="meter")
    with pytest.raises(ConfigError, match="data.synthetic.demo_round_fraction"):
        SyntheticTaskConfig(task="meter_reading", demo_round_fraction=1.5)


@pytest.mark.parametrize("in_prompt", [True, False])
def test_rollout_reads_the_meter_with_or_without_the_tool_section(in_prompt):
    tokenizer = load_qwen_tokenizer("qwen2_5", vocab_size=4096)
    tools = load_tools("configs/tools/meter_tool_config.yaml")
    _, val = make_rows(CFG)
    rows = [dict(val[0], prompt=[*val[0]["prompt"][:1], {"role": "user", "content": "KEY What does the meter read?"}])]
    reading = rows[0]["reward_model"]["ground_truth"]
    engine = ScriptedEngine(tokenizer, {"KEY": [call(METER_TOOL), f"#### {reading}"]})
    cfg = RolloutConfig(n=1, prompt_length=512, response_length=64,
                        multi_turn=MultiTurnConfig(max_assistant_turns=2, tool_schemas_in_prompt=in_prompt))
    batch = asyncio.run(generate_sequences(rows, engine, tools, None, cfg, tokenizer))
    prompt = tokenizer.decode(engine.prompts[0])
    assert ("# Tools" in prompt) is in_prompt and (METER_TOOL in prompt) is in_prompt
    assert batch["tool_log"][0] == [
        {"turn": 1, "name": METER_TOOL, "arguments": "{}", "result": reading, "error": False,
         "seconds": batch["tool_log"][0][0]["seconds"], "error_type": None, "traceback": None}
    ]
    assert batch["request_metrics"][0]["sanity_check_mismatch"] == 0  # the check renders the same way
    text = tokenizer.decode(batch["responses"][0][batch["attention_mask"][0, batch["prompts"].shape[1]:].bool()])
    assert score_of(compute_score(METER_SOURCE, text, reading)) == 1.0


PAIR = SyntheticTaskConfig(enable=True, task="meter_pair", num_train=200, num_val=8, min_operand=10, max_operand=99,
                           demo_round_fraction=0.7, seed=5)


def test_the_pair_task_reads_two_meters_in_turn_with_a_reward_per_new_read():
    """meter_pair: the tool reads the next meter per call (0.25 per new read, an error after both), the teacher
    skips the second read in the given fraction, and a rollout that reads both earns a per-turn reward at each
    read's turn and the exact answer."""
    from mcore_agentic.data.synthetic import PAIR_SOURCE
    from mcore_agentic.feed.scoring import turn_reward_tensor

    train, val = make_rows(PAIR)
    first, second = train[0]["extra_info"]["readings"]
    assert train[0]["reward_model"]["ground_truth"] == f"{first}{second}" and train[0]["data_source"] == PAIR_SOURCE
    demos = sft_conversations(PAIR)
    skipped = sum(sum(m["role"] == "tool" for m in d) == 1 for d in demos)
    assert abs(skipped / len(demos) - 0.7) < 0.1
    for demo in demos:
        readings = [m["content"] for m in demo if m["role"] == "tool"]
        answer = demo[-1]["content"]
        assert answer == f"#### {readings[0]}{readings[-1]}"  # one read: the first reading twice
    tokenizer = load_qwen_tokenizer("qwen2_5", vocab_size=4096)
    tools = load_tools("configs/tools/meter_pair_tool_config.yaml")
    row = dict(val[0], prompt=[*val[0]["prompt"][:1], {"role": "user", "content": "KEY two meters"}])
    a, b = row["extra_info"]["readings"]
    engine = ScriptedEngine(tokenizer, {"KEY": [call(METER_TOOL), call(METER_TOOL), call(METER_TOOL), f"#### {a}{b}"]})
    cfg = RolloutConfig(n=1, prompt_length=512, response_length=128, multi_turn=MultiTurnConfig(max_assistant_turns=4))
    batch = asyncio.run(generate_sequences([row], engine, tools, None, cfg, tokenizer))
    log = batch["tool_log"][0]
    assert [c["result"] for c in log[:2]] == [str(a), str(b)] and log[2]["error"]  # a third read is an error
    assert batch["turn_tool_rewards"][0] == [0.25, 0.25, 0.0, 0.0] and batch["tool_rewards"][0] == 0.5
    placed = turn_reward_tensor(batch)[0]
    assert [placed[e].item() for e in batch["turn_ends"][0]] == [0.25, 0.25, 0.0, 0.0]
    text = tokenizer.decode(batch["responses"][0][batch["attention_mask"][0, batch["prompts"].shape[1]:].bool()])
    assert score_of(compute_score(PAIR_SOURCE, text, f"{a}{b}")) == 1.0
