"""Group statistics that count episodes, not rows: an agent episode whose session forked trains each of its samples,
and its group's baseline must weigh the episode once (``episodes=`` of the outcome estimators)."""

from __future__ import annotations

import pytest
import torch

from mcore_agentic.algorithms.advantages import compute_advantage
from mcore_agentic.algorithms.config import AlgorithmConfig

# One prompt group: episode 0 has two samples (rows 0 and 1, its score 1.0 on both), episode 1 one (0.0), episode 2
# one (0.5). Row 4 is another group's only episode, of three samples. Row 7 failed: it sampled nothing.
SCORES = [1.0, 1.0, 0.0, 0.5, 0.3, 0.3, 0.3, 0.0]
UIDS = ["g", "g", "g", "g", "h", "h", "h", "g"]
EPISODES = torch.tensor([0, 0, 1, 2, 3, 3, 3, 4])


def _rows():
    mask = torch.ones(len(SCORES), 3, dtype=torch.long)
    mask[7] = 0
    rewards = torch.zeros(len(SCORES), 3)
    rewards[:, -1] = torch.tensor(SCORES)
    return rewards, mask


def _per_row(adv: torch.Tensor) -> list[float]:
    return [round(float(a[-1]), 6) for a in adv]


@pytest.mark.parametrize("estimator,want", [
    # rloo: 1 - (0 + 0.5)/2, 0 - (1 + 0.5)/2, 0.5 - (1 + 0)/2: the two-sample episode is one of three, and its rows
    # leave each other out too.
    ("rloo", [0.75, 0.75, -0.75, 0.0, 0.0, 0.0, 0.0, 0.0]),
    # grpo: mean over episodes 0.5, std over episodes sqrt((0.25 + 0.25 + 0) / 2) = 0.5.
    ("grpo", [1.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0]),
])
def test_episodes_count_once_in_their_group(estimator, want):
    rewards, mask = _rows()
    cfg = AlgorithmConfig(adv_estimator=estimator, grpo_epsilon=1e-12)
    adv, _ = compute_advantage(cfg, rewards, mask, index=UIDS, episodes=(EPISODES, 5))
    assert _per_row(adv) == pytest.approx(want, abs=1e-6)
    # Counted as rows, episode 0 would weigh twice: a different answer (the test can fail).
    rows, _ = compute_advantage(cfg, rewards, mask, index=UIDS)
    assert _per_row(rows) != pytest.approx(want, abs=1e-3)


def test_reinforce_plus_plus_baseline_centres_on_the_episode_mean():
    rewards, mask = _rows()
    cfg = AlgorithmConfig(adv_estimator="reinforce_plus_plus_baseline")
    adv, _ = compute_advantage(cfg, rewards, mask, index=UIDS, episodes=(EPISODES, 5))
    # centred: 0.5, 0.5, -0.5, 0.0 in group g (episode mean 0.5); group h is one episode: 0; then whitened.
    centred = torch.tensor([0.5, 0.5, -0.5, 0.0, 0.0, 0.0, 0.0])
    values = centred.repeat_interleave(3)
    want = (centred - values.mean()) / torch.sqrt(values.var() + 1e-8)
    assert _per_row(adv)[:7] == pytest.approx(want.tolist(), abs=1e-5)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_episodes_of_one_sample_give_todays_result(estimator):
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(8, 4, generator=gen)
    mask = (torch.rand(8, 4, generator=gen) < 0.8).long()
    cfg = AlgorithmConfig(adv_estimator=estimator)
    want, _ = compute_advantage(cfg, rewards, mask, index=UIDS)
    got, _ = compute_advantage(cfg, rewards, mask, index=UIDS, episodes=(torch.arange(8), 8))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_an_episode_split_over_two_replicas_gets_the_whole_batch_result(estimator):
    from tests.unit.trainer.test_experience import _simulated_replicas

    rewards, mask = _rows()
    cfg = AlgorithmConfig(adv_estimator=estimator)
    gid = torch.tensor([0 if u == "g" else 1 for u in UIDS])
    want, _ = compute_advantage(cfg, rewards, mask, index=UIDS, episodes=(EPISODES, 5))
    parts = [[0, 2, 4, 7], [1, 3, 5, 6]]  # episode 0 and episode 3 each on both replicas

    def replica(rows):
        return lambda reduce: compute_advantage(cfg, rewards[rows], mask[rows], index=gid[rows], num_groups=2,
                                                reduce=reduce, episodes=(EPISODES[rows], 5))[0]

    for rows, got in zip(parts, _simulated_replicas([replica(rows) for rows in parts])):
        torch.testing.assert_close(got, want[rows], atol=1e-6, rtol=0)


@pytest.mark.parametrize("estimator", ["grpo_turn", "gigpo"])
def test_turn_level_estimators_refuse_episodes_of_several_samples(estimator):
    rewards, mask = _rows()
    with pytest.raises(ValueError, match="rollout.agent.train_samples=last"):
        compute_advantage(AlgorithmConfig(adv_estimator=estimator), rewards, mask, index=UIDS,
                          episodes=(EPISODES, 5), turn_states=mask)
