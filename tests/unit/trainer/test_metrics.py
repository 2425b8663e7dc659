"""Metric reduction, batch data metrics, timing and throughput."""

from __future__ import annotations

import time

import pytest
import torch

from mcore_agentic.data.batch import Batch
from mcore_agentic.parallel.stats import Stats
from mcore_agentic.trainer.experience import compute_data_metrics, throughput_metrics
from mcore_agentic.utils.timing import PhaseTimer, timer


def test_stats_summaries():
    st = Stats().add("reward", [1.0, 0.0, 0.5]).add("len", torch.tensor([3, 5])).add("empty", [])
    out = {**st.summary("reward"), **st.summary("len"), **st.summary("empty")}
    assert out == {"reward/mean": 0.5, "reward/max": 1.0, "reward/min": 0.0, "len/mean": 4.0, "len/max": 5.0, "len/min": 3.0}


def test_data_metrics_from_batch():
    # 2 sequences, prompt width 3 (left padded), response width 4 (right padded).
    attention = torch.tensor([[0, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]])
    response_mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 1]])
    scores = torch.zeros(2, 4)
    scores[0, 1] = 1.0
    batch = Batch(
        tensors={
            "prompts": torch.zeros(2, 3, dtype=torch.long),
            "attention_mask": attention,
            "response_mask": response_mask,
            "token_level_scores": scores,
            "advantages": torch.tensor([[1.0, 3.0, 99.0, 99.0], [2.0, 99.0, 2.0, 2.0]]),
        }
    )
    m = compute_data_metrics(batch, max_response_length=4)
    assert m["critic/score/mean"] == 0.5 and m["critic/score/max"] == 1.0
    assert m["critic/advantages/mean"] == pytest.approx(2.0) and m["critic/advantages/max"] == 3.0  # masked 99s ignored
    assert m["prompt_length/mean"] == 2.5 and m["response_length/mean"] == 3.5
    assert m["response_length/clip_ratio"] == 0.5
    assert m["response/policy_tokens/mean"] == 2.5


def test_data_metrics_cover_every_present_key_and_skip_absent_ones():
    mask = torch.tensor([[1, 0, 1], [0, 1, 1]])
    batch = Batch(
        tensors={
            "response_mask": mask,
            "token_level_scores": torch.tensor([[0.0, 0.0, 2.0], [0.0, 0.0, -1.0]]),
            "token_level_rewards": torch.tensor([[0.0, 0.0, 1.5], [0.0, 0.5, -1.0]]),
            "returns": torch.tensor([[1.0, 50.0, 3.0], [-50.0, 2.0, 6.0]]),
            "values": torch.tensor([[0.5, 9.0, 0.5], [9.0, 1.0, 1.0]]),
        }
    )
    m = compute_data_metrics(batch, max_response_length=3, group=None)
    assert m["critic/score/mean"] == 0.5 and m["critic/score/min"] == -1.0
    assert m["critic/rewards/mean"] == pytest.approx(0.5) and m["critic/rewards/max"] == 1.5
    assert m["critic/returns/mean"] == 3.0 and m["critic/returns/max"] == 6.0 and m["critic/returns/min"] == 1.0
    assert m["critic/values/mean"] == pytest.approx(0.75) and m["critic/values/max"] == 1.0
    assert m["response/policy_tokens/mean"] == 2.0
    # No advantages, prompts or attention mask in the batch: no such metrics (and no clip ratio without lengths).
    assert not any(k.startswith(("critic/advantages", "prompt_length", "response_length")) for k in m)
    assert m == compute_data_metrics(batch, max_response_length=3)


def test_data_metrics_of_no_rows_are_empty():
    batch = Batch(
        tensors={
            "prompts": torch.zeros(0, 3, dtype=torch.long),
            "attention_mask": torch.zeros(0, 7, dtype=torch.long),
            "response_mask": torch.zeros(0, 4, dtype=torch.long),
            "token_level_scores": torch.zeros(0, 4),
            "advantages": torch.zeros(0, 4),
        }
    )
    assert compute_data_metrics(batch, max_response_length=4) == {}


def test_clip_ratio_needs_a_max_response_length():
    batch = Batch(tensors={"prompts": torch.zeros(1, 1, dtype=torch.long), "attention_mask": torch.ones(1, 3)})
    m = compute_data_metrics(batch)
    assert m["response_length/mean"] == 2.0 and "response_length/clip_ratio" not in m
    assert compute_data_metrics(batch, max_response_length=2)["response_length/clip_ratio"] == 1.0


def test_timer_accumulates_and_phase_timer_pops():
    timings: dict[str, float] = {}
    with timer("gen", timings, sync=False):
        time.sleep(0.01)
    with timer("gen", timings, sync=False):
        time.sleep(0.01)
    assert timings["gen"] >= 0.02
    t = PhaseTimer(sync=False)
    with t.phase("update"):
        pass
    popped = t.pop()
    assert list(popped) == ["timing_s/update"] and t.pop() == {}


def test_timer_records_even_when_the_block_raises():
    timings: dict[str, float] = {}
    with pytest.raises(RuntimeError), timer("boom", timings, sync=False):
        raise RuntimeError
    assert "boom" in timings


def test_throughput():
    m = throughput_metrics(num_tokens=1000, step_seconds=2.0, world_size=4)
    assert m["perf/tokens_per_s"] == 500.0 and m["perf/throughput"] == 125.0
    assert throughput_metrics(10, 0.0, 1) == {}
