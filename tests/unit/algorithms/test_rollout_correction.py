"""Rollout-training mismatch correction against hand-computed values: TIS and rejection at token, sequence and
geometric level, the veto, the metrics, the identity when the policies agree, and the weights in the PPO loss."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_agentic.algorithms.config import RolloutCorrectionConfig
from mcore_agentic.algorithms.losses import compute_policy_loss
from mcore_agentic.algorithms.rollout_correction import compute_rollout_correction
from mcore_agentic.utils.errors import ConfigError

# two rows; row 0 has 3 sampled tokens then padding, row 1 has 2 sampled, an environment token, 1 sampled
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 1]])
LOG_RATIO = torch.tensor([[0.5, -0.2, 0.1, 0.0], [1.5, 0.0, 0.0, -3.0]])  # log(pi_old / pi_rollout)
ROLLOUT = torch.full((2, 4), -1.0)
OLD = ROLLOUT + LOG_RATIO


def _corr(**kw):
    return compute_rollout_correction(OLD, ROLLOUT, MASK, RolloutCorrectionConfig(**kw))


def test_identity_when_the_engine_samples_the_trainers_policy():
    corr = compute_rollout_correction(ROLLOUT, ROLLOUT, MASK, RolloutCorrectionConfig(
        rollout_is="sequence", rollout_rs="token", rollout_rs_threshold=1.5, rollout_token_veto_threshold=1e-4))
    assert torch.equal(corr.weights, MASK.float()) and torch.equal(corr.mask, MASK)
    m = corr.metrics
    assert m["rollout_corr/ratio_mean"] == 1.0 and m["rollout_corr/kl_k1"] == 0.0 and m["rollout_corr/kl_k3"] == 0.0
    assert m["rollout_corr/masked_fraction"] == 0.0 and m["rollout_corr/clipped_fraction"] == 0.0


def test_token_tis_caps_each_tokens_ratio():
    corr = _corr(rollout_is="token", rollout_is_threshold=2.0)
    expected = torch.tensor([[math.exp(0.5), math.exp(-0.2), math.exp(0.1), 0.0], [2.0, 1.0, 0.0, math.exp(-3.0)]])
    torch.testing.assert_close(corr.weights, expected)
    assert torch.equal(corr.mask, MASK)  # TIS weights, never drops
    assert corr.metrics["rollout_corr/clipped_fraction"] == pytest.approx(1 / 6)  # of 6 sampled: only exp(1.5) > 2


def test_sequence_and_geometric_tis_weigh_whole_rows():
    seq = _corr(rollout_is="sequence", rollout_is_threshold=10.0)
    row0, row1 = math.exp(0.5 - 0.2 + 0.1), math.exp(1.5 + 0.0 - 3.0)  # environment token 1,2 not counted
    torch.testing.assert_close(seq.weights, torch.tensor([[row0] * 3 + [0.0], [row1, row1, 0.0, row1]]))
    geo = _corr(rollout_is="geometric", rollout_is_threshold=1.1)
    g0, g1 = min(math.exp(0.4 / 3), 1.1), min(math.exp(-1.5 / 3), 1.1)
    torch.testing.assert_close(geo.weights, torch.tensor([[g0] * 3 + [0.0], [g1, g1, 0.0, g1]]))
    assert geo.metrics["rollout_corr/clipped_fraction"] == pytest.approx(3 / 6)  # row 0: exp(0.133) > 1.1


def test_token_rejection_masks_tokens_outside_the_band():
    corr = _corr(rollout_rs="token", rollout_rs_threshold=2.0)  # lower: 1/2
    expected = torch.tensor([[1, 1, 1, 0], [0, 1, 0, 0]])  # exp(1.5) > 2 and exp(-3) < 0.5 are dropped
    assert torch.equal(corr.mask, expected)
    assert torch.equal(corr.weights, MASK.float())  # no TIS asked for
    assert corr.metrics["rollout_corr/masked_fraction"] == pytest.approx(2 / 6)
    assert corr.metrics["rollout_corr/rows_dropped_fraction"] == 0.0


def test_sequence_and_geometric_rejection_drop_whole_rows():
    seq = _corr(rollout_rs="sequence", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.3)
    assert torch.equal(seq.mask, torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]]))  # row 1: exp(-1.5) = 0.22 < 0.3
    assert seq.metrics["rollout_corr/rows_dropped_fraction"] == 0.5
    geo = _corr(rollout_rs="geometric", rollout_rs_threshold=1.1, rollout_rs_threshold_lower=0.5)
    assert torch.equal(geo.mask, torch.tensor([[0, 0, 0, 0], [1, 1, 0, 1]]))  # row 0: exp(0.133) > 1.1


def test_veto_drops_rows_with_one_very_unlikely_token():
    corr = _corr(rollout_token_veto_threshold=0.1)  # exp(-3) = 0.05 in row 1
    assert torch.equal(corr.mask, torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]]))


def test_kl_estimates_and_ratio_statistics():
    m = _corr(rollout_is="token").metrics
    lr = torch.tensor([0.5, -0.2, 0.1, 1.5, 0.0, -3.0], dtype=torch.float64)
    assert m["rollout_corr/kl_k1"] == pytest.approx(float(-lr.mean()))
    assert m["rollout_corr/kl_k3"] == pytest.approx(float((lr.exp() - 1 - lr).mean()))
    assert m["rollout_corr/ratio_mean"] == pytest.approx(float(lr.exp().mean()))
    assert m["rollout_corr/ratio_max"] == pytest.approx(math.exp(1.5)) and m["rollout_corr/ratio_min"] == pytest.approx(math.exp(-3))
    assert m["rollout_corr/ratio_p50"] == pytest.approx(1.0, rel=0.01)  # the third of six log-ratios: 0
    assert m["rollout_corr/ratio_p99"] == pytest.approx(math.exp(1.5), rel=0.02)


def test_policy_loss_multiplies_each_tokens_term_by_its_weight():
    adv = torch.tensor([[1.0, -2.0, 0.5, 0.0], [3.0, 1.0, 0.0, -1.0]])
    w = _corr(rollout_is="token").weights
    logp = ROLLOUT.clone().requires_grad_(True)
    out = compute_policy_loss(ROLLOUT, logp, adv, MASK, weights=w)  # ratio 1: the loss is -mean(A * w)
    assert float(out.pg_loss.detach()) == pytest.approx(float(-(adv * w * MASK).sum() / MASK.sum()))
    out.pg_loss.backward()
    torch.testing.assert_close(logp.grad, -(adv * w * MASK) / MASK.sum())
    plain = compute_policy_loss(ROLLOUT, ROLLOUT, adv, MASK)
    assert float(plain.pg_loss) == pytest.approx(float(-(adv * MASK).sum() / MASK.sum()))


def test_config_names_the_bad_key():
    with pytest.raises(ConfigError, match="algorithm.rollout_correction.rollout_is"):
        RolloutCorrectionConfig(rollout_is="seq")
    with pytest.raises(ConfigError, match="rollout_rs_threshold_lower"):
        RolloutCorrectionConfig(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=3.0)
    assert not RolloutCorrectionConfig().enabled and RolloutCorrectionConfig(rollout_rs="token").enabled


def test_percentiles_stay_inside_the_observed_ratios():
    # Ratios of 1 +- 1e-6 (engine and trainer in fp32) fall in the histogram bins centred at 0.995 and 1.005;
    # the reported percentiles are bounded by the ratios actually seen.
    old = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    rollout = old + torch.tensor([[1e-6, -1e-6, 2e-7]], dtype=torch.float64)
    m = compute_rollout_correction(old, rollout, torch.ones(1, 3), RolloutCorrectionConfig(rollout_is="token")).metrics
    for q in ("p01", "p50", "p99"):
        assert m["rollout_corr/ratio_min"] <= m[f"rollout_corr/ratio_{q}"] <= m["rollout_corr/ratio_max"]
        assert m[f"rollout_corr/ratio_{q}"] == pytest.approx(1.0, abs=2e-6)


def test_metrics_by_token_age_split_the_mismatch_by_how_old_the_sampling_weights_were():
    # row 0: two fresh tokens (log-ratio 0); row 1: one token 1 version old, two 3 versions old (the 2plus bucket)
    old = torch.tensor([[0.0, 0.0, 0.0], [0.2, -0.8, 0.7]])
    rollout = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    ages = torch.tensor([[0, 0, 5], [1, 3, 3]])  # the padded token's age never counts
    cfg = RolloutCorrectionConfig(rollout_rs="token", rollout_rs_threshold=1.5, rollout_rs_threshold_lower=0.5)
    m = compute_rollout_correction(old, rollout, mask, cfg, token_ages=ages).metrics

    def k3(x: float) -> float:
        return math.exp(x) - 1 - x

    assert m["rollout_corr/age_0/token_fraction"] == pytest.approx(2 / 5)
    assert m["rollout_corr/age_1/token_fraction"] == pytest.approx(1 / 5)
    assert m["rollout_corr/age_2plus/token_fraction"] == pytest.approx(2 / 5)
    assert m["rollout_corr/age_0/kl_k3"] == 0.0
    assert m["rollout_corr/age_1/kl_k3"] == pytest.approx(k3(0.2))
    assert m["rollout_corr/age_2plus/kl_k3"] == pytest.approx((k3(-0.8) + k3(0.7)) / 2)
    # exp(0.7) > 1.5 and exp(-0.8) < 0.5 are rejected: both old tokens; the fresh and 1-old ones stay
    assert m["rollout_corr/age_0/masked_fraction"] == 0.0 and m["rollout_corr/age_1/masked_fraction"] == 0.0
    assert m["rollout_corr/age_2plus/masked_fraction"] == 1.0
    assert "rollout_corr/age_0/kl_k3" not in compute_rollout_correction(old, rollout, mask, cfg).metrics
