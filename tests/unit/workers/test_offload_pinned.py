"""Pinned host memory for offloads is bounded (``actor.offload_pinned_mb``) and reused; past the bound, pageable.

No GPU here: the pool's chunks are pageable stand-ins and ``pin_if`` accepts CPU storages, so the code path that
copies CUDA storages into pinned chunks (split across chunk boundaries, the rest pageable) runs on CPU.
"""

from __future__ import annotations

import pytest
import torch

from mcore_agentic.utils.errors import ConfigError
from mcore_agentic.workers.config import ActorConfig
from mcore_agentic.workers.offload import Offloader, PinnedPool, model_param_tensors, pinned_pool


class _Allocations:
    """The pool's ``allocate``: pageable chunks standing in for pinned ones, counted."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, nbytes: int) -> torch.Tensor:
        self.count += 1
        return torch.empty(nbytes, dtype=torch.uint8)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))  # 848 bytes


def _nbytes(model: torch.nn.Module) -> int:
    return sum(p.untyped_storage().nbytes() for p in model.parameters())


def _pinned_and_pageable(off: Offloader, group: str) -> tuple[int, int]:
    pieces = [p for s in off._groups[group].saved for p in s.pieces]
    pinned = sum(copy.numel() for _, copy, is_pinned in pieces if is_pinned)
    return pinned, sum(copy.numel() for _, copy, is_pinned in pieces if not is_pinned)


def test_pool_is_bounded_and_reuses_its_chunks():
    alloc = _Allocations()
    pool = PinnedPool(3 * 1024, chunk_bytes=1024, allocate=alloc)
    first = pool.take(5000)  # wants 5 chunks, the bound allows 3
    assert len(first) == 3 and pool.pinned_bytes == 3 * 1024 and pool.take(1) == []
    pool.give_back(first)
    again = pool.take(2048)
    assert len(again) == 2 and alloc.count == 3  # reused, nothing new pinned
    pool.give_back(again)
    pool.set_limit(1024)  # free chunks past a lower bound are released
    assert pool.chunks == 1 and pool.pinned_bytes == 1024
    pool.set_limit(0)
    assert pool.chunks == 0 and pool.take(10) == []
    with pytest.raises(ValueError, match="limit must be >= 0"):
        pool.set_limit(-1)


def test_offload_past_the_bound_goes_pageable_and_reloads_bit_identical():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    total = _nbytes(model)
    alloc = _Allocations()
    pool = PinnedPool(512, chunk_bytes=64, allocate=alloc)  # 8 chunks: storages split across chunk boundaries
    off = Offloader(pool=pool, pin_if=lambda storage: True)
    for cycle in range(3):
        assert off.offload("params", model_param_tensors([model])) == total
        assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
        pinned, pageable = _pinned_and_pageable(off, "params")
        assert (pinned, pageable) == (512, total - 512)
        assert pool.pinned_bytes == 512  # never more than the bound
        assert off.reload("params") == total
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), (cycle, k)
    assert alloc.count == 8  # pinned once, reused by every later offload


def test_offloaders_share_the_bound():
    pool = PinnedPool(640, chunk_bytes=64, allocate=_Allocations())
    actor, critic = _model(0), _model(1)
    a = Offloader(pool=pool, pin_if=lambda storage: True)
    c = Offloader(pool=pool, pin_if=lambda storage: True)
    a.offload("params", model_param_tensors([actor]))
    c.offload("params", model_param_tensors([critic]))
    assert pool.pinned_bytes == 640
    assert _pinned_and_pageable(a, "params")[0] + _pinned_and_pageable(c, "params")[0] <= 640
    a.reload("params")
    c.reload("params")


def test_cpu_storages_are_never_pinned_by_default():
    pool = PinnedPool(1 << 20, chunk_bytes=64, allocate=_Allocations())
    off = Offloader(pool=pool)  # pin_if: CUDA storages only
    model = _model()
    total = _nbytes(model)
    off.offload("params", model_param_tensors([model]))
    assert _pinned_and_pageable(off, "params") == (0, total) and pool.chunks == 0
    off.reload("params")


def test_zero_bound_never_pins():
    model = _model()
    total = _nbytes(model)
    off = Offloader(pool=PinnedPool(0, chunk_bytes=64, allocate=_Allocations()), pin_if=lambda storage: True)
    off.offload("params", model_param_tensors([model]))
    assert _pinned_and_pageable(off, "params") == (0, total)
    off.reload("params")


def test_process_pool_follows_the_config_key():
    assert pinned_pool().limit_bytes == ActorConfig().offload_pinned_mb * 2**20  # the default until the trainer sets it
    assert ActorConfig(offload_pinned_mb=0).offload_pinned_mb == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="actor.offload_pinned_mb"):
            ActorConfig(offload_pinned_mb=bad)
