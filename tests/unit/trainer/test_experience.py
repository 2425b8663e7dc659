"""Experience assembly: re-padding DP shares into one global batch, scores -> token rewards -> GRPO advantages."""

from __future__ import annotations

import pytest
import torch

from mcore_agentic.algorithms.config import AlgorithmConfig
from mcore_agentic.algorithms.kl import build_kl_controller
from mcore_agentic.data.batch import Batch
from mcore_agentic.trainer.experience import compute_experience, concat_padded, rollout_vs_train_metrics

PAD = 0


def _share(prompts: list[list[int]], responses: list[list[int]], masks: list[list[int]], uid: str) -> Batch:
    p = max(len(x) for x in prompts)
    r = max(len(x) for x in responses)
    b = len(prompts)
    pt = torch.full((b, p), PAD)
    rt = torch.full((b, r), PAD)
    attn = torch.zeros((b, p + r), dtype=torch.long)
    mt = torch.zeros((b, r), dtype=torch.long)
    for i in range(b):
        pt[i, p - len(prompts[i]):] = torch.tensor(prompts[i])
        attn[i, p - len(prompts[i]):p] = 1
        rt[i, : len(responses[i])] = torch.tensor(responses[i])
        attn[i, p: p + len(responses[i])] = 1
        mt[i, : len(masks[i])] = torch.tensor(masks[i])
    return Batch(
        tensors={"prompts": pt, "responses": rt, "input_ids": torch.cat([pt, rt], 1), "attention_mask": attn,
                 "position_ids": (attn.cumsum(1) - 1).clamp(min=0), "response_mask": mt,
                 "rollout_log_probs": mt.float() * -0.5, "seq_scores": torch.arange(b, dtype=torch.float32)},
        meta={"uid": [uid] * b},
    )


def test_concat_padded_keeps_every_row_and_relayouts_padding():
    a = _share([[5, 6, 7]], [[8, 9]], [[1, 1]], "a")
    b = _share([[5], [6, 7]], [[8, 9, 10, 11], [12]], [[1, 0, 1, 1], [1]], "b")
    g = concat_padded([a, b], PAD)
    assert g["prompts"].tolist() == [[5, 6, 7], [PAD, PAD, 5], [PAD, 6, 7]]
    assert g["responses"].tolist() == [[8, 9, PAD, PAD], [8, 9, 10, 11], [12, PAD, PAD, PAD]]
    assert g["response_mask"].tolist() == [[1, 1, 0, 0], [1, 0, 1, 1], [1, 0, 0, 0]]
    assert g["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0, 0]]
    assert g["position_ids"][1].tolist() == [0, 0, 0, 1, 2, 3, 4]
    assert torch.equal(g["input_ids"], torch.cat([g["prompts"], g["responses"]], 1))
    assert g["seq_scores"].tolist() == [0.0, 0.0, 1.0] and g["uid"] == ["a", "b", "b"]


def test_grpo_experience_scores_on_last_sampled_token():
    batch = _share([[1]] * 4, [[2, 3, 4]] * 4, [[1, 0, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]], "x")
    batch = batch.update({"seq_scores": torch.tensor([1.0, 0.0, 1.0, 0.0])}, meta={"uid": ["g", "g", "h", "h"]})
    out, metrics = compute_experience(batch, AlgorithmConfig(adv_estimator="grpo"), build_kl_controller(
        AlgorithmConfig().kl_ctrl))
    assert out["token_level_scores"].tolist() == [[0, 0, 1], [0, 0, 0], [0, 0, 1], [0, 0, 0]]
    # group g: scores 1, 0 -> mean 0.5, unbiased std 0.7071 -> +-0.7071 on sampled tokens only
    adv = out["advantages"]
    assert adv[0].tolist() == pytest.approx([0.7071, 0.0, 0.7071], abs=1e-3)
    assert adv[1].tolist() == pytest.approx([-0.7071, -0.7071, 0.0], abs=1e-3)
    assert metrics == {}


def test_rollout_vs_train_gap_counts_sampled_tokens_only():
    batch = _share([[1]], [[2, 3, 4]], [[1, 0, 1]], "x")
    batch = batch.update({"rollout_log_probs": torch.tensor([[-1.0, -9.0, -2.0]]),
                          "old_log_probs": torch.tensor([[-1.5, 0.0, -2.0]])})
    m = rollout_vs_train_metrics(batch)
    assert m["rollout/logprob_diff_max"] == pytest.approx(0.5)
    assert m["rollout/logprob_diff_mean"] == pytest.approx(0.25)
