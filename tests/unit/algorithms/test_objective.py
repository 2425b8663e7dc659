"""Tests for the config-driven actor/critic objectives: hand values, micro-batch sums, missing inputs."""

from __future__ import annotations

import pytest
import torch

from mcore_agentic.algorithms.config import PolicyLossConfig, ValueLossConfig
from mcore_agentic.algorithms.losses import loss_normalisers
from mcore_agentic.algorithms.objective import compute_actor_loss, compute_critic_loss

F64 = torch.float64


def test_actor_loss_by_hand():
    cfg = PolicyLossConfig(entropy_coeff=0.1, use_kl_loss=True, kl_loss_coef=0.2, kl_loss_type="k2")
    zeros = torch.zeros(1, 3, dtype=F64)
    log_prob = zeros.clone().requires_grad_(True)
    adv = torch.tensor([[1.0, -2.0, 50.0]], dtype=F64)
    entropy = torch.tensor([[1.0, 3.0, 50.0]], dtype=F64)
    ref = torch.tensor([[-1.0, 1.0, 50.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]])
    out = compute_actor_loss(cfg, zeros, log_prob, adv, mask, entropy=entropy, ref_log_prob=ref)
    # ratio 1: pg = mean(-1, 2) = 0.5; entropy mean 2 -> -0.1 * 2; k2 = 0.5 * d^2 = 0.5 each -> +0.2 * 0.5
    assert out.loss.item() == pytest.approx(0.5 - 0.2 + 0.1)
    assert out.metrics["actor/entropy"].item() == 2.0
    assert out.metrics["actor/kl_loss"].item() == pytest.approx(0.5)
    assert out.metrics["actor/pg_clipfrac"].item() == 0.0
    out.loss.backward()
    # d/dlogp: pg -A/2 -> [-0.5, 1.0]; k2 grad d = logp - ref = [1, -1], x 0.2 / 2
    assert log_prob.grad[0].tolist() == pytest.approx([-0.5 + 0.1, 1.0 - 0.1, 0.0])


def test_actor_micro_batches_sum_to_mini_batch():
    cfg = PolicyLossConfig(loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.01, use_kl_loss=True)
    torch.manual_seed(0)
    old = torch.randn(6, 5, dtype=F64) * 0.2 - 1
    log_prob = (old + 0.3 * torch.randn(6, 5, dtype=F64)).requires_grad_(True)
    adv, ent, ref = torch.randn(6, 5, dtype=F64), torch.rand(6, 5, dtype=F64), old - 0.1
    mask = (torch.rand(6, 5) > 0.3).long()
    full = compute_actor_loss(cfg, old, log_prob, adv, mask, entropy=ent, ref_log_prob=ref).loss
    norm = loss_normalisers(mask)
    parts = [
        compute_actor_loss(
            cfg, old[s], log_prob[s], adv[s], mask[s], entropy=ent[s], ref_log_prob=ref[s], normalisers=norm
        ).loss
        for s in (slice(0, 4), slice(4, 6))
    ]
    assert sum(parts).item() == pytest.approx(full.item(), rel=1e-12)


def test_actor_missing_inputs_name_the_setting():
    t = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="entropy_coeff"):
        compute_actor_loss(PolicyLossConfig(entropy_coeff=0.1), t, t, t, t.long())
    with pytest.raises(ValueError, match="use_kl_loss"):
        compute_actor_loss(PolicyLossConfig(use_kl_loss=True), t, t, t, t.long())
    out = compute_actor_loss(PolicyLossConfig(), t, t, t, torch.ones(1, 2, dtype=torch.long))
    assert "actor/kl_loss" not in out.metrics and "actor/entropy" not in out.metrics


def test_critic_loss_by_hand():
    vpreds = torch.tensor([[1.0, 2.0, 0.0]], dtype=F64, requires_grad=True)
    values = torch.tensor([[0.5, 1.0, 0.2]], dtype=F64)
    returns = torch.tensor([[1.2, 0.0, 1.0]], dtype=F64)
    out = compute_critic_loss(ValueLossConfig(cliprange_value=0.3), vpreds, returns, values, torch.ones(1, 3))
    assert out.loss.item() == pytest.approx(0.5 * (0.16 + 4.0 + 1.0) / 3)
    assert out.metrics["critic/vf_clipfrac"].item() == pytest.approx(1 / 3)
    assert out.metrics["critic/vpred_mean"].item() == pytest.approx(1.0)
