"""Unreadable data files and rows: one line naming the key, the file and the row; overlong rows cost no tokenising."""

from __future__ import annotations

import json
import os
import time

import pytest

from mcore_agentic.config import ConfigError
from mcore_agentic.data.config import DataConfig
from mcore_agentic.data.dataset import (
    RLDataset,
    cannot_fit,
    load_datasets,
    longest_token_chars,
    prompt_token_length,
    write_parquet,
)
from mcore_agentic.models.tokenizer import load_qwen_tokenizer


def _row(i: int = 0, content: str = "What is 2 + 3?") -> dict:
    return {"prompt": [{"role": "user", "content": content}], "data_source": "test/src",
            "reward_model": {"ground_truth": "5"}, "extra_info": {"index": i}}


def _error(tmp_path, name: str, data: bytes, field: str = "train_files") -> str:
    path = tmp_path / name
    path.write_bytes(data)
    cfg = DataConfig(**{field: str(path)}) if field == "train_files" else DataConfig(train_files=str(_good(tmp_path)), val_files=str(path))
    with pytest.raises(ConfigError) as err:
        load_datasets(cfg)
    message = str(err.value)
    assert "\n" not in message and str(path) in message, message
    assert message.startswith(f"data.{field}:"), message
    return message


def _good(tmp_path):
    path = tmp_path / "good.parquet"
    if not path.exists():
        write_parquet([_row(0), _row(1)], path)
    return path


def test_empty_random_and_truncated_parquet(tmp_path):
    assert "is empty (0 bytes)" in _error(tmp_path, "empty.parquet", b"")
    assert "is not a parquet file" in _error(tmp_path, "random.parquet", os.urandom(4096))
    whole = _good(tmp_path).read_bytes()
    assert "truncated?" in _error(tmp_path, "cut.parquet", whole[: len(whole) // 2])
    # Magic bytes intact, the middle scrambled: pyarrow's own error, in one line with the file.
    broken = whole[:4] + os.urandom(len(whole) - 8) + whole[-4:]
    assert "cannot be read as parquet" in _error(tmp_path, "mid.parquet", broken)


def test_a_jsonl_file_passed_as_parquet_is_named(tmp_path):
    message = _error(tmp_path, "rows.parquet", (json.dumps(_row()) + "\n").encode())
    assert "not a parquet file" in message and ".jsonl" in message


def test_bad_jsonl_files_name_the_line(tmp_path):
    good = json.dumps(_row()).encode()
    assert "line 2 is not UTF-8 text (byte 0xff" in _error(tmp_path, "latin.jsonl", good + b"\n" + b'{"a": "caf\xff"}\n')
    assert "line 3 is not JSON" in _error(tmp_path, "torn.jsonl", good + b"\n\n" + good[:20] + b"\n")
    assert "line 1 is a JSON list" in _error(tmp_path, "list.jsonl", b"[1, 2]\n")
    assert "only blank lines" in _error(tmp_path, "blank.jsonl", b"\n\n")
    assert "is not JSON" in _error(tmp_path, "bad.json", b"{")
    assert "holds a JSON dict" in _error(tmp_path, "obj.json", b"{}")
    assert "is empty" in _error(tmp_path, "val.jsonl", b"", field="val_files")


def test_a_bad_row_names_its_file_and_row_in_that_file(tmp_path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("".join(json.dumps(_row(i)) + "\n" for i in range(3)))
    bad = _row(1)
    bad["prompt"][0]["role"] = "robot"
    second.write_text(json.dumps(_row(0)) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ConfigError) as err:
        load_datasets(DataConfig(train_files=[str(first), str(second)]))
    assert str(err.value).startswith(f"prompt[0].role: row 1 of {second}: got 'robot'")


def test_jsonl_and_json_rows_load_like_parquet(tmp_path):
    rows = [_row(i) for i in range(3)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "d.json").write_text(json.dumps(rows))
    write_parquet(rows, tmp_path / "d.parquet")
    loaded = [list(RLDataset.from_files(tmp_path / f"d.{ext}")) for ext in ("jsonl", "json", "parquet")]
    assert loaded[0] == loaded[1] == loaded[2]


def test_an_overlong_row_is_dropped_before_tokenising():
    tokenizer = load_qwen_tokenizer("qwen2_5", 4096)
    longest = longest_token_chars(tokenizer)
    assert 16 <= longest <= 512  # the Qwen vocabulary's longest entry, in byte-level characters
    huge = _row(0, "x" * 10_000_000)
    start = time.perf_counter()
    ds = RLDataset.from_rows([_row(1), huge], "mem", tokenizer=tokenizer, max_prompt_length=128)
    assert time.perf_counter() - start < 2.0  # tokenising 10 MB takes tens of seconds
    assert len(ds) == 1 and ds.num_dropped_overlong == 1
    with pytest.raises(ConfigError, match="row 1 of mem: its text alone cannot fit in data.max_prompt_length=128"):
        RLDataset.from_rows([_row(1), huge], "mem", tokenizer=tokenizer, max_prompt_length=128,
                            filter_overlong_prompts=False)
    # The bound is safe: text that tokenises to at most the budget is never refused by it.
    for text in ("a" * 128, " " * 4000, "=" * 2000, "\n" * 3000, "é" * 128):
        messages = [{"role": "user", "content": text}]
        n = prompt_token_length(tokenizer, messages, None)
        assert not cannot_fit(messages, n, tokenizer), (text[:5], n)


def test_dropped_prompts_are_counted_with_the_longest_length(tmp_path, caplog):
    """docs/configuration.md: over-long prompts are dropped *and counted*; the count and the longest length are said."""
    import logging

    from mcore_agentic.feed.build import build_datasets

    tokenizer = load_qwen_tokenizer("qwen2_5", 4096)
    ds = RLDataset.from_rows([_row(0), _row(1, "word " * 300), _row(2, "word " * 200)], "mem", tokenizer=tokenizer,
                             max_prompt_length=128)
    assert (len(ds), ds.num_dropped_overlong) == (1, 2)
    assert 300 < ds.longest_dropped < 360
    assert ds.dropped_line() == (
        f"mem: dropped 2 of 3 prompts longer than data.max_prompt_length=128 (longest {ds.longest_dropped} tokens; "
        "chat template and tool schemas included): raise data.max_prompt_length to keep them"
    )
    # The feed says it once, at load time.
    from mcore_agentic.config import compose, load_config

    rows = [_row(0), _row(1, "word " * 300)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(compose("ppo_trainer", [f"data.train_files={tmp_path / 'd.jsonl'}", "data.max_prompt_length=128"]))
    with caplog.at_level(logging.WARNING, logger="mcore_agentic.feed.build"):
        train, _ = build_datasets(cfg.data, cfg.rollout, tokenizer, {})
    said = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(train) == 1 and said == [train.dropped_line()] and "dropped 1 of 2 prompts" in said[0]
