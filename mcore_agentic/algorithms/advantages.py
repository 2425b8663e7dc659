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

The estimators live in :mod:`.sequence_advantages` (GAE, GRPO, RLOO, REINFORCE++, REINFORCE++-baseline and the group
statistics) and :mod:`.turn_advantages` (turn-level GRPO, GiGPO, turn spans); this module holds their
``estimate_<name>`` adapters and :func:`compute_advantage`, and re-exports both.
"""

from __future__ import annotations

import torch

from mcore_agentic.algorithms.config import AlgorithmConfig
from mcore_agentic.algorithms.estimators import EstimatorInputs, estimator
from mcore_agentic.algorithms.sequence_advantages import (
    Episodes,
    Index,
    Reduce,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
)
from mcore_agentic.algorithms.turn_advantages import TurnEpisodes, compute_gigpo_advantage, compute_grpo_turn_advantage

__all__ = [
    "compute_advantage",
]


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
