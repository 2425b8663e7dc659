"""Advantage estimators (GAE, GRPO, RLOO, REINFORCE++, REINFORCE++-baseline) on multi-turn loss masks.

All tensors are ``[B, R]`` over the response region; ``response_mask`` is 1 only on
tokens the policy sampled. Tool results, user turns and padding *inside* the
response are 0: they are the environment's, not actions.

Multi-turn convention (GAE and REINFORCE++): **time steps are sampled tokens**.
The backward recursion walks through masked (environment) tokens without
touching its state — no discount, no reward, no value is taken from them — so
the last sampled token before a tool result bootstraps from the value of the
first sampled token after it, exactly as if the tool-result gap were not there.
(verl's REINFORCE++ instead resets the return at every masked token, which in a
multi-turn response would cut earlier turns off from the outcome reward.)
Consequently rewards must sit on sampled tokens: :func:`place_sequence_rewards`
puts an outcome score on the last sampled token; a reward at a masked position
is ignored. Outputs are 0 at masked positions.

Outcome estimators (GRPO, RLOO, REINFORCE++-baseline) use the per-sequence score
``sum(token_level_rewards * mask)`` and compare sequences that share a prompt
(``index``: one uid per sequence). A group of one has no baseline and gets advantage 0.
Sequences without sampled tokens (failed or aborted requests) are left out of their group.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from mcore_agentic.algorithms.config import AlgorithmConfig
from mcore_agentic.algorithms.masked import masked_sum, masked_whiten

__all__ = [
    "compute_advantage",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "group_ids",
    "place_sequence_rewards",
]

Index = Sequence[Hashable] | torch.Tensor


def place_sequence_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Put each sequence's outcome score ``scores[b]`` on its last sampled token: ``[B] -> [B, R]``.

    A sequence with no sampled token (e.g. truncated before its first action) keeps
    an all-zero row: there is no action to credit.
    """
    if scores.dim() != 1 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(f"scores must be [B={response_mask.shape[0]}], got {tuple(scores.shape)}")
    valid = response_mask.bool()
    num_cols = valid.shape[-1]
    last = num_cols - 1 - valid.flip(-1).to(torch.int8).argmax(dim=-1)
    rewards = torch.zeros(valid.shape, dtype=scores.dtype, device=scores.device)
    rewards.scatter_(1, last.unsqueeze(-1), scores.unsqueeze(-1))
    return torch.where(valid, rewards, torch.zeros_like(rewards))


def group_ids(index: Index, batch_size: int, device: torch.device | None = None) -> tuple[torch.Tensor, int]:
    """Map per-sequence uids to dense group ids ``[B]`` (first-seen order) and the number of groups."""
    keys = index.tolist() if isinstance(index, torch.Tensor) else list(index)
    if len(keys) != batch_size:
        raise ValueError(f"index has {len(keys)} entries for a batch of {batch_size} sequences")
    dense: dict[Hashable, int] = {}
    ids = [dense.setdefault(k, len(dense)) for k in keys]
    return torch.tensor(ids, dtype=torch.long, device=device), len(dense)


