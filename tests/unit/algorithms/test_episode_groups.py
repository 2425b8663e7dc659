"""Group statistics that count episodes, not rows: an agent episode whose session forked trains each of its samples,
and its group's baseline must weigh the episode once (``episodes=`` of the outcome estimators)."""

from __future__ import annotations

import pytest
import torch

from mcore_agentic.algorithms.advantages import compute_advantage
from mcore_agentic.algorithms.config import AlgorithmConfig
from tests.unit.algorithms.test_gigpo import _rows as _turn_rows  # (state, reward) turns -> rows

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


# --- turn level: a row's turns at its episode's turn indices ---------------------------------------------------------
def _turn_values(adv: torch.Tensor, rows) -> list[float]:
    """Each turn's advantage (read on its sampled token), row after row."""
    return [float(adv[i, 2 * t]) for i, row in enumerate(rows) for t in range(len(row))]


def test_grpo_turn_compares_episodes_at_the_episodes_turn_index():
    # Episode 0: row A (turns 0, 1) and row B (its continuation after a compaction: turn 2). Episode 1: row C
    # (turns 0-2). Episode 2: row D (turn 0). gamma 1: A's returns 1.0, 0.9; B 1.0; C 0.5 x3; D 0.3.
    rows = [[(1, 0.1), (1, 0.9)], [(1, 1.0)], [(1, 0.0), (1, 0.0), (1, 0.5)], [(1, 0.3)]]
    rewards, mask, _ = _turn_rows(rows)
    cfg = AlgorithmConfig(adv_estimator="grpo_turn")
    adv, _ = compute_advantage(cfg, rewards, mask, index=["g"] * 4, episodes=(torch.tensor([0, 0, 1, 2]), 3),
                               turn_offset=torch.tensor([0, 2, 0, 0]))
    # index 0: A 1.0 - (0.5 + 0.3)/2, C 0.5 - (1.0 + 0.3)/2, D 0.3 - (1.0 + 0.5)/2; index 1: A 0.9 - 0.5, C -0.4;
    # index 2: B 1.0 - 0.5 (C's), C 0.5 - 1.0 (B's: episode 0's turn 2).
    assert _turn_values(adv, rows) == pytest.approx([0.6, 0.4, 0.5, -0.15, -0.4, -0.5, -0.45])


def test_two_samples_of_one_episode_at_one_turn_index_leave_each_other_out():
    # Concurrent samples: rows A (turns 0, 1) and A2 (offset 1) of episode 0 both act at turn index 1.
    rows = [[(1, 0.0), (1, 1.0)], [(1, 0.6)], [(1, 0.0), (1, 0.2)]]
    rewards, mask, _ = _turn_rows(rows)
    cfg = AlgorithmConfig(adv_estimator="grpo_turn")
    adv, _ = compute_advantage(cfg, rewards, mask, index=["g"] * 3, episodes=(torch.tensor([0, 0, 1]), 2),
                               turn_offset=torch.tensor([0, 1, 0]))
    # index 0: A 1.0 - 0.2, C 0.2 - 1.0; index 1: A 1.0 - 0.2 and A2 0.6 - 0.2 (only C is another episode), C
    # 0.2 - (1.0 + 0.6)/2.
    assert _turn_values(adv, rows) == pytest.approx([0.8, 0.8, 0.4, -0.8, -0.6])


def test_gigpo_counts_episodes_at_both_levels():
    # Row B retries from the state A's second turn acted from (s2): they are one episode (0) and leave each other
    # out of that step group. Returns: A 1.0, 1.0; B 0.4; C 0.2, 0.2. Episode scores: episode 0 the mean of its
    # samples' (1.0, 0.4) = 0.7, episode 1 0.2.
    rows = [[(1, 0.0), (2, 1.0)], [(2, 0.4)], [(1, 0.0), (2, 0.2)]]
    rewards, mask, states = _turn_rows(rows)
    cfg = AlgorithmConfig(adv_estimator="gigpo")
    adv, _ = compute_advantage(cfg, rewards, mask, index=["g"] * 3, episodes=(torch.tensor([0, 0, 1]), 2),
                               turn_offset=torch.tensor([0, 2, 0]), turn_states=states)
    # episode part (rloo over episodes): A 1.0 - 0.2, B 0.4 - 0.2, C 0.2 - 0.7. Step part: A at s1 1.0 - 0.2, at s2
    # 1.0 - 0.2 (B left out), B at s2 0.4 - 0.2, C at s1 0.2 - 1.0, at s2 0.2 - (1.0 + 0.4)/2.
    assert _turn_values(adv, rows) == pytest.approx([1.6, 1.6, 0.4, -1.3, -1.0])


