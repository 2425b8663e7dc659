"""``adv_estimator=gigpo``: hand-computed episode and step advantages, and how turns get their states.

The exact unbiasedness check of its ``mean_norm`` form is in ``test_turn_credit_unbiased.py``; its DP reduction in
``tests/unit/trainer/test_experience.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from mcore_agentic.algorithms.advantages import compute_advantage
from mcore_agentic.algorithms.config import AlgorithmConfig
from mcore_agentic.algorithms.turn_advantages import compute_gigpo_advantage
from mcore_agentic.data.batch import Batch
from mcore_agentic.feed.turn_states import turn_state_tensor
from mcore_agentic.utils.errors import ConfigError

# One group of three rows; a turn is one sampled token followed by one masked separator. States A=1, B=2, C=3.
#   row 0: A r=0.5, B r=1.0           returns-to-go (gamma 1) 1.5, 1.0    score 1.5
#   row 1: A r=0.0, C r=0.0           0.0, 0.0                            score 0.0
#   row 2: A r=0.2, B r=0.3, B r=0.1  0.6, 0.4, 0.1 (B twice: a loop)     score 0.6
TURNS = [[(1, 0.5), (2, 1.0)], [(1, 0.0), (3, 0.0)], [(1, 0.2), (2, 0.3), (2, 0.1)]]


def _rows(turns=TURNS, width: int = 8):
    """Rows of (state, reward) turns: one sampled token then one masked separator per turn."""
    rewards = torch.zeros(len(turns), width, dtype=torch.float64)
    mask = torch.zeros(len(turns), width, dtype=torch.long)
    states = torch.zeros(len(turns), width, dtype=torch.long)
    for i, row in enumerate(turns):
        for t, (state, reward) in enumerate(row):
            rewards[i, 2 * t], mask[i, 2 * t], states[i, 2 * t] = reward, 1, state
    return rewards, mask, states


def _per_turn(adv: torch.Tensor) -> list[list[float]]:
    return [[round(float(adv[i, 2 * t]), 6) for t in range(len(row))] for i, row in enumerate(TURNS)]


def test_mean_norm_by_hand():
    rewards, mask, states = _rows()
    adv, ret = compute_gigpo_advantage(rewards, mask, states, ["g"] * 3)
    # Episode part (rloo): 1.5 - (0 + 0.6)/2 = 1.2; 0 - (1.5 + 0.6)/2 = -1.05; 0.6 - (1.5 + 0)/2 = -0.15.
    # Step part, the other rows' turns from the same state:
    #   row 0: A 1.5 - (0 + 0.6)/2 = 1.2;  B 1.0 - (0.4 + 0.1)/2 = 0.75
    #   row 1: A 0 - (1.5 + 0.6)/2 = -1.05; C alone: 0
    #   row 2: A 0.6 - (1.5 + 0)/2 = -0.15; both B turns against row 0's only (its own loop is left out):
    #          0.4 - 1.0 = -0.6, 0.1 - 1.0 = -0.9
    assert _per_turn(adv) == [[2.4, 1.95], [-2.1, -1.05], [-0.3, -0.75, -1.05]]
    assert _per_turn(ret) == [[1.5, 1.0], [0.0, 0.0], [0.6, 0.4, 0.1]]
    assert bool((adv[mask == 0] == 0).all())
    half, _ = compute_gigpo_advantage(rewards, mask, states, ["g"] * 3, step_advantage_w=0.5)
    assert _per_turn(half)[0] == pytest.approx([1.2 + 0.6, 1.2 + 0.375])


def test_a_turn_alone_at_its_state_is_measured_against_a_zero_baseline():
    turns = [[(1, 0.0), (2, 1.0)], [(1, 0.5)]]
    rewards, mask, states = _rows(turns, width=4)
    adv, _ = compute_gigpo_advantage(rewards, mask, states, ["g"] * 2)
    # Episode (rloo): 1.0 - 0.5 = 0.5 and 0.5 - 1.0 = -0.5. Step: row 0 at A 1.0 - 0.5 = 0.5, at B alone 1.0 - 0;
    # row 1 at A 0.5 - 1.0 = -0.5.
    assert [float(adv[0, 0]), float(adv[0, 2]), float(adv[1, 0])] == pytest.approx([1.0, 1.5, -1.0])
    std, _ = compute_gigpo_advantage(rewards, mask, states, ["g"] * 2, mode="mean_std_norm")
    # verl-agent's form: a step group of one adds nothing. Episode and step A both z = 0.25 / std(1.0, 0.5) = 1/sqrt 2.
    assert [float(std[0, 0]), float(std[0, 2])] == pytest.approx([2 ** 0.5, 2 ** -0.5], abs=1e-5)


def test_mean_std_norm_by_hand():
    rewards, mask, states = _rows()
    eps = 1e-6
    adv, _ = compute_gigpo_advantage(rewards, mask, states, ["g"] * 3, mode="mean_std_norm", epsilon=eps)

    def z(x: float, xs: list[float]) -> float:
        mean = sum(xs) / len(xs)
        std = math.sqrt(sum((v - mean) ** 2 for v in xs) / (len(xs) - 1))
        return (x - mean) / (std + eps)

    a, b = [1.5, 0.0, 0.6], [1.0, 0.4, 0.1]  # step groups A and B (the row's own turns included); C is alone
    want = [[z(1.5, a) + z(1.5, a), z(1.5, a) + z(1.0, b)], [z(0.0, a) + z(0.0, a), z(0.0, a) + 0.0],
            [z(0.6, a) + z(0.6, a), z(0.6, a) + z(0.4, b), z(0.6, a) + z(0.1, b)]]
    for got_row, want_row in zip(_per_turn(adv), want):
        assert got_row == pytest.approx(want_row, abs=1e-5)


def test_discounting_and_groups_and_rows_that_did_not_act():
    turns = TURNS + [[(1, 0.7), (2, 0.0)], []]  # row 3: another group; row 4: failed (sampled nothing)
    rewards, mask, states = _rows(turns)
    adv, ret = compute_gigpo_advantage(rewards, mask, states, ["g", "g", "g", "h", "g"], gamma=0.5)
    assert float(ret[0, 0]) == pytest.approx(0.5 + 0.5 * 1.0)
    assert float(ret[2, 0]) == pytest.approx(0.2 + 0.5 * (0.3 + 0.5 * 0.1))
    assert bool((adv[3] == 0).all())  # a group of one: no baseline at either level
    assert bool((adv[4] == 0).all())
    # Rows of group h never join group g's step groups, although their state ids are equal.
    alone, _ = compute_gigpo_advantage(rewards[:3], mask[:3], states[:3], ["g"] * 3, gamma=0.5)
    torch.testing.assert_close(adv[:3], alone)


def test_the_dispatch_reads_algorithm_gigpo_and_needs_states():
    rewards, mask, states = _rows()
    cfg = AlgorithmConfig(adv_estimator="gigpo", gigpo={"step_advantage_w": 0.5, "mode": "mean_std_norm"})
    got, _ = compute_advantage(cfg, rewards, mask, index=["g"] * 3, turn_states=states)
    want, _ = compute_gigpo_advantage(rewards, mask, states, ["g"] * 3, step_advantage_w=0.5, mode="mean_std_norm")
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="turn_states"):
        compute_advantage(cfg, rewards, mask, index=["g"] * 3)
    assert cfg.needs_groups and not cfg.needs_critic


@pytest.mark.parametrize("key,value", [("mode", "std"), ("state", "full"), ("step_advantage_w", -1.0)])
def test_bad_settings_name_their_key(key, value):
    with pytest.raises(ConfigError) as info:
        AlgorithmConfig(adv_estimator="gigpo", gigpo={key: value})
    assert info.value.field == f"algorithm.gigpo.{key}"


# ------------------------------------------------------------------------------------------------- states
PAD = 0


def _batch(rows: list[tuple[list[int], list[tuple[int, bool]]]], uids: list[str]) -> Batch:
    """Rows of (prompt ids, response as (id, sampled) pairs): left-padded prompts, right-padded responses."""
    p = max(len(r[0]) for r in rows)
    w = max(len(r[1]) for r in rows)
    prompts = torch.full((len(rows), p), PAD)
    responses = torch.full((len(rows), w), PAD)
    attention = torch.zeros(len(rows), p + w, dtype=torch.long)
    mask = torch.zeros(len(rows), w, dtype=torch.long)
    for i, (prompt, response) in enumerate(rows):
        prompts[i, p - len(prompt):] = torch.tensor(prompt)
        attention[i, p - len(prompt): p + len(response)] = 1
        for j, (tok, sampled) in enumerate(response):
            responses[i, j], mask[i, j] = tok, int(sampled)
    return Batch(tensors={"prompts": prompts, "responses": responses, "attention_mask": attention,
                          "response_mask": mask}, meta={"uid": uids})


def _turn_states(states: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    out = []
    for row, m in zip(states.tolist(), mask.tolist()):
        runs, previous = [], 0
        for value, sampled in zip(row, m):
            if sampled and not previous:
                runs.append(value)
            previous = sampled
        out.append(runs)
    return out


def test_states_from_observations_and_from_histories():
    S, E = True, False  # a sampled token, an environment token
    rows = [
        # prompt 7 8; the model says 50 51, the tool answers 90, the model says 52
        ([7, 8], [(50, S), (51, S), (90, E), (52, S)]),
        # same prompt; another first turn, the same tool answer, then a turn, tool answer 91, a turn
        ([7, 8], [(60, S), (90, E), (53, S), (91, E), (54, S)]),
        # same prompt, the first row's exact path: same history at every turn
        ([7, 8], [(50, S), (51, S), (90, E), (55, S), (91, E), (56, S)]),
        # another prompt group with the same tokens: its own numbering
        ([7, 8], [(50, S), (90, E), (57, S)]),
    ]
    batch = _batch(rows, ["a", "a", "a", "b"])
    mask = batch["response_mask"]
    observation = turn_state_tensor(batch, "observation")
    # First turns share the prompt (1); after tool answer 90 (2); after 91 (3). Group b numbers from 1 again.
    assert _turn_states(observation, mask) == [[1, 2], [1, 2, 3], [1, 2, 3], [1, 2]]
    history = turn_state_tensor(batch, "history")
    # Histories: the first turn's is shared; row 2 repeats row 0's path up to its second turn only.
    assert _turn_states(history, mask) == [[1, 2], [1, 3, 4], [1, 2, 5], [1, 2]]
    assert bool((observation[mask == 0] == 0).all()) and bool((history[mask == 0] == 0).all())
    with pytest.raises(ValueError, match="observation or history"):
        turn_state_tensor(batch, "latest")
