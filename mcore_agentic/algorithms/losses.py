"""Loss aggregation, the PPO clipped policy loss (with dual-clip), the clipped value loss, entropy and KL terms.

Aggregation modes (``mask`` [B, R] is 1 on tokens the policy sampled; a sequence
is "valid" if it has at least one such token):

- ``token-mean``: ``sum(loss * mask) / N_tokens`` — every sampled token weighs the same.
- ``seq-mean-token-sum``: ``sum_s(sum_t loss * mask) / N_seqs`` — mean over sequences of per-sequence sums.
- ``seq-mean-token-mean``: ``sum_s(sum_t loss * mask / n_s) / N_seqs`` — mean over sequences of per-sequence
  means (``n_s`` = that sequence's token count).
- ``seq-mean-token-sum-norm``: ``sum_s(sum_t loss * mask) / (N_seqs * loss_scale_factor)`` — Dr. GRPO: each
  sequence's sum divided by a *constant* (default: the padded length ``R``), then averaged over sequences.

Sequences without valid tokens add nothing to the numerator and are not counted in ``N_seqs``, so no NaN.

Global normalisers. By default ``N_tokens``/``N_seqs`` are counted in the given tensors.
A worker that splits a mini-batch into micro-batches (and data-parallel ranks) passes
the counts of the *whole* mini-batch instead — ``global_tokens`` / ``global_seqs``
from :func:`loss_normalisers` summed over micro-batches and DP ranks — and then the
*sum* of the micro-batch losses equals the full-batch loss exactly (so gradients must
be accumulated by summing: no extra division by the number of micro-batches, and a
DP gradient all-reduce that *averages* must be compensated by multiplying by DP size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_agentic.algorithms.config import LOSS_AGG_MODES
from mcore_agentic.algorithms.kl import kl_penalty
from mcore_agentic.algorithms.masked import masked_mean

__all__ = [
    "LossNormalisers",
    "PolicyLossOutput",
    "ValueLossOutput",
    "agg_loss",
    "compute_entropy_loss",
    "compute_kl_loss",
    "compute_policy_loss",
    "compute_value_loss",
    "loss_normalisers",
]


@dataclass(frozen=True)
class LossNormalisers:
    """Counts behind the aggregation denominators; sum them over micro-batches and DP ranks."""

    tokens: int
    """Number of valid (mask == 1) tokens."""
    seqs: int
    """Number of sequences with at least one valid token."""

    def __add__(self, other: LossNormalisers) -> LossNormalisers:
        return LossNormalisers(self.tokens + other.tokens, self.seqs + other.seqs)


def loss_normalisers(mask: torch.Tensor) -> LossNormalisers:
    """The ``(tokens, seqs)`` counts of a ``[B, R]`` mask (a host sync: call once per micro-batch)."""
    valid = mask.bool()
    return LossNormalisers(tokens=int(valid.sum().item()), seqs=int(valid.any(dim=-1).sum().item()))


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_tokens: int | float | torch.Tensor | None = None,
    global_seqs: int | float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a ``[B, R]`` per-token loss into a scalar; see the module docstring for the modes.

    ``global_tokens`` (token-mean) / ``global_seqs`` (seq-mean-*) replace the locally
    counted denominators; ``loss_scale_factor`` is the Dr. GRPO constant (default ``R``).
    Values at masked positions never matter (even NaN/inf).
    """
    valid = mask.bool()
    zero = torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device)
    loss_mat = torch.where(valid, loss_mat, zero)
    if mode == "token-mean":
        denom = valid.sum() if global_tokens is None else global_tokens
        return loss_mat.sum() / _clamp_denominator(denom, loss_mat)
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={mode!r}; use one of {', '.join(LOSS_AGG_MODES)}")
    seq_tokens = valid.sum(dim=-1)
    seq_sums = loss_mat.sum(dim=-1)
    if mode == "seq-mean-token-sum":
        per_seq = seq_sums
    elif mode == "seq-mean-token-mean":
        per_seq = seq_sums / seq_tokens.clamp(min=1).to(loss_mat.dtype)
    else:  # seq-mean-token-sum-norm
        scale = float(mask.shape[-1]) if loss_scale_factor is None else float(loss_scale_factor)
        per_seq = seq_sums / scale
    denom = (seq_tokens > 0).sum() if global_seqs is None else global_seqs
    return per_seq.sum() / _clamp_denominator(denom, loss_mat)


