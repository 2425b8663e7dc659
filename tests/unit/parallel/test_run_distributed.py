"""The test helper's ranks (``tests/helpers/distributed.py``): ranks without a GPU each see none (GPU review m2)."""

from __future__ import annotations

import os

import torch

from tests.helpers.distributed import run_distributed


def _visible(rank: int, world_size: int) -> tuple[str | None, bool]:
    return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.is_available()


def test_ranks_without_a_gpu_each_see_none():
    """One rank more than there are GPUs: gloo ranks, which must not all put their models on ``cuda:0``."""
    world = torch.cuda.device_count() + 1
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    assert run_distributed(_visible, world_size=world) == [("", False)] * world
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == before  # the caller's own environment is put back
