"""Advantage estimators (GAE, GRPO, RLOO, REINFORCE++, REINFORCE++-baseline, turn-level GRPO, GiGPO) on multi-turn
loss masks; each has an ``estimate_<name>(cfg, inputs)`` that :mod:`.estimators` registers and
:func:`compute_advantage` calls.

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

Turns (``grpo_turn``, :func:`turn_spans`): a turn is a maximal run of sampled tokens. Between two assistant turns the
chat template's own tokens (end of turn, the tool or user message, the next header) are masked, so the runs of a
row's mask are its assistant turns, found in the response layout wherever the rows sit (packing and CP splitting
happen later, on copies). A turn's reward is the sum of the token-level rewards over its tokens: the per-turn
rewards (``algorithm.turn_rewards``) sit on each turn's last sampled token, the outcome on the row's last one.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from mcore_agentic.algorithms.config import AlgorithmConfig
from mcore_agentic.algorithms.estimators import EstimatorInputs, estimator
from mcore_agentic.algorithms.masked import masked_sum, masked_whiten

__all__ = [
    "compute_advantage",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "Episodes",
    "TurnEpisodes",
    "compute_gigpo_advantage",
    "compute_grpo_turn_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "group_ids",
    "place_sequence_rewards",
    "turn_spans",
    "turn_index",
    "TURN_METRIC_TURNS",
]

Index = Sequence[Hashable] | torch.Tensor
Reduce = Callable[[torch.Tensor], torch.Tensor]
"""Sum over the data-parallel replicas (an all-reduce), for rows spread over them; None: this batch is all."""
Episodes = tuple[torch.Tensor, int]
"""``(episode ids [B], number of episodes)``: rows that are samples of one episode share an id in
``[0, number)`` (an agent episode whose session forked trains each sample; ids are step-wide over DP)."""


@dataclass(frozen=True)
class TurnEpisodes:
    """:data:`Episodes` for the turn-level estimators: the ids, their number, and each row's ``turn_offset`` [B] (the
    episode's turn index of the row's first turn)."""

    index: torch.Tensor
    count: int
    turn_offset: torch.Tensor


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


def turn_spans(response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sampled token's turn and each row's turn count: ``(turn [B, R], counts [B])``.

    ``turn`` is the 0-based index of the maximal run of sampled tokens the token belongs to (-1 on masked tokens);
    ``counts`` how many runs the row has (0 for a row that sampled nothing)."""
    valid = response_mask.bool()
    previous = torch.nn.functional.pad(valid[:, :-1], (1, 0), value=False)
    starts = valid & ~previous
    turn = torch.cumsum(starts.long(), dim=-1) - 1
    return torch.where(valid, turn, torch.full_like(turn, -1)), starts.sum(-1)


TURN_METRIC_TURNS = 8
"""Turn indices the per-turn metrics report (``turn/*/0`` .. ``turn/*/7``, ``distill/reverse_kl/turn_0`` .. ``_7``)."""


def turn_index(response_mask: torch.Tensor, turn_offset: torch.Tensor | None = None) -> torch.Tensor:
    """Each sampled token's turn index ``[B, R]`` (-1 on masked tokens), counted from the row's ``turn_offset`` when
    given (a sample of a forked agent episode counts on from the turns its session sampled before it)."""
    turn, _ = turn_spans(response_mask)
    if turn_offset is not None:
        turn = torch.where(turn >= 0, turn + turn_offset.unsqueeze(1), turn)
    return turn


