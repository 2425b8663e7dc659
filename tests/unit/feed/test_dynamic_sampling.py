"""Dynamic sampling: which prompt groups are informative, how groups are allocated over rollout groups, and the
pool that keeps a leader's groups across rounds of different padded widths."""

from __future__ import annotations

import pytest
import torch

from mcore_agentic.data.batch import Batch, build_rollout_layout, concat_rollouts
from mcore_agentic.feed.dynamic_sampling import group_rows, informative, metric_values
from mcore_agentic.feed.fresh_rounds import GroupPool
from mcore_agentic.feed.rounds import allocate

PAD = 0


def _scored(uids, accs, scores, acted=None, *, prompt=2, response=3) -> Batch:
    """Rows of ``prompt``+``response`` tokens (response tokens = row index + 1); ``acted`` False: no sampled token."""
    b = len(uids)
    acted = acted or [True] * b
    prompts = [[7] * prompt for _ in range(b)]
    responses = [[i + 1] * response for i in range(b)]
    masks = [[int(a)] * response for a in acted]
    tensors = build_rollout_layout(prompts, responses, pad_token_id=PAD,
                                   response_fields={"response_mask": (masks, torch.long)})
    tensors["seq_scores"] = torch.tensor(scores, dtype=torch.float32)
    return Batch(tensors=tensors, meta={"uid": list(uids), "acc": list(accs)})


def test_groups_follow_uids_in_first_seen_order():
    batch = _scored(["b", "a", "b", "a", "c"], [0] * 5, [0.0] * 5)
    assert group_rows(batch) == [[0, 2], [1, 3], [4]]


def test_informative_groups_by_accuracy():
    # g0 all wrong, g1 mixed, g2 all right, g3 mixed but only one sample acted (the other failed), g4 mixed.
    uids = ["g0", "g0", "g1", "g1", "g2", "g2", "g3", "g3", "g4", "g4", "g4"]
    accs = [0, 0, 1, 0, 1, 1, 1, 0, 0, 0, 1]
    acted = [True] * 6 + [True, False] + [True] * 3
    batch = _scored(uids, accs, [float(a) for a in accs], acted)
    assert informative(batch, "acc") == [False, True, False, False, True]


def test_informative_groups_by_score_see_what_accuracy_does_not():
    # Both samples wrong (acc 0) but one was closer (a shaped score): informative by score only.
    batch = _scored(["g", "g", "h", "h"], [0, 0, 1, 1], [0.2, 0.0, 1.0, 1.0])
    assert informative(batch, "acc") == [False, False]
    assert informative(batch, "score") == [True, False]
    assert informative(batch, "seq_reward") == informative(batch, "score")
    assert metric_values(batch, "score") == pytest.approx([0.2, 0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="unknown filter metric"):
        metric_values(batch, "seq_final_reward")


def test_allocate_takes_in_rollout_group_order():
    assert allocate([3, 5, 2], 6) == [3, 3, 0]
    assert allocate([0, 5, 2], 6) == [0, 5, 1]
    assert allocate([1, 1], 0) == [0, 0]
    with pytest.raises(ValueError, match="6 groups wanted but only 4"):
        allocate([2, 2], 6)


def test_concat_repads_rounds_of_different_widths():
    a = _scored(["a", "a"], [1, 0], [1.0, 0.0], prompt=2, response=3)
    b = _scored(["b", "b"], [1, 0], [1.0, 0.0], prompt=4, response=1)
    out = concat_rollouts([a, b], PAD)
    assert out["prompts"].shape == (4, 4) and out["responses"].shape == (4, 3)
    assert out["uid"] == ["a", "a", "b", "b"]
    assert out["responses"][2].tolist() == [1, PAD, PAD] and out["response_mask"][2].tolist() == [1, 0, 0]
    assert out["prompts"][0].tolist() == [PAD, PAD, 7, 7] and out["attention_mask"][0].tolist() == [0, 0, 1, 1, 1, 1, 1]
    assert out["seq_scores"].tolist() == [1.0, 0.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="no rows"):
        concat_rollouts([], PAD)


def test_pool_keeps_informative_groups_first_then_spares_in_round_order():
    pool = GroupPool("acc")
    round1 = _scored(["x", "x", "y", "y"], [1, 1, 1, 0], [1.0, 1.0, 1.0, 0.0], response=2)
    round2 = _scored(["z", "z", "w", "w"], [0, 1, 0, 0], [0.0, 1.0, 0.0, 0.0], response=4)
    assert pool.add(round1) == (1, 1)  # y informative, x spare
    assert pool.add(round2) == (1, 1)  # z informative, w spare
    both = pool.take(2, 0, PAD)
    assert both["uid"] == ["y", "y", "z", "z"] and both["responses"].shape[1] == 4
    filled = pool.take(1, 2, PAD)  # one informative group, then the spares in round order
    assert filled["uid"] == ["y", "y", "x", "x", "w", "w"]
    assert pool.take(0, 0, PAD) is None


def test_allocate_even_spreads_groups_over_rollout_groups():
    from mcore_agentic.feed.rounds import allocate_even

    assert allocate_even([5, 5], 4) == [2, 2]
    assert allocate_even([1, 5, 5], 6) == [1, 3, 2]  # the first runs out; the rest share what is left
    assert allocate_even([3, 3], 5) == [3, 2]
    assert allocate_even([0, 7], 4) == [0, 4]
    assert allocate_even([2, 2], 0) == [0, 0]
    with pytest.raises(ValueError, match="5 groups wanted but only 4"):
        allocate_even([2, 2], 5)
