"""GSM8K preprocessing: local jsonl/parquet -> tool-use RL parquet the dataset reads back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch.preprocess_gsm8k import convert, extract_ground_truth, main
from mcore_agentic.config import ConfigError
from mcore_agentic.data.dataset import RLDataset
from mcore_agentic.rewards.gsm8k import compute_score as gsm8k_score

REPO = Path(__file__).resolve().parents[3]
SAMPLE = REPO / "data" / "gsm8k_sample.jsonl"


def test_sample_file_is_consistent():
    records = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    assert len(records) >= 50
    assert len({r["question"] for r in records}) == len(records)
    for r in records:
        truth = extract_ground_truth(r["answer"], "sample")
        # The last worked step states the same number as the #### line.
        assert r["answer"].splitlines()[-2].split(">>")[-1].split()[0] == truth


def test_ground_truth_extraction():
    assert extract_ground_truth("so 3 + 4 = 7\n#### 1,234", "x") == "1234"
    assert extract_ground_truth("#### -5", "x") == "-5"
    with pytest.raises(ConfigError, match="record 3"):
        extract_ground_truth("no final answer", "record 3")


def test_main_writes_parquet_the_dataset_reads(tmp_path):
    assert main(["--train", str(SAMPLE), "--test-size", "10", "--tools", "both", "--interaction", "--out", str(tmp_path)]) == 0
    train = RLDataset.from_files(tmp_path / "train.parquet")
    test = RLDataset.from_files(tmp_path / "test.parquet")
    assert (len(train), len(test)) == (40, 10)
    row = test[0]
    truth = row["reward_model"]["ground_truth"]
    assert row["data_source"] == "openai/gsm8k" and row["extra_info"]["split"] == "test"
    assert row["extra_info"]["index"] == 0
    assert row["extra_info"]["tools_kwargs"] == {
        "calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}},
        "calculator": {"create_kwargs": {}},
    }
    assert row["extra_info"]["interaction_kwargs"]["ground_truth"] == truth
    # Without --interaction the rows ask for none: the shipped config (no interaction) trains them as they are.
    assert main(["--train", str(SAMPLE), "--test-size", "10", "--out", str(tmp_path / "plain")]) == 0
    assert all(not r["extra_info"]["interaction_kwargs"] for r in RLDataset.from_files(tmp_path / "plain" / "train.parquet"))
    system, user = row["prompt"]
    assert system["role"] == "system" and "calc_gsm8k_reward" in system["content"] and "####" in system["content"]
    assert user["content"].startswith(row["extra_info"]["question"])
    # The reference solution itself earns full reward under the gsm8k rule.
    assert gsm8k_score(row["extra_info"]["answer"], truth) == 1.0


def test_parquet_input_and_bad_records(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"question": "1+1?", "answer": "#### 2"}]), tmp_path / "in.parquet")
    assert [r["reward_model"]["ground_truth"] for r in convert(tmp_path / "in.parquet", "train", "gsm8k")] == ["2"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    result = subprocess.run(
        [sys.executable, str(REPO / "launch" / "preprocess_gsm8k.py"), "--train", str(bad), "--out", str(tmp_path / "o")],
        capture_output=True, text=True, cwd=REPO,
    )
    assert result.returncode == 2 and "record 0 of" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "o" / "train.parquet").exists()
