"""Left-padding removal (padded and packed THD layouts), CP padding, the map back to the response layout, micro-batches."""

import random

import pytest
import torch

from mcore_agentic.data.balance import partition
from mcore_agentic.utils.errors import ConfigError
from mcore_agentic.workers.sequence import (
    fixed_micro_batches,
    pack_rows,
    packed_budget_count,
    packed_budget_micro_batches,
    pad_rows,
    padded_budget_micro_batches,
    scatter_rows,
    segment_lengths,
)


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


# ----------------------------------------------------------------------------------- padded
def test_rows_start_at_zero_and_labels_are_next_tokens():
    ids, am = _layout()
    packed = pad_rows(ids, am, prompt_len=4)
    assert packed.tokens.tolist() == [[11, 12, 21, 22, 0, 0, 0], [13, 14, 15, 16, 23, 24, 25], [17, 26, 0, 0, 0, 0, 0]]
    assert packed.labels[0].tolist() == [12, 21, 22, 0, 0, 0, 0]
    assert packed.lengths.tolist() == [4, 7, 2] and packed.left_pad.tolist() == [2, 0, 3]
    assert not packed.is_packed and packed.starts.tolist() == [0, 7, 14]


def test_cp_padding_multiple():
    ids, am = _layout()
    assert pad_rows(ids, am, 4, cp_size=2).padded_len == 8
    assert pad_rows(ids, am, 4, cp_size=2, multiple_of=3).padded_len == 12


def test_to_response_selects_the_predicting_position():
    ids, am = _layout()
    packed = pad_rows(ids, am, prompt_len=4, cp_size=2)
    # A per-token output that equals the label it predicts must map back to the response ids.
    resp = packed.to_response(packed.labels.float())
    expected = ids[:, 4:].float()
    assert torch.equal(resp, expected)


def test_hole_in_attention_mask_is_rejected():
    ids, am = _layout()
    am = am.clone()
    am[1, 2] = 0
    with pytest.raises(ValueError, match="row 1 has a hole"):
        pad_rows(ids, am, prompt_len=4)
    with pytest.raises(ValueError, match="row 1 has a hole"):
        pack_rows(ids, am, prompt_len=4)


# ----------------------------------------------------------------------------------- packed
def test_pack_rows_concatenates_real_tokens_with_cu_seqlens():
    ids, am = _layout()
    packed = pack_rows(ids, am, prompt_len=4)
    assert packed.is_packed and packed.tokens.shape == (1, 13)
    assert packed.tokens[0].tolist() == [11, 12, 21, 22, 13, 14, 15, 16, 23, 24, 25, 17, 26]
    # Labels are the next token within the row; 0 on each row's last token (no crossing into the next row).
    assert packed.labels[0].tolist() == [12, 21, 22, 0, 14, 15, 16, 23, 24, 25, 0, 26, 0]
    assert packed.position_ids[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 0, 1]
    assert packed.cu_seqlens.tolist() == [0, 4, 11, 13] and packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens_real.tolist() == [0, 4, 11, 13] and packed.cu_seqlens_real.dtype == torch.int32
    assert packed.starts.tolist() == [0, 4, 11]
    assert packed.lengths.tolist() == [4, 7, 2] and packed.left_pad.tolist() == [2, 0, 3]
    assert packed.max_seqlen == 7 and packed.num_tokens == 13 and packed.padded_len == 13
    assert (packed.prompt_len, packed.response_len) == (4, 3)


