"""``LocalDotProductAttention``: exact causal attention without TransformerEngine, for CP and packed (THD) rows.

Megatron's local ``DotProductAttention`` asserts ``context_parallel_size == 1`` and refuses
packed sequences (both live in TransformerEngine's attention). This module is a drop-in for
the ``core_attention`` slot of the local layer spec (same constructor signature). It is not
a patch: nothing in megatron-core is replaced; the bridge's local spec chooses it::

    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = LocalDotProductAttention

CP layout (Megatron's load-balanced split, see ``mcore_agentic.parallel.cp_split``): a
sequence of length ``S`` is cut into ``2*CP`` chunks and CP rank ``r`` holds chunks ``r`` and
``2*CP-1-r``, so local queries sit at global positions ``cp_positions(S, CP, r)``. Forward
all-gathers K and V over the CP group and restores the natural order (``cp_gather``; its
backward sums the gradients of every rank at this rank's tokens, i.e. a reduce-scatter),
then each query at global position ``i`` attends to keys ``j <= i`` — exactly the
full-sequence causal attention, restricted to the local rows.

Packed rows (``packed_seq_params.qkv_format == "thd"``, queries ``[t, np, hn]``): the
segments of ``cu_seqlens_q_padded`` (each row, CP-padded at its end) are attended one by
one, each causally within itself, each split over CP like a sequence of its own. The cost
is the sum of the rows' squared lengths, linear in the number of rows: never a mask over
the packed length. Padding sits after a row's real tokens, so causality keeps it out of
every real token's context.

Memory is O(S_local * S) per head and row, fine for CPU and moderate lengths (ring attention
is TE's job on GPU). With CP == 1 and unpacked rows it computes what ``DotProductAttention``
does. Supported: causal / no-mask / padding mask types, GQA (``num_query_groups <
num_attention_heads``), attention dropout under the RNG tracker,
``apply_query_key_layer_scaling``. Not supported (raises): attention bias, sliding windows,
non-vanilla softmax, a padding mask together with packed rows.

Versions: megatron-core 0.16.1 (``DotProductAttention``'s constructor; the range setup.py pins).
It lives in ``parallel/`` because it is a layer a spec chooses, not a patch (it replaces nothing).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor

from mcore_agentic.parallel.cp_split import cp_gather, cp_positions


class LocalDotProductAttention(DotProductAttention):
    """Core attention ([sq, b, np, hn] queries, [sk, b, ng, hn] keys/values; or packed THD rows) with CP via K/V all-gather."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ):
        # DotProductAttention asserts CP == 1; build it on a shallow copy that says so, keep the real config.
        cp1_config = copy.copy(config)
        cp1_config.context_parallel_size = 1
        super().__init__(
            config=cp1_config,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            attention_type=attention_type,
            attention_dropout=attention_dropout,
            softmax_scale=softmax_scale,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
        )
        self.config = config
        if config.softmax_type != "vanilla":
            raise NotImplementedError(
                f"LocalDotProductAttention supports softmax_type='vanilla' only, got {config.softmax_type!r}"
            )
        if getattr(config, "window_size", None) is not None:
            raise NotImplementedError("LocalDotProductAttention does not support window_size (sliding window)")
        cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if cp_group is None and config.context_parallel_size > 1:
            cp_group = parallel_state.get_context_parallel_group()
        self.cp_group = cp_group
        self.cp_size = config.context_parallel_size
        if cp_group is not None and cp_group.size() != self.cp_size:
            raise ValueError(
                f"context_parallel_size={self.cp_size} but the CP process group has {cp_group.size()} ranks"
            )
        # FusedScaleMaskSoftmax divides the scale by layer_number and multiplies it back in fp32; we do both at once.
        self.score_scale = self.softmax_scale * (self.layer_number if config.apply_query_key_layer_scaling else 1.0)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        """Attention for the local queries.

        Shapes: ``query`` [sq, b, np, hn], ``key``/``value`` [sq, b, ng, hn] (local CP shards,
        ``sq = S / CP``); packed (THD): [t, np, hn] and [t, ng, hn]. ``attention_mask``
        (optional, bool, True = masked out) is [b or 1, 1 or np, sq, S]: rows are the local
        queries, columns the *full* sequence in natural order. Returns [sq, b, np * hn] ([t, np * hn] packed).
        """
        if attention_bias is not None:
            raise NotImplementedError("LocalDotProductAttention does not support attention_bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            if attention_mask is not None:
                raise NotImplementedError("LocalDotProductAttention: packed rows take no attention_mask (rows are segments)")
            return self._packed(query, key, value, packed_seq_params, mask_type)
        if packed_seq_params is not None:
            raise NotImplementedError(f"LocalDotProductAttention: qkv_format={packed_seq_params.qkv_format!r} (use thd)")
        sq, b, np_, _ = query.shape
        cp_rank = self.cp_group.rank() if self.cp_size > 1 else 0
        key, value = self._gather_kv(key, value)  # [S, b, ng, hn], natural order
        masked = None
        if mask_type == AttnMaskType.causal:
            q_pos = cp_positions(key.shape[0], self.cp_size, cp_rank, device=query.device)
            k_pos = torch.arange(key.shape[0], device=query.device)
            masked = (k_pos.unsqueeze(0) > q_pos.unsqueeze(1)).view(1, 1, sq, key.shape[0])
        if attention_mask is not None:
            masked = attention_mask if masked is None else (masked | attention_mask)
        context = self._attend(query, key, value, masked)  # [sq, b, np, hn]
        return context.reshape(sq, b, -1)

    def _packed(self, query: Tensor, key: Tensor, value: Tensor, params: Any, mask_type: AttnMaskType) -> Tensor:
        """Per-segment causal attention of packed rows ([t, heads, hn]); returns [t, np * hn]."""
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        bounds = [int(v) for v in cu.tolist()]
        cp_rank = self.cp_group.rank() if self.cp_size > 1 else 0
        key, value = self._gather_kv(key, value, bounds)  # each segment's CP chunks put back in place
        outs = []
        for start, end in zip(bounds, bounds[1:]):
            n = end - start
            q = query[start // self.cp_size : end // self.cp_size].unsqueeze(1)  # [n/cp, 1, np, hn]
            k = key[start:end].unsqueeze(1)
            v = value[start:end].unsqueeze(1)
            masked = None
            if mask_type == AttnMaskType.causal:
                q_pos = cp_positions(n, self.cp_size, cp_rank, device=query.device)
                k_pos = torch.arange(n, device=query.device)
                masked = (k_pos.unsqueeze(0) > q_pos.unsqueeze(1)).view(1, 1, q.shape[0], n)
            outs.append(self._attend(q, k, v, masked).squeeze(1))
        context = torch.cat(outs, dim=0) if outs else query.new_zeros(query.shape)
        return context.reshape(context.shape[0], -1)

    def _gather_kv(self, key: Tensor, value: Tensor, cu_seqlens: list[int] | None = None) -> tuple[Tensor, Tensor]:
        """K and V of the whole sequence in natural order, in one all-gather over CP (a no-op at CP 1); the
        backward reduce-scatters their gradients to the ranks that own the tokens."""
        if self.cp_size == 1:
            return key, value
        both = cp_gather(torch.cat([key, value], dim=-1), self.cp_size, self.cp_group, seq_dim=0, grad_mode="sum",
                         cu_seqlens=cu_seqlens)
        return both.split(key.shape[-1], dim=-1)

    def _attend(self, query: Tensor, key: Tensor, value: Tensor, masked: Tensor | None) -> Tensor:
        """Softmax attention: ``query`` [sq, b, np, hn], full ``key``/``value`` [S, b, ng, hn] -> [sq, b, np, hn]."""
        np_, groups = query.shape[2], key.shape[2]
        if np_ // groups > 1:  # GQA: each KV head serves np/ng query heads (after the gather: less traffic)
            key = key.repeat_interleave(np_ // groups, dim=2)
            value = value.repeat_interleave(np_ // groups, dim=2)
        scores = torch.einsum("qbnh,kbnh->bnqk", query, key)  # [b, np, sq, S]
        if self.config.attention_softmax_in_fp32 or scores.dtype == torch.float32:
            scores = scores.float()
        scores = scores * self.score_scale
        if masked is not None:
            scores = scores.masked_fill(masked, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1).to(query.dtype)
        if not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.attention_dropout(probs)
        else:
            probs = self.attention_dropout(probs)
        return torch.einsum("bnqk,kbnh->qbnh", probs, value)
