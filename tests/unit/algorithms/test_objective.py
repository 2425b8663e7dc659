"""The config-driven actor/critic objectives the workers train with: hand values, micro-batch sums, missing inputs."""

from __future__ import annotations

import pytest
import torch

from mcore_agentic.algorithms.config import PolicyLossConfig, ValueLossConfig
from mcore_agentic.algorithms.losses import loss_normalisers
from mcore_agentic.algorithms.objective import actor_objective, critic_objective

F64 = torch.float64


def _actor(cfg, mask, norms=None, **t):
    return actor_objective(cfg, norms or loss_normalisers(mask), response_mask=mask, **t)


def test_actor_loss_by_hand():
    cfg = PolicyLossConfig(entropy_coeff=0.1, use_kl_loss=True, kl_loss_coef=0.2, kl_loss_type="k2")
    zeros = torch.zeros(1, 3, dtype=F64)
    log_prob = zeros.clone().requires_grad_(True)
    adv = torch.tensor([[1.0, -2.0, 50.0]], dtype=F64)
    entropy = torch.tensor([[1.0, 3.0, 50.0]], dtype=F64)
    ref = torch.tensor([[-1.0, 1.0, 50.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]])
    out = _actor(cfg, mask, old_log_probs=zeros, log_probs=log_prob, entropys=entropy, advantages=adv,
                 ref_log_probs=ref)
    # ratio 1: pg = mean(-1, 2) = 0.5; entropy mean 2 -> -0.1 * 2; k2 = 0.5 * d^2 = 0.5 each -> +0.2 * 0.5
    assert out.loss.item() == pytest.approx(0.5 - 0.2 + 0.1)
    assert out.metrics["loss"].item() == pytest.approx(0.4)
    assert out.metrics["entropy"].item() == 2.0
    assert out.metrics["kl_loss"].item() == pytest.approx(0.5)
    assert out.metrics["pg_clipfrac"].item() == 0.0
    out.loss.backward()
    # d/dlogp: pg -A/2 -> [-0.5, 1.0]; k2 grad d = logp - ref = [1, -1], x 0.2 / 2
    assert log_prob.grad[0].tolist() == pytest.approx([-0.5 + 0.1, 1.0 - 0.1, 0.0])


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_actor_micro_batches_sum_to_mini_batch(mode):
    cfg = PolicyLossConfig(loss_agg_mode=mode, entropy_coeff=0.01, use_kl_loss=True, clip_ratio_low=0.1)
    torch.manual_seed(0)
    old = torch.randn(6, 5, dtype=F64) * 0.2 - 1
    log_prob = (old + 0.3 * torch.randn(6, 5, dtype=F64)).requires_grad_(True)
    adv, ent, ref = torch.randn(6, 5, dtype=F64), torch.rand(6, 5, dtype=F64), old - 0.1
    mask = (torch.rand(6, 5) > 0.3).long()
    t = dict(old_log_probs=old, log_probs=log_prob, entropys=ent, advantages=adv, ref_log_probs=ref)
    full = _actor(cfg, mask, **t)
    norms = loss_normalisers(mask)
    parts = [_actor(cfg, mask[s], norms, **{k: v[s] for k, v in t.items()}) for s in (slice(0, 4), slice(4, 6))]
    assert sum(p.loss for p in parts).item() == pytest.approx(full.loss.item(), rel=1e-12)
    for key in full.metrics:  # metrics are shares: they sum to the mini-batch's too
        assert sum(p.metrics[key] for p in parts).item() == pytest.approx(full.metrics[key].item(), rel=1e-6), key
    assert full.metrics["pg_clipfrac"].item() > 0


def test_actor_kl_loss_needs_the_reference():
    t = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="use_kl_loss"):
        _actor(PolicyLossConfig(use_kl_loss=True), torch.ones(1, 2, dtype=torch.long), old_log_probs=t, log_probs=t,
               entropys=t, advantages=t)
    out = _actor(PolicyLossConfig(), torch.ones(1, 2, dtype=torch.long), old_log_probs=t, log_probs=t, entropys=t,
                 advantages=t)
    assert "kl_loss" not in out.metrics and "entropy" in out.metrics


def test_critic_loss_by_hand_and_micro_batch_sums():
    vpreds = torch.tensor([[1.0, 2.0, 0.0]], dtype=F64, requires_grad=True)
    values = torch.tensor([[0.5, 1.0, 0.2]], dtype=F64)
    returns = torch.tensor([[1.2, 0.0, 1.0]], dtype=F64)
    mask = torch.ones(1, 3)
    out = critic_objective(ValueLossConfig(cliprange_value=0.3), loss_normalisers(mask), vpreds=vpreds,
                           returns=returns, values=values, response_mask=mask)
    assert out.loss.item() == pytest.approx(0.5 * (0.16 + 4.0 + 1.0) / 3)
    assert out.metrics["vf_clipfrac"].item() == pytest.approx(1 / 3)
    assert out.metrics["vpred_mean"].item() == pytest.approx(1.0)
    torch.manual_seed(1)
    v, r, old = torch.randn(5, 4, dtype=F64), torch.randn(5, 4, dtype=F64), torch.randn(5, 4, dtype=F64)
    mask = (torch.rand(5, 4) > 0.3).long()
    cfg = ValueLossConfig(cliprange_value=0.2)
    full = critic_objective(cfg, loss_normalisers(mask), vpreds=v, returns=r, values=old, response_mask=mask)
    norms = loss_normalisers(mask)
    parts = [critic_objective(cfg, norms, vpreds=v[s], returns=r[s], values=old[s], response_mask=mask[s])
             for s in (slice(0, 2), slice(2, 5))]
    for key in full.metrics:
        assert sum(p.metrics[key] for p in parts).item() == pytest.approx(full.metrics[key].item(), rel=1e-6), key
