"""Trajectory dumps of the default job round-trip: what the parquet says is what the trainer trained on.

The shared run (``default_job_dump`` in conftest: DP=2, two rollout engines, 2 steps) records
the batch every rank's actor update received. Every trained row must appear in the dump of
its step exactly once, with the same token ids, loss mask, trainer log-probs and advantages —
although the rows were dealt to the other replica half the time and the trainer-side values
came back to the rollout leader by :func:`~mcore_agentic.feed.distribute.return_rows`.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from mcore_agentic.feed.rollout_dump import read_dump

pytestmark = pytest.mark.timeout(400)


def _trained_rows(records_dir) -> dict[int, list[dict]]:
    """Per RL step (1-based), every row some replica's actor update trained on."""
    out: dict[int, list[dict]] = {}
    for path in sorted(records_dir.glob("rank*-update*.pt")):
        step = int(path.stem.split("update")[1]) + 1
        b = torch.load(path)
        width = b["prompts"].shape[1]
        for i in range(b["prompts"].shape[0]):
            p = int(b["attention_mask"][i, :width].sum())
            r = int(b["attention_mask"][i, width:].sum())
            out.setdefault(step, []).append({
                "ids": (tuple(b["prompts"][i, width - p :].tolist()), tuple(b["responses"][i, :r].tolist())),
                "mask": b["response_mask"][i, :r].tolist(),
                "old_log_probs": b["old_log_probs"][i, :r],
                "advantages": b["advantages"][i, :r],
            })
    return out


def test_dump_equals_what_the_trainer_trained_on(default_job_dump) -> None:
    table = read_dump(default_job_dump.dump_dir).to_pylist()
    trained = _trained_rows(default_job_dump.records_dir)
    assert sorted(trained) == [1, 2]
    for step, rows in trained.items():
        dumped = [r for r in table if r["split"] == "train" and r["step"] == step]
        assert len(dumped) == len(rows) == 8  # data.train_batch_size 4 x rollout.n 2, both rollout groups
        assert {r["group"] for r in dumped} == {0, 1}
        keys = [(tuple(r["prompt_ids"]), tuple(r["response_ids"])) for r in dumped]
        assert Counter(keys) == Counter(r["ids"] for r in rows)  # the same rows, as often
        by_ids = dict(zip(keys, dumped))
        for row in rows:
            d = by_ids[row["ids"]]
            assert d["response_mask"] == row["mask"]
            torch.testing.assert_close(torch.tensor(d["old_log_probs"]), row["old_log_probs"], rtol=0, atol=0)
            torch.testing.assert_close(torch.tensor(d["advantages"]), row["advantages"], rtol=0, atol=0)
            assert len(d["response_tokens"]) == len(d["response_ids"]) == len(d["rollout_log_probs"])
            # The engine sampled the masked tokens with the weights the trainer scored them with.
            gap = (torch.tensor(d["rollout_log_probs"]) - row["old_log_probs"]).abs()[torch.tensor(row["mask"]).bool()]
            assert float(gap.max()) < 1e-3
            assert d["weight_version"] == step  # the warm start is version 1, each update one more


def test_dump_rows_carry_conversation_rewards_and_tool_calls(default_job_dump) -> None:
    table = read_dump(default_job_dump.dump_dir).to_pylist()
    train = [r for r in table if r["split"] == "train"]
    val = [r for r in table if r["split"] == "val"]
    # before RL (trainer.val_before_train) and at step 2; data.synthetic.num_val=8, greedy, n=1
    assert sorted(r["step"] for r in val) == [0] * 8 + [2] * 8
    assert {r["weight_version"] for r in val if r["step"] == 0} == {1}  # the warm-started weights
    assert all(r["old_log_probs"] is None and r["advantages"] is None for r in val)
    for r in table:
        messages = json.loads(r["messages"])
        assert messages[0]["role"] == "system" and messages[-1]["role"] in ("assistant", "tool")
        assert r["reward"] == pytest.approx(r["reward_rule"] + r["reward_tool"] + r["reward_interaction"])
        assert r["finish_reason"] in ("stop", "length", "tool_calls", "aborted")
        calls = [m for m in messages if m["role"] == "tool"]
        assert len(r["tool_calls"]) == len(calls)
        for call, msg in zip(r["tool_calls"], calls):
            assert call["result"] == msg["content"] and call["seconds"] >= 0.0
            assert call["error"] == call["result"].startswith("Error")
    assert len(train) == 16 and all(r["response_tokens"] for r in train)
    for r in train:  # one turn end per assistant turn, each on its turn's last sampled token
        mask = r["response_mask"] + [0]
        runs = [i for i in range(len(mask) - 1) if mask[i] == 1 and mask[i + 1] == 0]
        assert [e for e in r["turn_ends"] if e >= 0] == runs and len(r["turn_rewards"]) == len(r["turn_ends"])
    # The warm-started policy reads the meter: its calls and the replies it read are in the dump.
    read = [(r, c) for r in table for c in r["tool_calls"] if not c["error"]]
    assert read, "the warm-started policy read no meter in 32 rollouts"
    for r, call in read:  # a successful call is read_meter, and its result is this row's reading
        assert call["name"] == "read_meter" and call["result"] == r["ground_truth"]


def test_dump_round_trips_when_leaders_are_not_replica_heads(tmp_path) -> None:
    """Actor TP=2 (one training replica over both ranks) with two rollout engines: rank 1 leads a rollout
    group but is not its replica's first rank, so its rows' trainer values come back from rank 0."""
    import os
    import subprocess
    import sys

    from tests.e2e.test_default_job import ROOT, job_overrides

    records = tmp_path / "trained"
    records.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "RECORD_ROWS_DIR": str(records)}
    extra = ["actor.tensor_model_parallel_size=2", "rollout.tensor_model_parallel_size=1",
             "actor.ppo_micro_batch_size_per_gpu=4", "trainer.total_training_steps=1", "trainer.test_freq=-1",
             "trainer.save_freq=-1", "trainer.logger=[console,jsonl]",
             f"trainer.rollout_data_dir={tmp_path / 'dump'}", "trainer.rollout_data_freq=1"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "e2e" / "_record_trained_rows.py"), *job_overrides(tmp_path, extra)]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    table = read_dump(tmp_path / "dump").to_pylist()
    assert {r["group"] for r in table} == {0, 1} and len(table) == 8
    b = torch.load(records / "rank1-update0.pt")  # both ranks of the one replica train all 8 rows
    width = b["prompts"].shape[1]
    by_ids = {(tuple(r["prompt_ids"]), tuple(r["response_ids"])): r for r in table}
    for i in range(8):
        p = int(b["attention_mask"][i, :width].sum())
        n = int(b["attention_mask"][i, width:].sum())
        d = by_ids[(tuple(b["prompts"][i, width - p :].tolist()), tuple(b["responses"][i, :n].tolist()))]
        assert d["response_mask"] == b["response_mask"][i, :n].tolist()
        assert d["old_log_probs"] == b["old_log_probs"][i, :n].tolist()
        assert d["advantages"] == b["advantages"][i, :n].tolist()
