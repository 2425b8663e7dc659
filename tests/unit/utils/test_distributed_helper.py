"""The 2-rank gloo spawner used by every multi-process test works and reports failures."""

import pytest
import torch
import torch.distributed as dist

from tests.helpers.distributed import run_distributed


def _allreduce(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()


def test_all_reduce_two_ranks():
    assert run_distributed(_allreduce, 2) == [3.0, 3.0]


def test_failure_is_reported():
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_distributed(_fail, 2, timeout=20)