def test_pack_rows_pads_each_row_for_cp():
    ids, am = _layout()
    packed = pack_rows(ids, am, prompt_len=4, cp_size=2)  # every segment a multiple of 2 * cp = 4
    assert packed.cu_seqlens.tolist() == [0, 4, 12, 16]
    assert segment_lengths(am, cp_size=2) == [4, 8, 4]
    assert packed.tokens[0].tolist() == [11, 12, 21, 22, 13, 14, 15, 16, 23, 24, 25, 0, 17, 26, 0, 0]
    assert packed.labels[0].tolist() == [12, 21, 22, 0, 14, 15, 16, 23, 24, 25, 0, 0, 26, 0, 0, 0]
    # Positions restart at every row and run on through its padding.
    assert packed.position_ids[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    assert packed.starts.tolist() == [0, 4, 12]
    assert packed.max_seqlen == 8
    segs = packed.cu_seqlens[1:] - packed.cu_seqlens[:-1]
    assert all(int(s) % 4 == 0 for s in segs)
    # The real lengths, padding left out (TE's cu_seqlens_q).
    assert (packed.cu_seqlens_real[1:] - packed.cu_seqlens_real[:-1]).tolist() == [4, 7, 2]
    # With sequence parallelism the segments are also multiples of the TP size.
    assert pack_rows(ids, am, 4, cp_size=2, multiple_of=3).cu_seqlens.tolist() == [0, 12, 24, 36]


def test_pack_rows_cu_seqlens_real_is_cumulative_real_lengths_under_cp_padding():
    # TransformerEngine (fused_attn.h): [a, PAD, b, b, c, PAD, PAD, d, d] has cu_seqlens = [0, 1, 3, 4, 6] and
    # cu_seqlens_padded = [0, 2, 4, 7, 9]; megatron_model.py passes cu_seqlens_real as PackedSeqParams.cu_seqlens_q.
    ids, am = _layout()
    packed = pack_rows(ids, am, prompt_len=4, cp_size=2)
    assert packed.cu_seqlens_real.tolist() == [0, 4, 11, 13]


def test_pack_rows_min_total_adds_a_trailing_padding_segment():
    ids, am = _layout()
    packed = pack_rows(ids, am, prompt_len=4, min_total=20)
    assert packed.cu_seqlens.tolist() == [0, 4, 11, 13, 20]
    assert packed.tokens.shape == (1, 20) and packed.tokens[0, 13:].tolist() == [0] * 7
    assert packed.labels[0, 13:].tolist() == [0] * 7
    assert packed.position_ids[0, 13:].tolist() == list(range(7))
    assert packed.cu_seqlens_real.tolist()[-1] == 13  # the padding segment has no real token
    assert packed.starts.tolist() == [0, 4, 11]  # rows only
    assert torch.equal(packed.to_response(packed.labels), ids[:, 4:])
    # CP: the trailing segment is CP-divisible too, so the total may exceed min_total.
    cp = pack_rows(ids, am, prompt_len=4, cp_size=2, min_total=18)
    assert cp.cu_seqlens.tolist() == [0, 4, 12, 16, 20]
    # Already long enough: no extra segment.
    assert pack_rows(ids, am, prompt_len=4, min_total=13).cu_seqlens.tolist() == [0, 4, 11, 13]
    assert pack_rows(ids, am, prompt_len=4, min_total=5).padded_len == 13


@pytest.mark.parametrize("cp_size", [1, 2])
def test_packed_to_response_returns_the_response_ids(cp_size):
    ids, am = _layout()
    packed = pack_rows(ids, am, prompt_len=4, cp_size=cp_size, min_total=30)
    assert torch.equal(packed.to_response(packed.labels), ids[:, 4:])
    assert torch.equal(packed.to_response(packed.labels.float()), ids[:, 4:].float())


def test_to_response_rejects_a_mismatched_shape():
    ids, am = _layout()
    packed = pack_rows(ids, am, prompt_len=4)
    with pytest.raises(ValueError, match="does not match tokens"):
        packed.to_response(torch.zeros(3, 7))


def _random_layout(rng: random.Random, b: int, p: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(b, p + r, dtype=torch.long)
    for i in range(b):
        n_p, n_r = rng.randint(0, p), rng.randint(0, r)
        ids[i, p - n_p : p] = torch.tensor([rng.randint(1, 999) for _ in range(n_p)], dtype=torch.long)
        ids[i, p : p + n_r] = torch.tensor([rng.randint(1, 999) for _ in range(n_r)], dtype=torch.long)
    return ids, (ids != 0).long()


@pytest.mark.parametrize("cp_size,multiple_of", [(1, 1), (2, 1), (2, 3)])
def test_packed_and_padded_layouts_map_outputs_identically(cp_size, multiple_of):
    rng = random.Random(cp_size * 10 + multiple_of)
    for _ in range(20):
        ids, am = _random_layout(rng, b=rng.randint(1, 6), p=5, r=6)
        layouts = [
            pad_rows(ids, am, 5, cp_size=cp_size, multiple_of=multiple_of),
            pack_rows(ids, am, 5, cp_size=cp_size, multiple_of=multiple_of, min_total=rng.choice([0, 80])),
        ]
        # A response token is predictable when some real token precedes it (rows with no prompt: not the first).
        predictable = am[:, 5:].bool() & (am[:, :5].sum(1, keepdim=True) + torch.arange(6) > 0)
        outs = []
        for lay in layouts:
            # A per-token "model output" that depends on the token and its position in its row, like a
            # causal model's (padding gets a distinct, non-zero value so leaking it would show).
            per_token = lay.tokens.double() * 1000 + lay.position_ids.double() + 0.5
            outs.append(lay.to_response(per_token))
            assert torch.equal(lay.to_response(lay.labels), torch.where(predictable, ids[:, 5:], 0))
        assert outs[0].shape == (ids.shape[0], 6)
        assert torch.equal(outs[0], outs[1])
        # Zero exactly where nothing predicts a response token (padding); elsewhere the predicting token's value.
        assert torch.equal(outs[0] != 0, predictable)


def test_packed_to_response_is_differentiable():
    ids, am = _layout()
    packed = pack_rows(ids, am, prompt_len=4, cp_size=2)
    x = torch.ones(packed.tokens.shape, requires_grad=True)
    packed.to_response(x).sum().backward()
    # One gradient per real response token (the layout has a prompt token before each response).
    assert float(x.grad.sum()) == float(am[:, 4:].sum())


# ----------------------------------------------------------------------------------- micro-batches
def test_fixed_micro_batches():
    assert fixed_micro_batches(5, 2) == [[0, 1], [2, 3], [4]]


def test_padded_budget_respects_padded_cost_and_covers_rows():
    lengths = [5, 30, 7, 12, 29, 3, 8]
    groups = padded_budget_micro_batches(lengths, 64, cp_size=2)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        padded = max(-(-lengths[i] // 4) * 4 for i in g)
        assert len(g) * padded <= 64
    assert groups == padded_budget_micro_batches(lengths, 64, cp_size=2)  # deterministic


def test_padded_budget_too_small_names_the_field():
    with pytest.raises(ConfigError) as err:
        padded_budget_micro_batches([10, 40], 32, field="critic.ppo_max_token_len_per_gpu")
    assert err.value.field == "critic.ppo_max_token_len_per_gpu"


def test_scatter_rows_inverts_the_grouping():
    x = torch.arange(7).float() * 10
    groups = padded_budget_micro_batches([5, 30, 7, 12, 29, 3, 8], 64)
    pieces = [x[g] for g in groups]
    assert torch.equal(scatter_rows(pieces, groups, 7), x)


def _fits(segments, k, budget):
    return max(sum(segments[i] for i in b) for b in partition(segments, k)) <= budget


def test_packed_budget_count_is_the_fewest_that_fit():
    assert packed_budget_count([], 10) == 0
    assert packed_budget_count([3, 3, 3], 100) == 1
    assert packed_budget_count([5, 5, 5, 5], 10) == 2  # the token lower bound is reachable
    assert packed_budget_count([6, 6, 6], 10) == 3  # sum/budget says 2, but no two rows share a micro-batch
    assert packed_budget_count([10], 10) == 1  # exactly the budget fits
    rng = random.Random(0)
    for _ in range(50):
        segs = [rng.randint(1, 40) for _ in range(rng.randint(1, 25))]
        budget = rng.randint(40, 120)
        k = packed_budget_count(segs, budget)
        assert k >= -(-sum(segs) // budget)
        assert _fits(segs, k, budget)
        if k > 1:
            assert not _fits(segs, k - 1, budget)


def test_packed_budget_count_row_over_budget_names_the_field():
    with pytest.raises(ConfigError, match="raise it to >= 40") as err:
        packed_budget_count([8, 40, 4], 32, field="critic.ppo_max_token_len_per_gpu")
    assert err.value.field == "critic.ppo_max_token_len_per_gpu"
    with pytest.raises(ConfigError) as err:
        packed_budget_count([33], 32)
    assert err.value.field == "actor.ppo_max_token_len_per_gpu"


def test_packed_budget_micro_batches_cover_rows_within_budget():
    rng = random.Random(1)
    for _ in range(30):
        segs = [rng.choice([4, 8, 12, 16, 64]) for _ in range(rng.randint(1, 30))]
        budget = 96
        k = packed_budget_count(segs, budget)
        groups = packed_budget_micro_batches(segs, k)
        assert len(groups) == k
        assert sorted(i for g in groups for i in g) == list(range(len(segs)))
        assert all(g and g == sorted(g) for g in groups)
        assert all(sum(segs[i] for i in g) <= budget for g in groups)
        assert [g[0] for g in groups] == sorted(g[0] for g in groups)
        assert groups == packed_budget_micro_batches(list(segs), k)  # deterministic
    # More micro-batches than rows (a replica asked to match its peers' count) is refused.
    with pytest.raises(ValueError, match="every micro-batch needs a row"):
        packed_budget_micro_batches([4, 4], 3)
    # A forced larger count still gives every micro-batch a row.
    groups = packed_budget_micro_batches([4, 4, 4, 100], 4)
    assert sorted(map(len, groups)) == [1, 1, 1, 1]


def test_packed_budget_balances_tokens():
    segs = [40, 8, 8, 8, 8, 8, 8, 8, 8, 30, 20, 10]
    groups = packed_budget_micro_batches(segs, 3)
    sums = sorted(sum(segs[i] for i in g) for g in groups)
    assert sums[-1] - sums[0] <= 8  # total 164 over 3: 56/54/54 is reachable


def test_to_response_keeps_trailing_dims():
    ids, am = _layout()
    packed = pack_rows(ids, am, prompt_len=4, cp_size=2)
    out = packed.to_response(packed.labels.unsqueeze(-1).repeat(1, 1, 2))
    assert out.shape == (3, 3, 2)
    assert torch.equal(out[..., 0], ids[:, 4:]) and torch.equal(out[..., 1], ids[:, 4:])


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("cp_size", [1, 2])
def test_a_teachers_top_k_sit_where_the_labels_are(pack, cp_size):
    """``teacher_top_k_ids`` ``[B, R, k]`` (response layout) reach the micro-batch at the positions that predict each
    response token, like ``labels``: a teacher whose first candidate is the sampled token has it exactly where the
    label is, on every CP rank; mapped back, the candidates are the rows' own."""
    from mcore_agentic.data.batch import Batch
    from mcore_agentic.workers.micro_batch import build_micro_batch

    ids, am = _layout()
    responses, real = ids[:, 4:], am[:, 4:]
    top = torch.stack([responses, responses + 100, responses + 200], dim=-1) * real.unsqueeze(-1)
    data = Batch(tensors={"input_ids": ids, "attention_mask": am, "teacher_top_k_ids": top})
    seen = 0
    for rank in range(cp_size):
        mb = build_micro_batch(data, 4, pack=pack, common=0, cp_size=cp_size, cp_rank=rank, multiple_of=1, replay=False)
        assert mb.candidates.shape == (*mb.labels.shape, 3)
        first = mb.candidates[..., 0]
        predicting = first != 0  # positions before a response token
        assert torch.equal(first[predicting], mb.labels[predicting])
        assert torch.equal(mb.candidates[..., 1][predicting], mb.labels[predicting] + 100)
        seen += int(predicting.sum())
        if cp_size == 1:
            assert torch.equal(mb.packed.to_response(mb.candidates), top)
    assert seen == int(real.sum())
    assert build_micro_batch(Batch(tensors={"input_ids": ids, "attention_mask": am}), 4, pack=pack, common=0,
                             cp_size=1, cp_rank=0, multiple_of=1, replay=False).candidates is None
