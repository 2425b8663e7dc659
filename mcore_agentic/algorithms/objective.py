"""The actor and critic objectives assembled from their configs: one call per micro-batch.

``actor loss = pg_loss - entropy_coeff * entropy + kl_loss_coef * kl_loss`` (the last
term only with ``use_kl_loss``), every term aggregated by the same ``loss_agg_mode``
and the same global normalisers (see :mod:`mcore_agentic.algorithms.losses`), so
summing the per-micro-batch losses of a mini-batch gives the mini-batch loss.

Metrics use verl's names (``actor/pg_loss``, ``critic/vf_clipfrac`` ...) and are
detached per-micro-batch values: loss terms are this micro-batch's share of the
mini-batch loss (sum them), ratios/fractions are local means (average them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_agentic.algorithms.config import PolicyLossConfig, ValueLossConfig
from mcore_agentic.algorithms.kl import kl_penalty
from mcore_agentic.algorithms.losses import (
    LossNormalisers,
    agg_loss,
    compute_policy_loss,
    compute_value_loss,
)
from mcore_agentic.algorithms.masked import masked_mean

__all__ = ["ObjectiveOutput", "compute_actor_loss", "compute_critic_loss"]


@dataclass(frozen=True)
class ObjectiveOutput:
    """A differentiable scalar ``loss`` and detached scalar ``metrics``."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


def _norm_kwargs(normalisers: LossNormalisers | None, loss_scale_factor: float | None) -> dict:
    kwargs: dict = {"loss_scale_factor": loss_scale_factor}
    if normalisers is not None:
        kwargs.update(global_tokens=normalisers.tokens, global_seqs=normalisers.seqs)
    return kwargs


def compute_actor_loss(
    cfg: PolicyLossConfig,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    entropy: torch.Tensor | None = None,
    ref_log_prob: torch.Tensor | None = None,
    normalisers: LossNormalisers | None = None,
) -> ObjectiveOutput:
    """PPO actor loss for one micro-batch; all tensors ``[B, R]``.

    ``entropy`` (per token, differentiable) is required when ``cfg.entropy_coeff > 0``
    and otherwise only reported; ``ref_log_prob`` is required with ``cfg.use_kl_loss``.
    ``normalisers``: counts of the whole mini-batch (summed over micro-batches and DP
    ranks); ``None`` normalises within this micro-batch.
    """
    if cfg.entropy_coeff > 0 and entropy is None:
        raise ValueError(f"actor.entropy_coeff={cfg.entropy_coeff} > 0 needs the per-token entropy (entropy=)")
    if cfg.use_kl_loss and ref_log_prob is None:
        raise ValueError("actor.use_kl_loss=true needs reference log-probs (ref_log_prob=); enable the reference")
    norm = _norm_kwargs(normalisers, cfg.loss_scale_factor)
    pg = compute_policy_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        clip_ratio_low=cfg.clip_ratio_low,
        clip_ratio_high=cfg.clip_ratio_high,
        clip_ratio_c=cfg.clip_ratio_c,
        loss_agg_mode=cfg.loss_agg_mode,
        **norm,
    )
    loss = pg.pg_loss
    metrics = {
        "actor/pg_loss": pg.pg_loss.detach(),
        "actor/pg_clipfrac": pg.pg_clipfrac,
        "actor/ppo_kl": pg.ppo_kl,
        "actor/pg_clipfrac_lower": pg.pg_clipfrac_lower,
    }
    if entropy is not None:
        if cfg.entropy_coeff > 0:
            entropy_term = agg_loss(entropy, response_mask, cfg.loss_agg_mode, **norm)
            loss = loss - cfg.entropy_coeff * entropy_term
        with torch.no_grad():
            metrics["actor/entropy"] = masked_mean(entropy.detach(), response_mask)
    if cfg.use_kl_loss:
        kl_term = agg_loss(
            kl_penalty(log_prob, ref_log_prob, cfg.kl_loss_type), response_mask, cfg.loss_agg_mode, **norm
        )
        loss = loss + cfg.kl_loss_coef * kl_term
        metrics["actor/kl_loss"] = kl_term.detach()
        metrics["actor/kl_coef"] = torch.tensor(cfg.kl_loss_coef)
    return ObjectiveOutput(loss=loss, metrics=metrics)


def compute_critic_loss(
    cfg: ValueLossConfig,
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    normalisers: LossNormalisers | None = None,
) -> ObjectiveOutput:
    """Clipped value loss for one micro-batch; all tensors ``[B, R]`` (``values``: the old predictions)."""
    out = compute_value_loss(
        vpreds,
        returns,
        values,
        response_mask,
        cfg.cliprange_value,
        cfg.loss_agg_mode,
        **_norm_kwargs(normalisers, None),
    )
    metrics = {
        "critic/vf_loss": out.vf_loss.detach(),
        "critic/vf_clipfrac": out.vf_clipfrac,
        "critic/vpred_mean": masked_mean(vpreds.detach(), response_mask),
    }
    return ObjectiveOutput(loss=out.vf_loss, metrics=metrics)
