"""RL dataset rows, overlong filtering with the real tokenizer, resumable order, synthetic task."""

from __future__ import annotations

import asyncio
import copy

import pytest
import yaml

from mcore_agentic.config import CONFIG_DIR, ConfigError
from mcore_agentic.data.config import DataConfig, SyntheticTaskConfig
from mcore_agentic.data.dataloader import RLDataLoader, make_train_loader
from mcore_agentic.data.dataset import RLDataset, load_datasets, normalize_row, prompt_token_length, write_parquet
from mcore_agentic.data.synthetic import DATA_SOURCE, ideal_conversation, make_rows, sft_conversations
from mcore_agentic.models.tokenizer import load_qwen_tokenizer
from mcore_agentic.rewards.tool_arith import compute_score
from mcore_agentic.tools.calculator import CalculatorTool
from tests.helpers.nested import apply_changes


def _row(**changes):
    row = {
        "prompt": [{"role": "user", "content": "What is 2 + 3?"}],
        "data_source": "test/src",
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "5"},
        "extra_info": {
            "index": 7,
            "tools_kwargs": {"calculator": {"create_kwargs": {}}},
            "interaction_kwargs": {"name": "gsm8k", "ground_truth": "5"},
        },
    }
    return apply_changes(row, changes, delete=_DELETE)


_DELETE = object()


@pytest.fixture(scope="module")
def tokenizer():
    return load_qwen_tokenizer("qwen2_5", 4096)


@pytest.fixture(scope="module")
def calculator_schemas():
    tools = yaml.safe_load((CONFIG_DIR / "tools" / "calculator_tool_config.yaml").read_text())["tools"]
    return tools, [t["tool_schema"] for t in tools]


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"prompt": _DELETE}, "prompt"),
        ({"prompt": "What is 2 + 3?"}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [{"role": "robot", "content": "hi"}]}, "prompt[0].role"),
        ({"prompt": [{"role": "user", "content": 3}]}, "prompt[0].content"),
        ({"data_source": _DELETE}, "data_source"),
        ({"extra_info__index": "seven"}, "extra_info.index"),
        ({"extra_info__tools_kwargs": ["calculator"]}, "extra_info.tools_kwargs"),
        ({"extra_info__tools_kwargs__calculator": {"create_kwarg": {}}}, "extra_info.tools_kwargs.calculator.create_kwarg"),
        ({"extra_info__tools_kwargs__calculator": {"create_kwargs": 5}}, "extra_info.tools_kwargs.calculator.create_kwargs"),
        ({"extra_info__interaction_kwargs": "not json"}, "extra_info.interaction_kwargs"),
    ],
)
def test_bad_rows_name_field_and_row(changes, field):
    with pytest.raises(ConfigError) as info:
        RLDataset.from_rows([_row(), _row(**changes)], "unit.parquet")
    assert info.value.field == field
    assert "row 1 of unit.parquet" in str(info.value) and "\n" not in str(info.value)


def test_normalised_row_defaults():
    row = normalize_row(_row(extra_info={}, reward_model=None, ability=None), 3, "x")
    assert row["extra_info"] == {"index": 3, "tools_kwargs": {}, "interaction_kwargs": {}}
    assert row["reward_model"] == {"ground_truth": None} and row["ability"] == ""


def test_parquet_roundtrip_keeps_nested_kwargs(tmp_path):
    rows = [_row(), _row(extra_info__tools_kwargs={"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "5"}}})]
    write_parquet(rows, tmp_path / "d.parquet")
    ds = RLDataset.from_files(tmp_path / "d.parquet")
    # Different tool names per row must not leak into each other (as parquet struct columns would).
    assert ds[0]["extra_info"]["tools_kwargs"] == {"calculator": {"create_kwargs": {}}}
    assert ds[1]["extra_info"]["tools_kwargs"] == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "5"}}}
    assert ds[0]["extra_info"]["interaction_kwargs"] == {"name": "gsm8k", "ground_truth": "5"}
    assert ds[0]["prompt"] == rows[0]["prompt"]


def test_overlong_prompts_dropped_and_counted(tokenizer, calculator_schemas):
    _, schemas = calculator_schemas
    short = _row()
    long = _row(prompt=[{"role": "user", "content": "count " * 200}])
    budget = prompt_token_length(tokenizer, short["prompt"], schemas)
    ds = RLDataset.from_rows(
        [short, long, short], "x", tokenizer=tokenizer, max_prompt_length=budget, tool_schemas=schemas
    )
    assert len(ds) == 2 and ds.num_dropped_overlong == 1
    # Tool schemas count: without them the same prompt is much shorter.
    assert prompt_token_length(tokenizer, short["prompt"], None) < budget - 100
    with pytest.raises(ConfigError, match="row 1 of x") as info:
        RLDataset.from_rows(
            [short, long], "x", tokenizer=tokenizer, max_prompt_length=budget, filter_overlong_prompts=False,
            tool_schemas=schemas,
        )
    assert info.value.field == "prompt"


def _take(loader, k):
    out = []
    for _ in range(k):
        for batch in loader:
            out.append(batch)
            if len(out) == k:
                return out
    return out


