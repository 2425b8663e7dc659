"""Tests for loss aggregation, PPO policy loss (dual-clip), value loss, entropy/KL terms."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_agentic.algorithms.losses import (
    agg_loss,
    compute_entropy_loss,
    compute_kl_loss,
    compute_policy_loss,
    compute_value_loss,
    loss_normalisers,
)

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the third sequence has no valid token


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 4) / 3),
        ("seq-mean-token-sum", (3 + 4) / 2),
        ("seq-mean-token-mean", (1.5 + 4) / 2),
        ("seq-mean-token-sum-norm", (3 / 3 + 4 / 3) / 2),
    ],
)
def test_agg_modes_by_hand(mode, expected):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected, rel=1e-12)


def test_sum_norm_constant_and_empty_batch():
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=10).item() == pytest.approx(0.35)
    for mode in MODES:
        out = agg_loss(LOSS, torch.zeros_like(MASK), mode)
        assert out.item() == 0.0
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(LOSS, MASK, "mean")


@pytest.mark.parametrize("mode", MODES)
def test_masked_positions_never_matter(mode):
    changed = LOSS.clone()
    changed[~MASK.bool()] = float("nan")
    assert agg_loss(changed, MASK, mode).item() == agg_loss(LOSS, MASK, mode).item()
    leaf = LOSS.clone().requires_grad_(True)
    agg_loss(leaf, MASK, mode).backward()
    assert (leaf.grad[~MASK.bool()] == 0).all()


@pytest.mark.parametrize("mode", MODES)
def test_micro_batch_sum_equals_full_batch_with_global_normaliser(mode):
    torch.manual_seed(0)
    loss = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    mask = (torch.rand(7, 6) > 0.4).long()
    mask[3] = 0  # a sequence without valid tokens
    full = agg_loss(loss, mask, mode, loss_scale_factor=6)
    (g_full,) = torch.autograd.grad(full, loss)

    splits = [(0, 2), (2, 3), (3, 7)]
    norm = sum((loss_normalisers(mask[a:b]) for a, b in splits[1:]), loss_normalisers(mask[0:2]))
    assert norm == loss_normalisers(mask)
    parts = [
        agg_loss(loss[a:b], mask[a:b], mode, global_tokens=norm.tokens, global_seqs=norm.seqs, loss_scale_factor=6)
        for a, b in splits
    ]
    total = sum(parts)
    (g_micro,) = torch.autograd.grad(total, loss)
    assert total.item() == pytest.approx(full.item(), rel=1e-12)
    assert torch.allclose(g_micro, g_full, rtol=1e-12, atol=0)
    # Without the global normaliser the micro-batch mean of means differs (the point of the option).
    local = sum(agg_loss(loss[a:b], mask[a:b], mode, loss_scale_factor=6) for a, b in splits) / len(splits)
    assert not math.isclose(local.item(), full.item(), rel_tol=1e-6)


# PPO by hand: old_log_prob = 0 so ratio = exp(log_prob). clip 0.2/0.2, dual clip 3.
RATIOS = [1.5, 0.5, 0.5, 5.0, 1.1, 100.0]
ADV = [1.0, 1.0, -1.0, -1.0, 2.0, 100.0]
PG_MASK = [1, 1, 1, 1, 1, 0]
# token: unclipped -A r | clipped -A clip(r) | result
# 0: -1.5 | -1.2 | max -> -1.2 (clip active)
# 1: -0.5 | -0.8 | -0.5
# 2:  0.5 |  0.8 | 0.8 (clip active), dual bound 3 not reached
# 3:  5.0 |  1.2 | 5.0 -> min(5.0, 3) = 3 (dual clip active)
# 4: -2.2 | -2.2 | -2.2
PG_LOSSES = [-1.2, -0.5, 0.8, 3.0, -2.2]


def _pg_inputs():
    log_prob = torch.tensor([RATIOS], dtype=torch.float64).log().requires_grad_(True)
    return torch.zeros(1, 6, dtype=torch.float64), log_prob, torch.tensor([ADV], dtype=torch.float64)


def test_policy_loss_by_hand():
    old, log_prob, adv = _pg_inputs()
    out = compute_policy_loss(old, log_prob, adv, torch.tensor([PG_MASK]), clip_ratio_c=3.0)
    assert out.pg_loss.item() == pytest.approx(sum(PG_LOSSES) / 5, rel=1e-12)
    assert out.pg_clipfrac.item() == pytest.approx(2 / 5)
    assert out.pg_clipfrac_lower.item() == pytest.approx(1 / 5)
    assert out.ppo_kl.item() == pytest.approx(-sum(math.log(r) for r in RATIOS[:5]) / 5, rel=1e-12)
    out.pg_loss.backward()
    # d/dlogp of -A r is -A r where unclipped; 0 where a clip (or the dual clip) is active or masked.
    assert log_prob.grad[0].tolist() == pytest.approx([0.0, -0.5 / 5, 0.0, 0.0, -2.2 / 5, 0.0], abs=1e-12)


def test_policy_loss_clip_higher():
    old, log_prob, adv = _pg_inputs()
    out = compute_policy_loss(old, log_prob, adv, torch.tensor([PG_MASK]), clip_ratio_high=0.28)
    # token 0 now clipped at 1.28 instead of 1.2
    assert out.pg_loss.item() == pytest.approx((sum(PG_LOSSES) + 1.2 - 1.28) / 5, rel=1e-12)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss(old, log_prob, adv, torch.tensor([PG_MASK]), clip_ratio_c=0.9)


def test_policy_loss_masked_tokens_and_gradcheck():
    torch.manual_seed(1)
    old = torch.randn(3, 5, dtype=torch.float64) * 0.3 - 1
    log_prob = (old + torch.randn(3, 5, dtype=torch.float64) * 0.4).requires_grad_(True)
    adv = torch.randn(3, 5, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 1, 1, 1]])
    for mode in MODES:
        base = compute_policy_loss(old, log_prob, adv, mask, loss_agg_mode=mode).pg_loss
        adv2, old2 = adv.clone(), old.clone()
        adv2[~mask.bool()] = 1e6
        old2[~mask.bool()] = -50.0
        assert compute_policy_loss(old2, log_prob, adv2, mask, loss_agg_mode=mode).pg_loss.item() == base.item()
        assert torch.autograd.gradcheck(
            lambda lp, m=mode: compute_policy_loss(old, lp, adv, mask, loss_agg_mode=m).pg_loss, (log_prob,)
        )


def test_value_loss_by_hand():
    vpreds = torch.tensor([[1.0, 2.0, 0.0, 55.0]], dtype=torch.float64, requires_grad=True)
    values = torch.tensor([[0.5, 1.0, 0.2, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[1.2, 0.0, 1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    # 0: clipped pred 0.8 -> max(0.04, 0.16) = 0.16 (clip active); 1: clipped 1.3 -> max(4, 1.69) = 4;
    # 2: within range -> 1.0.
    out = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.3)
    assert out.vf_loss.item() == pytest.approx(0.5 * (0.16 + 4.0 + 1.0) / 3, rel=1e-12)
    assert out.vf_clipfrac.item() == pytest.approx(1 / 3)
    out.vf_loss.backward()
    # grad 0.5 * 2 (v - R) / 3 where the unclipped error wins; 0 where the clipped (constant) one does.
    assert vpreds.grad[0].tolist() == pytest.approx([0.0, 2.0 / 3, -1.0 / 3, 0.0], abs=1e-12)
    assert torch.autograd.gradcheck(
        lambda v: compute_value_loss(v, returns, values, mask, 0.3, "seq-mean-token-mean").vf_loss,
        (vpreds.detach().clone().requires_grad_(True),),
    )


def test_entropy_and_kl_terms():
    ent = torch.tensor([[1.0, 2.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    assert compute_entropy_loss(ent, mask).item() == 1.5
    assert compute_entropy_loss(ent, mask, "seq-mean-token-sum", global_seqs=3).item() == 1.0
    logp = torch.tensor([[-1.0, -2.0, 0.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, 7.0]], dtype=torch.float64)
    kl = compute_kl_loss(logp, ref, mask, "k1")
    assert kl.item() == pytest.approx((0.5 - 1.0) / 2)
    kl.backward()
    assert logp.grad[0].tolist() == [0.5, 0.5, 0.0]
