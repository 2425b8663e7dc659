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

Two ways to compute each attention, the same math:

* **fused** (on CUDA, dropout inactive): torch's ``scaled_dot_product_attention`` (flash or
  memory-efficient kernels: no ``[S, S]`` scores in memory), ``is_causal`` at CP 1 and the CP
  mask otherwise; packed rows at CP 1 go to ``torch.nn.attention.varlen.varlen_attn`` (flash,
  one kernel for every row of the micro-batch) where this torch has it, else one SDPA per row.
  The first GPU run (H100, bf16) measured the eager path at 1.5-5.7% MFU with packed rows at
  half the speed of padded ones: per-row eager einsums and fp32 score matrices.
* **eager** (on CPU, or with attention dropout under Megatron's RNG tracker): einsum, fp32
  softmax, einsum. Memory O(S_local * S) per head and row, fine for CPU and moderate lengths.

With CP == 1 and unpacked rows it computes what ``DotProductAttention`` does. Supported: causal / no-mask / padding mask types, GQA (``num_query_groups <
num_attention_heads``), attention dropout under the RNG tracker,
``apply_query_key_layer_scaling``. Not supported (raises): attention bias, sliding windows,
non-vanilla softmax, a padding mask together with packed rows.

Versions: megatron-core 0.16.1 (``DotProductAttention``'s constructor; the range setup.py pins).
It lives in ``parallel/`` because it is a layer a spec chooses, not a patch (it replaces nothing).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor

from mcore_agentic.parallel.cp_split import cp_gather, cp_positions


@dataclasses.dataclass
class LocalPackedSeqParams(PackedSeqParams):
    """``PackedSeqParams`` of the local spec: the offsets stay host tensors (megatron's unfused THD RoPE and the
    eager path read them as integers in every layer, at no sync), and ``cu_seqlens_device`` holds the padded
    offsets once more on the compute device, int32, for the varlen kernel (copied with the micro-batch)."""

    cu_seqlens_device: Tensor | None = None


def _varlen_attn() -> Callable[..., Tensor] | None:
    """torch's varlen flash attention where this torch has it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.lru_cache(maxsize=8)
def _parameters(fn: Callable[..., Tensor]) -> frozenset[str]:
    """``fn``'s parameter names, read once (the call is built in every layer of every micro-batch)."""
    return frozenset(inspect.signature(fn).parameters)


def varlen_causal(
    fn: Callable[..., Tensor], query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_len: int,
    scale: float, causal: bool,
) -> Tensor:
    """``fn`` (``varlen_attn``) on packed ``query`` [t, np, hn], ``key``/``value`` [t, ng, hn]: its signature has
    changed across torch releases (``is_causal`` and no scale or GQA in 2.9-2.10; ``window_size``, ``scale`` and
    ``enable_gqa`` later), so the call is built from the one it has."""
    params = _parameters(fn)
    kwargs: dict[str, Any] = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        kwargs["is_causal"] = causal
    if "scale" in params:
        kwargs["scale"] = scale
    else:  # the kernel's own scale is 1/sqrt(hn)
        query = query * (scale * math.sqrt(query.shape[-1]))
    if query.shape[1] != key.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            rep = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    return fn(query, key, value, cu_seqlens, cu_seqlens, max_len, max_len, **kwargs)


#: torch's ``varlen_attn`` (``None`` where this torch lacks it); tests put a stand-in with its signature here.
VARLEN_ATTN: Callable[..., Tensor] | None = _varlen_attn()


class LocalDotProductAttention(DotProductAttention):
    """Core attention ([sq, b, np, hn] queries, [sk, b, ng, hn] keys/values; or packed THD rows) with CP via K/V all-gather."""

    #: Device types on which the fused kernels run (tests add "cpu" to check them against the eager path).
    fused_devices: tuple[str, ...] = ("cuda",)

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
        if self._fused(query) and attention_mask is None and mask_type in (AttnMaskType.causal, AttnMaskType.no_mask):
            return self._sdpa(query, key, value, mask_type == AttnMaskType.causal, cp_rank).reshape(sq, b, -1)
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
        causal = mask_type == AttnMaskType.causal
        fused = self._fused(query) and mask_type in (AttnMaskType.causal, AttnMaskType.no_mask)
        cu_device = getattr(params, "cu_seqlens_device", None)
        varlen = fused and self.cp_size == 1 and VARLEN_ATTN is not None and cu_device is not None
        if varlen and query.dtype in (torch.float16, torch.bfloat16) and len(bounds) > 1:  # flash: half types
            max_len = max(e - s for s, e in zip(bounds, bounds[1:]))
            context = varlen_causal(VARLEN_ATTN, query, key, value, cu_device, max_len, self.score_scale, causal)
            return context.reshape(context.shape[0], -1)
        outs = []
        for start, end in zip(bounds, bounds[1:]):
            n = end - start
            q = query[start // self.cp_size : end // self.cp_size].unsqueeze(1)  # [n/cp, 1, np, hn]
            k = key[start:end].unsqueeze(1)
            v = value[start:end].unsqueeze(1)
            if fused:
                outs.append(self._sdpa(q, k, v, causal, cp_rank).squeeze(1))
                continue
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

    def _fused(self, query: Tensor) -> bool:
        """Whether this call takes the fused kernels: on their devices, with no dropout to draw under Megatron's
        RNG tracker (SDPA's dropout would draw from torch's own generator, differently on each TP rank)."""
        return query.device.type in self.fused_devices and (not self.training or self.attention_dropout.p == 0.0)

    def _sdpa(self, query: Tensor, key: Tensor, value: Tensor, causal: bool, cp_rank: int) -> Tensor:
        """``scaled_dot_product_attention`` of the local ``query`` [sq, b, np, hn] on the whole ``key``/``value``
        [S, b, ng, hn]: causal with the CP rank's query positions (``is_causal`` when they are all of them)."""
        sq, s = query.shape[0], key.shape[0]
        mask = None
        if causal and sq != s:  # CP: the local queries sit at cp_positions of the full sequence
            q_pos = cp_positions(s, self.cp_size, cp_rank, device=query.device)
            mask = torch.arange(s, device=query.device).unsqueeze(0) <= q_pos.unsqueeze(1)  # True = attend
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, len, hn]
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=self.score_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out.permute(2, 0, 1, 3)  # [sq, b, np, hn]

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
