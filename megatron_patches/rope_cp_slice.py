"""Patch ``rope_cp_slice``: RoPE's per-CP-rank slice without pinned memory / ``.cuda()``.

Target: ``megatron.core.models.common.embeddings.rope_utils.get_pos_emb_on_this_cp_rank``
and the same name imported into ``...rotary_pos_embedding`` and
``...yarn_rotary_pos_embedding``.

Reason: with context parallelism each rank applies RoPE for its two load-balanced
chunks (``r`` and ``2*CP-1-r``); Megatron builds that chunk index with
``torch.tensor(..., pin_memory=True).cuda()``, which raises without CUDA. The
replacement selects the same chunks with an index on the embedding's own device:
identical result.

Versions: megatron-core 0.16.x - 0.19.x (run and tested on 0.16.1 only; missing targets are skipped). Remove when the index is built on the
embedding's device upstream.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_patches._base import Patch, PatchContext


def get_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group: dist.ProcessGroup) -> torch.Tensor:
    """Rows of ``pos_emb`` (split into ``2*CP`` chunks along ``seq_dim``) for chunks ``r`` and ``2*CP-1-r``."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[(seq_dim + 1) :])
    pos_emb = pos_emb.index_select(seq_dim, cp_idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[(seq_dim + 2) :])


def _install(ctx: PatchContext) -> None:
    for dotted in (
        "megatron.core.models.common.embeddings.rope_utils",
        "megatron.core.models.common.embeddings.rotary_pos_embedding",
        "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
    ):
        ctx.swap_in(dotted, "get_pos_emb_on_this_cp_rank", lambda _orig: get_pos_emb_on_this_cp_rank)


PATCH = Patch(
    name="rope_cp_slice",
    reason="RoPE's CP chunk index is built in pinned memory and moved with .cuda()",
    install=_install,
)
