"""Left-padding removal, CP padding and the map back to the response layout."""

import pytest
import torch

from mcore_agentic.config.errors import ConfigError
from mcore_agentic.workers.sequence import fixed_micro_batches, pack_sequences, scatter_rows, token_budget_micro_batches


def _layout():
    # P=4 (left-padded), R=3 (right-padded)
    input_ids = torch.tensor(
        [
            [0, 0, 11, 12, 21, 22, 0],  # prompt 2, response 2
            [13, 14, 15, 16, 23, 24, 25],  # prompt 4, response 3
            [0, 0, 0, 17, 26, 0, 0],  # prompt 1, response 1
        ]
    )
    attention_mask = (input_ids != 0).long()
    return input_ids, attention_mask


def test_rows_start_at_zero_and_labels_are_next_tokens():
    ids, am = _layout()
    packed = pack_sequences(ids, am, prompt_len=4)
    assert packed.tokens.tolist() == [[11, 12, 21, 22, 0, 0, 0], [13, 14, 15, 16, 23, 24, 25], [17, 26, 0, 0, 0, 0, 0]]
    assert packed.labels[0].tolist() == [12, 21, 22, 0, 0, 0, 0]
    assert packed.lengths.tolist() == [4, 7, 2] and packed.left_pad.tolist() == [2, 0, 3]


def test_cp_padding_multiple():
    ids, am = _layout()
    assert pack_sequences(ids, am, 4, cp_size=2).padded_len == 8
    assert pack_sequences(ids, am, 4, cp_size=2, multiple_of=3).padded_len == 12


def test_to_response_selects_the_predicting_position():
    ids, am = _layout()
    packed = pack_sequences(ids, am, prompt_len=4, cp_size=2)
    # A per-token output that equals the label it predicts must map back to the response ids.
    resp = packed.to_response(packed.labels.float())
    expected = ids[:, 4:].float()
    assert torch.equal(resp, expected)


def test_hole_in_attention_mask_is_rejected():
    ids, am = _layout()
    am = am.clone()
    am[1, 2] = 0
    with pytest.raises(ValueError, match="row 1 has a hole"):
        pack_sequences(ids, am, prompt_len=4)


def test_fixed_micro_batches():
    assert fixed_micro_batches(5, 2) == [[0, 1], [2, 3], [4]]


def test_token_budget_respects_padded_cost_and_covers_rows():
    lengths = [5, 30, 7, 12, 29, 3, 8]
    groups = token_budget_micro_batches(lengths, 64, cp_size=2)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        padded = max(-(-lengths[i] // 4) * 4 for i in g)
        assert len(g) * padded <= 64
    assert groups == token_budget_micro_batches(lengths, 64, cp_size=2)  # deterministic


def test_token_budget_too_small_names_the_field():
    with pytest.raises(ConfigError) as err:
        token_budget_micro_batches([10, 40], 32, field="critic.ppo_max_token_len_per_gpu")
    assert err.value.field == "critic.ppo_max_token_len_per_gpu"


def test_scatter_rows_inverts_the_grouping():
    x = torch.arange(7).float() * 10
    groups = token_budget_micro_batches([5, 30, 7, 12, 29, 3, 8], 64)
    pieces = [x[g] for g in groups]
    assert torch.equal(scatter_rows(pieces, groups, 7), x)