def _clamp_denominator(denom: int | float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    # An empty batch has a zero numerator; dividing by 1 gives 0 instead of NaN. A host number becomes a
    # device fill (a kernel), never a host-to-device copy: that copy synchronises the GPU on every micro-batch.
    if isinstance(denom, torch.Tensor):
        return denom.to(dtype=like.dtype, device=like.device).clamp(min=1)
    return like.new_full((), max(float(denom), 1.0))


@dataclass(frozen=True)
class PolicyLossOutput:
    """Output of :func:`compute_policy_loss`; the metrics are detached local masked means."""

    pg_loss: torch.Tensor
    """Scalar aggregated policy-gradient loss (differentiable)."""
    pg_clipfrac: torch.Tensor
    """Fraction of valid tokens where the PPO clip was active."""
    ppo_kl: torch.Tensor
    """Approximate KL(old || new) = mean(old_log_prob - log_prob) over valid tokens."""
    pg_clipfrac_lower: torch.Tensor
    """Fraction of valid tokens where the dual-clip lower bound (A < 0) was active."""


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    global_tokens: int | float | torch.Tensor | None = None,
    global_seqs: int | float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
    weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate with dual-clip (Schulman et al. 2017; Ye et al. 2020), all tensors ``[B, R]``.

    ``weights``: detached per-token factors of the loss (rollout-correction importance weights), or None.

    Per token, with ``ratio = exp(log_prob - old_log_prob)`` (log-ratio clamped to ±20):
    ``l = max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high))``, and for ``A < 0``
    additionally ``l = min(l, -A * clip_ratio_c)`` so a huge ratio cannot produce an
    unbounded loss. Then aggregated by ``loss_agg_mode`` (see :func:`agg_loss`).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c={clip_ratio_c} must be > 1 (actor.clip_ratio_c)")
    neg_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(neg_approx_kl)
    losses_unclipped = -advantages * ratio
    losses_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_losses = torch.maximum(losses_unclipped, losses_clipped)
    losses_dual = -advantages * clip_ratio_c
    dual_clip_losses = torch.minimum(losses_dual, clip_losses)
    negative = advantages < 0
    pg_losses = torch.where(negative, dual_clip_losses, clip_losses)
    if weights is not None:
        pg_losses = pg_losses * weights.detach()

    pg_loss = agg_loss(
        pg_losses,
        response_mask,
        loss_agg_mode,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    with torch.no_grad():
        pg_clipfrac = masked_mean((losses_clipped > losses_unclipped).to(ratio.dtype), response_mask)
        ppo_kl = masked_mean(-neg_approx_kl, response_mask)
        pg_clipfrac_lower = masked_mean(((clip_losses > losses_dual) & negative).to(ratio.dtype), response_mask)
    return PolicyLossOutput(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)


@dataclass(frozen=True)
class ValueLossOutput:
    """Output of :func:`compute_value_loss`."""

    vf_loss: torch.Tensor
    """Scalar ``0.5 * agg(max((v - R)^2, (v_clipped - R)^2))`` (differentiable w.r.t. ``vpreds``)."""
    vf_clipfrac: torch.Tensor
    """Fraction of valid tokens where the clipped error was the larger one (detached)."""


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    *,
    global_tokens: int | float | torch.Tensor | None = None,
    global_seqs: int | float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> ValueLossOutput:
    """PPO2-style clipped value loss, all tensors ``[B, R]``.

    ``vpreds`` are the critic's current predictions, ``values`` the (old) ones the
    advantages were computed with; predictions are clipped to ``values ± cliprange_value``
    and the pessimistic (larger) squared error is used.
    """
    vpred_clipped = values + torch.clamp(vpreds - values, -cliprange_value, cliprange_value)
    losses_unclipped = (vpreds - returns).square()
    losses_clipped = (vpred_clipped - returns).square()
    losses = torch.maximum(losses_unclipped, losses_clipped)
    vf_loss = 0.5 * agg_loss(
        losses,
        response_mask,
        loss_agg_mode,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    with torch.no_grad():
        vf_clipfrac = masked_mean((losses_clipped > losses_unclipped).to(vpreds.dtype), response_mask)
    return ValueLossOutput(vf_loss, vf_clipfrac)


def compute_entropy_loss(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    **normalisers: int | float | torch.Tensor | None,
) -> torch.Tensor:
    """Aggregated per-token entropy (the actor subtracts ``entropy_coeff`` times this)."""
    return agg_loss(entropy, response_mask, loss_agg_mode, **normalisers)


def compute_kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_loss_type: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    **normalisers: int | float | torch.Tensor | None,
) -> torch.Tensor:
    """Aggregated KL(policy || ref) loss term (GRPO's ``use_kl_loss``); gradient flows to ``log_prob``."""
    return agg_loss(kl_penalty(log_prob, ref_log_prob, kl_loss_type), response_mask, loss_agg_mode, **normalisers)