@torch.no_grad()
def compute_grpo_turn_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index,
    gamma: float = 1.0,
    *,
    num_groups: int | None = None,
    reduce: Reduce | None = None,
    episodes: TurnEpisodes | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn-level, critic-free: each turn's discounted return-to-go minus the leave-one-out group mean of the
    returns-to-go *at the same turn index*; ``(advantages, returns)``, both broadcast over each turn's tokens.

    With ``r_{i,k}`` the reward of row ``i``'s turn ``k`` (the sum of its tokens' rewards) and ``K_i`` its turn
    count: ``G_{i,k} = sum_{m=k}^{K_i-1} gamma^(m-k) r_{i,m}``, and
    ``A_{i,k} = G_{i,k} - mean{ G_{j,k} : j != i in the group, K_j > k }`` (baseline 0 when no other row of the
    group reached turn ``k``: then ``A = G``; a row whose group has no other row that acted gets 0, as in GRPO).

    Why this baseline is unbiased when the policy decides when the episode ends. The gradient of the expected
    return is ``E[sum_k grad log pi(a_{i,k} | s_{i,k}) (G_{i,k} - b_{i,k})]`` for any ``b_{i,k}`` that does not
    depend on row ``i``'s actions from turn ``k`` on. The other rows of the group are independent samples, so any
    function of them qualifies: which of them reached turn ``k``, and their returns there, say nothing about
    whether row ``i`` continues. Leaving row ``i`` out matters: a mean that includes it scales the term of turn
    ``k`` by ``(n_k - 1) / n_k``, with ``n_k`` the rows at turn ``k`` — a different weight per turn index, which
    reweights late turns against early ones. The tempting construction (MT-GRPO-style, verl RFC #7244) normalises
    each turn's *reward* per turn index and sums the normalised rewards from ``k`` to the row's own last turn: its
    baseline ``sum_{m=k}^{K_i-1} mean_m(r)`` has as many terms as row ``i`` chose to take: an action-dependent
    baseline. Its later terms cancel the value of continuing, so the "take another turn" decision is credited with
    the immediate reward difference only (a hidden length bias). ``tests/unit/algorithms/test_turn_credit_unbiased.py``
    computes each construction's expectation exactly on a small continue-or-stop MDP.

    No division by a standard deviation: a per-turn-index std would reweight turns the same way (the
    ``norm_adv_by_std_in_grpo`` switch belongs to ``grpo``). Rows without sampled tokens are left out.

    ``episodes`` (:class:`TurnEpisodes`: samples of a forked agent episode as rows of their own): a row's turns
    sit at its episode's turn indices (``turn_offset`` + its own), "the other rows" are the other *episodes*
    (their samples at turn ``k``), and a group's acting episodes decide whether it has a baseline at all. A row's
    returns-to-go sum its own turns' rewards and what its last token holds: the rest of the episode's reward,
    including turn rewards other samples earned before it (its past: they add variance, not bias).
    """
    offset = episodes.turn_offset if episodes is not None else None
    turns = _turn_returns(token_level_rewards, response_mask, gamma, reduce, offset)
    batch, width, dtype, device = response_mask.shape[0], turns.width, torch.float64, response_mask.device
    counts, reached, returns_to_go = turns.counts, turns.reached, turns.returns_to_go
    gid, num_groups = _groups(index, batch, device, num_groups)
    live = reached.to(dtype)
    # [2, groups, turns]: returns-to-go and rows per turn index.
    table = torch.zeros(2, num_groups, width, dtype=dtype, device=device)
    table.index_add_(1, gid, torch.stack([returns_to_go, live]))
    if reduce is not None:
        table = reduce(table)
    own = torch.stack([returns_to_go, live])  # what the row (or, below, its whole episode) adds at each turn index
    if episodes is not None:
        own = _episode_tables(own, (episodes.index, episodes.count), reduce)
    at = table[:, gid]
    others = at[1] - own[1]
    baseline = torch.where(others > 0, (at[0] - own[0]) / others.clamp(min=1), torch.zeros_like(returns_to_go))
    # A group with no other episode that acted has no baseline at all: 0, as for every group estimator here.
    group_acted, mine = _acting_episodes((counts > 0).to(dtype), gid, num_groups,
                                         (episodes.index, episodes.count) if episodes is not None else None, reduce)
    alone = (group_acted - mine) <= 0
    turn_adv = torch.where(reached & ~alone.unsqueeze(1), returns_to_go - baseline, torch.zeros_like(returns_to_go))
    return turns.spread(turn_adv, token_level_rewards.dtype), turns.spread(returns_to_go, token_level_rewards.dtype)


def _episode_tables(values: torch.Tensor, episodes: Episodes, reduce: Reduce | None) -> torch.Tensor:
    """``values`` ``[..., B, C]`` per row summed over each row's episode (all-reduced): ``[..., B, C]`` per row again
    — what the row's whole episode contributes, to leave out of a leave-one-out baseline."""
    eid, num_episodes = episodes
    shape = (*values.shape[:-2], num_episodes, values.shape[-1])
    table = torch.zeros(shape, dtype=values.dtype, device=values.device).index_add_(values.dim() - 2, eid, values)
    if reduce is not None:
        table = reduce(table)
    return table.index_select(values.dim() - 2, eid)


def _acting_episodes(acted: torch.Tensor, gid: torch.Tensor, num_groups: int, episodes: Episodes | None,
                     reduce: Reduce | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the acting episodes of its group (a row is an episode without ``episodes``) and whether its own
    episode acted; all-reduced."""
    if episodes is None:
        mine = acted
    else:
        rows = _episode_tables(acted.unsqueeze(1), episodes, reduce).squeeze(1)
        mine = (rows > 0).to(acted.dtype)
        acted = acted / rows.clamp(min=1)  # an episode's acting rows weigh 1 together
    total = torch.zeros(num_groups, dtype=acted.dtype, device=acted.device).index_add_(0, gid, acted)
    if reduce is not None:
        total = reduce(total)
    return total.round()[gid], mine


@dataclass(frozen=True)
class _TurnReturns:
    """Per row and turn (``[B, width]``, width agreed over DP): reached, the discounted return-to-go; and each
    token's column (``slot``: its turn, ``width`` on masked tokens)."""

    slot: torch.Tensor
    counts: torch.Tensor
    width: int
    reached: torch.Tensor
    returns_to_go: torch.Tensor

    def spread(self, per_row_turn: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[B, width]`` per turn -> ``[B, R]`` on each turn's tokens (0 on masked tokens)."""
        padded = torch.nn.functional.pad(per_row_turn, (0, 1))  # the extra column reads 0 on masked tokens
        return padded.gather(1, self.slot.clamp(max=self.width)).to(dtype)

    def per_turn(self, per_token: torch.Tensor) -> torch.Tensor:
        """``[B, R]`` values constant over each turn -> ``[B, width]`` (the max over the turn's tokens; 0 if not
        reached)."""
        out = torch.zeros(per_token.shape[0], self.width + 1, dtype=per_token.dtype, device=per_token.device)
        out.scatter_reduce_(1, self.slot, per_token, reduce="amax", include_self=True)
        return out[:, : self.width]


def _turn_returns(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float,
                  reduce: Reduce | None, turn_offset: torch.Tensor | None = None) -> _TurnReturns:
    """Columns are turn indices: the row's own (its runs of sampled tokens), shifted by ``turn_offset`` [B] — the
    episode's turn index of the row's first turn, for a sample of a forked agent episode."""
    turn, counts = turn_spans(response_mask)
    batch, dtype, device = response_mask.shape[0], torch.float64, response_mask.device
    offset = torch.zeros(batch, dtype=torch.long, device=device) if turn_offset is None else turn_offset.long()
    turn = torch.where(turn >= 0, turn + offset.unsqueeze(1), turn)
    rewards = torch.where(response_mask.bool(), token_level_rewards.to(dtype), torch.zeros((), dtype=dtype))
    width = int((counts + offset).max()) if batch else 0
    # Every replica needs the same [groups, turns] shape for the all-reduce: the sum of the replicas' widths
    # bounds the widest of them, and needs no collective other than a sum.
    if reduce is not None:
        width = int(reduce(torch.tensor([float(width)], dtype=dtype))[0])
    per_turn = torch.zeros(batch, width + 1, dtype=dtype, device=device)  # column `width`: masked tokens
    slot = torch.where(turn >= 0, turn, torch.full_like(turn, width))
    per_turn.scatter_add_(1, slot, rewards)
    per_turn = per_turn[:, :width]
    columns = torch.arange(width, device=device).unsqueeze(0)
    reached = (columns >= offset.unsqueeze(1)) & (columns < (offset + counts).unsqueeze(1))  # [B, K]
    returns_to_go = torch.zeros_like(per_turn)
    running = torch.zeros(batch, dtype=dtype, device=device)
    for k in reversed(range(width)):
        running = torch.where(reached[:, k], per_turn[:, k] + gamma * running, running)
        returns_to_go[:, k] = torch.where(reached[:, k], running, torch.zeros_like(running))
    return _TurnReturns(slot, counts, width, reached, returns_to_go)


@torch.no_grad()
def compute_gigpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    turn_states: torch.Tensor,
    index: Index,
    gamma: float = 1.0,
    *,
    step_advantage_w: float = 1.0,
    mode: str = "mean_norm",
    epsilon: float = 1e-6,
    num_groups: int | None = None,
    reduce: Reduce | None = None,
    episodes: TurnEpisodes | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GiGPO (Feng et al. 2025, verl-agent): an episode-level group advantage plus ``step_advantage_w`` times a
    step-level one; ``(advantages, returns)`` with ``returns`` each turn's return-to-go.

    ``turn_states`` ``[B, R]`` (long): on every sampled token of a turn, 1 + the id of the state the turn acted
    from, numbered per prompt group (:func:`mcore_agentic.feed.turn_states.turn_state_tensor`); 0 elsewhere. Turns
    of a group's rows with the same id form a *step group*; ``G`` is a turn's discounted return-to-go.

    ``mean_norm`` (default): the episode part is ``rloo``; the step part of row ``i``'s turn ``k`` from state
    ``s`` is ``G_{i,k} - mean{ G_{j,m} : j != i in the group, turn m of j acted from s }``, with baseline 0 when no
    other row acted from ``s`` (as ``grpo_turn`` at a turn index no other row reached; a group with no other row
    that acted gets 0). Both baselines are functions of the other, independent rows (and of the state, which the
    turn's action does not affect), so each part is an unbiased policy-gradient estimate: their sum estimates
    ``(1 + step_advantage_w)`` times the gradient (a scale, which the learning rate absorbs), whether or not the
    policy decides when the episode ends. Other turns of row ``i`` from the same state (a loop) are left out
    too: they depend on row ``i``'s actions. GiGPO itself gives a step group of one 0 instead; that multiplies
    each turn's term by the chance that another row reaches its state — a weight per state, measured biased on
    the continue-or-stop MDP of ``tests/unit/algorithms/test_turn_credit_unbiased.py``.

    ``mean_std_norm`` is verl-agent's: the episode part ``grpo``'s ``(score - mean) / (std + epsilon)`` and the
    step part ``(G - mean) / (std + epsilon)`` over the step group, the turn itself included, a step group of one
    giving 0; the std division reweights groups, as in GRPO.

    ``episodes`` (samples of a forked agent episode as rows of their own): both levels count episodes — the
    episode part as ``rloo``/``grpo`` do, the step part leaving out the row's whole episode (``mean_norm``).
    """
    plain = (episodes.index, episodes.count) if episodes is not None else None
    turns = _turn_returns(token_level_rewards, response_mask, gamma, reduce,
                          episodes.turn_offset if episodes is not None else None)
    batch, dtype, device = response_mask.shape[0], torch.float64, response_mask.device
    if mode == "mean_norm":
        episode, _ = compute_rloo_outcome_advantage(token_level_rewards, response_mask, index, num_groups=num_groups,
                                                    reduce=reduce, episodes=plain)
    else:
        episode, _ = compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon, True,
                                                    num_groups=num_groups, reduce=reduce, episodes=plain)
    gid, num_groups = _groups(index, batch, device, num_groups)
    state = turns.per_turn(torch.where(response_mask.bool(), turn_states.long(), torch.zeros_like(turn_states.long())))
    reached = turns.reached & (state > 0)
    state = torch.where(reached, state - 1, torch.zeros_like(state))
    num_states = int(state.max()) + 1 if state.numel() else 1
    if reduce is not None:  # one table shape on every replica: the sum bounds the largest
        num_states = int(reduce(torch.tensor([float(num_states)], dtype=dtype))[0])
    g, live = turns.returns_to_go, reached.to(dtype)
    # Per row and state: its turns' returns-to-go (and squares) and how many; summed per (group, state) over DP.
    own = torch.zeros(3, batch, num_states, dtype=dtype, device=device)
    for j, values in enumerate((g * live, g * g * live, live)):
        own[j].scatter_add_(1, state, values)
    table = torch.zeros(3, num_groups, num_states, dtype=dtype, device=device)
    table.index_add_(1, gid, own)
    if reduce is not None:
        table = reduce(table)
    at = table[:, gid].gather(2, state.unsqueeze(0).expand(3, -1, -1))  # [3, B, width]: the turn's step group
    if mode == "mean_norm":
        mine = (own if plain is None else _episode_tables(own, plain, reduce)).gather(
            2, state.unsqueeze(0).expand(3, -1, -1))  # the row's (its episode's) own turns from the same state
        others = at[2] - mine[2]
        baseline = torch.where(others > 0, (at[0] - mine[0]) / others.clamp(min=1), torch.zeros_like(g))
        # A group with no other episode that acted has no baseline at all: 0, as for every group estimator here.
        group_acted, acted = _acting_episodes((turns.counts > 0).to(dtype), gid, num_groups, plain, reduce)
        alone = (group_acted - acted) <= 0
        step = torch.where(alone.unsqueeze(1), torch.zeros_like(g), g - baseline)
    else:
        n = at[2]
        mean = at[0] / n.clamp(min=1)
        var = (at[1] - n * mean * mean) / (n - 1).clamp(min=1)
        step = torch.where(n > 1, (g - mean) / (var.clamp(min=0).sqrt() + epsilon), torch.zeros_like(g))
    step = torch.where(reached, step, torch.zeros_like(step))
    out_dtype = token_level_rewards.dtype
    advantages = episode + step_advantage_w * turns.spread(step, out_dtype)
    return advantages * response_mask, turns.spread(turns.returns_to_go, out_dtype)


def estimate_gae(cfg: AlgorithmConfig, x: EstimatorInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``gae`` (registered in :mod:`.estimators`)."""
    return compute_gae_advantage_return(x.token_level_rewards, x.values, x.response_mask, cfg.gamma, cfg.lam,
                                        reduce=x.reduce)


def estimate_grpo(cfg: AlgorithmConfig, x: EstimatorInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``grpo``."""
    return compute_grpo_outcome_advantage(
        x.token_level_rewards, x.response_mask, x.index, cfg.grpo_epsilon, cfg.norm_adv_by_std_in_grpo,
        num_groups=x.num_groups, reduce=x.reduce, episodes=x.episodes,
    )


def estimate_rloo(cfg: AlgorithmConfig, x: EstimatorInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``rloo``."""
    return compute_rloo_outcome_advantage(x.token_level_rewards, x.response_mask, x.index, num_groups=x.num_groups,
                                          reduce=x.reduce, episodes=x.episodes)


def estimate_reinforce_plus_plus(cfg: AlgorithmConfig, x: EstimatorInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``reinforce_plus_plus`` (no group statistics: episodes change nothing)."""
    return compute_reinforce_plus_plus_outcome_advantage(x.token_level_rewards, x.response_mask, cfg.gamma, x.reduce)


def estimate_reinforce_plus_plus_baseline(cfg: AlgorithmConfig,
                                          x: EstimatorInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``reinforce_plus_plus_baseline``."""
    return compute_reinforce_plus_plus_baseline_outcome_advantage(
        x.token_level_rewards, x.response_mask, x.index, num_groups=x.num_groups, reduce=x.reduce, episodes=x.episodes)


def estimate_grpo_turn(cfg: AlgorithmConfig, x: EstimatorInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``grpo_turn``."""
    return compute_grpo_turn_advantage(x.token_level_rewards, x.response_mask, x.index, cfg.gamma,
                                       num_groups=x.num_groups, reduce=x.reduce, episodes=x.episodes)


def estimate_gigpo(cfg: AlgorithmConfig, x: EstimatorInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``gigpo`` (``algorithm.gigpo.*``)."""
    g = cfg.gigpo
    return compute_gigpo_advantage(x.token_level_rewards, x.response_mask, x.turn_states, x.index, cfg.gamma,
                                   step_advantage_w=g.step_advantage_w, mode=g.mode, epsilon=cfg.grpo_epsilon,
                                   num_groups=x.num_groups, reduce=x.reduce, episodes=x.episodes)


def compute_advantage(
    cfg: AlgorithmConfig,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    index: Index | None = None,
    num_groups: int | None = None,
    reduce: Reduce | None = None,
    turn_states: torch.Tensor | None = None,
    episodes: Episodes | None = None,
    turn_offset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Calls ``cfg.adv_estimator``'s registered function (:mod:`.estimators`); returns ``(advantages, returns)``,
    both ``[B, R]``.

    What the estimator declares it needs must be given: ``values`` (``needs_critic``: ``gae``), ``index`` (one uid
    per sequence; ``groups``), ``turn_states`` (in its ``row_fields``: ``gigpo``). ``episodes``: rows that are
    samples of one episode (:data:`Episodes`); the group estimators then count episodes, not rows (``gae`` and
    ``reinforce_plus_plus`` have no group statistics), the ``turn_level`` ones numbering a row's turns from its
    ``turn_offset`` [B].
    Rows spread over DP replicas: pass ``reduce`` (a sum over them) and ``index`` as step-wide
    integer group ids in ``[0, num_groups)``; whitening and group statistics then cover every
    replica's rows, and each replica gets exactly the single-batch result for its rows.
    """
    est = estimator(cfg.adv_estimator)
    name = est.name
    if est.needs_critic and values is None:
        raise ValueError(f"algorithm.adv_estimator={name} needs critic values; pass values= or pick grpo/rloo")
    if est.groups and index is None:
        raise ValueError(f"algorithm.adv_estimator={name} needs index= (one prompt uid per sequence)")
    given_episodes: Episodes | TurnEpisodes | None = episodes
    if episodes is not None and est.turn_level:
        if turn_offset is None:
            raise ValueError(f"algorithm.adv_estimator={name} with episodes of several samples needs "
                             "turn_offset= (the episode's turn index of each row's first turn)")
        given_episodes = TurnEpisodes(episodes[0], episodes[1], turn_offset)
    if "turn_states" in est.row_fields and turn_states is None:
        raise ValueError(f"algorithm.adv_estimator={name} needs turn_states= (each turn's state id; the feed adds "
                         "them when scoring)")
    inputs = EstimatorInputs(token_level_rewards, response_mask, values=values, index=index, num_groups=num_groups,
                             reduce=reduce, turn_states=turn_states, episodes=given_episodes)
    return est.fn(cfg, inputs)
