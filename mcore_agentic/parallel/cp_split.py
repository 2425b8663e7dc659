"""Megatron's load-balanced context-parallel (CP) sequence layout: split, positions, gather.

With causal attention, cutting a sequence into CP equal pieces gives the last rank
far more work than the first. Megatron-core instead cuts a sequence of length S
(divisible by ``2 * cp_size``) into ``2 * cp_size`` equal chunks and gives CP rank
``r`` chunks ``r`` and ``2 * cp_size - 1 - r``, concatenated in that order. Every
rank then holds one "early" and one "late" chunk, so causal work is balanced.

This module owns that layout and nothing else:

- :func:`cp_split` — the local shard of a full tensor (same as
  ``megatron.core.utils.get_batch_on_this_cp_rank`` for one tensor);
- :func:`cp_positions` — global positions of the local tokens (for RoPE, masks);
- :func:`cp_packed_indices` — the same for a packed (THD) batch, chunking each
  sequence separately as Megatron does with ``cu_seqlens``;
- :func:`cp_gather` — all-gather the shards and restore the original order, with
  a backward that gives each rank the gradient of its own tokens;
- :func:`pad_to_multiple` — the padded length a sequence needs to be splittable.

Next-token targets must be shifted on the *full* sequence before splitting
(``labels[t] = tokens[t + 1]``): after the split, neighbouring local tokens are not
neighbours in the sequence at the chunk boundary.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.distributed as dist

from mcore_agentic.parallel import comm

__all__ = [
    "cp_gather",
    "cp_packed_indices",
    "cp_positions",
    "cp_split",
    "pad_to_multiple",
]

GradMode = Literal["sum", "slice"]


def _check_cp(cp_size: int, cp_rank: int) -> None:
    if cp_size < 1:
        raise ValueError(f"cp_size={cp_size} must be >= 1")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} must be in [0, cp_size={cp_size})")


def _check_len(seq_len: int, cp_size: int, what: str = "sequence length") -> int:
    """Return the chunk length; raise naming the fix when ``seq_len`` cannot be split."""
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(
            f"{what} {seq_len} is not divisible by 2*cp_size={2 * cp_size}: "
            f"pad it to {pad_to_multiple(seq_len, cp_size)} (see pad_to_multiple)"
        )
    return seq_len // (2 * cp_size)


def pad_to_multiple(seq_len: int, cp_size: int, multiple_of: int = 1) -> int:
    """Smallest length ``>= seq_len`` that the CP layout can split.

    That is a multiple of ``2 * cp_size`` (or of 1 when ``cp_size == 1``, where no
    split happens), and also of ``multiple_of`` (e.g. the TP size when sequence
    parallelism additionally splits the local sequence).
    """
    if seq_len < 0:
        raise ValueError(f"seq_len={seq_len} must be >= 0")
    if cp_size < 1 or multiple_of < 1:
        raise ValueError(f"cp_size={cp_size} and multiple_of={multiple_of} must be >= 1")
    base = 2 * cp_size if cp_size > 1 else 1
    m = base * multiple_of // math.gcd(base, multiple_of)
    return -(-seq_len // m) * m


def cp_positions(seq_len: int, cp_size: int, cp_rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions (``LongTensor [seq_len // cp_size]``) of the tokens CP rank ``cp_rank`` holds.

    ``cp_split(x, ...)[..., i, ...] == x[..., cp_positions(...)[i], ...]`` along the sequence dim.
    With ``cp_size == 1`` this is ``arange(seq_len)``.
    """
    _check_cp(cp_size, cp_rank)
    if cp_size == 1:
        return torch.arange(seq_len, device=device)
    chunk = _check_len(seq_len, cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    late = 2 * cp_size - 1 - cp_rank
    second = torch.arange(late * chunk, (late + 1) * chunk, device=device)
    return torch.cat([first, second])


def cp_packed_indices(
    cu_seqlens: torch.Tensor | list[int], cp_size: int, cp_rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Indices into a packed (THD) token dim of the tokens CP rank ``cp_rank`` holds.

    ``cu_seqlens`` ([n+1], starting at 0) are the *padded* cumulative lengths; each
    sequence must be divisible by ``2 * cp_size``. Each sequence is split with the
    load-balanced layout independently and the local pieces are concatenated in
    sequence order, so the local cumulative lengths are ``cu_seqlens // cp_size``.
    """
    _check_cp(cp_size, cp_rank)
    bounds = [int(v) for v in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    if not bounds or bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens={bounds} must start at 0 and be non-decreasing")
    pieces = []
    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        if cp_size > 1:
            _check_len(end - start, cp_size, what=f"packed sequence {i} length")
        pieces.append(start + cp_positions(end - start, cp_size, cp_rank, device=device))
    if not pieces:
        return torch.zeros(0, dtype=torch.long, device=device)
    return torch.cat(pieces)


def cp_split(tensor: torch.Tensor, cp_size: int, cp_rank: int, seq_dim: int = 1) -> torch.Tensor:
    """The local CP shard of ``tensor``: chunks ``cp_rank`` and ``2*cp_size-1-cp_rank`` along ``seq_dim``.

    ``tensor.shape[seq_dim]`` must be divisible by ``2 * cp_size``; the result has
    ``1 / cp_size`` of it. Differentiable (it is an index_select). ``cp_size == 1``
    returns ``tensor`` itself.
    """
    _check_cp(cp_size, cp_rank)
    if cp_size == 1:
        return tensor
    seq_dim = seq_dim % tensor.dim()
    seq_len = tensor.shape[seq_dim]
    chunk = _check_len(seq_len, cp_size)
    late = 2 * cp_size - 1 - cp_rank
    # Two narrow views + one cat: a single copy, no index tensor on the device.
    return torch.cat(
        [tensor.narrow(seq_dim, cp_rank * chunk, chunk), tensor.narrow(seq_dim, late * chunk, chunk)], dim=seq_dim
    )


def _gather_order(
    local_len: int, cp_size: int, cu_seqlens: torch.Tensor | list[int] | None, device: torch.device
) -> torch.Tensor:
    """``[2, cp_size * local_len]`` long on ``device``: row 0 the global position of each rank-major gathered token
    (rank 0's ``local_len`` tokens, then rank 1's, ...), row 1 its inverse (where each global position sits in the
    rank-major order).

    Built on the host from host offsets (``cu_seqlens`` as a list or a CPU tensor; a device tensor is read to the
    host once) and copied to ``device`` in one go — pinned and non-blocking to a GPU — instead of two
    ``torch.arange`` per row and CP rank on the device (GPU review P6)."""
    if cu_seqlens is None:
        indices = [cp_positions(local_len * cp_size, cp_size, r) for r in range(cp_size)]
    else:
        bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
        indices = [cp_packed_indices(bounds, cp_size, r) for r in range(cp_size)]
        if indices[0].numel() != local_len:
            raise ValueError(
                f"cp_gather: cu_seqlens describe {indices[0].numel() * cp_size} packed tokens, "
                f"i.e. {indices[0].numel()} per rank, but the local tensor has {local_len}"
            )
    perm = torch.cat(indices)
    order = torch.empty((2, perm.numel()), dtype=torch.long)
    order[0] = perm
    order[1, perm] = torch.arange(perm.numel())
    if device.type == "cpu":
        return order
    if device.type == "cuda" and torch.cuda.is_available():
        return order.pin_memory().to(device, non_blocking=True)
    return order.to(device)


class _CPGather(torch.autograd.Function):
    """All-gather shards and put the rank-major tokens in sequence order (``order``: :func:`_gather_order`)."""

    @staticmethod
    def forward(
        ctx, local: torch.Tensor, group: dist.ProcessGroup, seq_dim: int, grad_mode: str, order: torch.Tensor,
        cp_size: int,
    ) -> torch.Tensor:
        ctx.group, ctx.seq_dim, ctx.grad_mode, ctx.order, ctx.cp_size = group, seq_dim, grad_mode, order, cp_size
        local = local.contiguous()
        shards = [comm.device_empty(*local.shape, dtype=local.dtype, device=local.device) for _ in range(cp_size)]
        comm.all_gather_device(shards, local, group=group)
        return torch.cat(shards, dim=seq_dim).index_select(seq_dim, order[1])

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        group, seq_dim, order = ctx.group, ctx.seq_dim, ctx.order
        none = (None, None, None, None, None)
        if ctx.grad_mode == "slice":
            local_len = order.shape[1] // ctx.cp_size
            mine = order[0].narrow(0, dist.get_rank(group) * local_len, local_len)
            return (grad_full.index_select(seq_dim, mine), *none)
        # "sum": every rank's loss may depend on every rank's tokens; the gradient of
        # the summed loss w.r.t. my tokens is the sum of all ranks' grads at my
        # positions. Rearrange to rank-major order so this is a reduce-scatter.
        rank_major = grad_full.index_select(seq_dim, order[0])
        mine = comm.reduce_scatter_device(rank_major.movedim(seq_dim, 0).contiguous(), group=group)
        return (mine.movedim(0, seq_dim).contiguous(), *none)


def cp_gather(
    local: torch.Tensor,
    cp_size: int,
    group: dist.ProcessGroup | None,
    seq_dim: int = 1,
    grad_mode: GradMode = "sum",
    cu_seqlens: torch.Tensor | list[int] | None = None,
) -> torch.Tensor:
    """All-gather CP shards along ``seq_dim`` and restore the original sequence order.

    Inverse of :func:`cp_split` across the CP ``group`` (whose size must be
    ``cp_size``; ``cp_size == 1`` returns ``local``). For a packed (THD) batch pass
    the padded ``cu_seqlens`` of the full batch: the inverse of
    :func:`cp_packed_indices` is applied instead. Backward, by ``grad_mode``:

    - ``"sum"`` (default, as ``torch.distributed.nn.all_gather`` and Megatron's
      gathers): each rank gets the *sum over CP ranks* of the gradient at its own
      positions — correct when each rank's loss is a separate term of a total loss
      summed across ranks.
    - ``"slice"``: each rank keeps only its own rank's gradient at its positions —
      correct when every CP rank computes the *same* (replicated) loss on the
      gathered tensor and the gradient of that single loss is wanted.
    """
    if cp_size == 1:
        return local
    if group is None:
        raise ValueError(f"cp_gather: cp_size={cp_size} > 1 needs the CP process group, got group=None")
    if dist.get_world_size(group) != cp_size:
        raise ValueError(f"cp_gather: cp_size={cp_size} but the group has {dist.get_world_size(group)} ranks")
    if grad_mode not in ("sum", "slice"):
        raise ValueError(f"cp_gather: grad_mode={grad_mode!r}; use 'sum' or 'slice'")
    seq_dim = seq_dim % local.dim()
    local_len = local.shape[seq_dim]
    if cu_seqlens is None and local_len % 2 != 0:
        raise ValueError(f"cp_gather: local length {local_len} must be even (two chunks per rank)")
    order = _gather_order(local_len, cp_size, cu_seqlens, local.device)
    return _CPGather.apply(local, group, seq_dim, grad_mode, order, cp_size)
