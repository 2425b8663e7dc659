"""Trajectory dump tables: a scripted multi-turn rollout (good, malformed and unknown tool calls) to parquet and back,
row sampling, and the writer's queue policy when the disk falls behind."""

from __future__ import annotations

import asyncio
import json
import threading

import pyarrow.parquet as pq
import pytest
import torch

from mcore_agentic.feed import rollout_dump
from mcore_agentic.feed import scoring as exp
from mcore_agentic.feed.rollout_dump import DumpWriter, dump_rows, read_dump, select_rows
from mcore_agentic.models.tokenizer import load_qwen_tokenizer
from mcore_agentic.rollout.config import MultiTurnConfig, RolloutConfig
from mcore_agentic.rollout.driver import generate_sequences
from tests.unit.rollout.scripted import AddTool, ScriptedEngine, call

SCRIPTS = {
    "Q-a": [call("add", a=2, b=3), "#### 5"],
    "Q-b": [call("nope", x=1), '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>', "#### 7"],
}


def _rows():
    return [
        {"prompt": [{"role": "user", "content": f"{q}: add?"}], "data_source": "test/add",
         "reward_model": {"ground_truth": "5"}, "extra_info": {"tools_kwargs": {"add": {"create_kwargs": {"ground_truth": "5"}}}}}
        for q in ("Q-a", "Q-b")
    ]


def _reward(data_source, solution_str, ground_truth, extra_info):
    return 1.0 if solution_str.rstrip().endswith(f"#### {ground_truth}<|im_end|>") else 0.0


@pytest.fixture(scope="module")
def scored():
    tokenizer = load_qwen_tokenizer("qwen2_5", vocab_size=4096)
    cfg = RolloutConfig(n=2, prompt_length=400, response_length=128, multi_turn=MultiTurnConfig(max_assistant_turns=4))
    batch = asyncio.run(generate_sequences(_rows(), ScriptedEngine(tokenizer, SCRIPTS), {"add": AddTool()}, None, cfg, tokenizer))
    return exp.score_rollout(batch, _reward, tokenizer, [{}] * len(batch)), tokenizer


def test_table_holds_tokens_rewards_and_every_tool_call(scored, tmp_path):
    batch, tokenizer = scored
    adv = [torch.full((int(batch["attention_mask"][i, batch["prompts"].shape[1]:].sum()),), float(i)) for i in range(4)]
    writer = DumpWriter()
    queued = dump_rows(writer, tmp_path, [batch], split="train", step=3, group=1, weight_version=7,
                       tokenizer=tokenizer, trainer_fields={"advantages": adv, "old_log_probs": adv})
    writer.close()
    assert queued == 4 and writer.written_rows == 4
    assert (tmp_path / "train" / "step_000003-group_001.parquet").is_file()
    rows = read_dump(tmp_path).to_pylist()
    assert [r["row"] for r in rows] == [0, 1, 2, 3] and {r["weight_version"] for r in rows} == {7}
    width = batch["prompts"].shape[1]
    for i, r in enumerate(rows):
        real = batch["attention_mask"][i].bool()
        assert r["prompt_ids"] + r["response_ids"] == batch["input_ids"][i][real].tolist()
        assert "".join(r["response_tokens"]) == tokenizer.decode(r["response_ids"], skip_special_tokens=False)
        assert r["response_mask"] == batch["response_mask"][i, : len(r["response_ids"])].tolist()
        assert r["rollout_log_probs"] == pytest.approx(batch["rollout_log_probs"][i, : len(r["response_ids"])].tolist())
        assert r["advantages"] == [float(i)] * len(r["response_ids"]) and r["values"] is None
        assert r["prompt_text"].endswith("<|im_start|>assistant\n") and len(r["prompt_ids"]) <= width
        assert json.loads(r["messages"]) == batch["messages"][i]
    a, b = rows[0], rows[2]
    assert a["reward"] == pytest.approx(a["reward_rule"] + a["reward_tool"]) and a["reward_rule"] == 1.0 and a["acc"] == 1.0
    assert [(c["name"], json.loads(c["arguments"]), c["result"], c["error"]) for c in a["tool_calls"]] == [
        ("add", {"a": 2, "b": 3}, "5", False)
    ]
    assert b["reward_rule"] == 0.0 and len(b["tool_calls"]) == 2
    unknown, malformed = b["tool_calls"]
    assert unknown["name"] == "nope" and unknown["error"] and "nope" in unknown["result"]
    assert malformed["error"] and malformed["arguments"].startswith("<tool_call>")  # the raw text it could not parse
    assert all(c["turn"] in (1, 2) and c["seconds"] >= 0 for c in b["tool_calls"])


def test_validation_rows_of_several_rollouts_are_numbered_across_them(scored, tmp_path):
    batch, tokenizer = scored
    writer = DumpWriter()
    dump_rows(writer, tmp_path, [batch, batch], split="val", step=0, group=0, weight_version=1, tokenizer=tokenizer)
    writer.close()
    rows = read_dump(tmp_path).to_pylist()
    assert [r["row"] for r in rows] == list(range(8)) and all(r["old_log_probs"] is None for r in rows)


def test_select_rows_samples_a_seeded_fraction_under_the_cap():
    assert select_rows(10, fraction=1.0, max_rows=None, seed=0) == list(range(10))
    some = select_rows(10, fraction=0.3, max_rows=None, seed=4)
    assert len(some) == 3 and some == sorted(some) and some == select_rows(10, fraction=0.3, max_rows=None, seed=4)
    assert len(select_rows(10, fraction=0.01, max_rows=None, seed=0)) == 1  # never an empty dump
    assert len(select_rows(10, fraction=1.0, max_rows=4, seed=0)) == 4


def test_a_full_queue_drops_the_newest_dump_after_waiting_and_close_writes_the_rest(scored, tmp_path, monkeypatch, caplog):
    batch, tokenizer = scored
    gate = threading.Event()
    real_write = pq.write_table

    def slow_disk(*args, **kwargs):  # the first write hangs until the test opens the gate
        gate.wait(timeout=30)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(rollout_dump.pq, "write_table", slow_disk)
    writer = DumpWriter(queue_size=1, wait_s=0.05)
    kw = dict(split="train", group=0, weight_version=0, tokenizer=tokenizer)
    assert dump_rows(writer, tmp_path, [batch], step=1, **kw) == 4  # taken by the writer thread, blocked on disk
    for _ in range(100):  # the thread has taken step 1 off the queue once the queue is empty
        if writer.queue.empty():
            break
        threading.Event().wait(0.01)
    assert dump_rows(writer, tmp_path, [batch], step=2, **kw) == 4  # fills the one slot
    assert dump_rows(writer, tmp_path, [batch], step=3, **kw) == 0  # no slot within 0.05 s: dropped
    assert writer.dropped_rows == 4 and "dropped (4 rows)" in caplog.text
    gate.set()
    writer.close()
    assert sorted(p.name for p in (tmp_path / "train").iterdir()) == [
        "step_000001-group_000.parquet", "step_000002-group_000.parquet"
    ]
