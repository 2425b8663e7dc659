"""Per-token KL estimators, the KL-in-reward penalty and its coefficient controllers.

Estimators take the log-probabilities of the *sampled* tokens under the policy
(``log_prob``, differentiable) and the reference (``ref_log_prob``) and estimate
KL(policy || ref) per token (Schulman, "Approximating KL divergence"):

============== ======================================= =============================
name           value (``d = log_prob - ref_log_prob``) notes
============== ======================================= =============================
``kl``/``k1``  ``d``                                   unbiased, high variance, can be < 0
``abs``        ``|d|``
``mse``/``k2`` ``d**2 / 2``                            biased, low variance, >= 0
``low_var_kl`` ``exp(-d) + d - 1``                     unbiased, >= 0; ``-d`` clamped to
/``k3``                                                [-20, 20], result to [-10, 10]
============== ======================================= =============================

A trailing ``+`` (``"k3+"``) keeps the estimator's value but takes k2's gradient
(straight-through), whose gradient is an unbiased KL gradient estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_agentic.algorithms.config import KLControlConfig, check_kl_penalty
from mcore_agentic.algorithms.masked import masked_mean

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "KLPenaltyResult",
    "apply_kl_penalty",
    "build_kl_controller",
    "kl_penalty",
]


def _estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    diff = log_prob - ref_log_prob
    if kind in ("kl", "k1"):
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("mse", "k2"):
        return 0.5 * diff.square()
    if kind in ("low_var_kl", "k3"):
        # k3 = r - log r - 1 with r = ref/policy; the clamps keep exp() finite when the
        # policy has drifted far from the reference (customary in verl/OpenRLHF).
        log_ratio = torch.clamp(-diff, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, min=-10.0, max=10.0)
    raise ValueError(f"unknown KL estimator {kind!r}")


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate, same shape as the inputs; gradients flow to ``log_prob`` (and ``ref_log_prob``)."""
    check_kl_penalty(kind, "kl_penalty")
    if kind.endswith("+"):
        value = _estimate(log_prob, ref_log_prob, kind[:-1])
        k2 = _estimate(log_prob, ref_log_prob, "k2")
        return k2 - k2.detach() + value.detach()
    return _estimate(log_prob, ref_log_prob, kind)


@dataclass
class FixedKLController:
    """Constant KL coefficient."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (kept so both controllers share one interface)."""


@dataclass
class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences").

    ``value *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon``.
    """

    value: float
    target_kl: float
    horizon: int

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient towards holding ``current_kl`` at ``target_kl``; ``n_steps`` = samples seen."""
        proportional_error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


def build_kl_controller(cfg: KLControlConfig) -> FixedKLController | AdaptiveKLController:
    """The controller described by ``algorithm.kl_ctrl``."""
    if cfg.type == "fixed":
        return FixedKLController(value=cfg.kl_coef)
    return AdaptiveKLController(value=cfg.kl_coef, target_kl=cfg.target_kl, horizon=cfg.horizon)


@dataclass(frozen=True)
class KLPenaltyResult:
    """Output of :func:`apply_kl_penalty`."""

    token_level_rewards: torch.Tensor
    """``[B, R]`` scores minus ``kl_coef * KL`` on sampled tokens."""
    current_kl: float
    """Batch mean of the per-sequence mean KL: feed to ``kl_ctrl.update(current_kl, n_steps=B)``."""
    kl_coef: float
    """The coefficient used."""


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    kl_penalty_type: str = "kl",
) -> KLPenaltyResult:
    """Subtract ``kl_ctrl.value * KL(old || ref)`` from the token-level scores (KL in the reward).

    All tensors are ``[B, R]``; the KL is zero on masked (non-sampled) tokens. This is a
    pure function: the controller is read, not updated — call
    ``kl_ctrl.update(result.current_kl, n_steps=B)`` afterwards (verl updates inside).
    """
    kld = kl_penalty(old_log_prob, ref_log_prob, kl_penalty_type)
    kld = torch.where(response_mask.bool(), kld, torch.zeros_like(kld))
    beta = float(kl_ctrl.value)
    rewards = token_level_scores - beta * kld
    current_kl = masked_mean(kld, response_mask, dim=-1).mean().item()
    return KLPenaltyResult(token_level_rewards=rewards, current_kl=current_kl, kl_coef=beta)
