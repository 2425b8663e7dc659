"""Rollout-training mismatch correction: importance weights and rejection masks for the policy loss.

The engine samples from ``pi_rollout``; the PPO loss is built around the trainer's ``pi_old``. Per
sampled token the ratio is ``r_t = pi_old / pi_rollout = exp(old_log_prob - rollout_log_prob)``
(log-ratio clamped to ±20). A row's ``sequence`` ratio is the product of its token ratios, its
``geometric`` ratio their geometric mean (``exp`` of the mean log-ratio).

* **TIS** (``rollout_is``): the policy loss of each sampled token is multiplied by the detached
  weight ``min(r, rollout_is_threshold)`` of its level (the token's own ratio, or its row's).
* **Rejection / MIS** (``rollout_rs``): tokens (``token``, IcePop-style) or whole rows (``sequence``,
  ``geometric``) whose ratio leaves ``[lower, upper]`` are removed from the policy loss mask.
* **Veto** (``rollout_token_veto_threshold``): a row with any sampled token's ratio below it is removed.

With ``pi_old == pi_rollout`` every ratio is 1: the weights are 1 and nothing is rejected (the
identity). Statistics are reduced over the data-parallel replicas with caller-supplied reducers
(sum, max); quantiles come from a histogram of the token log-ratios (bins of 0.01 in log space), so
they cost one all-reduce of a fixed size whatever the batch.

By token age (partial rollouts, ``token_ages``: how many weight versions behind the step each sampled token is):
``rollout_corr/age_{0,1,2plus}/{token_fraction,kl_k3,masked_fraction,clipped_fraction}`` — older tokens were
sampled by older weights, so their mismatch should be larger; these show by how much and what the correction
does to them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mcore_agentic.algorithms.config import RolloutCorrectionConfig

__all__ = ["RolloutCorrection", "compute_rollout_correction"]

_LOG_CLAMP = 20.0
_BINS = torch.linspace(-4.0, 4.0, 801, dtype=torch.float64)  # log-ratio histogram edges; outside goes to the ends
Reduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class RolloutCorrection:
    """``weights`` [B, R] (1.0 off TIS, 0 on padding), ``mask`` [B, R] (the policy loss's mask after rejection)
    and per-step ``metrics`` (over every replica's rows when a ``reduce`` was given)."""

    weights: torch.Tensor
    mask: torch.Tensor
    metrics: dict[str, float]


def _level_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Per-token log-ratio ``[B, R]`` at ``level``: the token's own, or its row's sum (sequence) / mean (geometric)."""
    if level == "token":
        return log_ratio
    total = (log_ratio * mask).sum(-1, keepdim=True)
    if level == "geometric":
        total = total / mask.sum(-1, keepdim=True).clamp(min=1)
    return total.clamp(-_LOG_CLAMP, _LOG_CLAMP).expand_as(log_ratio)


def compute_rollout_correction(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: RolloutCorrectionConfig,
    *,
    reduce: Reduce | None = None,
    reduce_max: Reduce | None = None,
    token_ages: torch.Tensor | None = None,
) -> RolloutCorrection:
    """Weights, mask and metrics of the correction ``cfg`` asks for (identity parts where it asks for none).

    ``reduce`` sums a tensor over the DP replicas, ``reduce_max`` takes its maximum (None: this batch is the step);
    ``token_ages`` ``[B, R]`` adds the metrics by token age (module docstring).
    """
    mask = response_mask.to(torch.float64)
    log_ratio = (old_log_probs.double() - rollout_log_probs.double()).clamp(-_LOG_CLAMP, _LOG_CLAMP) * mask
    weights = mask.clone()
    clipped = torch.zeros_like(mask)
    if cfg.rollout_is is not None:
        ratio = torch.exp(_level_log_ratio(log_ratio, mask, cfg.rollout_is))
        weights = torch.clamp(ratio, max=cfg.rollout_is_threshold) * mask
        clipped = (ratio > cfg.rollout_is_threshold).double() * mask
    keep = mask.clone()
    if cfg.rollout_rs is not None:
        ratio = torch.exp(_level_log_ratio(log_ratio, mask, cfg.rollout_rs))
        keep = keep * ((ratio >= cfg.rs_lower) & (ratio <= cfg.rollout_rs_threshold)).double()
    if cfg.rollout_token_veto_threshold is not None:
        vetoed = ((log_ratio < math.log(cfg.rollout_token_veto_threshold)) & mask.bool()).any(-1, keepdim=True)
        keep = keep * (~vetoed).double()
    metrics = _metrics(log_ratio, mask, keep, clipped, reduce, reduce_max)
    if token_ages is not None:
        metrics.update(_age_metrics(log_ratio, mask, keep, clipped, token_ages, reduce))
    return RolloutCorrection(
        weights=weights.to(old_log_probs.dtype), mask=keep.to(response_mask.dtype), metrics=metrics
    )


AGE_BUCKETS = ("0", "1", "2plus")


def _age_metrics(
    log_ratio: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor, clipped: torch.Tensor, token_ages: torch.Tensor,
    reduce: Reduce | None,
) -> dict[str, float]:
    """Per age bucket (0, 1, 2 or more versions behind): tokens, k3, rejected and clipped, summed; one all-reduce."""
    bucket = token_ages.long().clamp(0, len(AGE_BUCKETS) - 1)
    k3 = (torch.exp(log_ratio) - 1 - log_ratio) * mask
    rows = []
    for b in range(len(AGE_BUCKETS)):
        m = mask * (bucket == b).double()
        rows.append(torch.stack([m.sum(), (k3 * m).sum(), (m * (1 - keep)).sum(), (clipped * m).sum()]))
    sums = torch.stack(rows)
    if reduce is not None:
        sums = reduce(sums)
    total = float(sums[:, 0].sum())
    out: dict[str, float] = {}
    for name, (tokens, k3_sum, rejected, clip) in zip(AGE_BUCKETS, sums.tolist()):
        out[f"rollout_corr/age_{name}/token_fraction"] = tokens / total if total else 0.0
        if tokens:
            out[f"rollout_corr/age_{name}/kl_k3"] = k3_sum / tokens
            out[f"rollout_corr/age_{name}/masked_fraction"] = rejected / tokens
            out[f"rollout_corr/age_{name}/clipped_fraction"] = clip / tokens
    return out


def _metrics(
    log_ratio: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor, clipped: torch.Tensor,
    reduce: Reduce | None, reduce_max: Reduce | None,
) -> dict[str, float]:
    sampled = mask.bool()
    lr = log_ratio[sampled]
    ratio = torch.exp(lr)
    rows = (mask.sum(-1) > 0).double()
    rows_dropped = ((mask.sum(-1) > 0) & (keep.sum(-1) == 0)).double()
    sums = torch.stack([
        mask.sum(), ratio.sum(), keep.sum(), clipped.sum(),
        (-lr).sum(),  # k1: E_rollout[log pi_rollout - log pi_old]
        (ratio - 1 - lr).sum(),  # k3, non-negative
        rows.sum(), rows_dropped.sum(),
    ])
    extremes = torch.stack([ratio.max() if lr.numel() else torch.tensor(0.0, dtype=torch.float64),
                            -ratio.min() if lr.numel() else torch.tensor(0.0, dtype=torch.float64)])
    hist = torch.bucketize(lr.clamp(-4.0, 4.0), _BINS[1:-1])
    counts = torch.bincount(hist, minlength=len(_BINS) - 1).double()
    if reduce is not None:
        sums, counts = reduce(sums), reduce(counts)
    if reduce_max is not None:
        extremes = reduce_max(extremes)
    tokens = float(sums[0])
    if tokens == 0:
        return {}
    out = {
        "rollout_corr/ratio_mean": float(sums[1]) / tokens,
        "rollout_corr/masked_fraction": 1.0 - float(sums[2]) / tokens,
        "rollout_corr/clipped_fraction": float(sums[3]) / tokens,
        "rollout_corr/kl_k1": float(sums[4]) / tokens,
        "rollout_corr/kl_k3": float(sums[5]) / tokens,
        "rollout_corr/rows_dropped_fraction": float(sums[7]) / max(float(sums[6]), 1.0),
    }
    known = reduce is None or reduce_max is not None  # the extremes are global
    cdf = torch.cumsum(counts, 0) / counts.sum()
    centres = (_BINS[:-1] + _BINS[1:]) / 2
    for q in (0.01, 0.5, 0.99):
        at = int(torch.searchsorted(cdf, torch.tensor(q, dtype=torch.float64)))
        value = float(torch.exp(centres[min(at, len(centres) - 1)]))
        if known:  # a bin centre can lie past the data (ratios of 1 +- 1e-6 fall in bins centred at 0.995/1.005)
            value = min(max(value, float(-extremes[1])), float(extremes[0]))
        out[f"rollout_corr/ratio_p{round(q * 100):02d}"] = value
    if known:
        out["rollout_corr/ratio_max"] = float(extremes[0])
        out["rollout_corr/ratio_min"] = float(-extremes[1])
    return out
