"""DAPO's soft over-long punishment: hand-computed values, and the penalty inside the sequence score."""

from __future__ import annotations

import pytest
import torch

from mcore_agentic.data.batch import Batch, build_rollout_layout
from mcore_agentic.feed.scoring import score_rollout
from mcore_agentic.rewards.config import OverlongBufferConfig
from mcore_agentic.rewards.overlong import overlong_penalty


def test_penalty_is_zero_before_the_buffer_then_linear_to_the_factor():
    # Budget 20, buffer 8: free up to 12 tokens, then -factor * (L - 12) / 8.
    assert overlong_penalty(5, 20, 8, 1.0) == 0.0
    assert overlong_penalty(12, 20, 8, 1.0) == 0.0
    assert overlong_penalty(14, 20, 8, 1.0) == pytest.approx(-0.25)
    assert overlong_penalty(20, 20, 8, 0.5) == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="buffer_len=0"):
        overlong_penalty(5, 20, 0, 1.0)


class _Tok:
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


def _batch(lengths, finish):
    responses = [[5] * n for n in lengths]
    t = build_rollout_layout([[1, 2]] * len(lengths), responses, pad_token_id=0,
                             response_fields={"response_mask": ([[1] * n for n in lengths], torch.long)})
    return Batch(tensors=t, meta={
        "data_source": ["t"] * len(lengths), "ground_truth": ["x"] * len(lengths),
        "request_metrics": [{"state": "completed"}] * len(lengths), "tool_rewards": [0.5] * len(lengths),
        "finish_reason": finish,
    })


def test_score_rollout_adds_the_penalty_and_marks_truncation():
    batch = _batch([4, 14, 20], ["stop", "stop", "length"])
    rule = lambda *a: 1.0  # noqa: E731
    plain = score_rollout(batch, rule, _Tok(), [{}] * 3)
    assert plain["seq_scores"].tolist() == [1.5, 1.5, 1.5] and plain["overlong_penalty"] == [0.0, 0.0, 0.0]
    assert plain["truncated"].tolist() == [0, 0, 1]
    cfg = OverlongBufferConfig(enable=True, len=8, penalty_factor=1.0)
    shaped = score_rollout(batch, rule, _Tok(), [{}] * 3, overlong_buffer=cfg, max_response_length=20)
    assert shaped["overlong_penalty"] == pytest.approx([0.0, -0.25, -1.0])
    assert shaped["seq_scores"].tolist() == pytest.approx([1.5, 1.25, 0.5])
    off = score_rollout(batch, rule, _Tok(), [{}] * 3, overlong_buffer=OverlongBufferConfig(), max_response_length=20)
    assert off["seq_scores"].tolist() == [1.5, 1.5, 1.5]