@pytest.mark.parametrize("estimator", ["grpo_turn", "gigpo"])
def test_turn_level_estimators_with_episodes_split_over_two_replicas(estimator):
    from tests.unit.trainer.test_experience import _simulated_replicas

    rows = [[(1, 0.1), (2, 0.9)], [(2, 1.0)], [(1, 0.0), (3, 0.0), (2, 0.5)], [(1, 0.3)], [(1, 0.2), (2, 0.1)],
            [(1, 0.7)]]
    rewards, mask, states = _turn_rows(rows)
    uids = ["g", "g", "g", "g", "h", "h"]
    gid = torch.tensor([0, 0, 0, 0, 1, 1])
    episodes, offsets = torch.tensor([0, 0, 1, 2, 3, 4]), torch.tensor([0, 2, 0, 0, 0, 0])
    cfg = AlgorithmConfig(adv_estimator=estimator)
    want, _ = compute_advantage(cfg, rewards, mask, index=uids, episodes=(episodes, 5), turn_offset=offsets,
                                turn_states=states)
    parts = [[0, 2, 5], [1, 3, 4]]  # episode 0's samples on different replicas

    def replica(r):
        return lambda reduce: compute_advantage(cfg, rewards[r], mask[r], index=gid[r], num_groups=2, reduce=reduce,
                                                episodes=(episodes[r], 5), turn_offset=offsets[r],
                                                turn_states=states[r])[0]

    for r, got in zip(parts, _simulated_replicas([replica(r) for r in parts])):
        torch.testing.assert_close(got, want[r], atol=1e-6, rtol=0)


def test_a_truncated_row_counts_at_the_turns_it_reached():
    # Row T was cut by the response budget in its second turn: that turn is partial and carries the over-long
    # penalty (-0.5) instead of an outcome. It is a row like any other at the turns it reached.
    rows = [[(1, 0.2), (1, 0.8)], [(1, 0.2), (1, -0.5)], [(1, 0.3)]]
    rewards, mask, _ = _turn_rows(rows)
    mask[1, 3] = 1  # the cut turn: two tokens sampled before the budget ran out
    adv, _ = compute_advantage(AlgorithmConfig(adv_estimator="grpo_turn"), rewards, mask, index=["g"] * 3)
    # Returns: A 1.0, 0.8; T -0.3, -0.5; C 0.3. Index 0: A 1.0 - 0, T -0.3 - 0.65, C 0.3 - 0.35; index 1: A 0.8 + 0.5,
    # T -0.5 - 0.8 (on both of its cut turn's tokens).
    assert _turn_values(adv, rows) == pytest.approx([1.0, 1.3, -0.95, -1.3, -0.05])
    assert float(adv[1, 3]) == pytest.approx(-1.3)


def test_grpo_over_episodes_scores_each_row_by_its_episode():
    # Two episodes of two samples, both rewarded 1; one sample of each also carries a per-row over-long penalty
    # (-1). The episodes' scores are equal (0.5 each): std 0. A row's own score against that std would be +-0.5/eps.
    mask = torch.ones(4, 2, dtype=torch.long)
    rewards = torch.zeros(4, 2)
    rewards[:, -1] = torch.tensor([0.0, 1.0, 0.0, 1.0])
    adv, _ = compute_advantage(AlgorithmConfig(adv_estimator="grpo"), rewards, mask, index=["g"] * 4,
                               episodes=(torch.tensor([0, 0, 1, 1]), 2))
    assert float(adv.abs().max()) == 0.0
