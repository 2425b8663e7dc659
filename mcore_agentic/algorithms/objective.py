"""The actor and critic objectives assembled from their configs: one call per micro-batch.

``actor loss = pg_loss - entropy_coeff * entropy + kl_loss_coef * kl_loss + coef * distill_kl`` (the
KL loss only with ``use_kl_loss``, the last term only when distilling with ``algorithm.distillation.top_k``),
every term aggregated by the same ``loss_agg_mode``
and the same normalisers of the whole mini-batch (see :mod:`mcore_agentic.algorithms.losses`),
so the per-micro-batch losses of a mini-batch *sum* to the mini-batch loss, whatever
the micro-batch split or the data-parallel layout.

Metrics are detached scalars that sum the same way: loss terms are this micro-batch's
share of the mini-batch value already, and per-token ratios (clip fractions, ``ppo_kl``,
``vpred_mean``) are weighted by the micro-batch's share of the mini-batch's tokens. The
workers sum them over micro-batches and data-parallel ranks and report verl's names
under ``actor/`` and ``critic/``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_agentic.algorithms.config import PolicyLossConfig, ValueLossConfig
from mcore_agentic.algorithms.distillation import top_k_kl
from mcore_agentic.algorithms.losses import (
    LossNormalisers,
    agg_loss,
    compute_entropy_loss,
    compute_kl_loss,
    compute_policy_loss,
    compute_value_loss,
)

__all__ = ["ObjectiveOutput", "TopKDistillation", "actor_objective", "critic_objective"]


@dataclass(frozen=True)
class TopKDistillation:
    """The top-k distillation term of the actor loss (``algorithm.distillation`` with ``top_k``):
    ``coef * KL_k`` (:func:`~mcore_agentic.algorithms.distillation.top_k_kl`, ``direction``) between the teacher's
    and the student's log-probs ``[B, R, k]`` of the teacher's top k ids, aggregated like every other term."""

    coef: float
    direction: str
    student_log_probs: torch.Tensor | None = None
    teacher_log_probs: torch.Tensor | None = None


@dataclass(frozen=True)
class ObjectiveOutput:
    """A differentiable scalar ``loss`` and detached scalar ``metrics`` (micro-batch shares of the mini-batch's)."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


def _token_share(response_mask: torch.Tensor, norms: LossNormalisers) -> torch.Tensor:
    """This micro-batch's fraction of the mini-batch's response tokens."""
    return response_mask.sum().to(torch.float32) / max(norms.tokens, 1)


def actor_objective(
    cfg: PolicyLossConfig,
    norms: LossNormalisers,
    *,
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    entropys: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    ref_log_probs: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    distill: TopKDistillation | None = None,
) -> ObjectiveOutput:
    """PPO actor loss of one micro-batch; tensors ``[B, R]``; ``norms``: counts of the whole mini-batch.

    ``entropys`` (per token) is always reported and enters the loss with ``cfg.entropy_coeff``;
    ``ref_log_probs`` is required with ``cfg.use_kl_loss``; ``rollout_is_weights`` (rollout correction,
    :mod:`mcore_agentic.algorithms.rollout_correction`) multiply the policy-gradient term per token;
    ``distill`` adds the top-k distillation term (``distill_kl`` in the metrics).
    """
    if cfg.use_kl_loss and ref_log_probs is None:
        raise ValueError("actor.use_kl_loss=true needs reference log-probs (ref_log_probs=): enable the reference")
    agg = dict(global_tokens=norms.tokens, global_seqs=norms.seqs)
    pol = compute_policy_loss(
        old_log_probs, log_probs, advantages, response_mask,
        clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c,
        loss_agg_mode=cfg.loss_agg_mode, loss_scale_factor=cfg.loss_scale_factor, weights=rollout_is_weights, **agg,
    )
    entropy = compute_entropy_loss(
        # with entropy_coeff 0 the term is reported only: no backward through the vocab-sized entropy
        entropys if cfg.entropy_coeff else entropys.detach(),
        response_mask, cfg.loss_agg_mode, loss_scale_factor=cfg.loss_scale_factor, **agg,
    )
    loss = pol.pg_loss - cfg.entropy_coeff * entropy
    share = _token_share(response_mask, norms)  # local masked means -> shares of the mini-batch token mean
    metrics = {
        "pg_loss": pol.pg_loss.detach(),
        "entropy": entropy.detach(),
        "pg_clipfrac": pol.pg_clipfrac * share,
        "pg_clipfrac_lower": pol.pg_clipfrac_lower * share,
        "ppo_kl": pol.ppo_kl * share,
    }
    if cfg.use_kl_loss:
        kl = compute_kl_loss(
            log_probs, ref_log_probs, response_mask, cfg.kl_loss_type, cfg.loss_agg_mode,
            loss_scale_factor=cfg.loss_scale_factor, **agg,
        )
        loss = loss + cfg.kl_loss_coef * kl
        metrics["kl_loss"] = kl.detach()
    if distill is not None:
        per_token = top_k_kl(distill.student_log_probs, distill.teacher_log_probs, direction=distill.direction)
        kl = agg_loss(per_token, response_mask, cfg.loss_agg_mode, loss_scale_factor=cfg.loss_scale_factor, **agg)
        loss = loss + distill.coef * kl
        metrics["distill_kl"] = kl.detach()
    metrics["loss"] = loss.detach()
    return ObjectiveOutput(loss, metrics)


def critic_objective(
    cfg: ValueLossConfig,
    norms: LossNormalisers,
    *,
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
) -> ObjectiveOutput:
    """Clipped value loss of one micro-batch; tensors ``[B, R]`` (``values``: the predictions the rollout saw)."""
    out = compute_value_loss(
        vpreds, returns, values, response_mask, cfg.cliprange_value, cfg.loss_agg_mode,
        global_tokens=norms.tokens, global_seqs=norms.seqs,
    )
    metrics = {
        "vf_loss": out.vf_loss.detach(),
        "vf_clipfrac": out.vf_clipfrac * _token_share(response_mask, norms),
        "vpred_mean": (vpreds.detach() * response_mask).sum() / max(norms.tokens, 1),
    }
    return ObjectiveOutput(out.vf_loss, metrics)
