"""Tests for KL estimators (hand values, gradients), KL in reward and the KL controllers."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_agentic.algorithms.config import KLControlConfig
from mcore_agentic.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
    kl_penalty,
)
from mcore_agentic.utils.errors import ConfigError

LOGP = [-1.0, -2.0, -40.0]
REF = [-1.5, -1.0, -10.0]  # d = logp - ref = [0.5, -1.0, -30.0]


def _hand(kind: str) -> list[float]:
    out = []
    for lp, rf in zip(LOGP, REF):
        d = lp - rf
        if kind == "k1":
            out.append(d)
        elif kind == "abs":
            out.append(abs(d))
        elif kind == "k2":
            out.append(0.5 * d * d)
        else:  # k3 with the customary clamps: -d to [-20, 20], the result to [-10, 10]
            x = min(max(-d, -20.0), 20.0)
            out.append(min(max(math.exp(x) - x - 1.0, -10.0), 10.0))
    return out


@pytest.mark.parametrize(
    ("kind", "hand"),
    [("kl", "k1"), ("k1", "k1"), ("abs", "abs"), ("mse", "k2"), ("k2", "k2"), ("low_var_kl", "k3"), ("k3", "k3")],
)
def test_estimator_values_by_hand(kind, hand):
    got = kl_penalty(torch.tensor(LOGP, dtype=torch.float64), torch.tensor(REF, dtype=torch.float64), kind)
    assert got.tolist() == pytest.approx(_hand(hand), rel=1e-12)


def test_k3_is_clamped_to_ten():
    got = kl_penalty(torch.tensor(LOGP), torch.tensor(REF), "k3")
    assert got[2].item() == 10.0 and torch.isfinite(got).all()


@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3"])
def test_gradcheck_float64(kind):
    torch.manual_seed(0)
    logp = (torch.randn(4, 5, dtype=torch.float64) - 2).requires_grad_(True)
    ref = torch.randn(4, 5, dtype=torch.float64) - 2
    assert torch.autograd.gradcheck(lambda x: kl_penalty(x, ref, kind), (logp,))


def test_gradients_by_hand():
    logp = torch.tensor(LOGP[:2], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor(REF[:2], dtype=torch.float64)
    d = [0.5, -1.0]
    for kind, grad in [
        ("k1", [1.0, 1.0]),
        ("k2", d),
        ("k3", [1.0 - math.exp(-x) for x in d]),  # d/dd (exp(-d) + d - 1)
        ("k3+", d),  # straight-through: k2's gradient ...
    ]:
        logp.grad = None
        kl_penalty(logp, ref, kind).sum().backward()
        assert logp.grad.tolist() == pytest.approx(grad, rel=1e-12), kind
    # ... with k3's value.
    assert kl_penalty(logp, ref, "k3+").tolist() == pytest.approx(_hand("k3")[:2], rel=1e-12)


def test_unknown_estimator():
    with pytest.raises(ConfigError, match="full"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "full")


def test_apply_kl_penalty_by_hand():
    scores = torch.tensor([[0.0, 0.0, 1.0]])
    mask = torch.tensor([[1, 0, 1]])
    old = torch.tensor([[-1.0, -1.0, -2.0]])
    ref = torch.tensor([[-1.5, float("nan"), -1.0]])  # NaN at the masked position must not leak
    res = apply_kl_penalty(scores, old, ref, mask, FixedKLController(0.1), "kl")
    assert res.token_level_rewards[0].tolist() == pytest.approx([-0.05, 0.0, 1.1])
    assert res.current_kl == pytest.approx(-0.25)  # mean over valid tokens of [0.5, -1.0]
    assert res.kl_coef == 0.1


def test_adaptive_controller_by_hand():
    ctl = build_kl_controller(KLControlConfig(type="adaptive", kl_coef=0.1, target_kl=0.1, horizon=100))
    assert isinstance(ctl, AdaptiveKLController)
    ctl.update(current_kl=0.2, n_steps=10)  # error 1.0 clipped to 0.2 -> x(1 + 0.2*10/100)
    assert ctl.value == pytest.approx(0.102)
    ctl.update(current_kl=0.09, n_steps=10)  # error -0.1 -> x(1 - 0.1*10/100)
    assert ctl.value == pytest.approx(0.102 * 0.99)
    fixed = build_kl_controller(KLControlConfig(kl_coef=0.3))
    fixed.update(current_kl=5.0, n_steps=10)
    assert fixed.value == 0.3
