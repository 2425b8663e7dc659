"""Tests for advantage estimators on multi-turn masks: hand values and independent python loops."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from mcore_agentic.algorithms.advantages import compute_advantage
from mcore_agentic.algorithms.config import AlgorithmConfig
from mcore_agentic.algorithms.sequence_advantages import (
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    group_ids,
    place_sequence_rewards,
)

F64 = torch.float64


def test_place_sequence_rewards_on_last_sampled_token():
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]])
    out = place_sequence_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    assert out.tolist() == [[0, 0, 0, 2, 0], [0, 0, 0, 0, 0], [4, 0, 0, 0, 0]]
    with pytest.raises(ValueError, match="scores must be"):
        place_sequence_rewards(torch.zeros(2), mask)


# One two-turn trajectory: two sampled tokens, a two-token tool result (masked), one sampled token.
GAE_MASK = torch.tensor([[1, 1, 0, 0, 1]])
GAE_VALUES = torch.tensor([[0.5, 0.6, 9.0, 9.0, 0.8]], dtype=F64)
GAE_REWARDS = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]], dtype=F64)


def test_gae_by_hand_bootstraps_across_tool_result():
    adv, ret = compute_gae_advantage_return(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=0.9, lam=0.8, whiten=False)
    # Sampled steps V = 0.5, 0.6, 0.8; reward 1 on the last.
    # d2 = 1 - 0.8 = 0.2                      A2 = 0.2
    # d1 = 0.9 * 0.8 - 0.6 = 0.12             A1 = 0.12 + 0.72 * 0.2 = 0.264
    # d0 = 0.9 * 0.6 - 0.5 = 0.04             A0 = 0.04 + 0.72 * 0.264 = 0.23008
    assert adv[0].tolist() == pytest.approx([0.23008, 0.264, 0.0, 0.0, 0.2], abs=1e-12)
    assert ret[0].tolist() == pytest.approx([0.73008, 0.864, 0.0, 0.0, 1.0], abs=1e-12)
    white, _ = compute_gae_advantage_return(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=0.9, lam=0.8)
    kept = [0.23008, 0.264, 0.2]
    mean, var = statistics.mean(kept), statistics.variance(kept)
    assert white[0, [0, 1, 4]].tolist() == pytest.approx([(k - mean) / math.sqrt(var + 1e-8) for k in kept])
    assert white[0, 2:4].tolist() == [0.0, 0.0]


def _gae_reference(rewards, values, mask, gamma, lam):
    """Independent loop: compress each row to its sampled tokens, run textbook GAE, scatter back."""
    adv = [[0.0] * len(row) for row in mask]
    for b, row in enumerate(mask):
        idx = [t for t, m in enumerate(row) if m]
        last = 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            next_v = values[b][idx[k + 1]] if k + 1 < len(idx) else 0.0
            last = rewards[b][t] + gamma * next_v - values[b][t] + gamma * lam * last
            adv[b][t] = last
    return adv


def test_gae_matches_independent_loop_and_ignores_masked_values():
    torch.manual_seed(0)
    mask = (torch.rand(4, 9) > 0.35).long()
    mask[2] = 0
    values = torch.randn(4, 9, dtype=F64)
    scores = place_sequence_rewards(torch.randn(4, dtype=F64), mask)
    rewards = scores + torch.where(mask.bool(), 0.1 * torch.randn(4, 9, dtype=F64), 0.0)  # some dense rewards
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.95, lam=0.9, whiten=False)
    ref = torch.tensor(_gae_reference(rewards.tolist(), values.tolist(), mask.tolist(), 0.95, 0.9), dtype=F64)
    assert torch.allclose(adv, ref, atol=1e-12)
    assert torch.allclose(ret, torch.where(mask.bool(), ref + values, 0.0), atol=1e-12)
    # garbage at masked positions changes nothing
    bad_values, bad_rewards = values.clone(), rewards.clone()
    bad_values[~mask.bool()] = float("nan")
    bad_rewards[~mask.bool()] = 1e9
    adv2, ret2 = compute_gae_advantage_return(bad_rewards, bad_values, mask, gamma=0.95, lam=0.9)
    adv1, ret1 = compute_gae_advantage_return(rewards, values, mask, gamma=0.95, lam=0.9)
    assert torch.equal(adv1, adv2) and torch.equal(ret1, ret2)


INDEX = ["a", "a", "a", "b", "b", "c"]
SCORES = [1.0, 0.0, 1.0, 0.5, 0.5, 3.0]
OUT_MASK = torch.tensor([[1, 0, 1], [1, 1, 0], [0, 1, 1], [1, 1, 1], [0, 0, 1], [1, 1, 0]])


def _outcome_rewards():
    return place_sequence_rewards(torch.tensor(SCORES, dtype=F64), OUT_MASK)


def test_grpo_by_hand():
    adv, ret = compute_grpo_outcome_advantage(_outcome_rewards(), OUT_MASK, INDEX)
    std_a = statistics.stdev([1.0, 0.0, 1.0])  # unbiased: sqrt(1/3)
    per_seq = [(1 - 2 / 3) / (std_a + 1e-6), (0 - 2 / 3) / (std_a + 1e-6), (1 - 2 / 3) / (std_a + 1e-6), 0, 0, 0]
    expected = torch.tensor(per_seq, dtype=F64)[:, None] * OUT_MASK
    assert torch.allclose(adv, expected, atol=1e-12) and torch.equal(adv, ret)
    assert not torch.isnan(adv).any()  # identical-reward group "b" -> 0, group of one "c" -> 0
    centred, _ = compute_grpo_outcome_advantage(_outcome_rewards(), OUT_MASK, INDEX, norm_adv_by_std_in_grpo=False)
    assert centred[:, -1].tolist() == pytest.approx([1 / 3, 0, 1 / 3, 0, 0, 0])
    assert centred[1].tolist() == pytest.approx([-2 / 3, -2 / 3, 0])


def test_grpo_all_identical_and_masked_rewards_ignored():
    mask = torch.ones(4, 3, dtype=torch.long)
    adv, _ = compute_grpo_outcome_advantage(torch.full((4, 3), 0.7), mask, torch.tensor([5, 5, 5, 5]))
    assert torch.equal(adv, torch.zeros(4, 3))
    rewards = _outcome_rewards()
    noisy = rewards.clone()
    noisy[~OUT_MASK.bool()] = 100.0
    assert torch.equal(
        compute_grpo_outcome_advantage(noisy, OUT_MASK, INDEX)[0],
        compute_grpo_outcome_advantage(rewards, OUT_MASK, INDEX)[0],
    )


def test_rloo_by_hand():
    adv, _ = compute_rloo_outcome_advantage(_outcome_rewards(), OUT_MASK, INDEX)
    # group a: baselines (0+1)/2, (1+1)/2, (1+0)/2 -> 0.5, -1, 0.5; b: 0, 0; c: no baseline -> 0
    expected = torch.tensor([0.5, -1.0, 0.5, 0.0, 0.0, 0.0], dtype=F64)[:, None] * OUT_MASK
    assert torch.allclose(adv, expected, atol=1e-12)


def test_reinforce_plus_plus_by_hand():
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 0]])
    rewards = torch.tensor([[0.1, 0.0, 99.0, 1.0], [0.0, 0.0, 2.0, 0.0]], dtype=F64)
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    # row 0 (tool gap skipped, reward 99 there ignored): t3 = 1, t1 = 0.5, t0 = 0.1 + 0.25
    # row 1: t2 = 2, t1 = 1, t0 = 0.5
    assert ret.tolist() == [[0.35, 0.5, 0.0, 1.0], [0.5, 1.0, 2.0, 0.0]]
    kept = [0.35, 0.5, 1.0, 0.5, 1.0, 2.0]
    mean, var = statistics.mean(kept), statistics.variance(kept)
    white = [(k - mean) / math.sqrt(var + 1e-8) for k in kept]
    assert adv[mask.bool()].tolist() == pytest.approx(white)
    assert adv[~mask.bool()].tolist() == [0.0, 0.0]


def test_reinforce_plus_plus_baseline_by_hand():
    adv, _ = compute_reinforce_plus_plus_baseline_outcome_advantage(_outcome_rewards(), OUT_MASK, INDEX)
    centred = [1 / 3, -2 / 3, 1 / 3, 0.0, 0.0, 0.0]
    tokens = [c for c, row in zip(centred, OUT_MASK.tolist()) for m in row if m]
    mean, var = statistics.mean(tokens), statistics.variance(tokens)
    expected = [(c - mean) / math.sqrt(var + 1e-8) for c in tokens]
    assert adv[OUT_MASK.bool()].tolist() == pytest.approx(expected)
    assert (adv[~OUT_MASK.bool()] == 0).all()


def test_group_ids_and_dispatch():
    gid, n = group_ids(["x", "y", "x"], 3)
    assert gid.tolist() == [0, 1, 0] and n == 2
    with pytest.raises(ValueError, match="index has 2 entries"):
        group_ids(["x", "y"], 3)
    rewards = _outcome_rewards()
    for est in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        with pytest.raises(ValueError, match="needs index"):
            compute_advantage(AlgorithmConfig(adv_estimator=est), rewards, OUT_MASK)
        got, _ = compute_advantage(AlgorithmConfig(adv_estimator=est), rewards, OUT_MASK, index=INDEX)
        assert got.shape == rewards.shape
    with pytest.raises(ValueError, match="needs critic values"):
        compute_advantage(AlgorithmConfig(adv_estimator="gae"), rewards, OUT_MASK)
    gae, _ = compute_advantage(
        AlgorithmConfig(adv_estimator="gae", gamma=0.9, lam=0.8), GAE_REWARDS, GAE_MASK, values=GAE_VALUES
    )
    direct, _ = compute_gae_advantage_return(GAE_REWARDS, GAE_VALUES, GAE_MASK, 0.9, 0.8)
    assert torch.equal(gae, direct)
    rpp, _ = compute_advantage(AlgorithmConfig(adv_estimator="reinforce_plus_plus"), rewards, OUT_MASK)
    assert rpp.shape == rewards.shape
