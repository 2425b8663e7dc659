"""Tests for the load-balanced CP layout: split, positions, packed indices, gather (2 gloo ranks)."""

from __future__ import annotations

import pytest
import torch

from mcore_agentic.parallel.cp_split import (
    cp_gather,
    cp_packed_indices,
    cp_positions,
    cp_split,
    pad_to_multiple,
)
from tests.helpers.distributed import run_distributed


def test_positions_by_hand():
    # S=8, CP=2 -> 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert cp_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    # S=12, CP=3 -> 6 chunks of 2: rank 1 holds chunks 1 and 4.
    assert cp_positions(12, 3, 1).tolist() == [2, 3, 8, 9]
    assert cp_positions(5, 1, 0).tolist() == [0, 1, 2, 3, 4]


def test_positions_partition_the_sequence():
    for cp in (2, 3, 4):
        all_pos = torch.cat([cp_positions(8 * cp, cp, r) for r in range(cp)])
        assert sorted(all_pos.tolist()) == list(range(8 * cp))


def test_split_matches_positions_on_any_dim():
    x = torch.arange(2 * 12 * 3).reshape(2, 12, 3)
    for cp in (2, 3):
        for r in range(cp):
            pos = cp_positions(12, cp, r)
            assert torch.equal(cp_split(x, cp, r, seq_dim=1), x[:, pos])
            assert torch.equal(cp_split(x.transpose(0, 1), cp, r, seq_dim=0), x.transpose(0, 1)[pos])
            assert torch.equal(cp_split(x.transpose(1, 2), cp, r, seq_dim=-1), x.transpose(1, 2)[..., pos])
    assert cp_split(x, 1, 0) is x


def test_bad_lengths_name_the_fix():
    with pytest.raises(ValueError, match="pad it to 8"):
        cp_split(torch.zeros(1, 6), 2, 0)
    with pytest.raises(ValueError, match="cp_rank=2"):
        cp_positions(8, 2, 2)
    with pytest.raises(ValueError, match="packed sequence 1"):
        cp_packed_indices([0, 4, 10], 2, 0)


def test_pad_to_multiple():
    assert pad_to_multiple(10, 2) == 12
    assert pad_to_multiple(12, 2) == 12
    assert pad_to_multiple(0, 2) == 0
    assert pad_to_multiple(7, 1) == 7
    assert pad_to_multiple(5, 2, multiple_of=3) == 12  # lcm(4, 3)
    assert pad_to_multiple(5, 1, multiple_of=2) == 6


def test_packed_indices_split_each_sequence():
    # Two packed sequences of lengths 4 and 8 with CP=2.
    idx0 = cp_packed_indices(torch.tensor([0, 4, 12]), 2, 0)
    idx1 = cp_packed_indices([0, 4, 12], 2, 1)
    assert idx0.tolist() == [0, 3, 4, 5, 10, 11]
    assert idx1.tolist() == [1, 2, 6, 7, 8, 9]
    assert cp_packed_indices([0], 2, 0).numel() == 0


def test_split_is_differentiable():
    x = torch.randn(2, 8, requires_grad=True)
    cp_split(x, 2, 1).sum().backward()
    expected = torch.zeros(2, 8)
    expected[:, 2:6] = 1
    assert torch.equal(x.grad, expected)


def _gather_body(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from megatron.core.utils import get_batch_on_this_cp_rank

    group = dist.group.WORLD
    torch.manual_seed(0)  # same full tensors on every rank
    full = torch.randn(3, 16, 5, dtype=torch.float64)
    weights = [torch.randn(3, 16, 5, dtype=torch.float64) for _ in range(world_size)]

    local = cp_split(full, world_size, rank, seq_dim=1)
    # Same layout as Megatron-core's own batch splitter.
    ref = get_batch_on_this_cp_rank({"tokens": full.clone()}, cp_group=group)["tokens"]
    out = {"matches_megatron": torch.equal(local, ref)}

    gathered = cp_gather(local, world_size, group, seq_dim=1)
    out["identity"] = torch.equal(gathered, full)
    full_s0 = full.transpose(0, 1).contiguous()
    out["identity_dim0"] = torch.equal(
        cp_gather(cp_split(full_s0, world_size, rank, seq_dim=0), world_size, group, seq_dim=0), full_s0
    )

    # grad "sum": each rank's loss is its own term; my grad = sum over ranks of their weights at my positions.
    leaf = local.clone().requires_grad_(True)
    (cp_gather(leaf, world_size, group, seq_dim=1) * weights[rank]).sum().backward()
    out["grad_sum_ok"] = torch.allclose(leaf.grad, cp_split(sum(weights), world_size, rank, seq_dim=1))

    # grad "slice": replicated loss; my grad = my own weights at my positions.
    leaf2 = local.clone().requires_grad_(True)
    (cp_gather(leaf2, world_size, group, seq_dim=1, grad_mode="slice") * weights[rank]).sum().backward()
    out["grad_slice_ok"] = torch.allclose(leaf2.grad, cp_split(weights[rank], world_size, rank, seq_dim=1))

    # seq_dim = -1 round trip.
    full_t = full.transpose(1, 2).contiguous()
    out["identity_last_dim"] = torch.equal(
        cp_gather(cp_split(full_t, world_size, rank, seq_dim=-1), world_size, group, seq_dim=-1), full_t
    )

    # packed (THD) batch: sequences of lengths 4, 8 and 4 along dim 0.
    cu = [0, 4, 12, 16]
    packed = torch.randn(16, 3, dtype=torch.float64)
    packed_w = [torch.randn(16, 3, dtype=torch.float64) for _ in range(world_size)]
    leaf3 = packed[cp_packed_indices(cu, world_size, rank)].clone().requires_grad_(True)
    gathered_packed = cp_gather(leaf3, world_size, group, seq_dim=0, cu_seqlens=torch.tensor(cu))
    out["identity_packed"] = torch.equal(gathered_packed, packed)
    (gathered_packed * packed_w[rank]).sum().backward()
    out["grad_packed_ok"] = torch.allclose(leaf3.grad, sum(packed_w)[cp_packed_indices(cu, world_size, rank)])
    return out


def test_gather_on_two_gloo_ranks():
    results = run_distributed(_gather_body, world_size=2)
    for rank, res in enumerate(results):
        assert all(res.values()), (rank, res)
