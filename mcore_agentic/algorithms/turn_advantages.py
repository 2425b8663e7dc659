"""The turn-level advantage estimators (turn-level GRPO, GiGPO): each turn of a row credited against the other
rows' turns, at the same turn index or from the same state; and the turn arithmetic they and the per-turn metrics
share (:func:`turn_spans`, :func:`turn_index`). Conventions (turns, masked tokens, groups): :mod:`.advantages`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_agentic.algorithms.sequence_advantages import (
    Episodes,
    Index,
    Reduce,
    _episode_tables,
    _groups,
    compute_grpo_outcome_advantage,
    compute_rloo_outcome_advantage,
)


@dataclass(frozen=True)
class TurnEpisodes:
    """:data:`Episodes` for the turn-level estimators: the ids, their number, and each row's ``turn_offset`` [B] (the
    episode's turn index of the row's first turn)."""

    index: torch.Tensor
    count: int
    turn_offset: torch.Tensor

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
    batch, device = response_mask.shape[0], response_mask.device
    if mode == "mean_norm":
        episode, _ = compute_rloo_outcome_advantage(token_level_rewards, response_mask, index, num_groups=num_groups,
                                                    reduce=reduce, episodes=plain)
    else:
        episode, _ = compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon, True,
                                                    num_groups=num_groups, reduce=reduce, episodes=plain)
    gid, num_groups = _groups(index, batch, device, num_groups)
    step = _gigpo_step(turns, response_mask, turn_states, gid, num_groups, mode, epsilon, reduce, plain)
    out_dtype = token_level_rewards.dtype
    advantages = episode + step_advantage_w * turns.spread(step, out_dtype)
    return advantages * response_mask, turns.spread(turns.returns_to_go, out_dtype)


def _gigpo_step(turns: _TurnReturns, response_mask: torch.Tensor, turn_states: torch.Tensor, gid: torch.Tensor,
                num_groups: int, mode: str, epsilon: float, reduce: Reduce | None,
                plain: Episodes | None) -> torch.Tensor:
    """GiGPO's step-level part, ``[B, width]`` per row and turn (0 on turns not reached): each turn's return-to-go
    against its step group's (:func:`compute_gigpo_advantage`, its ``mode``)."""
    batch, dtype, device = response_mask.shape[0], torch.float64, response_mask.device
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
    return torch.where(reached, step, torch.zeros_like(step))
