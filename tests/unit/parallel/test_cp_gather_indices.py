"""GPU review P6: the CP gather's index tensors are built on the host and reach the device in one copy, however many
rows a packed micro-batch holds (not two ``torch.arange`` per row and CP rank on the device).

One process: the CP group of two ranks is a stand-in (its size and this rank's index) and so is its all-gather, which
fills the shards with every rank's split of a known tensor (on the CPU) or leaves them as they are (on ``meta``, the
stand-in for a GPU: every kernel there is shape-only, and what a device index costs is its construction).
"""

from __future__ import annotations

import types

import pytest
import torch
from torch.overrides import TorchFunctionMode

from mcore_agentic.parallel import comm, cp_split
from mcore_agentic.parallel.cp_split import cp_gather, cp_packed_indices, pad_to_multiple
from tests.helpers.torch_calls import target_device

CP = 2
META = torch.device("meta")


class _DeviceIndexCount(TorchFunctionMode):
    """Counts index constructions on a device: ``torch.arange`` given a non-CPU device, and integer host tensors
    copied to a non-CPU device (``.to`` / ``.cuda`` / ``.copy_``)."""

    def __init__(self) -> None:
        super().__init__()
        self.device_aranges = 0
        self.index_copies = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.arange:
            dev = kwargs.get("device")
            if dev is not None and torch.device(dev).type != "cpu":
                self.device_aranges += 1
        elif func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.copy_):
            src = args[1] if func is torch.Tensor.copy_ else args[0]
            dst = args[0].device if func is torch.Tensor.copy_ else target_device(args[1:], kwargs)
            if (isinstance(src, torch.Tensor) and src.device.type == "cpu" and not src.is_floating_point()
                    and dst is not None and dst.type != "cpu"):
                self.index_copies += 1
        return func(*args, **kwargs)


@pytest.fixture
def two_ranks(monkeypatch):
    """This process as CP rank ``rank`` of two; ``shards`` (set by a test): what the all-gather returns, per rank
    (None: leave the buffers as they are)."""
    state = types.SimpleNamespace(rank=0, shards=None)
    monkeypatch.setattr(cp_split, "dist", types.SimpleNamespace(
        get_world_size=lambda group: CP, get_rank=lambda group: state.rank, ProcessGroup=object,
    ))

    def all_gather(out, t, group=None):
        if state.shards is not None:
            for o, s in zip(out, state.shards):
                o.copy_(s)
        return out

    monkeypatch.setattr(comm, "all_gather_device", all_gather)
    return state


def _cu(rows: int) -> list[int]:
    """Padded offsets of ``rows`` packed rows of uneven lengths, each splittable over CP."""
    lengths = [pad_to_multiple(3 + 5 * i % 11, CP) for i in range(rows)]
    return [0, *torch.tensor(lengths).cumsum(0).tolist()]


def _counted_gather(rows: int, cu_seqlens: bool) -> _DeviceIndexCount:
    """One micro-batch's output on the device through the gather and the loss's backward (as ``post_process``)."""
    cu = _cu(rows)
    local = torch.randn(1, cu[-1] // CP, device=META, requires_grad=True)
    with _DeviceIndexCount() as count:
        out = cp_gather(local, CP, object(), seq_dim=1, grad_mode="slice", cu_seqlens=cu if cu_seqlens else None)
        out.sum().backward()
    assert out.shape == (1, cu[-1]) and local.grad is not None and local.grad.shape == local.shape
    return count


@pytest.mark.parametrize("cu_seqlens", [True, False], ids=["packed", "padded"])
def test_a_micro_batch_output_builds_no_index_on_the_device(two_ranks, cu_seqlens: bool):
    """The same constant cost for 2 rows and for 32: no ``arange`` on the device, one index copied there."""
    for rows in (2, 32):
        count = _counted_gather(rows, cu_seqlens)
        assert (count.device_aranges, count.index_copies) == (0, 1), (rows, vars(count))


@pytest.mark.parametrize("grad_mode", ["slice", "sum"])
def test_the_host_built_order_restores_each_row_and_its_gradient(two_ranks, monkeypatch, grad_mode: str):
    """On the CPU, the gathered tensor is the full packed one and each rank's gradient is its own tokens' (``slice``)
    or every rank's at its tokens (``sum``, the reduce-scatter's stand-in adding the ranks' rank-major gradients)."""
    cu = _cu(7)
    g = torch.Generator().manual_seed(0)
    full = torch.randn(cu[-1], 3, generator=g, dtype=torch.float64)
    weights = [torch.randn(cu[-1], 3, generator=g, dtype=torch.float64) for _ in range(CP)]
    index = [cp_packed_indices(cu, CP, r) for r in range(CP)]
    two_ranks.shards = [full[i] for i in index]
    grads: list[torch.Tensor] = []

    def reduce_scatter(t: torch.Tensor, group) -> torch.Tensor:
        """The stand-in: this rank's gradient must arrive rank-major; every rank's at this rank's tokens come back."""
        assert torch.equal(t, weights[two_ranks.rank][torch.cat(index)])
        return sum(w[index[two_ranks.rank]] for w in weights)

    monkeypatch.setattr(comm, "reduce_scatter_device", reduce_scatter)
    for rank in range(CP):
        two_ranks.rank = rank
        local = full[index[rank]].clone().requires_grad_(True)
        out = cp_gather(local, CP, object(), seq_dim=0, grad_mode=grad_mode, cu_seqlens=torch.tensor(cu))
        assert torch.equal(out, full)
        (out * weights[rank]).sum().backward()
        grads.append(local.grad)
    for rank in range(CP):
        expected = weights[rank] if grad_mode == "slice" else sum(weights)
        assert torch.equal(grads[rank], expected[index[rank]])
