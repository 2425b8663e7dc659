"""Turn-level credit, hand-computed: turns found from the loss mask, ``grpo_turn`` (returns-to-go per turn against
the leave-one-out mean at the same turn index), each turn's reward placed on its last sampled token by the scoring
(``algorithm.turn_rewards``), the experience splitting a row's score between its turns and its end, and GAE reading
the per-turn rewards across turns. The unbiasedness argument is measured in ``test_turn_credit_unbiased.py``."""

from __future__ import annotations

import pytest
import torch

from mcore_agentic.algorithms.advantages import compute_advantage
from mcore_agentic.algorithms.config import AlgorithmConfig
from mcore_agentic.algorithms.turn_advantages import compute_grpo_turn_advantage, turn_spans
from mcore_agentic.data.batch import Batch
from mcore_agentic.feed.scoring import turn_reward_tensor
from mcore_agentic.trainer.experience import compute_experience, turn_metrics

# Three rows of one group. Row 0: two turns (tokens 0-1, 4-6); row 1: three one/one/one-token turns (0, 2, 4);
# row 2: one turn (0-2). Masked tokens between turns are the tool results / user replies.
MASK = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0], [1, 0, 1, 0, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]])


def _rewards() -> torch.Tensor:
    r = torch.zeros(3, 8, dtype=torch.float64)
    r[0, 1], r[0, 6] = 0.5, 1.0  # turn rewards 0.5, 1.0
    r[1, 0], r[1, 2], r[1, 4] = 0.25, 0.5, 0.0  # 0.25, 0.5, 0
    r[2, 2] = 1.0  # 1.0
    return r


def test_turns_are_the_runs_of_sampled_tokens():
    turn, counts = turn_spans(MASK)
    assert counts.tolist() == [2, 3, 1]
    assert turn.tolist() == [[0, 0, -1, -1, 1, 1, 1, -1], [0, -1, 1, -1, 2, -1, -1, -1], [0, 0, 0, -1, -1, -1, -1, -1]]
    assert turn_spans(torch.zeros(1, 4, dtype=torch.long))[1].tolist() == [0]


def test_grpo_turn_by_hand():
    adv, ret = compute_grpo_turn_advantage(_rewards(), MASK, ["g", "g", "g"], gamma=1.0)
    # G: row 0 [1.5, 1.0]; row 1 [0.75, 0.5, 0.0]; row 2 [1.0]
    # turn 0: others' means 0.875, 1.25, 1.125 -> A 0.625, -0.5, -0.125; turn 1: 1.0 - 0.5, 0.5 - 1.0;
    # turn 2: row 1 alone at it -> baseline 0, A = G = 0
    want = torch.tensor([[0.625, 0.625, 0, 0, 0.5, 0.5, 0.5, 0], [-0.5, 0, -0.5, 0, 0.0, 0, 0, 0],
                         [-0.125, -0.125, -0.125, 0, 0, 0, 0, 0]], dtype=torch.float64)
    torch.testing.assert_close(adv, want)
    torch.testing.assert_close(ret[0, [0, 4]], torch.tensor([1.5, 1.0], dtype=torch.float64))


def test_grpo_turn_discounts_across_turns_not_tokens():
    adv, ret = compute_grpo_turn_advantage(_rewards(), MASK, ["g", "g", "g"], gamma=0.5)
    # G: row 0 [0.5 + 0.5 * 1.0, 1.0] = [1.0, 1.0]; row 1 [0.25 + 0.5 * 0.5, 0.5, 0] = [0.5, 0.5, 0]; row 2 [1.0]
    assert ret[0, 0].item() == pytest.approx(1.0) and ret[1, 0].item() == pytest.approx(0.5)
    assert adv[0, 0].item() == pytest.approx(1.0 - 0.75) and adv[1, 0].item() == pytest.approx(0.5 - 1.0)
    assert adv[0, 4].item() == pytest.approx(1.0 - 0.5)


def test_grpo_turn_groups_failed_rows_and_groups_of_one():
    mask = torch.cat([MASK, torch.zeros(1, 8, dtype=torch.long), MASK[:1]])
    rewards = torch.cat([_rewards(), torch.zeros(1, 8, dtype=torch.float64), _rewards()[:1]])
    adv, _ = compute_grpo_turn_advantage(rewards, mask, ["g", "g", "g", "g", "solo"])
    torch.testing.assert_close(adv[:3], compute_grpo_turn_advantage(_rewards(), MASK, ["g"] * 3)[0])  # failed: out
    assert adv[3].abs().sum() == 0 and adv[4].abs().sum() == 0  # no sampled token; no other row in its group


def test_grpo_turn_on_single_turn_rows_is_rloo():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    rewards = torch.tensor([[0, 1.0, 0], [0.0, 0, 0], [0, 0, 0.5]])
    cfg = AlgorithmConfig(adv_estimator="grpo_turn")
    adv, _ = compute_advantage(cfg, rewards, mask, index=[0, 0, 0])
    rloo, _ = compute_advantage(AlgorithmConfig(adv_estimator="rloo"), rewards, mask, index=[0, 0, 0])
    torch.testing.assert_close(adv, rloo)


def test_grpo_turn_over_replicas_equals_one_batch():
    """Rows split over two replicas (threads with a real summing all-reduce, ``test_experience``'s) give each
    replica exactly the one-batch advantages of its rows (the turn width agreed by a sum included)."""
    from tests.unit.trainer.test_experience import _simulated_replicas

    full, _ = compute_grpo_turn_advantage(_rewards(), MASK, [0, 0, 0], num_groups=1)
    parts = [slice(0, 1), slice(1, 3)]

    def replica(rows: slice):
        n = rows.stop - rows.start
        return lambda reduce: compute_grpo_turn_advantage(
            _rewards()[rows], MASK[rows], [0] * n, num_groups=1, reduce=reduce)[0]

    out = _simulated_replicas([replica(rows) for rows in parts])
    torch.testing.assert_close(out[0], full[0:1])
    torch.testing.assert_close(out[1], full[1:3])