def test_sampler_resumes_exactly_after_step_k():
    rows = [_row(extra_info__index=i) for i in range(10)]
    ds = RLDataset.from_rows(rows, "x")
    ids = lambda batches: [[r["extra_info"]["index"] for r in b] for b in batches]  # noqa: E731
    full = ids(_take(RLDataLoader(ds, 3, seed=5), 9))  # 3 batches/epoch (drop_last) over 3 epochs
    assert len(full) == 9 and full[:3] != full[3:6]  # each epoch reshuffles
    for k in (1, 3, 4):
        first = RLDataLoader(ds, 3, seed=5)
        assert ids(_take(first, k)) == full[:k]
        state = copy.deepcopy(first.state_dict())
        resumed = RLDataLoader(ds, 3, seed=5)
        resumed.load_state_dict(state)
        assert ids(_take(resumed, 9 - k)) == full[k:]
    other = RLDataLoader(ds, 3, seed=6)
    assert ids(_take(other, 3)) != full[:3]
    with pytest.raises(ConfigError, match="batch_size"):
        RLDataLoader(ds, 2, seed=5).load_state_dict(state)


def test_loaders_from_config():
    ds = RLDataset.from_rows([_row(extra_info__index=i) for i in range(5)], "x")
    cfg = DataConfig(train_files="x.parquet", train_batch_size=2, val_batch_size=None)
    assert len(make_train_loader(ds, cfg, seed=1)) == 2
    with pytest.raises(ConfigError, match="larger than the dataset"):
        make_train_loader(ds, DataConfig(train_files="x", train_batch_size=8), seed=1)


def test_synthetic_task_is_deterministic_and_disjoint():
    cfg = SyntheticTaskConfig(enable=True, num_train=100, num_val=20, min_operand=0, max_operand=20, seed=3)
    train, val = make_rows(cfg)
    assert (train, val) == make_rows(cfg)
    assert make_rows(SyntheticTaskConfig(enable=True, num_train=100, num_val=20, min_operand=0, max_operand=20, seed=4))[0] != train
    pairs = lambda rows: {tuple(r["extra_info"]["operands"]) for r in rows}  # noqa: E731
    assert len(pairs(train)) == 100 and not pairs(train) & pairs(val)
    assert all(r["data_source"] == DATA_SOURCE for r in train)
    assert all(int(r["reward_model"]["ground_truth"]) == sum(r["extra_info"]["operands"]) for r in train)
    assert all(0 <= x <= 20 for r in train + val for x in r["extra_info"]["operands"])
    # Defaults: two-digit operands and two-digit sums (fixed-offset copies).
    default_train, _ = make_rows(SyntheticTaskConfig(enable=True))
    assert all(len(str(x)) == 2 for r in default_train for x in [*r["extra_info"]["operands"], int(r["reward_model"]["ground_truth"])])
    with pytest.raises(ConfigError, match="distinct problems"):
        SyntheticTaskConfig(num_train=30, num_val=0, min_operand=1, max_operand=5)
    RLDataset.from_rows(train, "synthetic")  # rows pass the dataset's own validation


def test_synthetic_ideal_trajectory_is_real(tokenizer, calculator_schemas):
    """The demonstration's tool reply is what the real calculator returns; its rendering scores 1."""
    tools, schemas = calculator_schemas
    tool = CalculatorTool(tools[0]["config"], tools[0]["tool_schema"])
    cfg = SyntheticTaskConfig(enable=True, num_train=8, num_val=0)
    for conv in sft_conversations(cfg)[:4]:
        call = conv[2]["tool_calls"][0]["function"]
        result = asyncio.run(tool.execute("i", call["arguments"]))
        assert result.text == conv[3]["content"]
        text = tokenizer.apply_chat_template(conv, tools=schemas, tokenize=False)
        prompt = tokenizer.apply_chat_template(conv[:2], tools=schemas, tokenize=False, add_generation_prompt=True)
        response = text[len(prompt) :]
        assert "<tool_call>" in response and compute_score(response, conv[3]["content"]) == 1.0
        # Short enough for the tiny default (data.max_prompt_length=320, max_response_length=96).
        assert len(tokenizer(text)["input_ids"]) - len(tokenizer(prompt)["input_ids"]) <= 96
        assert len(tokenizer(prompt)["input_ids"]) <= 320


def test_load_datasets_synthetic_and_files(tmp_path, tokenizer, calculator_schemas):
    _, schemas = calculator_schemas
    cfg = DataConfig(synthetic=SyntheticTaskConfig(enable=True, num_train=16, num_val=4), max_prompt_length=320)
    train, val = load_datasets(cfg, tokenizer=tokenizer, tool_schemas=schemas)
    assert len(train) == 16 and len(val) == 4 and train.num_dropped_overlong == 0
    write_parquet(list(train), tmp_path / "t.parquet")
    train2, val2 = load_datasets(DataConfig(train_files=str(tmp_path / "t.parquet")))
    assert val2 is None and [r["prompt"] for r in train2] == [r["prompt"] for r in train]
    with pytest.raises(ConfigError, match="does not exist"):
        load_datasets(DataConfig(train_files=str(tmp_path / "missing.parquet")))
    assert ideal_conversation(train[0])[-1]["content"].startswith("#### ")
