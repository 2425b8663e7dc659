"""The step's row plan (pure functions): seeded deal over DP replicas, chunking by mini-batch, row buffers, group ids.

The collective ``exchange_rows`` is covered by a distributed test; here only what every rank computes alone.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from mcore_agentic.data.balance import partition_spread
from mcore_agentic.data.batch import Batch, build_rollout_layout
from mcore_agentic.feed.distribute import (
    FILLER_VERSION,
    RowShapes,
    _pack,
    _unpack,
    deal_rows,
    filler_rows,
    gather_row_counts,
    gather_shapes,
    plan_step,
    tag_episodes,
    tag_groups,
)
from mcore_agentic.trainer import experience

PAD = 7


def _lognormal_tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [max(1, int(rng.lognormvariate(6.5, 1.0))) for _ in range(n)]


def _chunk_rows(replicas: list[list[int]], k: int, chunk: int) -> list[list[int]]:
    """Each replica's rows of chunk ``k``."""
    per = chunk // len(replicas)
    return [rows[k * per : (k + 1) * per] for rows in replicas]


# ----------------------------------------------------------------------------------- deal_rows
@pytest.mark.parametrize("seed", [None, 0, 5])
@pytest.mark.parametrize("dp,chunk", [(1, 4), (2, 4), (4, 8), (4, 32)])
def test_deal_covers_every_row_with_chunk_over_dp_rows_per_chunk(seed, dp, chunk):
    tokens = _lognormal_tokens(32, seed=1)
    replicas = deal_rows(tokens, chunk=chunk, dp=dp, seed=seed)
    assert len(replicas) == dp
    assert sorted(r for rows in replicas for r in rows) == list(range(32))
    assert all(len(rows) == 32 // dp for rows in replicas)
    order = (
        list(range(32)) if seed is None else torch.randperm(32, generator=torch.Generator().manual_seed(seed)).tolist()
    )
    for k in range(32 // chunk):
        shares = _chunk_rows(replicas, k, chunk)
        assert all(len(s) == chunk // dp for s in shares)
        # Chunk k of every replica comes from the k-th piece of the (shuffled) order: chunks run in order.
        assert sorted(r for s in shares for r in s) == sorted(order[k * chunk : (k + 1) * chunk])


def test_unseeded_chunks_are_consecutive_row_ranges():
    replicas = deal_rows(_lognormal_tokens(24), chunk=6, dp=3, seed=None)
    for k in range(4):
        assert sorted(r for s in _chunk_rows(replicas, k, 6) for r in s) == list(range(6 * k, 6 * k + 6))


def test_seeded_shuffle_is_deterministic_and_depends_on_the_seed():
    tokens = _lognormal_tokens(64)
    a = deal_rows(tokens, chunk=16, dp=4, seed=11)
    assert deal_rows(list(tokens), chunk=16, dp=4, seed=11) == a
    b = deal_rows(tokens, chunk=16, dp=4, seed=12)
    assert a != b
    chunk0 = lambda reps: sorted(r for s in _chunk_rows(reps, 0, 16) for r in s)  # noqa: E731
    assert chunk0(a) != chunk0(b)
    assert chunk0(a) != list(range(16))  # shuffled, not in order


def test_mini_batch_composition_does_not_depend_on_dp():
    tokens = _lognormal_tokens(48, seed=2)
    chunk = 8
    sets = {}
    for dp in (1, 2, 4, 8):
        replicas = deal_rows(tokens, chunk=chunk, dp=dp, seed=3)
        sets[dp] = [sorted(r for s in _chunk_rows(replicas, k, chunk) for r in s) for k in range(48 // chunk)]
    assert sets[1] == sets[2] == sets[4] == sets[8]
    # dp=1: the replica trains the shuffled order itself.
    assert deal_rows(tokens, chunk=chunk, dp=1, seed=3)[0] != list(range(48))


def test_tokens_balance_far_better_than_a_contiguous_split():
    tokens = _lognormal_tokens(256, seed=4)
    dp, chunk = 8, 64
    replicas = deal_rows(tokens, chunk=chunk, dp=dp, seed=None)
    naive = [[] for _ in range(dp)]
    for start in range(0, 256, chunk):
        for d in range(dp):
            naive[d] += list(range(start + d * chunk // dp, start + (d + 1) * chunk // dp))
    # Per mini-batch chunk (the replicas step together through it) and over the whole step.
    dealt = [partition_spread(tokens, _chunk_rows(replicas, k, chunk)) for k in range(256 // chunk)]
    contiguous = [partition_spread(tokens, _chunk_rows(naive, k, chunk)) for k in range(256 // chunk)]
    assert all(d < c for d, c in zip(dealt, contiguous))
    assert all(d <= max(tokens[k * chunk : (k + 1) * chunk]) for k, d in enumerate(dealt))
    assert sum(dealt) * 3 < sum(contiguous)
    total_dealt, total_naive = partition_spread(tokens, replicas), partition_spread(tokens, naive)
    assert total_dealt * 4 < total_naive
    assert total_dealt <= max(tokens)


def test_deal_rejects_chunks_that_do_not_fit():
    tokens = [1] * 12
    with pytest.raises(ValueError, match="do not cut into chunks"):
        deal_rows(tokens, chunk=5, dp=1, seed=None)  # 12 % 5
    with pytest.raises(ValueError, match="do not cut into chunks"):
        deal_rows(tokens, chunk=6, dp=4, seed=None)  # 6 % 4
    with pytest.raises(ValueError, match="do not cut into chunks"):
        deal_rows(tokens, chunk=0, dp=1, seed=None)


# ----------------------------------------------------------------------------------- plan_step
def _shapes(n: int, rows_per_group: int, leaders: list[int], seed: int = 0) -> RowShapes:
    rng = random.Random(seed)
    return RowShapes(
        prompt=[rng.randint(1, 50) for _ in range(n)],
        response=[rng.randint(0, 400) for _ in range(n)],
        group_rows=[rows_per_group] * len(leaders),
        group_leaders=leaders,
    )


def test_row_shapes():
    shapes = _shapes(6, 3, [0, 4])
    assert shapes.tokens(2) == shapes.prompt[2] + shapes.response[2]
    assert [shapes.source(r) for r in range(6)] == [0, 0, 0, 4, 4, 4]
    assert [shapes.local_index(r) for r in range(6)] == [0, 1, 2, 0, 1, 2]


def test_row_shapes_of_uneven_rollout_groups():
    # Dynamic sampling: group 0 kept 4 rows, group 1 none, group 2 two.
    shapes = RowShapes(prompt=[1] * 6, response=[2] * 6, group_rows=[4, 0, 2], group_leaders=[0, 2, 4])
    assert [shapes.source(r) for r in range(6)] == [0, 0, 0, 0, 4, 4]
    assert [shapes.local_index(r) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    with pytest.raises(ValueError, match="do not match rollout groups"):
        RowShapes(prompt=[1] * 5, response=[2] * 5, group_rows=[4, 0, 2], group_leaders=[0, 2, 4])


def test_plan_step_chunks_by_the_gcd_of_rows_and_mini_batches():
    shapes = _shapes(24, 12, [0, 2])
    tokens = [shapes.tokens(r) for r in range(24)]
    plan = plan_step(shapes, 2, mini_batch_sizes=[8, 12], seed=3)  # gcd(24, 8, 12) = 4, not min = 8
    assert math.gcd(24, 8, 12) == 4
    assert plan.replicas == deal_rows(tokens, chunk=4, dp=2, seed=3)
    assert plan.shapes is shapes
    assert plan.replica_tokens() == [sum(tokens[r] for r in rows) for rows in plan.replicas]
    assert sum(plan.replica_tokens()) == sum(tokens)
    # Every 8-row and every 12-row mini-batch is a whole number of chunks on every replica.
    order = torch.randperm(24, generator=torch.Generator().manual_seed(3)).tolist()
    for k in range(6):
        assert sorted(r for s in _chunk_rows(plan.replicas, k, 4) for r in s) == sorted(order[4 * k : 4 * k + 4])
    # One mini-batch of the whole step: one chunk.
    whole = plan_step(shapes, 4, mini_batch_sizes=[24], seed=None)
    assert whole.replicas == deal_rows(tokens, chunk=24, dp=4, seed=None)
    # A chunk (gcd 3) that does not split over the replicas is refused.
    with pytest.raises(ValueError, match="chunks of 3 split evenly over 2"):
        plan_step(shapes, 2, mini_batch_sizes=[9], seed=None)


# ----------------------------------------------------------------------------------- row buffers
def _rollout(prompts, responses, seed: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    masks = [[int(x) for x in torch.randint(0, 2, (len(r),), generator=gen)] for r in responses]
    logps = [(-torch.rand(len(r), generator=gen)).tolist() for r in responses]
    tensors = build_rollout_layout(
        prompts, responses, pad_token_id=PAD,
        response_fields={"response_mask": (masks, torch.long), "rollout_log_probs": (logps, torch.float32)},
    )
    b = len(prompts)
    tensors["seq_scores"] = torch.rand(b, generator=gen)
    tensors["group_index"] = torch.randint(0, 100, (b,), generator=gen)
    tensors["truncated"] = torch.randint(0, 2, (b,), generator=gen)
    return Batch(tensors=tensors, meta={"uid": [f"u{i}" for i in range(b)]}), masks, logps


PROMPTS = [[1, 2, 3], [4], [5, 6], [8, 9, 10, 11], [12], []]
RESPONSES = [[20, 21], [22, 23, 24, 25, 26], [], [27], [28, 29, 30], [31, 32]]


def _shapes_of(batches: list[Batch]) -> RowShapes:
    p, r = [], []
    for b in batches:
        width = b["prompts"].shape[1]
        p += b["attention_mask"][:, :width].sum(1).tolist()
        r += b["attention_mask"][:, width:].sum(1).tolist()
    return RowShapes(p, r, group_rows=[len(b) for b in batches], group_leaders=[2 * g for g in range(len(batches))])


def _expected(rows, prompts, responses, masks, logps, scores, groups, truncated) -> dict[str, torch.Tensor]:
    out = build_rollout_layout(
        [prompts[r] for r in rows], [responses[r] for r in rows], pad_token_id=PAD,
        response_fields={
            "response_mask": ([masks[r] for r in rows], torch.long),
            "rollout_log_probs": ([logps[r] for r in rows], torch.float32),
        },
    )
    out["seq_scores"] = scores[rows]
    out["group_index"] = groups[rows]
    out["truncated"] = truncated[rows]
    return out


def _assert_same(got: Batch, want: dict[str, torch.Tensor]) -> None:
    assert set(got.tensors) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype, k
        assert torch.equal(got[k], v), k


def test_pack_unpack_round_trip_one_source():
    local, masks, logps = _rollout(PROMPTS, RESPONSES)
    shapes = _shapes_of([local])
    assert shapes.prompt == [3, 1, 2, 4, 1, 0] and shapes.response == [2, 5, 0, 1, 3, 2]
    rows = [4, 0, 2, 5]  # a subset, out of order; row 2 has no response, row 5 no prompt
    ints, floats = _pack(local, rows, shapes)
    assert ints.dtype == torch.long and floats.dtype == torch.float32
    # Real tokens only: prompt + response + response_mask + group_index + truncated; log-probs + score.
    assert ints.numel() == sum(shapes.tokens(r) + shapes.response[r] + 2 for r in rows)
    assert floats.numel() == sum(shapes.response[r] + 1 for r in rows)
    got = _unpack({0: (ints, floats)}, rows, shapes, PAD)
    want = _expected(rows, PROMPTS, RESPONSES, masks, logps, local["seq_scores"], local["group_index"], local["truncated"])
    _assert_same(got, want)
    # Re-padded to the subset's own widths, not the source's.
    assert got["prompts"].shape == (4, 3) and got["responses"].shape == (4, 3)


@pytest.mark.parametrize("cut", [3, 4])  # 4: uneven rollout groups (dynamic sampling)
def test_pack_unpack_round_trip_two_sources_interleaved(cut):
    first, m1, l1 = _rollout(PROMPTS[:cut], RESPONSES[:cut], seed=1)
    second, m2, l2 = _rollout(PROMPTS[cut:], RESPONSES[cut:], seed=2)
    shapes = _shapes_of([first, second])  # leaders 0 and 2, rows 0..cut-1 and cut..5
    rows = [3, 1, 5, 0, 4]
    buffers = {
        src: _pack(local, [r for r in rows if shapes.source(r) == src], shapes)
        for src, local in ((0, first), (2, second))
    }
    got = _unpack(buffers, rows, shapes, PAD)
    scores = torch.cat([first["seq_scores"], second["seq_scores"]])
    groups = torch.cat([first["group_index"], second["group_index"]])
    truncated = torch.cat([first["truncated"], second["truncated"]])
    want = _expected(rows, PROMPTS, RESPONSES, m1 + m2, l1 + l2, scores, groups, truncated)
    _assert_same(got, want)


def test_routed_experts_ride_with_their_rows_across_sources():
    """Per-token int16 routing (3 MoE layers x top-2, an odd count per token: packed four to an int64 and padded)
    arrives aligned with the rows' tokens in the receiver's own widths, -1 on padding."""
    from mcore_agentic.data.batch import build_token_field

    def routing(p, r, salt):  # a value per (row, token, layer, slot) that names its token
        return [torch.arange((len(p) + len(r)) * 6, dtype=torch.int16).view(-1, 3, 2) + salt for p, r in zip(p, r)]

    cut = 4
    sources = []
    for k, (lo, hi) in enumerate(((0, cut), (cut, 6))):
        local, _, _ = _rollout(PROMPTS[lo:hi], RESPONSES[lo:hi], seed=k)
        values = routing(PROMPTS[lo:hi], RESPONSES[lo:hi], 100 * (lo + 1))
        local = local.update({"routed_experts": build_token_field(
            values, [len(p) for p in PROMPTS[lo:hi]], prompt_width=local["prompts"].shape[1],
            response_width=local["responses"].shape[1])})
        sources.append((local, values))
    shapes = _shapes_of([s for s, _ in sources])
    rows = [3, 1, 5, 0, 4]
    buffers = {src: _pack(local, [r for r in rows if shapes.source(r) == src], shapes, (3, 2))
               for src, (local, _) in ((0, sources[0]), (2, sources[1]))}
    assert sum(b[0].numel() for b in buffers.values()) == sum(
        shapes.tokens(r) + shapes.response[r] + 2 + -(-shapes.tokens(r) * 6 // 4) for r in rows)
    got = _unpack(buffers, rows, shapes, PAD, (3, 2))
    every = sources[0][1] + sources[1][1]
    want = build_token_field([every[r] for r in rows], [len(PROMPTS[r]) for r in rows],
                             prompt_width=got["prompts"].shape[1], response_width=got["responses"].shape[1])
    assert got["routed_experts"].dtype == torch.int16 and torch.equal(got["routed_experts"], want)
    assert bool((got["routed_experts"][got["attention_mask"] == 0] == -1).all())


def test_pack_of_no_rows_is_empty():
    local, _, _ = _rollout(PROMPTS, RESPONSES)
    ints, floats = _pack(local, [], _shapes_of([local]))
    assert ints.numel() == 0 and floats.numel() == 0
    assert ints.dtype == torch.long and floats.dtype == torch.float32


# ----------------------------------------------------------------------------------- shapes and groups
def test_gather_shapes_on_one_process():
    local, _, _ = _rollout(PROMPTS, RESPONSES)
    placement = SimpleNamespace(tensor_parallel_size=1, num_groups=1, group_index=0)
    shapes = gather_shapes(local, placement, 6)
    assert shapes.prompt == [3, 1, 2, 4, 1, 0] and shapes.response == [2, 5, 0, 1, 3, 2]
    assert shapes.group_leaders == [0] and shapes.group_rows == [6]
    with pytest.raises(ValueError, match="returned 6 rows, expected 4"):
        gather_shapes(local, placement, 4)
    with pytest.raises(ValueError, match="returned 6 rows, expected 5"):
        gather_shapes(local, placement, [5])


def test_tag_groups_ids_are_unique_across_rollout_groups():
    uids = ["b", "b", "a", "a"]
    tagged = [tag_groups(Batch(tensors={"x": torch.zeros(4)}, meta={"uid": list(uids)}), 4 * g) for g in range(3)]
    ids = [t["group_index"].tolist() for t in tagged]
    assert ids[0] == [0, 0, 1, 1]
    assert ids[1] == [4, 4, 5, 5] and ids[2] == [8, 8, 9, 9]
    flat = [i for group in ids for i in group]
    # Same uid in the same rollout group <=> same id; the same uid string in another group is another prompt.
    assert len(set(flat)) == 6 and all(0 <= i < 3 * 4 for i in flat)
    assert tagged[0]["group_index"].dtype == torch.long
    assert tagged[1]["uid"] == uids and torch.equal(tagged[1]["x"], torch.zeros(4))  # the rest is kept


# ----------------------------------------------------------------------------------- episodes of several samples
def test_filler_rows_train_nothing_and_travel_like_any_row():
    local, _, _ = _rollout(PROMPTS[:4], RESPONSES[:4])
    local = local.update(meta={"episode_id": ["e0", "e0", "e1", "e2"], "oldest_version": [3, 3, 3, 3],
                               "request_metrics": [{}] * 4})
    fillers = filler_rows(local, 3, PAD)
    assert len(fillers) == 3 and set(fillers.tensors) == set(local.tensors)
    assert int(fillers["response_mask"].sum()) == 0 and float(fillers["seq_scores"].abs().sum()) == 0.0
    p = local["prompts"].shape[1]
    assert int(fillers["attention_mask"][:, p:].sum()) == 0  # no response at all
    assert torch.equal(fillers["prompts"], local["prompts"][[0, 0, 0]])  # row 0's prompt
    assert len(set(fillers["uid"]) | set(local["uid"])) == 7  # a prompt group and an episode of their own
    assert len(set(fillers["episode_id"]) | set(local["episode_id"])) == 6
    assert fillers["oldest_version"] == [FILLER_VERSION] * 3
    step = tag_episodes(tag_groups(Batch.concat([local, fillers]), 8), 8)
    assert step["episode_index"].tolist() == [8, 8, 9, 10, 11, 12, 13]
    shapes = _shapes_of([step])
    assert shapes.response[4:] == [0, 0, 0]


def test_row_counts_on_one_process():
    local, _, _ = _rollout(PROMPTS, RESPONSES)
    assert gather_row_counts(local, SimpleNamespace(tensor_parallel_size=1, num_groups=1)) == [6]


def test_data_metrics_leave_filler_rows_out():
    local, _, _ = _rollout(PROMPTS[:4], RESPONSES[:4])
    local = local.update(meta={"episode_id": ["a", "b", "c", "d"], "oldest_version": [0] * 4, "request_metrics": [{}] * 4})
    both = Batch.concat([local, filler_rows(local, 2, PAD)])
    versions = torch.tensor(both["oldest_version"])
    want = experience.compute_data_metrics(local.update({"weight_version": torch.zeros(4, dtype=torch.long)}))
    got = experience.compute_data_metrics(both.update({"weight_version": versions}))
    assert got == want
