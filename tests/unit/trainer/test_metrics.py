"""Metric reduction, batch data metrics, timing and throughput."""

from __future__ import annotations

import time

import pytest
import torch

from mcore_agentic.data.batch import Batch
from mcore_agentic.trainer.metrics import compute_data_metrics, reduce_metrics, throughput_metrics
from mcore_agentic.utils.timing import PhaseTimer, timer


def test_reduce_metrics():
    out = reduce_metrics({"reward": [1.0, 0.0, 0.5], "len": torch.tensor([3, 5]), "empty": []})
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
