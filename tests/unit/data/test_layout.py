"""The rollout batch layout: left-padded prompts, right-padded responses, masks, positions, widths, re-padding."""

from __future__ import annotations

import pytest
import torch

from mcore_agentic.data.batch import LAYOUT_KEYS, build_rollout_layout, repad_rollout_layout

PAD = 9


def _three() -> dict[str, torch.Tensor]:
    return build_rollout_layout(
        [[1, 2, 3], [4], []],
        [[5, 6], [7, 8, 10, 11], []],
        pad_token_id=PAD,
        response_fields={
            "response_mask": ([[1, 0], [1, 1, 0, 1], []], torch.long),
            "rollout_log_probs": ([[-0.5, 0.0], [-1.0, -2.0, 0.0, -3.0], []], torch.float32),
        },
    )


def test_padding_sides_masks_and_positions():
    t = _three()
    assert list(t) == [*LAYOUT_KEYS, "response_mask", "rollout_log_probs"]
    assert t["prompts"].tolist() == [[1, 2, 3], [PAD, PAD, 4], [PAD, PAD, PAD]]
    assert t["responses"].tolist() == [[5, 6, PAD, PAD], [7, 8, 10, 11], [PAD, PAD, PAD, PAD]]
    assert torch.equal(t["input_ids"], torch.cat([t["prompts"], t["responses"]], 1))
    assert t["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0]]
    assert t["position_ids"].tolist() == [[0, 1, 2, 3, 4, 4, 4], [0, 0, 0, 1, 2, 3, 4], [0, 0, 0, 0, 0, 0, 0]]
    assert t["response_mask"].tolist() == [[1, 0, 0, 0], [1, 1, 0, 1], [0, 0, 0, 0]]
    assert t["rollout_log_probs"].tolist() == [[-0.5, 0.0, 0.0, 0.0], [-1.0, -2.0, 0.0, -3.0], [0.0] * 4]
    for k in LAYOUT_KEYS + ("response_mask",):
        assert t[k].dtype == torch.int64, k
    assert t["rollout_log_probs"].dtype == torch.float32
    # every real token is attended, every pad is not, and positions count the real tokens only
    assert torch.equal(t["attention_mask"].bool(), t["input_ids"] != PAD)
    for row, attn in zip(t["position_ids"], t["attention_mask"]):
        assert torch.equal(row[attn.bool()], torch.arange(int(attn.sum())))


def test_widths_default_to_longest_row_at_least_one_and_can_be_given():
    empty = build_rollout_layout([[]], [[]], pad_token_id=PAD)
    assert empty["prompts"].shape == (1, 1) and empty["responses"].shape == (1, 1)
    assert empty["attention_mask"].tolist() == [[0, 0]]
    wide = build_rollout_layout([[1, 2]], [[3]], pad_token_id=PAD, prompt_width=4, response_width=3)
    assert wide["input_ids"].tolist() == [[PAD, PAD, 1, 2, 3, PAD, PAD]]
    assert wide["position_ids"].tolist() == [[0, 0, 0, 1, 2, 2, 2]]
    with pytest.raises(ValueError, match="prompt width 1 is shorter"):
        build_rollout_layout([[1, 2]], [[3]], pad_token_id=PAD, prompt_width=1)
    with pytest.raises(ValueError, match="response width 0 is shorter"):
        build_rollout_layout([[1, 2]], [[3]], pad_token_id=PAD, response_width=0)


def test_rows_may_be_tensors_and_fields_must_match_the_response():
    lists = _three()
    as_tensors = build_rollout_layout(
        [torch.tensor(x, dtype=torch.long) for x in ([1, 2, 3], [4], [])],
        [torch.tensor(x, dtype=torch.long) for x in ([5, 6], [7, 8, 10, 11], [])],
        pad_token_id=PAD,
        response_fields={
            "response_mask": ([torch.tensor(x, dtype=torch.long) for x in ([1, 0], [1, 1, 0, 1], [])], torch.long),
            "rollout_log_probs": ([[-0.5, 0.0], [-1.0, -2.0, 0.0, -3.0], []], torch.float32),
        },
    )
    for k in lists:
        assert as_tensors[k].dtype == lists[k].dtype and torch.equal(as_tensors[k], lists[k]), k
    with pytest.raises(ValueError, match="row 0 has 1 values for 2 tokens"):
        build_rollout_layout([[1]], [[2, 3]], pad_token_id=PAD, response_fields={"m": ([[1]], torch.long)})
    with pytest.raises(ValueError, match="1 prompts but 2 responses"):
        build_rollout_layout([[1]], [[2], [3]], pad_token_id=PAD)


def test_repad_equals_building_at_the_wider_widths():
    t = _three()
    t["seq_scores"] = torch.tensor([1.0, 2.0, 3.0])
    wide = repad_rollout_layout(t, pad_token_id=PAD, prompt_width=5, response_width=6)
    built = build_rollout_layout(
        [[1, 2, 3], [4], []],
        [[5, 6], [7, 8, 10, 11], []],
        pad_token_id=PAD,
        prompt_width=5,
        response_width=6,
        response_fields={
            "response_mask": ([[1, 0], [1, 1, 0, 1], []], torch.long),
            "rollout_log_probs": ([[-0.5, 0.0], [-1.0, -2.0, 0.0, -3.0], []], torch.float32),
        },
    )
    assert set(wide) == set(built) | {"seq_scores"}
    for k in built:
        assert wide[k].dtype == built[k].dtype and torch.equal(wide[k], built[k]), k
    assert wide["seq_scores"] is t["seq_scores"]
    same = repad_rollout_layout(t, pad_token_id=PAD, prompt_width=3, response_width=4)
    for k in t:
        assert torch.equal(same[k], t[k]), k


def test_repad_refuses_narrowing_and_unknown_shapes():
    t = _three()
    with pytest.raises(ValueError, match="cannot narrow"):
        repad_rollout_layout(t, pad_token_id=PAD, prompt_width=2, response_width=4)
    with pytest.raises(ValueError, match="cannot re-pad batch key 'hidden'"):
        repad_rollout_layout({**t, "hidden": torch.zeros(3, 7, 2)}, pad_token_id=PAD, prompt_width=3, response_width=4)