def _group_stats(
    scores: torch.Tensor, gid: torch.Tensor, num_groups: int, response_mask: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Per-sequence (group count, group sum, group mean, unbiased group std) over the group's sequences that
    sampled at least one token; std is 0 for groups of one.

    A sequence without sampled tokens (a failed or aborted request: its loss mask is all 0) took no action,
    so it neither trains nor moves its group's baseline.
    """
    acted = (response_mask.sum(dim=-1) > 0).to(scores.dtype)
    counts = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid, acted)
    sums = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid, scores * acted)
    mean = sums / counts.clamp(min=1)
    sq_dev = torch.zeros_like(sums).index_add_(0, gid, (scores - mean[gid]).square() * acted)
    std = torch.sqrt(sq_dev / (counts - 1).clamp(min=1))
    return counts[gid], sums[gid], mean[gid], std[gid]


def _sequence_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return masked_sum(token_level_rewards, response_mask, dim=-1)


def _broadcast(per_seq: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return torch.where(response_mask.bool(), per_seq.unsqueeze(-1), torch.zeros((), dtype=per_seq.dtype))


@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over sampled tokens; returns ``(advantages, returns)``.

    Over the sampled tokens t_1 < t_2 < ... of a row (masked tokens skipped, see the
    module docstring): ``delta_k = r_k + gamma * V_{k+1} - V_k`` (``V`` after the last
    sampled token is 0: the episode ends), ``A_k = delta_k + gamma * lam * A_{k+1}``,
    ``returns = A + V``. Advantages are then whitened over all valid tokens of the
    batch (``whiten=False`` to skip); returns are not.
    """
    valid = response_mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    rewards = torch.where(valid, token_level_rewards.to(values.dtype), zero)
    values = torch.where(valid, values, zero)
    batch, length = values.shape
    next_value = torch.zeros(batch, dtype=values.dtype, device=values.device)
    last_gae = torch.zeros_like(next_value)
    advantages = torch.zeros_like(values)
    # A python loop over positions (vectorised over the batch): R is at most a few thousand.
    for t in reversed(range(length)):
        m = valid[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        next_value = torch.where(m, values[:, t], next_value)
        last_gae = torch.where(m, gae, last_gae)
        advantages[:, t] = torch.where(m, gae, zero)
    returns = torch.where(valid, advantages + values, zero)
    if whiten:
        advantages = torch.where(valid, masked_whiten(advantages, response_mask), zero)
    return advantages, returns


@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: ``(score - group_mean) / (group_std + epsilon)`` on every sampled token; ``(adv, adv)``.

    ``group_std`` is the unbiased std of the group's scores; ``norm_adv_by_std_in_grpo=False``
    only centres (Dr. GRPO). Identical scores give 0 (not NaN); a group of one gives 0.
    """
    scores = _sequence_scores(token_level_rewards, response_mask)
    gid, num_groups = group_ids(index, scores.shape[0], scores.device)
    counts, _, mean, std = _group_stats(scores, gid, num_groups, response_mask)
    adv = scores - mean
    if norm_adv_by_std_in_grpo:
        adv = adv / (std + epsilon)
    adv = torch.where(counts > 1, adv, torch.zeros_like(adv))
    adv = _broadcast(adv, response_mask)
    return adv, adv


@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024): ``score_i - mean_{j != i} score_j`` within the group; ``(adv, adv)``."""
    scores = _sequence_scores(token_level_rewards, response_mask)
    gid, num_groups = group_ids(index, scores.shape[0], scores.device)
    counts, sums, _, _ = _group_stats(scores, gid, num_groups, response_mask)
    baseline = (sums - scores) / (counts - 1).clamp(min=1)
    adv = torch.where(counts > 1, scores - baseline, torch.zeros_like(scores))
    adv = _broadcast(adv, response_mask)
    return adv, adv


@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted return-to-go over sampled tokens, whitened over the batch.

    Returns ``(advantages, returns)``; the return skips masked tokens (module docstring).
    """
    valid = response_mask.bool()
    rewards = torch.where(valid, token_level_rewards, torch.zeros((), dtype=token_level_rewards.dtype))
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    returns = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        m = valid[:, t]
        candidate = rewards[:, t] + gamma * running
        running = torch.where(m, candidate, running)
        returns[:, t] = torch.where(m, candidate, torch.zeros_like(candidate))
    advantages = torch.where(valid, masked_whiten(returns, response_mask), torch.zeros_like(returns))
    return advantages, returns


@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: score minus its group mean on every sampled token, then whitened over
    the batch's valid tokens (longer responses weigh more, as in verl); ``(adv, adv)``.

    A group of one has its centred score set to 0 before whitening.
    """
    scores = _sequence_scores(token_level_rewards, response_mask)
    gid, num_groups = group_ids(index, scores.shape[0], scores.device)
    counts, _, mean, _ = _group_stats(scores, gid, num_groups, response_mask)
    centred = torch.where(counts > 1, scores - mean, torch.zeros_like(scores))
    per_token = _broadcast(centred, response_mask)
    adv = torch.where(response_mask.bool(), masked_whiten(per_token, response_mask), torch.zeros_like(per_token))
    return adv, adv


def compute_advantage(
    cfg: AlgorithmConfig,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    index: Index | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch on ``cfg.adv_estimator``; returns ``(advantages, returns)``, both ``[B, R]``.

    ``values`` is required for ``gae``; ``index`` (one uid per sequence) for the group estimators.
    """
    if cfg.adv_estimator == "gae":
        if values is None:
            raise ValueError("algorithm.adv_estimator=gae needs critic values; pass values= or pick grpo/rloo")
        return compute_gae_advantage_return(token_level_rewards, values, response_mask, cfg.gamma, cfg.lam)
    if cfg.adv_estimator == "reinforce_plus_plus":
        return compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, cfg.gamma)
    if index is None:
        raise ValueError(f"algorithm.adv_estimator={cfg.adv_estimator} needs index= (one prompt uid per sequence)")
    if cfg.adv_estimator == "grpo":
        return compute_grpo_outcome_advantage(
            token_level_rewards, response_mask, index, cfg.grpo_epsilon, cfg.norm_adv_by_std_in_grpo
        )
    if cfg.adv_estimator == "rloo":
        return compute_rloo_outcome_advantage(token_level_rewards, response_mask, index)
    return compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards, response_mask, index)
