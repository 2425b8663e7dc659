"""An agent program whose every episode forks trains every sample, end to end on 2 gloo ranks (DP=2).

The program (``tests/e2e/_forking_agent.py``) drops the system message after the first tool result, so each episode
that reads the meter has two samples. One RL step of the default job with ``grpo`` and with ``grpo_turn``: the step's rows are counted after
the rollout and padded with filler rows to split evenly over mini-batches and replicas; the actor update trains each
sample's own tokens, the fillers train nothing, and the advantages count episodes, not rows — with ``grpo_turn`` at
the episode's turn indices, a continuation sample's turns counting on from its earlier sample's (checked against the
dumped rewards by hand). The rows each rank's update received are recorded (``_record_trained_rows.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from tests.e2e.test_default_job import ROOT, job_overrides


def _runs(mask: list[int]) -> list[list[int]]:
    """The positions of each run of sampled tokens (each assistant turn)."""
    runs: list[list[int]] = []
    for i, k in enumerate(mask):
        if k and (not i or not mask[i - 1]):
            runs.append([])
        if k:
            runs[-1].append(i)
    return runs


def _grpo_want(table: list[dict], by_episode: dict[str, list[dict]]) -> dict[tuple[str, int], float]:
    """grpo without the std: every turn of a sample gets its episode's reward minus the mean over its group's
    episodes (a two-sample episode counts once)."""
    groups: dict[str, list[float]] = defaultdict(list)
    for samples in by_episode.values():
        groups[samples[0]["uid"]].append(samples[0]["reward"])
    out = {}
    for r in table:
        rewards = groups[r["uid"]]
        for t in range(len(_runs(r["response_mask"]))):
            out[(r["request_id"], t)] = r["reward"] - sum(rewards) / len(rewards) if len(rewards) > 1 else 0.0
    return out


def _grpo_turn_want(table: list[dict], by_episode: dict[str, list[dict]]) -> dict[tuple[str, int], float]:
    """grpo_turn (gamma 1, the outcome on each sample's last token): a turn at the episode's turn index k (a sample's
    turns count on from its earlier samples') gets the episode's reward minus the mean reward of the group's other
    episodes that have a turn at k (0 if none; 0 in a group with no other acting episode)."""
    at: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
    index: dict[tuple[str, int], int] = {}
    acting: dict[str, set[str]] = defaultdict(set)
    for episode, samples in by_episode.items():
        offset = 0
        for r in sorted(samples, key=lambda r: r["episode_sample"]):
            for t in range(len(_runs(r["response_mask"]))):
                at[(r["uid"], offset + t)][episode] = r["reward"]
                index[(r["request_id"], t)] = offset + t
                acting[r["uid"]].add(episode)
            offset += len(_runs(r["response_mask"]))
    out = {}
    for (request_id, t), k in index.items():
        r = next(row for row in table if row["request_id"] == request_id)
        others = [v for e, v in at[(r["uid"], k)].items() if e != r["episode_id"]]
        alone = len(acting[r["uid"]]) <= 1
        out[(request_id, t)] = 0.0 if alone else r["reward"] - (sum(others) / len(others) if others else 0.0)
    return out


@pytest.mark.timeout(420)
@pytest.mark.parametrize("estimator", ["grpo", "grpo_turn"])
def test_a_forking_agents_samples_all_train_as_episodes(tmp_path: Path, estimator: str) -> None:
    records = tmp_path / "trained"
    records.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "RECORD_ROWS_DIR": str(records)}
    extra = [
        "trainer.total_training_steps=1", "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.logger=[console,jsonl]",
        f"trainer.rollout_data_dir={tmp_path / 'dump'}", "trainer.rollout_data_freq=1",
        "rollout.agent.entrypoint=tests/e2e/_forking_agent.py:run", "rollout.multi_turn.tool_config_path=null",
        "data.max_prompt_length=160", f"algorithm.adv_estimator={estimator}", "algorithm.norm_adv_by_std_in_grpo=false",
    ]
    if estimator == "grpo_turn":  # the reward function judges each episode by its last sample, in validation too
        extra += ["rollout.agent.reward=reward_fn", "trainer.val_before_train=true"]
    overrides = [o if not o.startswith("trainer.sft_warmup_steps=") else "trainer.sft_warmup_steps=120"
                 for o in job_overrides(tmp_path, extra) if o != "trainer.val_before_train=false"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "e2e" / "_record_trained_rows.py"), *overrides]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]

    metrics = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    if estimator == "grpo_turn":
        assert "val/reward/accuracy" in next(r for r in metrics if r.get("step") == 0)
    m = next(r for r in metrics if r.get("step") == 1 and "agent/trained_samples" in r)
    episodes, trained, rows = m["agent/episodes"], m["agent/trained_samples"], m["rollout/step_rows"]
    assert episodes == 8 and trained > episodes, m  # the warm-started policy reads the meter: episodes fork
    assert rows % 4 == 0 and 0 <= rows - trained < 4  # 2 mini-batches x 2 replicas; fewer than 4 fillers

    table = pq.read_table(sorted((tmp_path / "dump" / "train").glob("step_000001-*.parquet"))).to_pylist()
    assert len(table) == trained  # every trained sample, no filler
    by_episode: dict[str, list[dict]] = defaultdict(list)
    for r in table:
        by_episode[r["episode_id"]].append(r)
    assert len(by_episode) == episodes
    for samples in by_episode.values():
        assert sorted(r["episode_sample"] for r in samples) == list(range(samples[0]["episode_samples"]))
        assert len({r["reward"] for r in samples}) == 1  # the episode's reward, on each of its samples
    want = (_grpo_want if estimator == "grpo" else _grpo_turn_want)(table, by_episode)
    for r in table:
        for t, positions in enumerate(_runs(r["response_mask"])):
            got = {round(r["advantages"][i], 5) for i in positions}
            assert got == {round(want[(r["request_id"], t)], 5)}, (r["request_id"], t, got, want[(r["request_id"], t)])

    updates = [torch.load(p) for p in sorted(records.glob("rank*-update0.pt"))]
    assert len(updates) == 2 and {len(u["response_mask"]) for u in updates} == {rows // 2}  # equal shares
    fillers = sum(int((u["response_mask"].sum(1) == 0).sum()) for u in updates)
    failed = sum(r["state"] == "failed" for r in table)
    assert fillers == rows - trained + failed  # filler rows and failed episodes train nothing, every sample trains