def _scored_batch() -> Batch:
    responses = torch.ones(2, 8, dtype=torch.long)
    return Batch(
        tensors={"responses": responses, "response_mask": MASK[:2]},
        meta={"turn_ends": [[1, 6], [0, 2, -1]], "turn_tool_rewards": [[0.5, 0.0], [0.25, 0.5, 0.3]],
              "turn_interaction_scores": [[0.0, 0.25], [0.0, 0.0, 0.0]],
              "request_metrics": [{"state": "completed"}, {"state": "completed"}]},
    )


def test_each_turn_reward_sits_on_the_turns_last_sampled_token():
    out = turn_reward_tensor(_scored_batch())
    want = torch.zeros(2, 8)
    want[0, 1], want[0, 6] = 0.5, 0.25  # tool step reward; the interaction's score of the reply to turn 1
    want[1, 0], want[1, 2] = 0.25, 0.5  # the third turn sampled nothing: its 0.3 stays with the episode
    torch.testing.assert_close(out, want)
    failed = _scored_batch()
    failed.meta["request_metrics"][0] = {"state": "failed"}
    assert turn_reward_tensor(failed)[0].abs().sum() == 0


def test_the_experience_splits_a_score_between_its_turns_and_its_end():
    turns = turn_reward_tensor(_scored_batch())
    batch = Batch(tensors={"response_mask": MASK[:2], "seq_scores": torch.tensor([2.0, 1.0]), "turn_rewards": turns},
                  meta={"uid": ["a", "a"]})
    out, metrics = compute_experience(batch, AlgorithmConfig(adv_estimator="grpo_turn"), None)
    scores = out["token_level_scores"]
    torch.testing.assert_close(scores.sum(-1), torch.tensor([2.0, 1.0]))  # nothing lost, nothing added
    assert scores[0, 1].item() == pytest.approx(0.5) and scores[0, 6].item() == pytest.approx(0.25 + 1.25)
    assert scores[1, 0].item() == pytest.approx(0.25) and scores[1, 4].item() == pytest.approx(0.25)
    assert metrics["turn/rows/0"] == 2 and metrics["turn/rows/2"] == 1
    assert metrics["turn/reward_mean/0"] == pytest.approx((0.5 + 0.25) / 2)


def test_gae_reads_turn_rewards_across_turns():
    """A per-turn reward at turn 0 and the outcome at the end: with gamma=lam=1 and zero values the first turn's
    tokens see both, the last turn's only the outcome (environment tokens are not time steps)."""
    mask = torch.tensor([[1, 1, 0, 1, 1]])
    rewards = torch.tensor([[0, 0.5, 0, 0, 1.0]])
    cfg = AlgorithmConfig(adv_estimator="gae", gamma=1.0, lam=1.0)
    _, returns = compute_advantage(cfg, rewards, mask, values=torch.zeros(1, 5))
    torch.testing.assert_close(returns, torch.tensor([[1.5, 1.5, 0, 1.0, 1.0]]))


def test_turn_metrics_by_turn_index():
    scores = _rewards().float()
    adv, _ = compute_grpo_turn_advantage(_rewards(), MASK, ["g"] * 3)
    m = turn_metrics(scores, adv.float(), MASK)
    assert m["turn/rows/0"] == 3 and m["turn/rows/1"] == 2 and m["turn/rows/2"] == 1 and "turn/rows/3" not in m
    assert m["turn/reward_mean/1"] == pytest.approx((1.0 + 0.5) / 2)
    assert m["turn/advantage_mean/1"] == pytest.approx((0.5 * 3 - 0.5) / 4)


def test_scoring_counts_and_places_every_turn_source_only_in_turn_mode():
    """Tool step rewards (already in the episode score), the interaction's turn scores and the reward function's
    ``turn_rewards`` land on their turns with ``turn_rewards=True``; without it the score is today's."""
    from mcore_agentic.feed.scoring import score_rollout
    from mcore_agentic.models.tokenizer import load_qwen_tokenizer

    base = _scored_batch()
    prompts = torch.ones(2, 3, dtype=torch.long)
    batch = Batch(
        tensors={"prompts": prompts, "responses": base["responses"], "response_mask": base["response_mask"],
                 "attention_mask": torch.ones(2, 11, dtype=torch.long)},
        meta={**base.meta, "uid": ["a", "a"], "data_source": ["x", "x"], "ground_truth": ["1", "1"],
              "tool_rewards": [0.5, 1.05], "finish_reason": ["stop", "length"]},
    )

    def reward_fn(source, text, truth, extra):
        return {"score": 1.0, "turn_rewards": [0.125, 0.0, 0.0]}

    tok = load_qwen_tokenizer()
    episode = score_rollout(batch, reward_fn, tok, [{}, {}])
    assert episode["seq_scores"].tolist() == pytest.approx([1.5, 2.05]) and "turn_rewards" not in episode
    turn = score_rollout(batch, reward_fn, tok, [{}, {}], turn_rewards=True)
    # + the interaction's turn scores (0.25 for row 0) + the reward function's turn rewards (0.125 each)
    assert turn["seq_scores"].tolist() == pytest.approx([1.5 + 0.25 + 0.125, 2.05 + 0.125])
    placed = turn["turn_rewards"]
    assert placed[0, 1].item() == pytest.approx(0.5 + 0.125) and placed[0, 6].item() == pytest.approx(0.25)
    assert placed[1, 0].item() == pytest.approx(0.25 + 0.125) and placed[1, 2].item() == pytest.approx(0.5)
