"""The estimator registry (algorithms/estimators.py): a new outcome estimator is one ``register`` call plus its
function, and every registered estimator's declarations match what the code asks of it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import mcore_agentic.algorithms.config as algorithm_config
from mcore_agentic.algorithms.advantages import compute_advantage
from mcore_agentic.algorithms.config import AlgorithmConfig
from mcore_agentic.algorithms.estimators import ESTIMATORS, EstimatorInputs, estimator, register, unregister
from mcore_agentic.algorithms.sequence_advantages import group_ids
from mcore_agentic.feed.fields import field_names, wanted_fields
from mcore_agentic.utils.errors import ConfigError

# Two groups of two rows; the rows' rewards sit on their last sampled token (row 1 has a masked gap).
MASK = torch.tensor([[1, 1, 0], [1, 0, 1], [1, 1, 1], [1, 0, 0]])
REWARDS = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 3.0], [0.0, 0.0, 0.0], [4.0, 0.0, 0.0]])
INDEX = ["a", "a", "b", "b"]


def _reward_minus_mean(cfg: AlgorithmConfig, x: EstimatorInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The row's score minus its group's mean (no std), on every sampled token."""
    scores = (x.token_level_rewards * x.response_mask).sum(-1)
    gid, n = group_ids(x.index, scores.shape[0], scores.device)
    mean = torch.zeros(n).index_add_(0, gid, scores) / torch.zeros(n).index_add_(0, gid, torch.ones_like(scores))
    adv = (scores - mean[gid]).unsqueeze(-1) * x.response_mask
    return adv, adv


@pytest.fixture
def toy():
    est = register("reward_minus_mean", _reward_minus_mean, groups=True, doc="score minus the group mean")
    yield est
    unregister("reward_minus_mean")


def test_a_registered_outcome_estimator_is_accepted_and_computes(toy):
    cfg = AlgorithmConfig(adv_estimator="reward_minus_mean")
    assert not cfg.needs_critic and cfg.needs_groups
    assert "reward_minus_mean" in algorithm_config.ADV_ESTIMATORS  # read when asked: the registry's names
    # scores 1, 3 (mean 2) and 0, 4 (mean 2): -1, 1, -2, 2 on each row's sampled tokens.
    adv, returns = compute_advantage(cfg, REWARDS, MASK, index=INDEX)
    assert adv.tolist() == [[-1, -1, 0], [1, 0, 1], [-2, -2, -2], [2, 0, 0]]
    assert torch.equal(returns, adv)
    with pytest.raises(ValueError, match="reward_minus_mean needs index"):
        compute_advantage(cfg, REWARDS, MASK)
    run = SimpleNamespace(algorithm=cfg, rollout=SimpleNamespace(
        partial_rollout=SimpleNamespace(enable=False), agent=SimpleNamespace(enabled=False, train_samples="all")),
        actor=SimpleNamespace(moe=SimpleNamespace(routing_replay="disable")))
    assert "turn_states" not in wanted_fields(run)


def test_the_registry_refuses_a_taken_name_and_names_the_known_ones(toy):
    with pytest.raises(ValueError, match="registered already"):
        register("reward_minus_mean", _reward_minus_mean)
    with pytest.raises(ConfigError) as info:
        AlgorithmConfig(adv_estimator="ppo")
    assert info.value.field == "algorithm.adv_estimator" and "reward_minus_mean" in str(info.value)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="gigpo"):
        estimator("ppo")


def test_the_decorator_form_registers_the_function():
    @register("toy_decorated", needs_critic=True)
    def toy_decorated(cfg, x):
        return x.values, x.values

    try:
        assert estimator("toy_decorated").fn is toy_decorated
        assert AlgorithmConfig(adv_estimator="toy_decorated").needs_critic
    finally:
        unregister("toy_decorated")
    assert "toy_decorated" not in ESTIMATORS


def test_the_built_in_declarations():
    assert list(ESTIMATORS)[:7] == ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                                    "grpo_turn", "gigpo"]
    assert {n for n, e in ESTIMATORS.items() if e.needs_critic} == {"gae"}
    assert {n for n, e in ESTIMATORS.items() if e.groups} == {
        "grpo", "rloo", "reinforce_plus_plus_baseline", "grpo_turn", "gigpo"}
    assert {n for n, e in ESTIMATORS.items() if e.turn_level} == {"grpo_turn", "gigpo"}
    assert {n: e.row_fields for n, e in ESTIMATORS.items() if e.row_fields} == {"gigpo": {"turn_states"}}


def _run(name: str) -> SimpleNamespace:
    return SimpleNamespace(algorithm=AlgorithmConfig(adv_estimator=name), rollout=SimpleNamespace(
        partial_rollout=SimpleNamespace(enable=False), agent=SimpleNamespace(enabled=False, train_samples="all")),
        actor=SimpleNamespace(moe=SimpleNamespace(routing_replay="disable")))


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_each_estimator_needs_what_it_declares(name):
    est = estimator(name)
    assert callable(est.fn)
    # The feed sends the fields it reads (and they are fields of the table).
    assert est.row_fields <= field_names()
    assert est.row_fields <= wanted_fields(_run(name))
    cfg = AlgorithmConfig(adv_estimator=name)
    assert cfg.needs_critic == est.needs_critic and cfg.needs_groups == est.groups
    given = dict(values=torch.zeros(4, 3), index=INDEX, turn_states=MASK.clone())
    adv, _ = compute_advantage(cfg, REWARDS, MASK, **given)
    assert adv.shape == REWARDS.shape
    # Without what it declares it refuses; without what it does not declare it still computes.
    for key, declared in (("values", est.needs_critic), ("index", est.groups),
                          ("turn_states", "turn_states" in est.row_fields)):
        less = {k: v for k, v in given.items() if k != key}
        if declared:
            with pytest.raises(ValueError, match=f"adv_estimator={name} needs"):
                compute_advantage(cfg, REWARDS, MASK, **less)
        else:
            assert torch.equal(compute_advantage(cfg, REWARDS, MASK, **less)[0], adv)
    # Samples of one episode: a turn-level estimator numbers their turns from turn_offset, the others need none.
    episodes = (torch.tensor([0, 0, 1, 2]), 3)
    if est.turn_level:
        with pytest.raises(ValueError, match="turn_offset"):
            compute_advantage(cfg, REWARDS, MASK, episodes=episodes, **given)
        compute_advantage(cfg, REWARDS, MASK, episodes=episodes, turn_offset=torch.zeros(4, dtype=torch.long), **given)
    else:
        compute_advantage(cfg, REWARDS, MASK, episodes=episodes, **given)
