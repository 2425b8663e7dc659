"""The row-level advantage estimators: GAE and REINFORCE++ over a row's sampled tokens, and the outcome estimators
(GRPO, RLOO, REINFORCE++-baseline) that compare a row's score with its group's; with the group and episode
statistics every estimator shares. Conventions (masked tokens, groups, episodes): :mod:`.advantages`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch

from mcore_agentic.algorithms.masked import masked_sum, masked_whiten

Index = Sequence[Hashable] | torch.Tensor
Reduce = Callable[[torch.Tensor], torch.Tensor]
"""Sum over the data-parallel replicas (an all-reduce), for rows spread over them; None: this batch is all."""
Episodes = tuple[torch.Tensor, int]
"""``(episode ids [B], number of episodes)``: rows that are samples of one episode share an id in
``[0, number)`` (an agent episode whose session forked trains each sample; ids are step-wide over DP)."""


def _groups(index: Index, batch_size: int, device: torch.device, num_groups: int | None) -> tuple[torch.Tensor, int]:
    """Dense group ids: step-wide integer ids in ``[0, num_groups)`` as given, else uids mapped first-seen."""
    if num_groups is None:
        return group_ids(index, batch_size, device)
    gid = torch.as_tensor(index, dtype=torch.long, device=device)
    if gid.shape != (batch_size,) or (gid.numel() and (int(gid.min()) < 0 or int(gid.max()) >= num_groups)):
        raise ValueError(f"index must be {batch_size} integer group ids in [0, {num_groups})")
    return gid, num_groups


def _whiten(values: torch.Tensor, mask: torch.Tensor, reduce: Reduce | None) -> torch.Tensor:
    """``masked_whiten`` over every replica's rows: mean and unbiased variance from all-reduced sums."""
    if reduce is None:
        return masked_whiten(values, mask)
    valid = mask.bool()
    zero = torch.zeros((), dtype=torch.float64, device=values.device)
    x = torch.where(valid, values.double(), zero)
    n_sum = reduce(torch.stack([valid.sum().double(), x.sum()]))
    n = n_sum[0].clamp(min=1)
    mean = n_sum[1] / n
    sq = reduce(torch.where(valid, (x - mean).square(), zero).sum().reshape(1))[0]
    var = sq / n
    if float(n_sum[0]) >= 2:
        var = var * n / (n - 1)
    return ((values.double() - mean) * torch.rsqrt(var + 1e-8)).to(values.dtype)


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
    scores: torch.Tensor, gid: torch.Tensor, num_groups: int, response_mask: torch.Tensor, reduce: Reduce | None = None,
    episodes: Episodes | None = None,
) -> tuple[torch.Tensor, ...]:
    """Per-sequence (group count, group sum, group mean, unbiased group std, own) over the group's sequences that
    sampled at least one token; std is 0 for groups of one. ``own`` is what the sequence adds to its group's sum
    (its score), for a leave-one-out baseline.

    A sequence without sampled tokens (a failed or aborted request: its loss mask is all 0) took no action,
    so it neither trains nor moves its group's baseline. With ``reduce`` a group's rows may sit on several
    replicas: its counts and sums are all-reduced (``[num_groups]`` tensors, two collectives).

    ``episodes`` (an agent episode that trains several samples, :class:`Episodes`): the statistics count episodes,
    not rows — an episode's score is the mean of its acting samples' (they share it), each row weighs
    ``1 / (its episode's acting rows)``, and ``own`` is the episode's score, so a leave-one-out baseline leaves the
    whole episode out. One more collective (``[num_episodes]``).
    """
    reduce = reduce or (lambda t: t)
    acted = (response_mask.sum(dim=-1) > 0).to(scores.dtype)
    if episodes is None:
        weight, own = acted, scores
    else:
        per = torch.stack([acted, scores * acted], dim=1).to(torch.float64)
        rows, total = _episode_tables(per, episodes, reduce).unbind(1)  # each row's episode: acting rows, score sum
        weight = (acted / rows.clamp(min=1)).to(scores.dtype)
        own = (total / rows.clamp(min=1)).to(scores.dtype)
    counts = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid, weight)
    sums = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid, own * weight)
    counts, sums = reduce(torch.stack([counts, sums])).unbind(0)
    if episodes is not None:
        counts = counts.round()  # whole episodes: the weights of an episode's rows sum to 1
    mean = sums / counts.clamp(min=1)
    sq_dev = reduce(torch.zeros_like(sums).index_add_(0, gid, (own - mean[gid]).square() * weight))
    std = torch.sqrt(sq_dev / (counts - 1).clamp(min=1))
    return counts[gid], sums[gid], mean[gid], std[gid], own


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
    reduce: Reduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over sampled tokens; returns ``(advantages, returns)``.

    Over the sampled tokens t_1 < t_2 < ... of a row (masked tokens skipped, see the
    docstring of :mod:`.advantages`): ``delta_k = r_k + gamma * V_{k+1} - V_k`` (``V`` after the last
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
        advantages = torch.where(valid, _whiten(advantages, response_mask, reduce), zero)
    return advantages, returns


@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    *,
    num_groups: int | None = None,
    reduce: Reduce | None = None,
    episodes: Episodes | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: ``(score - group_mean) / (group_std + epsilon)`` on every sampled token; ``(adv, adv)``.

    ``group_std`` is the unbiased std of the group's scores; ``norm_adv_by_std_in_grpo=False``
    only centres (Dr. GRPO). Identical scores give 0 (not NaN); a group of one gives 0.
    """
    scores = _sequence_scores(token_level_rewards, response_mask)
    gid, num_groups = _groups(index, scores.shape[0], scores.device, num_groups)
    counts, _, mean, std, own = _group_stats(scores, gid, num_groups, response_mask, reduce, episodes)
    # Over episodes, a row is its episode's score against theirs: samples of one episode may differ (a per-row
    # over-long penalty, KL in the reward) by more than the episodes' std, which would blow the ratio up.
    adv = (own if episodes is not None else scores) - mean
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
    *,
    num_groups: int | None = None,
    reduce: Reduce | None = None,
    episodes: Episodes | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024): ``score_i - mean_{j != i} score_j`` within the group; ``(adv, adv)``."""
    scores = _sequence_scores(token_level_rewards, response_mask)
    gid, num_groups = _groups(index, scores.shape[0], scores.device, num_groups)
    counts, sums, _, _, own = _group_stats(scores, gid, num_groups, response_mask, reduce, episodes)
    baseline = (sums - own) / (counts - 1).clamp(min=1)
    adv = torch.where(counts > 1, scores - baseline, torch.zeros_like(scores))
    adv = _broadcast(adv, response_mask)
    return adv, adv


@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    reduce: Reduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted return-to-go over sampled tokens, whitened over the batch.

    Returns ``(advantages, returns)``; the return skips masked tokens (:mod:`.advantages`' docstring).
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
    advantages = torch.where(valid, _whiten(returns, response_mask, reduce), torch.zeros_like(returns))
    return advantages, returns


@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index,
    *,
    num_groups: int | None = None,
    reduce: Reduce | None = None,
    episodes: Episodes | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: score minus its group mean on every sampled token, then whitened over
    the batch's valid tokens (longer responses weigh more, as in verl); ``(adv, adv)``.

    A group of one has its centred score set to 0 before whitening.
    """
    scores = _sequence_scores(token_level_rewards, response_mask)
    gid, num_groups = _groups(index, scores.shape[0], scores.device, num_groups)
    counts, _, mean, _, _ = _group_stats(scores, gid, num_groups, response_mask, reduce, episodes)
    centred = torch.where(counts > 1, scores - mean, torch.zeros_like(scores))
    per_token = _broadcast(centred, response_mask)
    adv = torch.where(response_mask.bool(), _whiten(per_token, response_mask, reduce), torch.zeros_like(per_token))
    return adv, adv


def _episode_tables(values: torch.Tensor, episodes: Episodes, reduce: Reduce | None) -> torch.Tensor:
    """``values`` ``[..., B, C]`` per row summed over each row's episode (all-reduced): ``[..., B, C]`` per row again
    — what the row's whole episode contributes, to leave out of a leave-one-out baseline."""
    eid, num_episodes = episodes
    shape = (*values.shape[:-2], num_episodes, values.shape[-1])
    table = torch.zeros(shape, dtype=values.dtype, device=values.device).index_add_(values.dim() - 2, eid, values)
    if reduce is not None:
        table = reduce(table)
    return table.index_select(values.dim() - 2, eid)
